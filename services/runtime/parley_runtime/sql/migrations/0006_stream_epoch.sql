-- The turn lease orders a room's messages by where they stand in the inbound stream.
-- Sequence numbers start again when the stream is deleted and created again, so the
-- order is (the stream's epoch: its creation time in microseconds, sequence).
ALTER TABLE runtime.room ADD COLUMN turn_epoch bigint NOT NULL DEFAULT 0;
ALTER TABLE runtime.turn ADD COLUMN stream_epoch bigint NOT NULL DEFAULT 0;
