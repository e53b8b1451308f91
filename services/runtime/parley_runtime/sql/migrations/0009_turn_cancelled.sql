-- A running turn can be cancelled (CancelTurn, a connector's cancel subject).
ALTER TABLE runtime.turn DROP CONSTRAINT turn_state_check;
ALTER TABLE runtime.turn ADD CONSTRAINT turn_state_check
    CHECK (state IN ('received', 'running', 'replied', 'ignored', 'failed', 'superseded', 'cancelled'));
