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

-- lock_room --
-- The room's lock for the ingest that follows in the same transaction, whose commit does not wait
-- for its WAL to reach the disk: nothing outside depends on the ingest alone being durable. The
-- inbound message is acked only after save_replies, a synchronous commit, which flushes the WAL up
-- to itself and so the ingest's too; a turn whose ingest a crash of PostgreSQL lost finds its lease
-- gone at save_replies (nothing published), and the redelivered message is ingested again. Effect
-- claims are synchronous commits as well, so an action never runs on a turn that could vanish.
SELECT pg_advisory_xact_lock(hashtextextended(%(lock_key)s, 0)), set_config('synchronous_commit', 'off', true);

-- ingest --
-- One round trip per inbound message: upsert the world, entity, room and
-- participant, store the message once, take the room's turn lease and record
-- the turn. The lease orders messages by the stream position (epoch, sequence) at which
-- each was first seen: a message older than the room's newest does not get it (it is
-- superseded), and a copy of a message (republished or redelivered) takes it
-- over from its earlier copy. A finished turn takes nothing. It runs after lock_room in the
-- same transaction, so ingests of one room are serial and each sees the ones before it: a copy
-- never races its own message, and a copy that finds the room taken by a newer message
-- supersedes the turn (its first holder may have died).
WITH prev AS (
    SELECT stream_epoch, stream_seq, state, response_id FROM runtime.turn
     WHERE agent_id = %(agent_id)s AND id = %(memory_id)s
), msg AS (
    SELECT coalesce((SELECT stream_epoch FROM prev), %(stream_epoch)s) AS epoch,
           coalesce((SELECT stream_seq FROM prev), %(stream_seq)s) AS seq,
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
    INSERT INTO runtime.room (agent_id, id, world_id, source, channel_id, type, turn_epoch, turn_seq,
                              turn_token)
    SELECT %(agent_id)s, %(room_id)s, %(world_id)s, %(source)s, %(channel_id)s, %(room_type)s, msg.epoch,
           msg.seq, 1
      FROM msg WHERE msg.open
    ON CONFLICT (agent_id, id) DO UPDATE
       SET turn_epoch = excluded.turn_epoch, turn_seq = excluded.turn_seq, turn_token = room.turn_token + 1
     WHERE (room.turn_epoch, room.turn_seq) <= (excluded.turn_epoch, excluded.turn_seq)
    -- The room's latest replies (save_replies), from the row this statement updated: it waited
    -- for their commit if it had to, so they are the ones before this message. Not when older
    -- than half the outbound stream's duplicate window: publishing them again could duplicate.
    RETURNING turn_token,
              CASE WHEN room.replied_at > clock_timestamp() - interval '5 minutes' THEN room.replies END
                  AS earlier_replies
), p AS (
    -- A copy of a finished message (which creates no room) naming a room that does not exist
    -- adds no participant: it is a duplicate, acked as such, not a database error.
    INSERT INTO runtime.participant (agent_id, room_id, entity_id, role)
    SELECT %(agent_id)s, %(room_id)s, %(entity_id)s, coalesce(%(sender_role)s, 'MEMBER')
      FROM msg
     WHERE msg.open OR EXISTS (SELECT 1 FROM runtime.room WHERE agent_id = %(agent_id)s AND id = %(room_id)s)
    ON CONFLICT (agent_id, room_id, entity_id) DO UPDATE SET role = excluded.role
     WHERE %(sender_role)s::text IS NOT NULL AND participant.role <> excluded.role
       AND participant.role_source = 'connector'  -- a claim never changes the operator's role
), m AS (
    INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, source, external_id)
    VALUES (%(agent_id)s, %(memory_id)s, %(room_id)s, %(entity_id)s, 'messages', %(content)s, %(source)s,
            %(external_id)s)
    ON CONFLICT DO NOTHING
), t AS (
    INSERT INTO runtime.turn (agent_id, id, room_id, stream_epoch, stream_seq, state, lease_token, started_at,
                              origin)
    SELECT %(agent_id)s, %(memory_id)s, %(room_id)s, msg.epoch, msg.seq,
           CASE WHEN (SELECT turn_token FROM r) IS NULL THEN 'superseded' ELSE 'running' END,
           (SELECT turn_token FROM r),
           CASE WHEN (SELECT turn_token FROM r) IS NULL THEN NULL ELSE clock_timestamp() END,
           %(origin)s
      FROM msg WHERE msg.open
    -- A copy that did not get the room (it raced a copy that did, or a newer message
    -- took the room) leaves the running turn to whoever holds it.
    -- A copy that lost to a newer message in the room (its first holder may have died)
    -- supersedes the turn, so no turn is left running with nobody to finish it.
    ON CONFLICT (agent_id, id) DO UPDATE
       SET attempts = turn.attempts + 1,
           lease_token = coalesce(excluded.lease_token, turn.lease_token),
           started_at = coalesce(excluded.started_at, turn.started_at),
           state = CASE WHEN excluded.lease_token IS NULL THEN 'superseded' ELSE turn.state END,
           finished_at = CASE WHEN excluded.lease_token IS NULL THEN clock_timestamp() ELSE turn.finished_at END
     WHERE turn.state IN ('received', 'running')
    RETURNING state, attempts, response_id
)
SELECT t.state, t.attempts, t.response_id, (SELECT turn_token FROM r) AS lease_token,
       (SELECT state FROM prev) AS previous_state,
       (SELECT response_id FROM prev) AS previous_response_id,
       (SELECT earlier_replies FROM r WHERE t.state = 'running') AS earlier_replies,
       -- What the turn needs to decide, read in the same round trip (only when it will run).
       (SELECT jsonb_build_object('state', ap.user_state, 'until', ap.mute_until)
          FROM runtime.participant ap
         WHERE t.state = 'running' AND ap.agent_id = %(agent_id)s AND ap.room_id = %(room_id)s
           AND ap.entity_id = %(agent_id)s) AS agent_room_state,
       (SELECT wm.metadata FROM runtime.world wm
         WHERE t.state = 'running' AND wm.agent_id = %(agent_id)s AND wm.id = %(world_id)s) AS world_metadata,
       (SELECT sp.role FROM runtime.participant sp
         WHERE t.state = 'running' AND sp.agent_id = %(agent_id)s AND sp.room_id = %(room_id)s
           AND sp.entity_id = %(entity_id)s) AS sender_role,
       (SELECT sp.role_source FROM runtime.participant sp
         WHERE t.state = 'running' AND sp.agent_id = %(agent_id)s AND sp.room_id = %(room_id)s
           AND sp.entity_id = %(entity_id)s) AS sender_role_source,
       (SELECT rm.entity_id = %(agent_id)s FROM runtime.memory rm
         WHERE t.state = 'running' AND rm.agent_id = %(agent_id)s AND rm.id = %(reply_to_id)s) AS replies_to_agent,
       (SELECT coalesce(jsonb_agg(pp ORDER BY pp.role, pp.entity_id), '[]'::jsonb)
          FROM (SELECT px.entity_id, ex.names, px.role, px.user_state
                  FROM runtime.participant px
                  JOIN runtime.entity ex ON ex.agent_id = px.agent_id AND ex.id = px.entity_id
                 WHERE t.state = 'running' AND px.agent_id = %(agent_id)s AND px.room_id = %(room_id)s
                 LIMIT 50) AS pp) AS participants,
       -- The room's recent messages, oldest first, for the prompt.
       (SELECT coalesce(jsonb_agg(h ORDER BY h.created_at, h.id), '[]'::jsonb)
          FROM (SELECT m.id, m.entity_id, m.content ->> 'text' AS text, m.created_at, e.names[1] AS name
                  FROM runtime.memory m
                  LEFT JOIN runtime.entity e ON e.agent_id = m.agent_id AND e.id = m.entity_id
                 WHERE t.state = 'running'
                   AND m.agent_id = %(agent_id)s AND m.room_id = %(room_id)s AND m.kind = 'messages'
                   AND m.id <> %(memory_id)s AND NOT coalesce((m.content ->> 'simple')::boolean, false)
                 ORDER BY m.created_at DESC, m.id DESC
                 LIMIT %(history)s) AS h) AS history,
       -- The reads every turn made as statements of their own: the custom actions' revision (is
       -- the cached catalog current?) and whether there are facts or documents to search at all.
       (SELECT cr.revision FROM runtime.custom_action_revision cr
         WHERE t.state = 'running' AND cr.agent_id = %(agent_id)s) AS custom_action_revision,
       (SELECT EXISTS (SELECT 1 FROM runtime.memory fm WHERE fm.agent_id = %(agent_id)s AND fm.kind = 'facts')
         WHERE t.state = 'running') AS has_facts,
       (SELECT EXISTS (SELECT 1 FROM runtime.document dm WHERE dm.agent_id = %(agent_id)s)
         WHERE t.state = 'running') AS has_documents
  FROM (SELECT 1) AS one LEFT JOIN t ON true;

-- save_replies --
-- Stores the turn's replies and finishes it as replied, only while this turn
-- holds the room's lease (or when keep_existing_responses says a newer message
-- must not discard them). A turn that lost the room to a newer message is
-- marked superseded; one whose lease was taken over by a copy of the same
-- message (lease_token changed) is left to that copy: no row comes back.
-- The replies are published after this; a redelivery of a replied turn
-- publishes the stored replies again under the same ids, so JetStream drops them.
-- Locking the room's row orders this statement with a newer message taking the room: that one
-- waits until this reply is saved, or this one sees its new token and is superseded. The
-- replies are also kept on the room's row (while the lease is held): the ingest of the room's
-- next message reads them, and that turn makes sure they are on the outbound stream before its
-- own (Outbox.publish_turn, turn/ports.py), wherever they were saved.
WITH room_lease AS (
    SELECT 1 FROM runtime.room
     WHERE agent_id = %(agent_id)s AND id = %(room_id)s AND turn_token = %(lease_token)s
       FOR NO KEY UPDATE
), lease AS (
    SELECT %(keep)s OR EXISTS (SELECT 1 FROM room_lease) AS held
), m AS (
    INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, source, in_reply_to)
    SELECT %(agent_id)s, r.id, %(room_id)s, %(agent_id)s, 'messages', r.content, %(source)s, %(turn_id)s
      FROM lease, unnest(%(response_ids)s::uuid[], %(contents)s::jsonb[]) AS r (id, content)
     WHERE lease.held
    ON CONFLICT DO NOTHING
), t AS (
    UPDATE runtime.turn
       SET response_id = CASE WHEN lease.held THEN (%(response_ids)s::uuid[])[1] END,
           state = CASE WHEN lease.held THEN 'replied' ELSE 'superseded' END,
           finished_at = clock_timestamp(),
           trajectory = %(trajectory)s
      FROM lease
     WHERE agent_id = %(agent_id)s AND id = %(turn_id)s AND state = 'running' AND lease_token = %(lease_token)s
    RETURNING state
), kept AS (
    UPDATE runtime.room
       SET replied_at = clock_timestamp(),
           replies = (SELECT jsonb_agg(jsonb_build_object('id', r.id, 'content', r.content) ORDER BY r.n)
                        FROM unnest(%(response_ids)s::uuid[], %(contents)s::jsonb[]) WITH ORDINALITY
                             AS r (id, content, n))
     WHERE agent_id = %(agent_id)s AND id = %(room_id)s AND turn_token = %(lease_token)s
       AND EXISTS (SELECT 1 FROM t WHERE t.state = 'replied')
)
SELECT state FROM t;

-- finish_turn --
-- Only the holder of the turn's lease finishes it; without a token (the last
-- delivery failed) any running turn is finished.
UPDATE runtime.turn
   SET state = %(state)s, reason = %(reason)s, error = %(error)s, finished_at = clock_timestamp(),
       trajectory = coalesce(%(trajectory)s, trajectory)
 WHERE agent_id = %(agent_id)s AND id = %(turn_id)s AND state = 'running'
   AND (%(lease_token)s::bigint IS NULL OR lease_token = %(lease_token)s)
RETURNING state;

-- save_ignore --
-- Not answering is remembered too: an IGNORE memory in reply to the message.
WITH m AS (
    INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, source, in_reply_to)
    VALUES (%(agent_id)s, %(memory_id)s, %(room_id)s, %(agent_id)s, 'messages', %(content)s, %(source)s,
            %(turn_id)s)
    ON CONFLICT DO NOTHING
)
UPDATE runtime.turn
   SET state = 'ignored', reason = %(reason)s, finished_at = clock_timestamp(), trajectory = %(trajectory)s
 WHERE agent_id = %(agent_id)s AND id = %(turn_id)s AND state = 'running' AND lease_token = %(lease_token)s
RETURNING state;

-- add_trajectory --
UPDATE runtime.turn SET trajectory = coalesce(trajectory, '{}'::jsonb) || %(patch)s
 WHERE agent_id = %(agent_id)s AND id = %(turn_id)s;

-- list_replies --
SELECT id, content FROM runtime.memory
 WHERE agent_id = %(agent_id)s AND in_reply_to = %(turn_id)s AND entity_id = %(agent_id)s AND kind = 'messages'
 ORDER BY created_at, id;

-- set_room_state --
INSERT INTO runtime.participant (agent_id, room_id, entity_id, role, user_state, mute_until)
VALUES (%(agent_id)s, %(room_id)s, %(agent_id)s, 'NONE', %(state)s, %(mute_until)s)
ON CONFLICT (agent_id, room_id, entity_id) DO UPDATE
   SET user_state = excluded.user_state, mute_until = excluded.mute_until;

-- lift_expired_mute --
-- A timed mute whose time has passed is lifted (only if it is still that mute).
UPDATE runtime.participant SET user_state = NULL, mute_until = NULL
 WHERE agent_id = %(agent_id)s AND room_id = %(room_id)s AND entity_id = %(agent_id)s
   AND user_state = 'MUTED' AND mute_until IS NOT NULL AND mute_until <= now()
RETURNING room_id;

-- lift_expired_world_mute --
UPDATE runtime.world
   SET metadata = metadata - 'agent_mute_state' - 'agent_mute_until'
 WHERE agent_id = %(agent_id)s AND id = %(world_id)s AND metadata ->> 'agent_mute_state' = 'MUTED'
   AND (metadata ->> 'agent_mute_until')::timestamptz <= now()
RETURNING id;

-- claim_effect --
-- Written before a non-idempotent action runs. No row back: a claim exists already
-- (a retried turn), and get_effect tells whether its result was recorded.
INSERT INTO runtime.effect_claim (agent_id, turn_id, action_index, action)
VALUES (%(agent_id)s, %(turn_id)s, %(action_index)s, %(action)s)
ON CONFLICT DO NOTHING
RETURNING claimed_at;

-- get_effect --
SELECT action, result, claimed_at, completed_at FROM runtime.effect_claim
 WHERE agent_id = %(agent_id)s AND turn_id = %(turn_id)s AND action_index = %(action_index)s;

-- complete_effect --
UPDATE runtime.effect_claim SET result = %(result)s, completed_at = clock_timestamp()
 WHERE agent_id = %(agent_id)s AND turn_id = %(turn_id)s AND action_index = %(action_index)s
   AND completed_at IS NULL
RETURNING completed_at;

-- remember --
-- Memories of one room and sender, each with its embedding; one already stored is kept as it is.
INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, source, embedding, metadata)
SELECT %(agent_id)s, m.id, %(room_id)s, %(entity_id)s, m.kind, m.content, %(source)s, m.embedding, m.metadata
  FROM unnest(%(ids)s::uuid[], %(kinds)s::text[], %(contents)s::jsonb[], %(embeddings)b::vector[],
              %(metadatas)s::jsonb[]) AS m(id, kind, content, embedding, metadata)
ON CONFLICT DO NOTHING;

-- set_embeddings --
-- Several memories' embeddings in one statement (a turn's message and replies, a backfill batch).
-- Its commit does not wait for the WAL to reach the disk: embeddings a crash of PostgreSQL loses
-- are missing ones, which the backfill task computes again.
WITH async AS (SELECT set_config('synchronous_commit', 'off', true))
UPDATE runtime.memory m SET embedding = v.embedding
  FROM unnest(%(ids)s::uuid[], %(embeddings)b::vector[]) AS v(id, embedding), async
 WHERE m.agent_id = %(agent_id)s AND m.id = v.id;

-- search_memories --
-- Nearest memories of one kind by cosine distance, for this agent only.
WITH q AS (SELECT %(embedding)s::vector AS v)
SELECT id, kind, content ->> 'text' AS text, created_at, 1 - (embedding <=> q.v) AS similarity
  FROM runtime.memory, q
 WHERE agent_id = %(agent_id)s AND kind = %(kind)s AND embedding IS NOT NULL
   AND vector_dims(embedding) = vector_dims(q.v)
   AND (%(room_id)s::uuid IS NULL OR room_id = %(room_id)s)
 ORDER BY embedding <=> q.v
 LIMIT %(limit)s;

-- has_memories --
SELECT EXISTS (SELECT 1 FROM runtime.memory WHERE agent_id = %(agent_id)s AND kind = %(kind)s) AS found;

-- get_memory --
SELECT id, room_id, entity_id, kind, content, source, external_id, in_reply_to, created_at
  FROM runtime.memory
 WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- get_room --
SELECT id, source, channel_id, type, world_id, created_at
  FROM runtime.room
 WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- list_memories --
SELECT id, room_id, entity_id, kind, content, source, in_reply_to, created_at
  FROM runtime.memory
 WHERE agent_id = %(agent_id)s AND kind = %(kind)s
   AND (%(room_id)s::uuid IS NULL OR room_id = %(room_id)s)
 ORDER BY created_at DESC, id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_turns --
SELECT id, room_id, stream_seq, state, reason, lease_token, attempts, response_id, error, received_at,
       started_at, finished_at, origin
  FROM runtime.turn
 WHERE agent_id = %(agent_id)s AND (%(room_id)s::uuid IS NULL OR room_id = %(room_id)s)
 ORDER BY received_at DESC, id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- upsert_secret --
INSERT INTO runtime.agent_secret (agent_id, name, ciphertext)
VALUES (%(agent_id)s, %(name)s, %(ciphertext)s)
ON CONFLICT (agent_id, name) DO UPDATE SET ciphertext = excluded.ciphertext, updated_at = now();

-- list_secrets --
SELECT name, ciphertext FROM runtime.agent_secret WHERE agent_id = %(agent_id)s ORDER BY name;

-- delete_other_secrets --
DELETE FROM runtime.agent_secret WHERE agent_id = %(agent_id)s AND NOT (name = ANY(%(keep)s::text[]));

-- get_agent --
SELECT id, name, enabled, character, created_at FROM runtime.agent WHERE id = %(id)s OR name = %(name)s;

-- set_agent_enabled --
UPDATE runtime.agent SET enabled = %(enabled)s, updated_at = now() WHERE id = %(id)s RETURNING id;

-- get_turn --
SELECT id, room_id, stream_seq, state, reason, lease_token, attempts, response_id, error, trajectory,
       received_at, started_at, finished_at, origin
  FROM runtime.turn
 WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- missing_embeddings --
-- Messages and facts stored while the embedding model could not be reached.
SELECT id, content ->> 'text' AS text FROM runtime.memory
 WHERE agent_id = %(agent_id)s AND embedding IS NULL AND kind IN ('messages', 'facts')
   AND coalesce(content ->> 'text', '') <> ''
 ORDER BY created_at DESC
 LIMIT %(limit)s;

-- --- confirmations (actions tagged `confirm`) -------------------------------------------------

-- save_tool_call --
-- Idempotent: a redelivered turn proposes the same call again and gets the first proposal
-- back, so what authz was told (parameters digest, message) never changes.
WITH new AS (
    INSERT INTO runtime.tool_call (agent_id, tool_call_id, turn_id, action_index, call_index, room_id,
                                   message_id, action, params, requester_id, role, invocation)
    VALUES (%(agent_id)s, %(tool_call_id)s, %(turn_id)s, %(action_index)s, %(call_index)s, %(room_id)s,
            %(message_id)s, %(action)s, %(params)s, %(requester_id)s, %(role)s, %(invocation)s)
    ON CONFLICT DO NOTHING
    RETURNING *
)
SELECT * FROM new
UNION ALL
SELECT * FROM runtime.tool_call
 WHERE agent_id = %(agent_id)s AND tool_call_id = %(tool_call_id)s AND NOT EXISTS (SELECT 1 FROM new);

-- get_tool_call --
SELECT * FROM runtime.tool_call WHERE agent_id = %(agent_id)s AND tool_call_id = %(tool_call_id)s;

-- get_tool_calls --
SELECT * FROM runtime.tool_call WHERE agent_id = %(agent_id)s AND tool_call_id = ANY(%(ids)s::text[]);


-- ---------------------------------------------------------------------------------------------
-- Documents (knowledge). Every statement that makes document rows, counts, fragments or rankings
-- selects from runtime.allowed_documents (see schema.sql), so what a requester may not read
-- never reaches a row, a count or a ranking. %(requester)s is an entity id (NULL for the
-- operator) and %(operator)s whether the operator asks (who acts as OWNER).
-- ---------------------------------------------------------------------------------------------

-- check_add_document --
-- Whether the requester may add a document with these values (the rules of runtime.document_rule
-- on the requester's role in the room), before its fragments are embedded; add_document decides
-- again in the statement that writes.
WITH rr AS (
    SELECT role, in_room FROM runtime.requester_roles(%(agent_id)s::uuid, %(requester)s::uuid)
     WHERE room_id = %(room_id)s::uuid
)
SELECT runtime.document_rule('mutate', %(agent_id)s::uuid, %(scope)s::text, %(scoped_to)s::uuid, %(grants)s::uuid[],
                             %(requester)s::uuid, %(operator)s::boolean,
                             (SELECT role FROM rr), (SELECT in_room FROM rr))
       AND (cardinality(%(grants)s::uuid[]) = 0
            OR runtime.document_rule('grant', %(agent_id)s::uuid, %(scope)s::text, %(scoped_to)s::uuid,
                                     %(grants)s::uuid[], %(requester)s::uuid, %(operator)s::boolean,
                                     (SELECT role FROM rr), (SELECT in_room FROM rr))) AS allowed,
       (%(room_id)s::uuid IS NULL
        OR EXISTS (SELECT 1 FROM runtime.room WHERE agent_id = %(agent_id)s::uuid AND id = %(room_id)s::uuid))
       AS room_found,
       (SELECT count(*) FROM runtime.entity
         WHERE agent_id = %(agent_id)s::uuid AND id = ANY (%(grants)s::uuid[])) = cardinality(%(grants)s::uuid[])
       AND (%(scoped_to)s::uuid IS NULL
            OR EXISTS (SELECT 1 FROM runtime.entity WHERE agent_id = %(agent_id)s::uuid AND id = %(scoped_to)s::uuid))
       AS entities_found;

-- add_document --
-- The document and its fragments in one statement, only when the requester may add it (the same
-- rules as check_add_document, decided again here) and every named entity and the room exist.
WITH rr AS (
    SELECT role, in_room FROM runtime.requester_roles(%(agent_id)s::uuid, %(requester)s::uuid)
     WHERE room_id = %(room_id)s::uuid
), ok AS (
    SELECT runtime.document_rule('mutate', %(agent_id)s::uuid, %(scope)s::text, %(scoped_to)s::uuid,
                                 %(grants)s::uuid[], %(requester)s::uuid, %(operator)s::boolean,
                                 (SELECT role FROM rr), (SELECT in_room FROM rr))
           AND (cardinality(%(grants)s::uuid[]) = 0
                OR runtime.document_rule('grant', %(agent_id)s::uuid, %(scope)s::text, %(scoped_to)s::uuid,
                                         %(grants)s::uuid[], %(requester)s::uuid, %(operator)s::boolean,
                                         (SELECT role FROM rr), (SELECT in_room FROM rr)))
           AND (%(room_id)s::uuid IS NULL
                OR EXISTS (SELECT 1 FROM runtime.room WHERE agent_id = %(agent_id)s::uuid AND id = %(room_id)s::uuid))
           AND (SELECT count(*) FROM runtime.entity
                 WHERE agent_id = %(agent_id)s::uuid AND id = ANY (%(grants)s::uuid[]))
               = cardinality(%(grants)s::uuid[])
           AND (%(scoped_to)s::uuid IS NULL
                OR EXISTS (SELECT 1 FROM runtime.entity
                            WHERE agent_id = %(agent_id)s::uuid AND id = %(scoped_to)s::uuid))
           AS allowed
), d AS (
    INSERT INTO runtime.document (agent_id, id, room_id, scope, scoped_to_entity_id, direct_grant_entity_ids,
                                  title, content_type, text, size_bytes, fragment_count, created_by)
    SELECT %(agent_id)s::uuid, %(id)s::uuid, %(room_id)s::uuid, %(scope)s::text, %(scoped_to)s::uuid,
           %(grants)s::uuid[], %(title)s, %(content_type)s, %(text)s, %(size_bytes)s,
           cardinality(%(fragments)s::text[]), %(requester)s::uuid
      FROM ok WHERE ok.allowed
    RETURNING agent_id, id, room_id, scope, scoped_to_entity_id, direct_grant_entity_ids, access_revision,
              title, content_type, size_bytes, fragment_count, created_by, created_at
), f AS (
    INSERT INTO runtime.document_fragment (agent_id, document_id, position, text, embedding)
    SELECT d.agent_id, d.id, (x.n - 1)::integer, x.text, x.embedding
      FROM d, unnest(%(fragments)s::text[], %(embeddings)b::vector[]) WITH ORDINALITY AS x (text, embedding, n)
)
SELECT d.* FROM d;

-- list_documents --
-- One page of the documents the requester may read, newest first (id breaks ties), and how many
-- there are in all; one row with NULL columns and the total when the page is empty.
WITH readable AS (
    SELECT d.agent_id, d.id, d.room_id, d.scope, d.scoped_to_entity_id, d.direct_grant_entity_ids,
           d.access_revision, d.title, d.content_type, d.size_bytes, d.fragment_count, d.created_by, d.created_at
      FROM runtime.allowed_documents('read', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) d
     WHERE (%(room_id)s::uuid IS NULL OR d.room_id = %(room_id)s::uuid)
)
SELECT page.*, total.total
  FROM (SELECT count(*) AS total FROM readable) AS total
  LEFT JOIN LATERAL (SELECT * FROM readable ORDER BY created_at DESC, id DESC
                      LIMIT %(limit)s OFFSET %(offset)s) AS page ON true
 ORDER BY page.created_at DESC, page.id DESC;

-- get_document --
SELECT d.agent_id, d.id, d.room_id, d.scope, d.scoped_to_entity_id, d.direct_grant_entity_ids,
       d.access_revision, d.title, d.content_type, d.size_bytes, d.fragment_count, d.created_by, d.created_at,
       CASE WHEN %(include_text)s THEN d.text END AS text
  FROM runtime.allowed_documents('read', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) d
 WHERE d.id = %(id)s::uuid;

-- remove_document --
-- Deletes the document (its fragments go with it) when the requester may change it. `readable`
-- tells a refusal (PERMISSION_DENIED) from a document they may not see (NOT_FOUND, like a missing one).
WITH target AS (
    SELECT d.id
      FROM runtime.allowed_documents('read', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) d
     WHERE d.id = %(id)s::uuid
), removed AS (
    DELETE FROM runtime.document d
     USING runtime.allowed_documents('mutate', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) a
     WHERE d.agent_id = %(agent_id)s::uuid AND d.id = %(id)s::uuid AND a.id = d.id
    RETURNING d.fragment_count
)
SELECT EXISTS (SELECT 1 FROM target) AS readable, (SELECT fragment_count FROM removed) AS fragments_removed;

-- replace_document_grants --
-- The grant replacement is one CAS on the access revision: only the statement that still finds
-- %(expected)s (re-checked on the newest row version when racing) wins. The other columns tell
-- why nothing changed: not readable (NOT_FOUND), readable but not re-grantable (PERMISSION_DENIED),
-- an unknown or foreign grantee (INVALID_ARGUMENT), or a lost CAS (ABORTED).
WITH target AS (
    SELECT d.access_revision,
           EXISTS (SELECT 1 FROM runtime.allowed_documents('grant', %(agent_id)s::uuid, %(requester)s::uuid,
                                                           %(operator)s::boolean) g
                    WHERE g.id = d.id) AS may_grant
      FROM runtime.allowed_documents('read', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) d
     WHERE d.id = %(id)s::uuid
), valid AS (
    SELECT count(*) = cardinality(%(grants)s::uuid[]) AS entities_found
      FROM runtime.entity WHERE agent_id = %(agent_id)s::uuid AND id = ANY (%(grants)s::uuid[])
), updated AS (
    UPDATE runtime.document d
       SET direct_grant_entity_ids = %(grants)s::uuid[], access_revision = d.access_revision + 1
      FROM valid,
           runtime.allowed_documents('grant', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) a
     WHERE valid.entities_found AND d.agent_id = %(agent_id)s::uuid AND d.id = %(id)s::uuid AND a.id = d.id
       AND d.access_revision = %(expected)s
    RETURNING d.agent_id, d.id, d.room_id, d.scope, d.scoped_to_entity_id, d.direct_grant_entity_ids,
              d.access_revision, d.title, d.content_type, d.size_bytes, d.fragment_count, d.created_by,
              d.created_at
)
SELECT EXISTS (SELECT 1 FROM target) AS readable, coalesce((SELECT may_grant FROM target), false) AS may_grant,
       (SELECT access_revision FROM target) AS current_revision, valid.entities_found, updated.*
  FROM valid LEFT JOIN updated ON true;

-- search_document_fragments --
-- The nearest fragments by cosine distance among the documents the requester may read: those
-- documents are found first (once each), then only their fragments are ranked (a hash join),
-- so a ranking holds only what the requester may see.
WITH q AS (SELECT %(embedding)s::vector AS v), readable AS MATERIALIZED (
    SELECT d.id, d.title
      FROM runtime.allowed_documents('read', %(agent_id)s::uuid, %(requester)s::uuid, %(operator)s::boolean) d
     WHERE (%(room_id)s::uuid IS NULL OR d.room_id = %(room_id)s::uuid)
       AND (%(scopes)s::text[] IS NULL OR d.scope::text = ANY(%(scopes)s::text[]))
), ranked AS (
    SELECT f.document_id, f.position, f.text, r.title, f.embedding <=> q.v AS distance
      FROM runtime.document_fragment f JOIN readable r ON r.id = f.document_id, q
     WHERE f.agent_id = %(agent_id)s::uuid AND vector_dims(f.embedding) = vector_dims(q.v)
)
SELECT document_id, position, text, title, 1 - distance AS similarity
  FROM ranked
 ORDER BY distance, document_id, position
 LIMIT %(limit)s;

-- has_documents --
SELECT EXISTS (SELECT 1 FROM runtime.document WHERE agent_id = %(agent_id)s::uuid) AS found;


-- ---------------------------------------------------------------------------------------------
-- Custom actions (parley_runtime/custom/store.py)
-- ---------------------------------------------------------------------------------------------

-- upsert_custom_action --
-- Insert or replace one definition (by id) and bump the agent's revision in the same statement.
-- A name taken by another id of the same agent fails on custom_action_name.
WITH saved AS (
    INSERT INTO runtime.custom_action (agent_id, id, name, definition, enabled)
    VALUES (%(agent_id)s, %(id)s, %(name)s, %(definition)s, %(enabled)s)
    ON CONFLICT (agent_id, id) DO UPDATE
       SET name = excluded.name, definition = excluded.definition, enabled = excluded.enabled,
           updated_at = now()
    RETURNING id, name, definition, enabled, created_at, updated_at
), bumped AS (
    INSERT INTO runtime.custom_action_revision AS r (agent_id, revision)
    SELECT %(agent_id)s, 1 FROM saved
    ON CONFLICT (agent_id) DO UPDATE SET revision = r.revision + 1
    RETURNING revision
)
SELECT saved.*, bumped.revision FROM saved, bumped;

-- delete_custom_action --
WITH gone AS (
    DELETE FROM runtime.custom_action WHERE agent_id = %(agent_id)s AND id = %(id)s RETURNING id
), bumped AS (
    INSERT INTO runtime.custom_action_revision AS r (agent_id, revision)
    SELECT %(agent_id)s, 1 FROM gone
    ON CONFLICT (agent_id) DO UPDATE SET revision = r.revision + 1
    RETURNING revision
)
SELECT gone.id, bumped.revision FROM gone, bumped;

-- custom_action_revision --
SELECT revision FROM runtime.custom_action_revision WHERE agent_id = %(agent_id)s;

-- list_custom_actions --
-- The revision and the definitions from one snapshot, so a cached list always matches its revision.
SELECT rev.revision, a.id, a.name, a.definition, a.enabled, a.created_at, a.updated_at
  FROM (SELECT coalesce((SELECT revision FROM runtime.custom_action_revision
                          WHERE agent_id = %(agent_id)s), 0) AS revision) rev
  LEFT JOIN runtime.custom_action a ON a.agent_id = %(agent_id)s
 ORDER BY a.name;

-- --- autonomy (parley_runtime/autonomy) --------------------------------------------------------

-- get_autonomy --
SELECT enabled, generation, updated_at FROM runtime.autonomy WHERE agent_id = %(agent_id)s;

-- set_autonomy --
-- The operator's switch; switching on from off (or for the first time) starts a new generation.
INSERT INTO runtime.autonomy AS a (agent_id, enabled, generation)
VALUES (%(agent_id)s, %(enabled)s, 1)
ON CONFLICT (agent_id) DO UPDATE
   SET enabled = excluded.enabled,
       generation = a.generation + CASE WHEN excluded.enabled AND NOT a.enabled THEN 1 ELSE 0 END,
       updated_at = now()
RETURNING enabled, generation, updated_at;

-- autonomy_busy --
-- An autonomous turn of the agent still running (and not abandoned by a replica that died).
SELECT EXISTS (
    SELECT 1 FROM runtime.turn
     WHERE agent_id = %(agent_id)s AND origin = 'autonomous' AND state IN ('received', 'running')
       -- statement_timestamp(), not clock_timestamp(): a stable bound is an index condition
       -- (turn_origin_recent), so this reads the recent turns, not every autonomous turn ever.
       AND received_at > statement_timestamp() - make_interval(secs => %(stale_seconds)s)
) AS busy;

-- autonomy_counts --
SELECT count(*) AS turns, max(received_at) AS last_at
  FROM runtime.turn WHERE agent_id = %(agent_id)s AND origin = 'autonomous';

-- --- operator administration (parley rooms|worlds|entities|participants|relationships) --------

-- list_rooms_admin --
-- Rooms with the agent's own state in each (muted, until when), newest first by room_recent. The
-- agent's row is read per room by its key: as a join, the planner could compare every room with
-- every room's agent row (quadratic in the agent's rooms, 4.5 million comparisons at 3,000).
SELECT r.id, r.source, r.channel_id, r.type, r.name, r.created_at, w.external_id AS world_external_id,
       r.world_id, ap.user_state, ap.mute_until
  FROM runtime.room r
  LEFT JOIN runtime.world w ON w.agent_id = r.agent_id AND w.id = r.world_id
  LEFT JOIN LATERAL (SELECT p.user_state, p.mute_until FROM runtime.participant p
                      WHERE p.agent_id = r.agent_id AND p.room_id = r.id AND p.entity_id = r.agent_id
                      LIMIT 1) ap ON true  -- (one row by the key; LIMIT keeps it from becoming a join)
 WHERE r.agent_id = %(agent_id)s AND (%(world_id)s::uuid IS NULL OR r.world_id = %(world_id)s)
 ORDER BY r.created_at DESC, r.id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_worlds --
SELECT w.id, w.source, w.external_id, w.name, w.metadata, w.created_at,
       (SELECT count(*) FROM runtime.room r WHERE r.agent_id = w.agent_id AND r.world_id = w.id) AS rooms
  FROM runtime.world w
 WHERE w.agent_id = %(agent_id)s
 ORDER BY w.created_at DESC, w.id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_entities --
SELECT e.id, e.names, e.metadata, e.created_at
  FROM runtime.entity e
 WHERE e.agent_id = %(agent_id)s
   AND (%(room_id)s::uuid IS NULL OR EXISTS (
        SELECT 1 FROM runtime.participant p
         WHERE p.agent_id = e.agent_id AND p.room_id = %(room_id)s AND p.entity_id = e.id))
 ORDER BY e.created_at DESC, e.id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_participants --
SELECT p.room_id, p.entity_id, e.names, p.role, p.role_source, p.user_state, p.mute_until, p.created_at
  FROM runtime.participant p
  JOIN runtime.entity e ON e.agent_id = p.agent_id AND e.id = p.entity_id
 WHERE p.agent_id = %(agent_id)s
   AND (%(room_id)s::uuid IS NULL OR p.room_id = %(room_id)s)
   AND (%(entity_id)s::uuid IS NULL OR p.entity_id = %(entity_id)s)
 ORDER BY p.created_at DESC, p.room_id, p.entity_id
 LIMIT %(limit)s OFFSET %(offset)s;

-- list_relationships --
SELECT id, source_entity_id, target_entity_id, tags, metadata, created_at, updated_at
  FROM runtime.relationship
 WHERE agent_id = %(agent_id)s
   AND (%(entity_id)s::uuid IS NULL OR source_entity_id = %(entity_id)s OR target_entity_id = %(entity_id)s)
   AND (%(tag)s::text IS NULL OR %(tag)s = ANY(tags))
 ORDER BY updated_at DESC, id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- set_participant_role --
-- The operator's role for an entity in a room (the entity must exist for this agent; the room too).
-- From now on the next turn's role gate reads it, and a connector's claim never changes it.
INSERT INTO runtime.participant (agent_id, room_id, entity_id, role, role_source)
SELECT %(agent_id)s, r.id, e.id, %(role)s, 'operator'
  FROM runtime.room r, runtime.entity e
 WHERE r.agent_id = %(agent_id)s AND r.id = %(room_id)s AND e.agent_id = %(agent_id)s AND e.id = %(entity_id)s
ON CONFLICT (agent_id, room_id, entity_id) DO UPDATE SET role = excluded.role, role_source = 'operator'
RETURNING room_id, entity_id, role, role_source, user_state, mute_until, created_at,
          (SELECT names FROM runtime.entity WHERE agent_id = %(agent_id)s AND id = %(entity_id)s) AS names;

-- room_exists --
SELECT id FROM runtime.room WHERE agent_id = %(agent_id)s AND id = %(id)s;

-- set_world_mute --
-- The agent's mute of a whole world (read by the gate with the world's metadata); NULL state unmutes.
UPDATE runtime.world
   SET metadata = CASE WHEN %(state)s::text IS NULL THEN metadata - 'agent_mute_state' - 'agent_mute_until'
                       ELSE metadata || jsonb_build_object('agent_mute_state', %(state)s::text,
                                                          'agent_mute_until', %(mute_until)s::timestamptz)
                  END
 WHERE agent_id = %(agent_id)s AND id = %(world_id)s
RETURNING id, metadata;
-- reflect_relationship --
-- REFLECTION's relationship between two entities of the agent: one row per (source, target), its
-- tags and metadata merged with what was known (the table of operator administration).
INSERT INTO runtime.relationship (agent_id, id, source_entity_id, target_entity_id, tags, metadata)
VALUES (%(agent_id)s, %(id)s, %(source_entity_id)s, %(target_entity_id)s, %(tags)s, %(metadata)s)
ON CONFLICT (agent_id, source_entity_id, target_entity_id) DO UPDATE
   SET tags = ARRAY(SELECT DISTINCT unnest(relationship.tags || excluded.tags) ORDER BY 1),
       metadata = relationship.metadata || excluded.metadata, updated_at = now()
RETURNING id;
