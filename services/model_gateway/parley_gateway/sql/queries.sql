-- Named queries of the model gateway. Every state change is one statement naming the state it expects.

-- reserve_budget --
-- Admit a call: roll the window if it has passed, then hold the tokens, but only while
-- spent + reserved + wanted stays within the limit. No budget row means no budget.
WITH budget AS (
    SELECT agent_id FROM model.budget WHERE agent_id = %(agent_id)s
), admitted AS (
    UPDATE model.budget AS b
       SET window_started_at = CASE WHEN b.window_started_at + b.window_seconds * interval '1 second' <= now()
                                    THEN now() ELSE b.window_started_at END,
           spent_tokens = CASE WHEN b.window_started_at + b.window_seconds * interval '1 second' <= now()
                               THEN 0 ELSE b.spent_tokens END,
           reserved_tokens = b.reserved_tokens + %(tokens)s,
           updated_at = now()
     WHERE b.agent_id = %(agent_id)s
       AND (CASE WHEN b.window_started_at + b.window_seconds * interval '1 second' <= now()
                 THEN 0 ELSE b.spent_tokens END) + b.reserved_tokens + %(tokens)s <= b.limit_tokens
    RETURNING b.limit_tokens, b.spent_tokens, b.reserved_tokens
)
SELECT EXISTS (SELECT 1 FROM budget) AS budgeted,
       EXISTS (SELECT 1 FROM admitted) AS admitted,
       (SELECT limit_tokens FROM model.budget WHERE agent_id = %(agent_id)s) AS limit_tokens;

-- commit_budget --
-- The call finished: its reservation becomes what it really used.
UPDATE model.budget
   SET reserved_tokens = reserved_tokens - %(reserved)s,
       spent_tokens = spent_tokens + %(used)s,
       updated_at = now()
 WHERE agent_id = %(agent_id)s AND reserved_tokens >= %(reserved)s
RETURNING spent_tokens, reserved_tokens;

-- release_budget --
-- The call failed before using anything: give the reservation back.
UPDATE model.budget
   SET reserved_tokens = reserved_tokens - %(reserved)s, updated_at = now()
 WHERE agent_id = %(agent_id)s AND reserved_tokens >= %(reserved)s
RETURNING reserved_tokens;

-- set_budget --
INSERT INTO model.budget AS b (agent_id, limit_tokens, window_seconds)
VALUES (%(agent_id)s, %(limit_tokens)s, %(window_seconds)s)
ON CONFLICT (agent_id) DO UPDATE
   SET limit_tokens = excluded.limit_tokens, window_seconds = excluded.window_seconds, updated_at = now()
RETURNING agent_id, limit_tokens, window_seconds, window_started_at, spent_tokens, reserved_tokens;

-- ensure_budget --
-- An agent's first call under a default budget creates its row; an existing one is left alone.
INSERT INTO model.budget (agent_id, limit_tokens, window_seconds)
VALUES (%(agent_id)s, %(limit_tokens)s, %(window_seconds)s)
ON CONFLICT (agent_id) DO NOTHING
RETURNING agent_id;

-- delete_budget --
DELETE FROM model.budget WHERE agent_id = %(agent_id)s
RETURNING agent_id;

-- get_budget --
SELECT agent_id, limit_tokens, window_seconds, window_started_at,
       CASE WHEN window_started_at + window_seconds * interval '1 second' <= now() THEN 0
            ELSE spent_tokens END AS spent_tokens,
       reserved_tokens
  FROM model.budget
 WHERE agent_id = %(agent_id)s;

-- record_usage --
-- Adds a batch of ledger increments (one row per key) in one statement.
INSERT INTO model.usage AS u
       (agent_id, provider, model, model_type, kind, requests, input_tokens, output_tokens,
        cached_input_tokens)
SELECT * FROM unnest(%(agent_ids)s::text[], %(providers)s::text[], %(models)s::text[],
                     %(model_types)s::text[], %(kinds)s::text[], %(requests)s::bigint[],
                     %(input_tokens)s::bigint[], %(output_tokens)s::bigint[], %(cached)s::bigint[])
ON CONFLICT (agent_id, provider, model, model_type, kind) DO UPDATE
   SET requests = u.requests + excluded.requests,
       input_tokens = u.input_tokens + excluded.input_tokens,
       output_tokens = u.output_tokens + excluded.output_tokens,
       cached_input_tokens = u.cached_input_tokens + excluded.cached_input_tokens,
       last_at = now();

-- list_usage --
SELECT agent_id, provider, model, model_type, kind, requests, input_tokens, output_tokens,
       cached_input_tokens, first_at, last_at
  FROM model.usage
 WHERE %(agent_id)s = '' OR agent_id = %(agent_id)s
 ORDER BY agent_id, provider, model, model_type, kind
 LIMIT %(limit)s OFFSET %(offset)s;

-- add_section --
INSERT INTO model.batch_section (agent_id, id, affinity, spec, frequency, min_cycle_ms, owner)
VALUES (%(agent_id)s, %(id)s, %(affinity)s, %(spec)s, %(frequency)s, %(min_cycle_ms)s, %(owner)s)
ON CONFLICT (agent_id, id) DO NOTHING
RETURNING id;

-- claim_drain --
-- Take the affinity's drain lease, unless a live drain holds it (no row: wait), and with it the
-- affinity's due sections and any left draining by a drain whose lease expired: one statement.
-- A section whose row another drain changed after this statement began is read again as it is now
-- (READ COMMITTED), so one delivered meanwhile is not claimed; one added meanwhile waits for the
-- next drain.
WITH lease AS (
    INSERT INTO model.batch_affinity AS a (affinity, drain_seq, draining_until, holder)
    VALUES (%(affinity)s, 1, now() + %(lease_seconds)s * interval '1 second', %(holder)s)
    ON CONFLICT (affinity) DO UPDATE
       SET drain_seq = a.drain_seq + 1, draining_until = excluded.draining_until, holder = excluded.holder
     WHERE a.draining_until IS NULL OR a.draining_until < now()
    -- clock_timestamp(): after any wait for the row lock, so the drain log shows the real start.
    RETURNING drain_seq AS seq, clock_timestamp() AS started_at
), claimed AS (
    UPDATE model.batch_section AS s
       SET state = 'draining', drain_seq = lease.seq
      FROM lease
     WHERE s.affinity = %(affinity)s
       AND (s.state = 'pending' OR (s.state = 'draining' AND s.drain_seq < lease.seq))
       AND (s.frequency <> 'recurring' OR s.last_run_at IS NULL
            OR s.last_run_at + s.min_cycle_ms * interval '1 millisecond' <= now())
    RETURNING s.spec
)
SELECT lease.seq, lease.started_at, coalesce((SELECT jsonb_agg(spec) FROM claimed), '[]'::jsonb) AS specs
  FROM lease;

-- finish_drain --
-- The drain's end, one statement: each claimed section delivered (once) or pending again (per
-- drain, recurring) with its result, while this drain still holds it; the lease given back (only
-- by the drain that holds it); the drain logged. A drain that failed finishes no section: what it
-- claimed is claimed again by the next.
WITH finished AS (
    UPDATE model.batch_section AS s
       SET state = CASE WHEN s.frequency = 'once' THEN 'delivered' ELSE 'pending' END,
           drain_seq = NULL,
           last_run_at = now(),
           deliveries = s.deliveries + 1,
           last_result = r.result
      FROM unnest(%(agent_ids)s::text[], %(ids)s::text[], %(results)s::jsonb[]) AS r(agent_id, id, result)
     WHERE s.agent_id = r.agent_id AND s.id = r.id AND s.state = 'draining' AND s.drain_seq = %(seq)s
    RETURNING s.id
), released AS (
    UPDATE model.batch_affinity
       SET draining_until = NULL, holder = NULL, drains = drains + 1, last_drain_at = now()
     WHERE affinity = %(affinity)s AND drain_seq = %(seq)s AND draining_until IS NOT NULL
    RETURNING affinity, drain_seq
), logged AS (
    INSERT INTO model.batch_drain (affinity, seq, started_at, sections, calls)
    SELECT affinity, drain_seq, %(started_at)s, %(sections)s, %(calls)s FROM released
    RETURNING seq
)
SELECT (SELECT count(*) FROM finished)::int AS finished, EXISTS (SELECT 1 FROM logged) AS released;

-- dispose_sections --
DELETE FROM model.batch_section
 WHERE agent_id = %(agent_id)s
   AND (id = ANY(%(ids)s::text[]) OR (%(owner)s <> '' AND owner = %(owner)s))
RETURNING id;

-- batcher_status --
-- Each affinity with sections still to deliver (read by batch_section_undelivered: delivered
-- sections stay until their owners dispose of them, and are not read), with its drains; and the
-- affinity asked for by name, also when it has none (its drains, or nothing if it never had any).
WITH live AS (
    SELECT affinity,
           count(*) FILTER (WHERE state = 'pending')::int AS pending,
           count(*)::int AS sections,
           min(min_cycle_ms) FILTER (WHERE frequency = 'recurring') AS min_cycle_ms
      FROM model.batch_section
     WHERE state <> 'delivered' AND (%(affinity)s = '' OR affinity = %(affinity)s)
     GROUP BY affinity
)
SELECT l.affinity, l.pending, l.sections, l.min_cycle_ms,
       coalesce(a.drains, 0) AS drains,
       coalesce(a.draining_until >= now(), false) AS draining,
       a.last_drain_at,
       (extract(epoch FROM now() - a.last_drain_at) * 1000)::bigint AS since_last_drain_ms
  FROM live l
  LEFT JOIN model.batch_affinity a ON a.affinity = l.affinity
UNION ALL
SELECT a.affinity, 0, 0, NULL, a.drains, coalesce(a.draining_until >= now(), false), a.last_drain_at,
       (extract(epoch FROM now() - a.last_drain_at) * 1000)::bigint
  FROM model.batch_affinity a
 WHERE a.affinity = %(affinity)s AND NOT EXISTS (SELECT 1 FROM live WHERE live.affinity = a.affinity)
 ORDER BY 1;
