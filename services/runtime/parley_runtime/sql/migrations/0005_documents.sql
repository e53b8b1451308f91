-- Documents (knowledge): documents with a scope, a room and direct grants, their fragments, and
-- the functions that decide who may read, change or re-grant them.

CREATE EXTENSION IF NOT EXISTS vector;

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
CREATE INDEX participant_entity ON runtime.participant (agent_id, entity_id);
CREATE INDEX room_world ON runtime.room (agent_id, world_id);

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
