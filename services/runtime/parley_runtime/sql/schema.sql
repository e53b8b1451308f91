-- The declared runtime schema. tests/integration/test_migrations.py proves that
-- applying sql/migrations/ in order builds exactly this.

CREATE SCHEMA IF NOT EXISTS runtime;
CREATE EXTENSION IF NOT EXISTS vector;


CREATE TABLE runtime.agent (
    id          uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE CHECK (name <> ''),
    character   jsonb NOT NULL,
    enabled     boolean NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE runtime.entity (
    agent_id    uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id          uuid NOT NULL,
    names       text[] NOT NULL DEFAULT '{}',
    -- {source: {id, name, userName}}
    metadata    jsonb NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id)
);

CREATE TABLE runtime.world (
    agent_id     uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id           uuid NOT NULL,
    source       text NOT NULL,
    external_id  text NOT NULL,
    name         text NOT NULL DEFAULT '',
    metadata     jsonb NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id)
);

CREATE TABLE runtime.room (
    agent_id    uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id          uuid NOT NULL,
    world_id    uuid,
    source      text NOT NULL CHECK (source <> ''),
    channel_id  text NOT NULL,
    type        text NOT NULL CHECK (type IN ('DM', 'GROUP', 'VOICE_DM', 'SELF', 'API', 'FEED', 'THREAD')),
    name        text NOT NULL DEFAULT '',
    metadata    jsonb NOT NULL DEFAULT '{}',
    -- The per-room turn lease: the stream sequence of the newest message that
    -- took it, and a fencing token raised on every take.
    turn_seq    bigint NOT NULL DEFAULT 0,
    turn_epoch  bigint NOT NULL DEFAULT 0,  -- see the turn's stream_epoch
    turn_token  bigint NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id),
    FOREIGN KEY (agent_id, world_id) REFERENCES runtime.world (agent_id, id)
);

CREATE TABLE runtime.participant (
    agent_id    uuid NOT NULL,
    room_id     uuid NOT NULL,
    entity_id   uuid NOT NULL,
    role        text NOT NULL DEFAULT 'MEMBER' CHECK (role IN ('OWNER', 'ADMIN', 'MEMBER', 'GUEST', 'NONE')),
    user_state  text CHECK (user_state IN ('FOLLOWED', 'MUTED')),
    mute_until  timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, room_id, entity_id),
    FOREIGN KEY (agent_id, room_id) REFERENCES runtime.room (agent_id, id) ON DELETE CASCADE,
    FOREIGN KEY (agent_id, entity_id) REFERENCES runtime.entity (agent_id, id) ON DELETE CASCADE
);

CREATE TABLE runtime.memory (
    agent_id     uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id           uuid NOT NULL,
    room_id      uuid,
    entity_id    uuid,
    kind         text NOT NULL CHECK (kind IN ('messages', 'facts', 'documents', 'fragments', 'reflections')),
    -- {text, actions, thought, source, in_reply_to, attachments, metadata}
    content      jsonb NOT NULL,
    source       text,
    -- The connector's message id: an inbound message is stored once.
    external_id  text,
    in_reply_to  uuid,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Embeddings of messages and facts; the dimension is the embedding model's.
    embedding    vector,
    metadata     jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (agent_id, id)
);
CREATE UNIQUE INDEX memory_inbound_once ON runtime.memory (agent_id, source, external_id)
    WHERE external_id IS NOT NULL;
CREATE INDEX memory_room_recent ON runtime.memory (agent_id, room_id, created_at DESC, id DESC);
CREATE INDEX memory_kind_recent ON runtime.memory (agent_id, kind, created_at DESC, id DESC);

CREATE TABLE runtime.turn (
    agent_id      uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    -- The id of the inbound message memory this turn answers.
    id            uuid NOT NULL,
    room_id       uuid NOT NULL,
    stream_seq    bigint NOT NULL,
    -- The inbound stream's creation time (microseconds): sequences restart in a new stream.
    stream_epoch  bigint NOT NULL DEFAULT 0,
    state         text NOT NULL CHECK (state IN ('received', 'running', 'replied', 'ignored', 'failed',
                                                 'superseded')),
    lease_token   bigint,
    attempts      integer NOT NULL DEFAULT 1 CHECK (attempts > 0),
    response_id   uuid,
    error         text,
    trajectory    jsonb,
    received_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at   timestamptz,
    -- Why the turn ended the way it did: self, muted, not_addressed, disabled, no_reply, ...
    reason        text,
    started_at    timestamptz,
    PRIMARY KEY (agent_id, id)
);
CREATE INDEX turn_room_recent ON runtime.turn (agent_id, room_id, received_at DESC);

-- Written before a non-idempotent action runs, so a retried turn can tell
-- that the effect may already have happened.
CREATE TABLE runtime.effect_claim (
    agent_id      uuid NOT NULL,
    turn_id       uuid NOT NULL,
    action_index  integer NOT NULL CHECK (action_index >= 0),
    action        text NOT NULL,
    result        jsonb,
    claimed_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    PRIMARY KEY (agent_id, turn_id, action_index),
    FOREIGN KEY (agent_id, turn_id) REFERENCES runtime.turn (agent_id, id) ON DELETE CASCADE
);

-- Character secrets, encrypted (AES-256-GCM, see parley_runtime/secrets.py).
CREATE TABLE runtime.agent_secret (
    agent_id    uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    name        text NOT NULL CHECK (name <> ''),
    ciphertext  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, name)
);

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
