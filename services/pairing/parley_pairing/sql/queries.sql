-- Named queries of the pairing service. Each `-- name --` header starts one statement.
-- %(ttl)s is the request TTL in seconds: a request is live while created_at > now() - ttl.

-- upsert_request --
-- One statement: a live request of the sender is refreshed and returned
-- ('existing'); otherwise the channel's expired requests are removed and a new
-- one is inserted into the lowest free slot ('created'); with no free slot the
-- channel is full ('full') and nothing is evicted. The slot and code are
-- unique indexes, so when a concurrent statement takes the same slot, sender or
-- code, ON CONFLICT inserts nothing and the outcome is 'raced': the caller runs
-- the statement again (with a fresh code) and then sees what the other one did.
WITH live AS (
    UPDATE pairing.request
       SET last_seen_at = now(), metadata = request.metadata || %(metadata)s
     WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND sender_id = %(sender_id)s
       AND created_at > now() - make_interval(secs => %(ttl)s)
    RETURNING id, code, created_at, last_seen_at, metadata
), expired AS (
    DELETE FROM pairing.request
     WHERE agent_id = %(agent_id)s AND channel = %(channel)s
       AND created_at <= now() - make_interval(secs => %(ttl)s)
    RETURNING 1
), free AS (
    SELECT s AS slot
      FROM generate_series(1, %(max_pending)s::integer) AS s
     WHERE NOT EXISTS (SELECT 1 FROM live)
       AND NOT EXISTS (SELECT 1 FROM pairing.request r
                        WHERE r.agent_id = %(agent_id)s AND r.channel = %(channel)s AND r.slot = s
                          AND r.created_at > now() - make_interval(secs => %(ttl)s))
     ORDER BY s
     LIMIT 1
), created AS (
    -- Joined with the count of `expired` so that the expired rows are deleted
    -- before this insert checks its unique indexes against them.
    INSERT INTO pairing.request (agent_id, channel, sender_id, code, slot, metadata)
    SELECT %(agent_id)s, %(channel)s, %(sender_id)s, %(code)s, free.slot, %(metadata)s
      FROM free, (SELECT count(*) FROM expired) AS purged
    ON CONFLICT DO NOTHING
    RETURNING id, code, created_at, last_seen_at, metadata
)
SELECT 'existing' AS outcome, id, code, created_at, last_seen_at, metadata FROM live
UNION ALL
SELECT 'created', id, code, created_at, last_seen_at, metadata FROM created
UNION ALL
SELECT CASE WHEN EXISTS (SELECT 1 FROM free) THEN 'raced' ELSE 'full' END,
       NULL::uuid, NULL::text, NULL::timestamptz, NULL::timestamptz, NULL::jsonb
 WHERE NOT EXISTS (SELECT 1 FROM live) AND NOT EXISTS (SELECT 1 FROM created);

-- approve_code --
-- One statement, so one transaction: the live request with this code is
-- deleted and its sender added to the allowlist. A sender already on the
-- allowlist keeps the entry it has (the no-op update returns it, even when a
-- concurrent transaction added it). No row: no live request has this code.
WITH approved AS (
    DELETE FROM pairing.request
     WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND code = %(code)s
       AND created_at > now() - make_interval(secs => %(ttl)s)
    RETURNING id, sender_id, code, created_at, last_seen_at, metadata
), entry AS (
    INSERT INTO pairing.allowlist AS a (agent_id, channel, sender_id, added_by, metadata)
    SELECT %(agent_id)s, %(channel)s, sender_id, %(added_by)s, metadata FROM approved
    ON CONFLICT (agent_id, channel, sender_id) DO UPDATE SET added_by = a.added_by
    RETURNING id, created_at, added_by, metadata
)
SELECT approved.id, approved.sender_id, approved.code, approved.created_at, approved.last_seen_at,
       approved.metadata, entry.id AS entry_id, entry.created_at AS entry_created_at,
       entry.added_by AS entry_added_by, entry.metadata AS entry_metadata
  FROM approved, entry;

-- deny_code --
DELETE FROM pairing.request
 WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND code = %(code)s
   AND created_at > now() - make_interval(secs => %(ttl)s)
RETURNING id, sender_id, code, created_at, last_seen_at, metadata;

-- is_allowed --
SELECT EXISTS (
    SELECT 1 FROM pairing.allowlist
     WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND sender_id = %(sender_id)s
) AS allowed;

-- add_to_allowlist --
-- Idempotent: a sender already on the allowlist is returned as it is
-- (created = false). The sender's pending request, if any, is withdrawn.
-- No row only when a concurrent statement added the same sender after this
-- one's snapshot; the caller runs it again and then sees that entry.
WITH pending AS (
    DELETE FROM pairing.request
     WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND sender_id = %(sender_id)s
), inserted AS (
    INSERT INTO pairing.allowlist (agent_id, channel, sender_id, added_by, metadata)
    VALUES (%(agent_id)s, %(channel)s, %(sender_id)s, %(added_by)s, %(metadata)s)
    ON CONFLICT (agent_id, channel, sender_id) DO NOTHING
    RETURNING id, created_at, added_by, metadata
)
SELECT true AS created, id, created_at, added_by, metadata FROM inserted
UNION ALL
SELECT false, id, created_at, added_by, metadata
  FROM pairing.allowlist
 WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND sender_id = %(sender_id)s
   AND NOT EXISTS (SELECT 1 FROM inserted);

-- remove_from_allowlist --
DELETE FROM pairing.allowlist
 WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND sender_id = %(sender_id)s
RETURNING id;

-- claim_reply --
-- True once per TTL window and code: a second claim for the same code within
-- the window finds the claim row and updates nothing. The row lock of the
-- upsert makes concurrent claims, from any replica, agree on one winner.
WITH current AS (
    SELECT code FROM pairing.request
     WHERE agent_id = %(agent_id)s AND channel = %(channel)s AND sender_id = %(sender_id)s
       AND created_at > now() - make_interval(secs => %(ttl)s)
), claimed AS (
    INSERT INTO pairing.reply_claim AS c (agent_id, channel, sender_id, code, claimed_at)
    VALUES (%(agent_id)s, %(channel)s, %(sender_id)s, (SELECT code FROM current), now())
    ON CONFLICT (agent_id, channel, sender_id) DO UPDATE
       SET code = excluded.code, claimed_at = excluded.claimed_at
     WHERE c.claimed_at <= now() - make_interval(secs => %(ttl)s) OR c.code IS DISTINCT FROM excluded.code
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM claimed) AS claimed, (SELECT code FROM current) AS code;

-- pending_page --
-- Expired requests are cut off in the index range, so they take no page slots. Columns come out
-- as the page's items carry them (ids as text, instants in epoch microseconds, empty metadata as
-- NULL): converting 50 rows in Python cost more than the statement itself. The order is by the
-- table's columns (r.id, the uuid), not by the text alias.
SELECT id::text AS id, sender_id, code,
       (extract(epoch FROM created_at) * 1000000)::int8 AS created_us,
       (extract(epoch FROM last_seen_at) * 1000000)::int8 AS last_seen_us,
       (extract(epoch FROM created_at + make_interval(secs => %(ttl)s)) * 1000000)::int8 AS expires_us,
       nullif(metadata, '{}'::jsonb) AS metadata
  FROM pairing.request r
 WHERE agent_id = %(agent_id)s AND channel = %(channel)s
   AND created_at > now() - make_interval(secs => %(ttl)s)
 ORDER BY r.created_at DESC, r.id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- allowlist_page --
-- Wire-ready columns, as pending_page.
SELECT id::text AS id, sender_id, added_by,
       (extract(epoch FROM created_at) * 1000000)::int8 AS created_us,
       nullif(metadata, '{}'::jsonb) AS metadata
  FROM pairing.allowlist a
 WHERE agent_id = %(agent_id)s AND channel = %(channel)s
 ORDER BY a.created_at DESC, a.id DESC
 LIMIT %(limit)s OFFSET %(offset)s;

-- purge_requests --
-- Expired requests, a batch at a time; replicas sweeping at once skip each other's rows.
DELETE FROM pairing.request r
 USING (SELECT agent_id, channel, sender_id
          FROM pairing.request
         WHERE created_at <= now() - make_interval(secs => %(ttl)s)
         ORDER BY created_at
         LIMIT %(batch)s
           FOR UPDATE SKIP LOCKED) AS doomed
 WHERE r.agent_id = doomed.agent_id AND r.channel = doomed.channel AND r.sender_id = doomed.sender_id;

-- purge_claims --
-- The cutoff again on the deleted rows: with it PostgreSQL finds them by the expiry index too,
-- without it each batch could join against a scan of the whole table.
DELETE FROM pairing.reply_claim c
 USING (SELECT agent_id, channel, sender_id
          FROM pairing.reply_claim
         WHERE claimed_at <= now() - make_interval(secs => %(ttl)s)
         ORDER BY claimed_at
         LIMIT %(batch)s
           FOR UPDATE SKIP LOCKED) AS doomed
 WHERE c.agent_id = doomed.agent_id AND c.channel = doomed.channel AND c.sender_id = doomed.sender_id
   AND c.claimed_at <= now() - make_interval(secs => %(ttl)s);

-- pending_counts --
SELECT channel, count(*) AS pending
  FROM pairing.request
 WHERE created_at > now() - make_interval(secs => %(ttl)s)
 GROUP BY channel;

-- add_connector --
-- A new connector; nothing when the name is taken (whether revoked or not: a name is used once).
INSERT INTO pairing.connector (name, namespace, agent_id, source, kind, secret_digest, api_key_digest)
VALUES (%(name)s, %(namespace)s, %(agent_id)s, %(source)s, %(kind)s, %(secret_digest)s, %(api_key_digest)s)
ON CONFLICT (name) DO NOTHING
RETURNING name, namespace, agent_id, source, kind, created_at, revoked_at;

-- list_connectors --
-- The connectors of one namespace (deployments sharing a database see only their own).
SELECT name, namespace, agent_id, source, kind, created_at, revoked_at
  FROM pairing.connector
 WHERE namespace = %(namespace)s
   AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s::uuid)
   AND (%(include_revoked)s OR revoked_at IS NULL)
 ORDER BY created_at DESC, name;

-- admit_connector --
-- The connector a NATS connection presents, when its secret matches and it is not revoked; the
-- connection is recorded in the same statement, so a revocation that follows finds it.
WITH found AS (
    SELECT name, namespace, agent_id, source, kind, created_at, revoked_at
      FROM pairing.connector
     WHERE name = %(name)s AND secret_digest = %(secret_digest)s AND revoked_at IS NULL
), session AS (
    INSERT INTO pairing.connector_session (connector, server_id, client_id)
    SELECT name, %(server_id)s, %(client_id)s FROM found
    ON CONFLICT DO NOTHING
)
SELECT * FROM found;

-- revoke_connector --
-- Revoked once: the first revocation returns the connector and its recorded connections.
-- Admission is not scoped by namespace (the server asks any pairing replica on its NATS), but an
-- operator revokes only their own namespace's connectors.
WITH revoked AS (
    UPDATE pairing.connector SET revoked_at = now()
     WHERE name = %(name)s AND namespace = %(namespace)s AND revoked_at IS NULL
    RETURNING name, namespace, agent_id, source, kind, created_at, revoked_at
)
SELECT revoked.*,
       coalesce((SELECT array_agg(s.server_id || ' ' || s.client_id)
                   FROM pairing.connector_session s WHERE s.connector = revoked.name), '{}') AS sessions
  FROM revoked;

-- get_connector --
SELECT name, namespace, agent_id, source, kind, created_at, revoked_at FROM pairing.connector WHERE name = %(name)s;

-- connector_by_api_key --
SELECT name, namespace, agent_id, source, kind, created_at, revoked_at
  FROM pairing.connector WHERE api_key_digest = %(api_key_digest)s AND revoked_at IS NULL;
