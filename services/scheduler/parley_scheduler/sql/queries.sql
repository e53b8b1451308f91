-- Named queries of the scheduler. Each `-- name --` header starts one statement.
-- Every state change is one statement that names the state it expects; a run's
-- completion is fenced by its lease token.

-- insert_tasks --
-- All or none: a duplicate id fails the whole statement.
INSERT INTO scheduler.task (
    id, agent_id, name, description, tags, room_id, world_id, entity_id, due_at, scheduled_at,
    update_interval_ms, base_interval_ms, not_before_ms, not_after_ms, max_failures, max_attempts,
    blocking, missed_run, cron, timeout_ms, "values", next_run_at, ready_at)
SELECT r.id, r.agent_id, r.name, r.description, ARRAY(SELECT jsonb_array_elements_text(r.tags)),
       r.room_id, r.world_id, r.entity_id, r.due_at, r.scheduled_at,
       r.update_interval_ms, r.base_interval_ms, r.not_before_ms, r.not_after_ms, r.max_failures,
       r.max_attempts, r.blocking, r.missed_run, r.cron, r.timeout_ms, r."values", r.next_run_at, r.ready_at
  FROM jsonb_to_recordset(%(rows)s) AS r(
       id uuid, agent_id uuid, name text, description text, tags jsonb, room_id uuid, world_id uuid,
       entity_id uuid, due_at timestamptz, scheduled_at timestamptz, update_interval_ms bigint,
       base_interval_ms bigint, not_before_ms bigint, not_after_ms bigint, max_failures integer,
       max_attempts integer, blocking boolean, missed_run text, cron text, timeout_ms bigint,
       "values" jsonb, next_run_at timestamptz, ready_at timestamptz)
RETURNING *;

-- claim_due --
-- One batch for one replica: due queue tasks in due order, and runs whose lease
-- expired (a crashed scheduler or a silent worker) claimed again as attempt + 1,
-- the lost attempt recorded as uncertain. SKIP LOCKED: replicas never wait on
-- each other, and a row locked by one is invisible to the others' claims.
-- A blocking task (and a one-shot) is leased on its row, so it is claimed again
-- only once its run is over. A non-blocking repeat task stays active: its slot
-- gets a run row with a lease of its own, and its ready_at is held (NULL) until
-- the claimer writes the next slot (advance_slot), so each slot is claimed once.
--
-- Every task is reached by its key, whatever the plan: the updates take their
-- rows by `= ANY (ARRAY(...))` and join what they picked afterwards, a run's
-- task is looked up per run. (As joins, a prepared statement's generic plan,
-- which cannot know that LIMIT is small, hashed the whole task table on every
-- claim: 9.9 ms at 20,000 due tasks instead of 0.9.) A run's lease token is
-- its key, so the runs taken over are joined as they are updated.
WITH due AS (
    SELECT id, blocking OR NOT repeat AS exclusive, ready_at AS old_ready_at,
           lease_owner AS old_owner, lease_token AS old_token, lease_expires_at AS old_expires_at,
           claimed_at AS old_claimed_at
      FROM scheduler.task
     WHERE status = 'active' AND queued AND ready_at <= now()
     ORDER BY ready_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id, true AS exclusive, ready_at AS old_ready_at,
           lease_owner AS old_owner, lease_token AS old_token, lease_expires_at AS old_expires_at,
           claimed_at AS old_claimed_at
      FROM scheduler.task
     WHERE status = 'running' AND lease_expires_at <= now()
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT * FROM due UNION ALL SELECT * FROM expired
), leased AS (
    UPDATE scheduler.task t
       SET status = 'running',
           attempt = CASE WHEN t.lease_expires_at IS NULL THEN 1 ELSE t.attempt + 1 END,
           lease_token = nextval('scheduler.lease_token_seq'),
           lease_owner = %(owner)s,
           lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond',
           claimed_at = now()
     WHERE t.id = ANY (ARRAY(SELECT id FROM picked WHERE exclusive))
    RETURNING t.*
), claimed AS (
    SELECT l.*, p.old_owner, p.old_token, p.old_expires_at, p.old_claimed_at, p.old_ready_at
      FROM leased l JOIN picked p ON p.id = l.id
), held AS (
    UPDATE scheduler.task t
       SET ready_at = NULL
     WHERE t.id = ANY (ARRAY(SELECT id FROM picked WHERE NOT exclusive))
    RETURNING t.*, NULL::text AS old_owner, NULL::bigint AS old_token, NULL::timestamptz AS old_expires_at,
              NULL::timestamptz AS old_claimed_at
), started AS (
    INSERT INTO scheduler.run (lease_token, task_id, slot, attempt, lease_owner, lease_expires_at, claimed_at)
    SELECT nextval('scheduler.lease_token_seq'), id, next_run_at, 1, %(owner)s,
           now() + %(lease_ms)s * interval '1 millisecond', now()
      FROM held
    RETURNING *
), lapsed AS (
    SELECT r.lease_token AS old_token, r.lease_owner AS old_owner, r.lease_expires_at AS old_expires_at,
           r.claimed_at AS old_claimed_at
      FROM scheduler.run r
     WHERE r.lease_expires_at <= now()
       AND (SELECT t.status FROM scheduler.task t WHERE t.id = r.task_id) = 'active'
     ORDER BY r.lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), retaken AS (
    UPDATE scheduler.run r
       SET lease_token = nextval('scheduler.lease_token_seq'),
           attempt = r.attempt + 1,
           lease_owner = %(owner)s,
           lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond',
           claimed_at = now()
      FROM lapsed l
     WHERE r.lease_token = l.old_token
    RETURNING r.*, l.old_owner, l.old_token, l.old_expires_at, l.old_claimed_at
), runs AS (
    SELECT h.*, p.old_ready_at, s.lease_token AS run_token, s.attempt AS run_attempt,
           s.lease_owner AS run_owner, s.lease_expires_at AS run_expires_at, s.slot AS run_slot
      FROM held h JOIN started s ON s.task_id = h.id JOIN picked p ON p.id = h.id
    UNION ALL
    SELECT t.*, r.old_owner, r.old_token, r.old_expires_at, r.old_claimed_at, t.ready_at,
           r.lease_token, r.attempt, r.lease_owner, r.lease_expires_at, r.slot
      FROM retaken r
     CROSS JOIN LATERAL (SELECT * FROM scheduler.task t WHERE t.id = r.task_id OFFSET 0) t
), uncertain AS (
    INSERT INTO scheduler.uncertain_attempt
           (task_id, attempt, agent_id, name, owner, lease_token, claimed_at, expired_at)
    SELECT id, attempt - 1, agent_id, name, old_owner, old_token, old_claimed_at, old_expires_at
      FROM claimed
     WHERE old_expires_at IS NOT NULL
    UNION ALL
    SELECT id, run_attempt - 1, agent_id, name, old_owner, old_token, old_claimed_at, old_expires_at
      FROM runs
     WHERE old_expires_at IS NOT NULL
)
SELECT c.*, NULL::bigint AS run_token, NULL::integer AS run_attempt, NULL::text AS run_owner,
       NULL::timestamptz AS run_expires_at, NULL::timestamptz AS run_slot, now() AS db_now
  FROM claimed c
UNION ALL
SELECT r.*, now() AS db_now FROM runs r;

-- advance_slot --
-- The claimer of a non-blocking task's slot writes the next slot (computed by the rules),
-- which makes the task claimable again. Only while the task still holds that slot: an
-- operator's change in between wins.
UPDATE scheduler.task
   SET next_run_at = %(next_run_at)s, ready_at = %(ready_at)s
 WHERE id = %(id)s AND ready_at IS NULL AND next_run_at = %(slot)s
RETURNING id;

-- claim_one --
-- ExecuteTask: this task now, whatever its schedule, unless a live lease holds it
-- (a non-blocking task's run gets a lease of its own, beside those in flight).
-- A paused task stays paused (it runs once, then waits for a resume).
WITH target AS (
    SELECT id, blocking OR NOT repeat AS exclusive, ready_at AS old_ready_at,
           lease_owner AS old_owner, lease_token AS old_token, lease_expires_at AS old_expires_at,
           claimed_at AS old_claimed_at
      FROM scheduler.task
     WHERE id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
       AND (lease_expires_at IS NULL OR lease_expires_at <= now())
       FOR UPDATE
), claimed AS (
    UPDATE scheduler.task t
       SET status = CASE WHEN t.status = 'paused' THEN 'paused' ELSE 'running' END,
           attempt = CASE WHEN p.old_expires_at IS NULL THEN 1 ELSE t.attempt + 1 END,
           lease_token = nextval('scheduler.lease_token_seq'),
           lease_owner = %(owner)s,
           lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond',
           claimed_at = now()
      FROM target p
     WHERE t.id = p.id AND p.exclusive
    RETURNING t.*, p.old_owner, p.old_token, p.old_expires_at, p.old_claimed_at, p.old_ready_at
), started AS (
    INSERT INTO scheduler.run (lease_token, task_id, slot, attempt, lease_owner, lease_expires_at, claimed_at)
    SELECT nextval('scheduler.lease_token_seq'), id, NULL, 1, %(owner)s,
           now() + %(lease_ms)s * interval '1 millisecond', now()
      FROM target
     WHERE NOT exclusive
    RETURNING *
), uncertain AS (
    INSERT INTO scheduler.uncertain_attempt
           (task_id, attempt, agent_id, name, owner, lease_token, claimed_at, expired_at)
    SELECT id, attempt - 1, agent_id, name, old_owner, old_token, old_claimed_at, old_expires_at
      FROM claimed
     WHERE old_expires_at IS NOT NULL
)
SELECT c.*, NULL::bigint AS run_token, NULL::integer AS run_attempt, NULL::text AS run_owner,
       NULL::timestamptz AS run_expires_at, NULL::timestamptz AS run_slot, now() AS db_now
  FROM claimed c
UNION ALL
SELECT t.*, NULL::text, NULL::bigint, NULL::timestamptz, NULL::timestamptz, t.ready_at,
       s.lease_token, s.attempt, s.lease_owner, s.lease_expires_at, s.slot, now()
  FROM started s JOIN scheduler.task t ON t.id = s.task_id;

-- finish_runs --
-- A batch of completions in one statement, each fenced by its lease token: a
-- late completion of a lost lease matches nothing. One-shot successes are
-- deleted; every other outcome updates its task. Schedule fields are written
-- only when no operator changed the task during the run (same revision); an
-- operator's pause outlives the run.
WITH gone AS (
    DELETE FROM scheduler.task t
     USING unnest(%(delete_ids)s::uuid[], %(delete_tokens)s::bigint[]) AS d(id, token)
     WHERE t.id = d.id AND t.lease_token = d.token AND t.lease_expires_at IS NOT NULL
    RETURNING t.id
), u AS (
    SELECT r.*,
           greatest(coalesce(r.next_at, '-infinity'), now() + r.delay_ms * interval '1 millisecond')
               AS next_run_at
      FROM jsonb_to_recordset(%(rows)s) AS r(
           id uuid, token bigint, revision bigint, status text, pause_reason text, failure_count integer,
           last_error text, update_interval_ms bigint, base_interval_ms bigint, next_at timestamptz,
           delay_ms bigint, not_before_ms bigint, ran boolean, orphaned boolean, keep_schedule boolean)
), kept AS (
    UPDATE scheduler.task t
       SET status = CASE WHEN t.status = 'running' OR u.status IN ('paused', 'failed')
                         THEN u.status ELSE t.status END,
           pause_reason = CASE WHEN t.status = 'running' OR u.status IN ('paused', 'failed')
                               THEN u.pause_reason ELSE t.pause_reason END,
           failure_count = u.failure_count,
           last_error = u.last_error,
           last_run_at = CASE WHEN u.ran THEN now() ELSE t.last_run_at END,
           run_count = t.run_count + u.ran::integer,
           orphaned_no_worker = u.orphaned,
           update_interval_ms = CASE WHEN t.revision = u.revision
                                     THEN u.update_interval_ms ELSE t.update_interval_ms END,
           base_interval_ms = CASE WHEN t.revision = u.revision
                                   THEN u.base_interval_ms ELSE t.base_interval_ms END,
           next_run_at = CASE WHEN t.revision = u.revision AND NOT u.keep_schedule
                              THEN u.next_run_at ELSE t.next_run_at END,
           ready_at = CASE WHEN t.revision = u.revision AND NOT u.keep_schedule
                           THEN u.next_run_at - u.not_before_ms * interval '1 millisecond'
                           ELSE greatest(t.ready_at, now() + u.delay_ms * interval '1 millisecond') END,
           lease_owner = NULL,
           lease_expires_at = NULL,
           updated_at = now()
      FROM u
     WHERE t.id = u.id AND t.lease_token = u.token AND t.lease_expires_at IS NOT NULL
    RETURNING t.id
)
SELECT id, true AS deleted FROM gone
UNION ALL
SELECT id, false AS deleted FROM kept;

-- finish_run --
-- The completion of one run of a non-blocking task, fenced by the run's own lease token.
-- Runs of the task complete concurrently, so the outcome is a compare-and-set on the
-- revision and failure count it was computed from: when another completion (or an
-- operator) came first, nothing is written and the run is reported `held` but not
-- `applied`, for the caller to compute the outcome again from the task as it is now.
-- The next slot was set at the claim: an outcome only pushes it later (backoff,
-- retry_at, a no-worker retry), and a slot being advanced (ready_at NULL) is left alone.
WITH fenced AS (
    SELECT t.id, t.revision = %(revision)s AND t.failure_count = %(failure_count_was)s AS current
      FROM scheduler.task t
     WHERE t.id = %(id)s
       AND EXISTS (SELECT 1 FROM scheduler.run r WHERE r.lease_token = %(token)s AND r.task_id = t.id)
       FOR UPDATE
), done AS (
    DELETE FROM scheduler.run r
     USING fenced f
     WHERE r.lease_token = %(token)s AND r.task_id = f.id AND f.current
    RETURNING r.task_id
), pushed AS (
    SELECT CASE WHEN %(next_at)s::timestamptz IS NULL AND %(delay_ms)s::bigint = 0 THEN NULL
                ELSE greatest(coalesce(%(next_at)s::timestamptz, '-infinity'),
                              now() + %(delay_ms)s::bigint * interval '1 millisecond') END AS at
), kept AS (
    UPDATE scheduler.task t
       SET status = CASE WHEN %(status)s::text IN ('paused', 'failed') THEN %(status)s::text
                         ELSE t.status END,
           pause_reason = CASE WHEN %(status)s::text IN ('paused', 'failed') THEN %(pause_reason)s::text
                               ELSE t.pause_reason END,
           orphaned_no_worker = CASE WHEN %(status)s::text IN ('paused', 'failed') THEN %(orphaned)s::boolean
                                     ELSE t.orphaned_no_worker END,
           failure_count = %(failure_count)s,
           last_error = %(last_error)s,
           last_run_at = CASE WHEN %(ran)s::boolean THEN now() ELSE t.last_run_at END,
           run_count = t.run_count + %(ran)s::boolean::integer,
           update_interval_ms = %(update_interval_ms)s,
           base_interval_ms = %(base_interval_ms)s,
           next_run_at = CASE WHEN t.ready_at IS NULL OR p.at IS NULL THEN t.next_run_at
                              ELSE greatest(t.next_run_at, p.at) END,
           ready_at = CASE WHEN t.ready_at IS NULL OR p.at IS NULL THEN t.ready_at
                           ELSE greatest(t.ready_at,
                                         p.at - %(not_before_ms)s::bigint * interval '1 millisecond') END,
           updated_at = now()
      FROM done d, pushed p
     WHERE t.id = d.task_id
    RETURNING t.id
)
SELECT (SELECT count(*) FROM kept) > 0 AS applied, (SELECT count(*) FROM fenced) > 0 AS held;

-- extend_lease --
-- A heartbeat of a long run: only the current claim may extend its lease (a
-- blocking task's on its row, a non-blocking task's run on the run).
WITH task_lease AS (
    UPDATE scheduler.task
       SET lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond'
     WHERE id = %(id)s AND lease_token = %(token)s AND lease_expires_at IS NOT NULL
    RETURNING lease_expires_at
), run_lease AS (
    UPDATE scheduler.run
       SET lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond'
     WHERE lease_token = %(token)s AND task_id = %(id)s
    RETURNING lease_expires_at
)
SELECT lease_expires_at FROM task_lease
UNION ALL
SELECT lease_expires_at FROM run_lease;

-- release_lease --
-- The worker went silent: give the lease up now so the slot is claimed again
-- (as attempt + 1) without waiting out the expiry.
WITH task_lease AS (
    UPDATE scheduler.task
       SET lease_expires_at = least(lease_expires_at, now()),
           last_error = %(error)s
     WHERE id = %(id)s AND lease_token = %(token)s AND lease_expires_at IS NOT NULL
    RETURNING id
), run_lease AS (
    UPDATE scheduler.run
       SET lease_expires_at = least(lease_expires_at, now())
     WHERE lease_token = %(token)s AND task_id = %(id)s
    RETURNING task_id
), noted AS (
    UPDATE scheduler.task
       SET last_error = %(error)s
     WHERE id IN (SELECT task_id FROM run_lease)
)
SELECT id FROM task_lease
UNION ALL
SELECT task_id FROM run_lease;

-- next_wakeup --
-- When the claim loop has something to do next: the earliest due queue task or
-- lease expiry that a claim would take (each from its index; the runs' in lease order, stopping
-- at the first of an active task, instead of joining every active task).
SELECT least((SELECT min(ready_at) FROM scheduler.task WHERE status = 'active' AND queued),
             (SELECT min(lease_expires_at) FROM scheduler.task WHERE status = 'running'),
             (SELECT r.lease_expires_at FROM scheduler.run r
               WHERE EXISTS (SELECT 1 FROM scheduler.task t WHERE t.id = r.task_id AND t.status = 'active')
               ORDER BY r.lease_expires_at
               LIMIT 1)) AS at,
       now() AS db_now;

-- count_due --
SELECT count(*) AS due
  FROM scheduler.task
 WHERE status = 'active' AND queued AND ready_at <= now();

-- get_task --
SELECT t.*, now() AS db_now,
       (SELECT count(*) FROM scheduler.run r WHERE r.task_id = t.id AND r.lease_expires_at > now())
           AS live_runs
  FROM scheduler.task t
 WHERE t.id = %(id)s AND (%(agent_id)s::uuid IS NULL OR t.agent_id = %(agent_id)s);

-- uncertain_attempts --
SELECT attempt, owner, claimed_at, expired_at, reclaimed_at
  FROM scheduler.uncertain_attempt
 WHERE task_id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
 ORDER BY reclaimed_at DESC, attempt DESC
 LIMIT 20;

-- list_tasks --
SELECT *, now() AS db_now
  FROM scheduler.task
 WHERE (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
   AND tags @> %(tags)s::text[]
   AND (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(name)s::text IS NULL OR name = %(name)s)
 ORDER BY created_at, id
 LIMIT %(limit)s OFFSET %(offset)s;

-- update_task --
-- Compare-and-set on the revision the caller's change was computed from.
UPDATE scheduler.task
   SET description = %(description)s,
       tags = %(tags)s,
       room_id = %(room_id)s,
       world_id = %(world_id)s,
       entity_id = %(entity_id)s,
       due_at = %(due_at)s,
       scheduled_at = %(scheduled_at)s,
       update_interval_ms = %(update_interval_ms)s,
       base_interval_ms = %(base_interval_ms)s,
       not_before_ms = %(not_before_ms)s,
       not_after_ms = %(not_after_ms)s,
       max_failures = %(max_failures)s,
       max_attempts = %(max_attempts)s,
       blocking = %(blocking)s,
       missed_run = %(missed_run)s,
       cron = %(cron)s,
       timeout_ms = %(timeout_ms)s,
       "values" = %(values)s,
       next_run_at = %(next_run_at)s,
       -- A slot being advanced by its claimer stays held unless the change moved it.
       ready_at = CASE WHEN ready_at IS NULL AND next_run_at = %(next_run_at)s
                            AND 'repeat' = ANY (%(tags)s::text[])
                       THEN NULL ELSE %(ready_at)s END,
       revision = revision + 1,
       updated_at = now()
 WHERE id = %(id)s AND revision = %(revision)s
RETURNING *, now() AS db_now;

-- delete_task --
DELETE FROM scheduler.task
 WHERE id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
RETURNING *, now() AS db_now;

-- pause_task --
UPDATE scheduler.task
   SET status = 'paused', pause_reason = 'operator', revision = revision + 1, updated_at = now()
 WHERE id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
   AND status IN ('active', 'running')
RETURNING *, now() AS db_now;

-- resume_task --
-- From paused (any reason) or failed. Failures start counting again and backoff
-- ends; a task whose run is still leased goes back to running. With
-- run_immediately it is due now.
UPDATE scheduler.task
   SET status = CASE WHEN lease_expires_at IS NULL THEN 'active' ELSE 'running' END,
       pause_reason = NULL,
       orphaned_no_worker = false,
       failure_count = 0,
       update_interval_ms = CASE WHEN cron IS NOT NULL THEN NULL
                                 ELSE coalesce(base_interval_ms, update_interval_ms) END,
       base_interval_ms = CASE WHEN cron IS NOT NULL THEN NULL ELSE base_interval_ms END,
       next_run_at = CASE WHEN %(now)s THEN now() ELSE next_run_at END,
       ready_at = CASE WHEN %(now)s THEN now() ELSE ready_at END,
       revision = revision + 1,
       updated_at = now()
 WHERE id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
   AND status IN ('paused', 'failed')
RETURNING *, now() AS db_now;

-- run_soon --
-- ResumeTask(run_immediately) of a task that is already active: due now.
UPDATE scheduler.task
   SET next_run_at = now(), ready_at = now(), revision = revision + 1, updated_at = now()
 WHERE id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s)
   AND status = 'active'
RETURNING *, now() AS db_now;

-- orphaned_names --
SELECT DISTINCT name FROM scheduler.task WHERE orphaned_no_worker;

-- resume_orphans --
-- A worker for the name is back: its orphaned tasks resume and run at once.
UPDATE scheduler.task
   SET status = 'active', pause_reason = NULL, orphaned_no_worker = false, last_error = NULL,
       ready_at = CASE WHEN ready_at IS NULL THEN NULL ELSE least(ready_at, now()) END,
       revision = revision + 1, updated_at = now()
 WHERE name = %(name)s AND orphaned_no_worker AND status = 'paused' AND lease_expires_at IS NULL
RETURNING id;

-- register_worker --
INSERT INTO scheduler.worker (name, service)
VALUES (%(name)s, %(service)s)
ON CONFLICT (name, service) DO UPDATE SET last_seen = now();

-- prune_uncertain --
-- Retention: uncertain attempts recorded before the cutoff, oldest first, a bounded batch per
-- statement so that pruning never holds many rows at once.
WITH old AS (
    SELECT task_id, lease_token FROM scheduler.uncertain_attempt
     WHERE reclaimed_at < now() - %(retention_ms)s * interval '1 millisecond'
     ORDER BY reclaimed_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
-- The cutoff again on the deleted rows: with it PostgreSQL finds them by the time index too,
-- without it each batch joined against a scan of the whole table.
DELETE FROM scheduler.uncertain_attempt u
 USING old
 WHERE u.task_id = old.task_id AND u.lease_token = old.lease_token
   AND u.reclaimed_at < now() - %(retention_ms)s * interval '1 millisecond'
RETURNING u.task_id;
