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
-- One batch for one replica: due queue tasks in due order, and tasks whose lease
-- expired (a crashed scheduler or a silent worker) claimed again as attempt + 1,
-- the lost attempt recorded as uncertain. SKIP LOCKED: replicas never wait on
-- each other, and a row locked by one is invisible to the others' claims.
WITH due AS (
    SELECT id, lease_owner AS old_owner, lease_token AS old_token, lease_expires_at AS old_expires_at,
           claimed_at AS old_claimed_at
      FROM scheduler.task
     WHERE status = 'active' AND queued AND ready_at <= now()
     ORDER BY ready_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id, lease_owner AS old_owner, lease_token AS old_token, lease_expires_at AS old_expires_at,
           claimed_at AS old_claimed_at
      FROM scheduler.task
     WHERE status = 'running' AND lease_expires_at <= now()
     ORDER BY lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), picked AS (
    SELECT * FROM due UNION ALL SELECT * FROM expired
), claimed AS (
    UPDATE scheduler.task t
       SET status = 'running',
           attempt = CASE WHEN p.old_expires_at IS NULL THEN 1 ELSE t.attempt + 1 END,
           lease_token = nextval('scheduler.lease_token_seq'),
           lease_owner = %(owner)s,
           lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond',
           claimed_at = now()
      FROM picked p
     WHERE t.id = p.id
    RETURNING t.*, p.old_owner, p.old_token, p.old_expires_at, p.old_claimed_at, now() AS db_now
), uncertain AS (
    INSERT INTO scheduler.uncertain_attempt
           (task_id, attempt, agent_id, name, owner, lease_token, claimed_at, expired_at)
    SELECT id, attempt - 1, agent_id, name, old_owner, old_token, old_claimed_at, old_expires_at
      FROM claimed
     WHERE old_expires_at IS NOT NULL
)
SELECT * FROM claimed;

-- claim_one --
-- ExecuteTask: this task now, whatever its schedule, unless a live lease holds it.
-- A paused task stays paused (it runs once, then waits for a resume).
WITH target AS (
    SELECT id, lease_owner AS old_owner, lease_token AS old_token, lease_expires_at AS old_expires_at,
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
     WHERE t.id = p.id
    RETURNING t.*, p.old_owner, p.old_token, p.old_expires_at, p.old_claimed_at, now() AS db_now
), uncertain AS (
    INSERT INTO scheduler.uncertain_attempt
           (task_id, attempt, agent_id, name, owner, lease_token, claimed_at, expired_at)
    SELECT id, attempt - 1, agent_id, name, old_owner, old_token, old_claimed_at, old_expires_at
      FROM claimed
     WHERE old_expires_at IS NOT NULL
)
SELECT * FROM claimed;

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

-- extend_lease --
-- A heartbeat of a long run: only the current claim may extend its lease.
UPDATE scheduler.task
   SET lease_expires_at = now() + %(lease_ms)s * interval '1 millisecond'
 WHERE id = %(id)s AND lease_token = %(token)s AND lease_expires_at IS NOT NULL
RETURNING lease_expires_at;

-- release_lease --
-- The worker went silent: give the lease up now so the slot is claimed again
-- (as attempt + 1) without waiting out the expiry.
UPDATE scheduler.task
   SET lease_expires_at = least(lease_expires_at, now()),
       last_error = %(error)s
 WHERE id = %(id)s AND lease_token = %(token)s AND lease_expires_at IS NOT NULL
RETURNING id;

-- next_wakeup --
-- When the claim loop has something to do next: the earliest due queue task or
-- lease expiry (both from their partial indexes).
SELECT least((SELECT min(ready_at) FROM scheduler.task WHERE status = 'active' AND queued),
             (SELECT min(lease_expires_at) FROM scheduler.task WHERE status = 'running')) AS at,
       now() AS db_now;

-- count_due --
SELECT count(*) AS due
  FROM scheduler.task
 WHERE status = 'active' AND queued AND ready_at <= now();

-- get_task --
SELECT *, now() AS db_now
  FROM scheduler.task
 WHERE id = %(id)s AND (%(agent_id)s::uuid IS NULL OR agent_id = %(agent_id)s);

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
       ready_at = %(ready_at)s,
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
       ready_at = least(ready_at, now()), revision = revision + 1, updated_at = now()
 WHERE name = %(name)s AND orphaned_no_worker AND status = 'paused' AND lease_expires_at IS NULL
RETURNING id;

-- register_worker --
INSERT INTO scheduler.worker (name, service)
VALUES (%(name)s, %(service)s)
ON CONFLICT (name, service) DO UPDATE SET last_seen = now();
