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
    -- The latest replies ([{id, content}]) saved while their turn held the lease, and when: the
    -- room's next turn puts them on the outbound stream before its own (Outbox.publish_turn, turn/ports.py).
    replies     jsonb,
    replied_at  timestamptz,
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
    -- Who set the role: a connector's claim (capped by CONNECTOR_ROLE_CEILING) or the operator,
    -- whose role a connector's claim never changes.
    role_source text NOT NULL DEFAULT 'connector' CHECK (role_source IN ('connector', 'operator')),
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
CREATE INDEX memory_room_recent ON runtime.memory (agent_id, room_id, kind, created_at DESC, id DESC);
CREATE INDEX memory_kind_recent ON runtime.memory (agent_id, kind, created_at DESC, id DESC);
CREATE INDEX memory_replies ON runtime.memory (agent_id, in_reply_to, created_at, id)
    WHERE in_reply_to IS NOT NULL;
CREATE INDEX memory_missing_embedding ON runtime.memory (agent_id, created_at DESC)
    WHERE embedding IS NULL AND kind IN ('messages', 'facts') AND coalesce(content ->> 'text', '') <> '';

CREATE TABLE runtime.turn (
    agent_id      uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    -- The id of the inbound message memory this turn answers.
    id            uuid NOT NULL,
    room_id       uuid NOT NULL,
    stream_seq    bigint NOT NULL,
    -- The inbound stream's creation time (microseconds): sequences restart in a new stream.
    stream_epoch  bigint NOT NULL DEFAULT 0,
    state         text NOT NULL CHECK (state IN ('received', 'running', 'replied', 'ignored', 'failed',
                                                 'superseded', 'cancelled')),
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
    -- Who started it: a connector's message (user), the runtime continuing a conversation after
    -- confirmations (continuation), or the agent's autonomy loop (autonomous).
    origin        text NOT NULL DEFAULT 'user' CHECK (origin IN ('user', 'continuation', 'autonomous')),
    PRIMARY KEY (agent_id, id)
);
CREATE INDEX turn_recent ON runtime.turn (agent_id, received_at DESC, id DESC);
CREATE INDEX turn_room_recent ON runtime.turn (agent_id, room_id, received_at DESC, id DESC);
CREATE INDEX turn_origin_recent ON runtime.turn (agent_id, origin, received_at DESC);

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
    inbound       bytea,  -- before migration 0007: the proposing message as protobuf bytes
    created_at    timestamptz NOT NULL DEFAULT now(),
    invocation    jsonb,  -- records.Invocation: what the call needs of the proposing message
    PRIMARY KEY (agent_id, tool_call_id),
    FOREIGN KEY (agent_id, turn_id) REFERENCES runtime.turn (agent_id, id) ON DELETE CASCADE,
    CONSTRAINT tool_call_invocation CHECK (invocation IS NOT NULL OR inbound IS NOT NULL)
);
CREATE INDEX tool_call_room ON runtime.tool_call (agent_id, room_id, created_at DESC);


-- ---------------------------------------------------------------------------------------------
-- Documents (knowledge), migration 0005_documents.sql
-- ---------------------------------------------------------------------------------------------

-- Documents (knowledge): each document has a room (its single room entitlement), a scope and
-- direct grants; its fragments carry the embeddings. Who may read, change or re-grant documents
-- is decided by runtime.allowed_documents (and, for a document not yet written, by the same
-- runtime.document_rule on the same runtime.requester_roles), which every query that makes rows,
-- counts, fragments or rankings selects from (spec/runtime.md, "Documents (knowledge)").

-- True when no element is NULL or repeated.
CREATE FUNCTION runtime.uuids_distinct(ids uuid[]) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT count(DISTINCT x) = count(*) FROM unnest(ids) AS u (x) $$;

CREATE TABLE runtime.document (
    agent_id                 uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id                       uuid NOT NULL,
    -- The single room entitlement; NULL: none (only OWNER, the agent and direct grantees read it).
    room_id                  uuid,
    scope                    text NOT NULL
                             CHECK (scope IN ('global', 'owner-private', 'user-private', 'agent-private')),
    scoped_to_entity_id      uuid,
    direct_grant_entity_ids  uuid[] NOT NULL DEFAULT '{}',
    -- Raised by every grant replacement: the CAS token of replace_document_grants.
    access_revision          bigint NOT NULL DEFAULT 1 CHECK (access_revision > 0),
    title                    text NOT NULL DEFAULT '',
    content_type             text NOT NULL
                             CHECK (content_type IN ('text/plain', 'text/markdown', 'application/pdf')),
    text                     text NOT NULL,
    size_bytes               bigint NOT NULL CHECK (size_bytes >= 0),
    fragment_count           integer NOT NULL CHECK (fragment_count >= 0),
    created_by               uuid,
    created_at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (agent_id, id),
    FOREIGN KEY (agent_id, room_id) REFERENCES runtime.room (agent_id, id),
    FOREIGN KEY (agent_id, scoped_to_entity_id) REFERENCES runtime.entity (agent_id, id) ON DELETE CASCADE,
    CONSTRAINT document_scoped_entity CHECK ((scope = 'user-private') = (scoped_to_entity_id IS NOT NULL)),
    CONSTRAINT document_grants_valid
        CHECK (cardinality(direct_grant_entity_ids) <= 1000 AND runtime.uuids_distinct(direct_grant_entity_ids))
);
CREATE INDEX document_recent ON runtime.document (agent_id, created_at DESC, id DESC);
CREATE INDEX document_room_recent ON runtime.document (agent_id, room_id, created_at DESC, id DESC);

CREATE TABLE runtime.document_fragment (
    agent_id     uuid NOT NULL,
    document_id  uuid NOT NULL,
    position     integer NOT NULL CHECK (position >= 0),
    text         text NOT NULL,
    -- The dimension is the embedding model's, as for memories.
    embedding    vector NOT NULL,
    PRIMARY KEY (agent_id, document_id, position),
    FOREIGN KEY (agent_id, document_id) REFERENCES runtime.document (agent_id, id) ON DELETE CASCADE
);

-- A requester's rooms, found from the requester's side (these two indexes), not per document.
CREATE INDEX participant_entity ON runtime.participant (agent_id, entity_id, room_id);
-- The operator's pages, newest first (entities, participants).
CREATE INDEX entity_recent ON runtime.entity (agent_id, created_at DESC, id DESC);
CREATE INDEX participant_recent ON runtime.participant (agent_id, created_at DESC, room_id, entity_id);
CREATE INDEX room_world ON runtime.room (agent_id, world_id);
CREATE INDEX room_recent ON runtime.room (agent_id, created_at DESC, id DESC);

-- The rules, on plain values (inlined by the planner: no per-row function call). `role` is the
-- requester's role in the document's room (NULL: none), `in_room` whether they take part in it;
-- action: read, mutate or grant. The operator acts as OWNER. The agent reads everything and
-- changes only its agent-private documents.
CREATE FUNCTION runtime.document_rule(
    action text, agent uuid, scope text, scoped_to uuid, grants uuid[], requester uuid, as_operator boolean,
    role text, in_room boolean
) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$
    SELECT CASE
        WHEN action NOT IN ('read', 'mutate', 'grant') THEN false
        WHEN as_operator THEN true
        WHEN requester IS NULL THEN false
        WHEN requester = agent THEN action = 'read' OR (action = 'mutate' AND scope = 'agent-private')
        WHEN role = 'OWNER' THEN true
        -- Grants give reading only, never of agent-private documents, and need no room.
        WHEN action = 'read' AND scope <> 'agent-private' AND requester = ANY (grants) THEN true
        WHEN NOT coalesce(in_room, false) THEN false
        WHEN role = 'GUEST' THEN action = 'read' AND scope = 'global'
        WHEN action = 'read' THEN
            scope = 'global' OR (scope = 'user-private' AND (role = 'ADMIN' OR requester = scoped_to))
        WHEN action = 'mutate' THEN scope = 'user-private' AND (role = 'ADMIN' OR requester = scoped_to)
        ELSE role = 'ADMIN' AND scope IN ('global', 'user-private')
    END
$$;

-- The requester's role in each room where they have one: their participant role, else their
-- role in the room's world (world.metadata.roles[entity id]); in_room: they take part in it.
CREATE FUNCTION runtime.requester_roles(agent uuid, requester uuid)
    RETURNS TABLE (room_id uuid, role text, in_room boolean)
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    SELECT coalesce(p.room_id, wr.room_id), coalesce(p.role, wr.role), p.room_id IS NOT NULL
      FROM (SELECT pp.room_id, pp.role FROM runtime.participant pp
             WHERE pp.agent_id = agent AND pp.entity_id = requester) AS p
      FULL JOIN (SELECT r.id AS room_id, upper(w.metadata -> 'roles' ->> requester::text) AS role
                   FROM runtime.world w JOIN runtime.room r ON r.agent_id = w.agent_id AND r.world_id = w.id
                  WHERE w.agent_id = agent AND w.metadata -> 'roles' ? requester::text) AS wr
        ON wr.room_id = p.room_id
$$;

-- The one predicate, as a set: the agent's documents on which `requester` (an entity of the
-- agent; NULL with as_operator for the operator) may do `action`. Every document query selects
-- from it, so what may not be read never reaches a row, a count or a ranking.
CREATE FUNCTION runtime.allowed_documents(action text, agent uuid, requester uuid, as_operator boolean)
    RETURNS SETOF runtime.document
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    SELECT d.*
      FROM runtime.document d
      LEFT JOIN runtime.requester_roles(agent, requester) AS rr ON rr.room_id = d.room_id
     WHERE d.agent_id = agent
       AND runtime.document_rule(action, d.agent_id, d.scope, d.scoped_to_entity_id, d.direct_grant_entity_ids,
                                 requester, as_operator, rr.role, rr.in_room)
$$;

-- ---------------------------------------------------------------------------------------------
-- Custom actions (migration 0004, parley_runtime/custom)
-- ---------------------------------------------------------------------------------------------

-- Custom actions registered live through the operator API (parley_runtime/custom).
CREATE TABLE runtime.custom_action (
    agent_id    uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id          text NOT NULL CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$'),
    name        text NOT NULL CHECK (name ~ '^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$'),
    definition  jsonb NOT NULL CHECK (jsonb_typeof(definition) = 'object'),
    enabled     boolean NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id)
);
CREATE UNIQUE INDEX custom_action_name ON runtime.custom_action (agent_id, name);

-- Bumped by the statement that changes an agent's custom actions; each replica reads it before a
-- turn and reloads the definitions when it moved.
CREATE TABLE runtime.custom_action_revision (
    agent_id  uuid PRIMARY KEY REFERENCES runtime.agent (id) ON DELETE CASCADE,
    revision  bigint NOT NULL CHECK (revision > 0)
);

-- ---------------------------------------------------------------------------------------------
-- Autonomy (migration 0008, parley_runtime/autonomy)
-- ---------------------------------------------------------------------------------------------

-- The operator's switch (`parley autonomy on|off`); without a row the character's
-- AUTONOMY_ENABLED setting decides. Each switch from off to on starts a new generation, which
-- names the agent's recurring think section in the model gateway's prompt batcher.
CREATE TABLE runtime.autonomy (
    agent_id    uuid PRIMARY KEY REFERENCES runtime.agent (id) ON DELETE CASCADE,
    enabled     boolean NOT NULL,
    generation  bigint NOT NULL CHECK (generation > 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- Relationships between entities, as elizaOS keeps them: a source, a target, tags and metadata.
CREATE TABLE runtime.relationship (
    agent_id          uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id                uuid NOT NULL,
    source_entity_id  uuid NOT NULL,
    target_entity_id  uuid NOT NULL,
    tags              text[] NOT NULL DEFAULT '{}',
    metadata          jsonb NOT NULL DEFAULT '{}',
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id),
    UNIQUE (agent_id, source_entity_id, target_entity_id),
    FOREIGN KEY (agent_id, source_entity_id) REFERENCES runtime.entity (agent_id, id) ON DELETE CASCADE,
    FOREIGN KEY (agent_id, target_entity_id) REFERENCES runtime.entity (agent_id, id) ON DELETE CASCADE
);
CREATE INDEX relationship_target ON runtime.relationship (agent_id, target_entity_id);
CREATE INDEX relationship_recent ON runtime.relationship (agent_id, updated_at DESC, id DESC);
