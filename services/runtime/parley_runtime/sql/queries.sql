-- Named queries of the runtime. Each `-- name --` header starts one statement.

-- upsert_agent --
-- The agent and its own entity (same id), so its replies have an author.
WITH a AS (
    INSERT INTO runtime.agent (id, name, character, enabled)
    VALUES (%(id)s, %(name)s, %(character)s, %(enabled)s)
    ON CONFLICT (id) DO UPDATE
       SET name = excluded.name, character = excluded.character, updated_at = now()
     WHERE agent.character IS DISTINCT FROM excluded.character OR agent.name IS DISTINCT FROM excluded.name
)
INSERT INTO runtime.entity (agent_id, id, names)
VALUES (%(id)s, %(id)s, ARRAY[%(name)s])
ON CONFLICT DO NOTHING;

-- list_agents --
SELECT id, name, enabled, character, created_at
  FROM runtime.agent
 ORDER BY name, id
 LIMIT %(limit)s OFFSET %(offset)s;

-- ingest --
-- One round trip per inbound message: upsert the world, entity, room and
-- participant, store the message once, take the room's turn lease and record
-- the turn. The lease orders messages by the stream sequence at which each was
-- first seen: a message older than the room's newest does not get it (it is
-- superseded), and a copy of a message (republished or redelivered) takes it
-- over from its earlier copy. A finished turn takes nothing.
WITH prev AS (
    SELECT stream_seq, state, response_id FROM runtime.turn WHERE agent_id = %(agent_id)s AND id = %(memory_id)s
), msg AS (
    SELECT coalesce((SELECT stream_seq FROM prev), %(stream_seq)s) AS seq,
           coalesce((SELECT state IN ('received', 'running') FROM prev), true) AS open
), w AS (
    INSERT INTO runtime.world (agent_id, id, source, external_id)
    SELECT %(agent_id)s, %(world_id)s, %(source)s, %(world_external_id)s
     WHERE %(world_id)s::uuid IS NOT NULL
    ON CONFLICT (agent_id, id) DO NOTHING
), e AS (
    INSERT INTO runtime.entity (agent_id, id, names, metadata)
    VALUES (%(agent_id)s, %(entity_id)s, %(entity_names)s, %(entity_metadata)s)
    ON CONFLICT (agent_id, id) DO UPDATE
       SET names = ARRAY(SELECT DISTINCT unnest(entity.names || excluded.names)),
           metadata = entity.metadata || excluded.metadata
     WHERE NOT (entity.names @> excluded.names AND entity.metadata @> excluded.metadata)
), r AS (
    INSERT INTO runtime.room (agent_id, id, world_id, source, channel_id, type, turn_seq, turn_token)
    SELECT %(agent_id)s, %(room_id)s, %(world_id)s, %(source)s, %(channel_id)s, %(room_type)s, msg.seq, 1
      FROM msg WHERE msg.open
    ON CONFLICT (agent_id, id) DO UPDATE
       SET turn_seq = excluded.turn_seq, turn_token = room.turn_token + 1
     WHERE room.turn_seq <= excluded.turn_seq
    RETURNING turn_token
), p AS (
    INSERT INTO runtime.participant (agent_id, room_id, entity_id)
    VALUES (%(agent_id)s, %(room_id)s, %(entity_id)s)
    ON CONFLICT DO NOTHING
), m AS (
    INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, source, external_id)
    VALUES (%(agent_id)s, %(memory_id)s, %(room_id)s, %(entity_id)s, 'messages', %(content)s, %(source)s,
            %(external_id)s)
    ON CONFLICT DO NOTHING
), t AS (
    INSERT INTO runtime.turn (agent_id, id, room_id, stream_seq, state, lease_token)
    SELECT %(agent_id)s, %(memory_id)s, %(room_id)s, msg.seq,
           CASE WHEN (SELECT turn_token FROM r) IS NULL THEN 'superseded' ELSE 'running' END,
           (SELECT turn_token FROM r)
      FROM msg WHERE msg.open
    -- A copy that did not get the room (it raced a copy that did, or a newer message
    -- took the room) leaves the running turn to whoever holds it.
    ON CONFLICT (agent_id, id) DO UPDATE
       SET attempts = turn.attempts + 1,
           lease_token = coalesce(excluded.lease_token, turn.lease_token)
     WHERE turn.state IN ('received', 'running')
    RETURNING state, attempts, response_id
)
SELECT t.state, t.attempts, t.response_id, (SELECT turn_token FROM r) AS lease_token,
       (SELECT state FROM prev) AS previous_state,
       (SELECT response_id FROM prev) AS previous_response_id,
       -- The room's recent messages, oldest first, for the prompt (none when the turn is not run).
       (SELECT coalesce(jsonb_agg(h ORDER BY h.created_at, h.id), '[]'::jsonb)
          FROM (SELECT m.id, m.entity_id, m.content ->> 'text' AS text, m.created_at, e.names[1] AS name
                  FROM runtime.memory m
                  LEFT JOIN runtime.entity e ON e.agent_id = m.agent_id AND e.id = m.entity_id
                 WHERE t.state = 'running'
                   AND m.agent_id = %(agent_id)s AND m.room_id = %(room_id)s AND m.kind = 'messages'
                   AND m.id <> %(memory_id)s
                 ORDER BY m.created_at DESC, m.id DESC
                 LIMIT %(history)s) AS h) AS history
  FROM (SELECT 1) AS one LEFT JOIN t ON true;

-- save_reply --
-- Stores the reply and finishes the turn as replied, only while this turn holds
-- the room's lease. A turn that lost the room to a newer message is marked
-- superseded; one whose lease was taken over by a copy of the same message
-- (lease_token changed) is left to that copy and this statement returns no row.
-- The reply is published after this; a redelivery of a replied turn publishes
-- the stored reply again under the same id, so JetStream drops the copy.
WITH lease AS (
    SELECT EXISTS (SELECT 1 FROM runtime.room
                    WHERE agent_id = %(agent_id)s AND id = %(room_id)s AND turn_token = %(lease_token)s) AS held
), m AS (
    INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, source, in_reply_to)
    SELECT %(agent_id)s, %(response_id)s, %(room_id)s, %(agent_id)s, 'messages', %(content)s, %(source)s,
           %(turn_id)s
      FROM lease WHERE lease.held
    ON CONFLICT DO NOTHING
)
UPDATE runtime.turn
   SET response_id = CASE WHEN lease.held THEN %(response_id)s::uuid END,
       state = CASE WHEN lease.held THEN 'replied' ELSE 'superseded' END,
       finished_at = clock_timestamp(),
       trajectory = %(trajectory)s
  FROM lease
 WHERE agent_id = %(agent_id)s AND id = %(turn_id)s AND state = 'running' AND lease_token = %(lease_token)s
RETURNING state, response_id;

-- finish_turn --
-- Only the holder of the turn's lease finishes it; without a token (the last
-- delivery failed) any running turn is finished.
UPDATE runtime.turn
   SET state = %(state)s, error = %(error)s, finished_at = clock_timestamp()
 WHERE agent_id = %(agent_id)s AND id = %(turn_id)s AND state = 'running'
   AND (%(lease_token)s::bigint IS NULL OR lease_token = %(lease_token)s)
RETURNING state;

-- get_memory --
SELECT id, room_id, entity_id, kind, content, source, external_id, in_reply_to, created_at
  FROM runtime.memory
 WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- get_room --
SELECT id, source, channel_id, type, world_id, created_at
  FROM runtime.room
 WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- list_rooms --
SELECT r.id, r.source, r.channel_id, r.type, r.created_at, w.external_id AS world_external_id
  FROM runtime.room r
  LEFT JOIN runtime.world w ON w.agent_id = r.agent_id AND w.id = r.world_id
 WHERE r.agent_id = %(agent_id)s
 ORDER BY r.created_at DESC, r.id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_memories --
SELECT id, room_id, entity_id, kind, content, source, in_reply_to, created_at
  FROM runtime.memory
 WHERE agent_id = %(agent_id)s AND kind = %(kind)s
   AND (%(room_id)s::uuid IS NULL OR room_id = %(room_id)s)
 ORDER BY created_at DESC, id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_turns --
SELECT id, room_id, stream_seq, state, lease_token, attempts, response_id, error, received_at, finished_at
  FROM runtime.turn
 WHERE agent_id = %(agent_id)s AND (%(room_id)s::uuid IS NULL OR room_id = %(room_id)s)
 ORDER BY received_at DESC, id DESC
 LIMIT %(limit)s OFFSET %(offset)s;
