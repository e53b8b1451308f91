-- Actions that wait for a human decision (authz's tool-call approvals). The runtime keeps
-- what it needs to run the action later, on whichever replica receives the approval:
-- the parameters (they never enter authz, only their digest) and the message that
-- proposed it.
CREATE TABLE runtime.tool_call (
    agent_id      uuid NOT NULL,
    tool_call_id  text NOT NULL CHECK (length(tool_call_id) BETWEEN 1 AND 200),
    turn_id       uuid NOT NULL,
    action_index  integer NOT NULL CHECK (action_index >= 0),
    call_index    integer NOT NULL CHECK (call_index >= 0),
    room_id       uuid NOT NULL,
    message_id    uuid NOT NULL,
    action        text NOT NULL,
    params        jsonb NOT NULL,
    requester_id  uuid NOT NULL,
    role          text NOT NULL,
    inbound       bytea NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, tool_call_id),
    FOREIGN KEY (agent_id, turn_id) REFERENCES runtime.turn (agent_id, id) ON DELETE CASCADE
);
CREATE INDEX tool_call_room ON runtime.tool_call (agent_id, room_id, created_at DESC);
