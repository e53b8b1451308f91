-- The declared scheduler schema. tests/integration/test_migrations.py proves that
-- applying sql/migrations/ in order builds exactly this.

CREATE SCHEMA IF NOT EXISTS scheduler;

-- Fencing tokens of leases: unique across every task, so a completion can never
-- match a later claim, not even of a task deleted and created again under its id.
CREATE SEQUENCE scheduler.lease_token_seq AS bigint CACHE 100;

CREATE TABLE scheduler.task (
    id                  uuid PRIMARY KEY,
    agent_id            uuid NOT NULL,
    name                text NOT NULL CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$'),
    description         text NOT NULL DEFAULT '' CHECK (length(description) <= 2000),
    tags                text[] NOT NULL DEFAULT '{}' CHECK (cardinality(tags) <= 32),
    queued              boolean GENERATED ALWAYS AS ('queue' = ANY (tags)) STORED,
    repeat              boolean GENERATED ALWAYS AS ('repeat' = ANY (tags)) STORED,
    room_id             uuid,
    world_id            uuid,
    entity_id           uuid,
    due_at              timestamptz,
    scheduled_at        timestamptz,
    -- Schedule (metadata). Durations are milliseconds.
    update_interval_ms  bigint CHECK (update_interval_ms > 0),
    base_interval_ms    bigint CHECK (base_interval_ms > 0),
    not_before_ms       bigint NOT NULL DEFAULT 0 CHECK (not_before_ms >= 0),
    not_after_ms        bigint CHECK (not_after_ms >= 0),
    max_failures        integer NOT NULL DEFAULT 5,
    max_attempts        integer NOT NULL DEFAULT 1 CHECK (max_attempts BETWEEN 1 AND 1000),
    blocking            boolean NOT NULL DEFAULT true,
    missed_run          text NOT NULL DEFAULT 'run_once' CHECK (missed_run IN ('run_once', 'skip')),
    cron                text CHECK (cron <> ''),
    timeout_ms          bigint CHECK (timeout_ms > 0),
    "values"            jsonb NOT NULL DEFAULT '{}',
    -- State.
    status              text NOT NULL DEFAULT 'active'
                        CHECK (status IN ('active', 'paused', 'running', 'failed')),
    pause_reason        text CHECK (pause_reason IN ('operator', 'max_failures', 'no_worker')),
    failure_count       integer NOT NULL DEFAULT 0 CHECK (failure_count >= 0),
    last_error          text,
    last_run_at         timestamptz,
    run_count           bigint NOT NULL DEFAULT 0,
    -- The ideal time of the next run, and when it becomes due (not_before earlier).
    next_run_at         timestamptz NOT NULL,
    -- NULL: a non-blocking run just claimed the slot and its claimer computes the next one.
    ready_at            timestamptz,
    orphaned_no_worker  boolean NOT NULL DEFAULT false,
    -- The lease of the run in progress. The token only grows; a held lease has an expiry.
    attempt             integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    lease_token         bigint NOT NULL DEFAULT 0,
    lease_owner         text,
    lease_expires_at    timestamptz,
    claimed_at          timestamptz,
    revision            bigint NOT NULL DEFAULT 1,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT task_repeat_has_schedule CHECK (NOT repeat OR update_interval_ms IS NOT NULL OR cron IS NOT NULL),
    CONSTRAINT task_cron_needs_repeat CHECK (cron IS NULL OR repeat),
    CONSTRAINT task_running_is_leased CHECK (status <> 'running' OR lease_expires_at IS NOT NULL),
    CONSTRAINT task_active_is_not_leased CHECK (status <> 'active' OR lease_expires_at IS NULL),
    CONSTRAINT task_lease_has_owner CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL)),
    CONSTRAINT task_paused_has_reason CHECK ((status = 'paused') = (pause_reason IS NOT NULL)),
    CONSTRAINT task_orphan_is_paused CHECK (NOT orphaned_no_worker OR status = 'paused'),
    CONSTRAINT task_held_is_repeat CHECK (ready_at IS NOT NULL OR repeat)
);

-- The claim loop's two scans: due queue tasks by due time, and expired leases.
CREATE INDEX task_due ON scheduler.task (ready_at) WHERE status = 'active' AND queued;
CREATE INDEX task_leased ON scheduler.task (lease_expires_at) WHERE status = 'running';
CREATE INDEX task_agent ON scheduler.task (agent_id, created_at, id);
CREATE INDEX task_orphaned ON scheduler.task (name) WHERE orphaned_no_worker;

-- The runs in flight of non-blocking repeat tasks, one per claimed slot (or ExecuteTask, slot
-- NULL), each with a lease of its own; a blocking task's one run is leased on its row. The fencing
-- token comes from the same sequence as the task leases'.
CREATE TABLE scheduler.run (
    lease_token       bigint PRIMARY KEY,
    task_id           uuid NOT NULL REFERENCES scheduler.task (id) ON DELETE CASCADE,
    slot              timestamptz,
    attempt           integer NOT NULL CHECK (attempt >= 1),
    lease_owner       text NOT NULL,
    lease_expires_at  timestamptz NOT NULL,
    claimed_at        timestamptz NOT NULL
);

CREATE INDEX run_task ON scheduler.run (task_id);
CREATE INDEX run_leased ON scheduler.run (lease_expires_at);
-- Two runs of one slot cannot be in flight at once.
CREATE UNIQUE INDEX run_one_per_slot ON scheduler.run (task_id, slot) WHERE slot IS NOT NULL;

-- Attempts whose lease expired before they completed: they may or may not have
-- run. Written by the claim that takes the task over, kept after the task is gone.
CREATE TABLE scheduler.uncertain_attempt (
    task_id       uuid NOT NULL,
    attempt       integer NOT NULL,
    agent_id      uuid NOT NULL,
    name          text NOT NULL,
    owner         text NOT NULL,
    lease_token   bigint NOT NULL,
    claimed_at    timestamptz,
    expired_at    timestamptz NOT NULL,
    reclaimed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, lease_token)
);

CREATE INDEX uncertain_attempt_agent ON scheduler.uncertain_attempt (agent_id, reclaimed_at);
-- Retention: pruned oldest first (PARLEY_SCHEDULER_UNCERTAIN_RETENTION_DAYS).
CREATE INDEX uncertain_attempt_reclaimed ON scheduler.uncertain_attempt (reclaimed_at);

-- Workers that announced themselves (RegisterWorker); subscribing is enough to serve.
CREATE TABLE scheduler.worker (
    name        text NOT NULL,
    service     text NOT NULL,
    first_seen  timestamptz NOT NULL DEFAULT now(),
    last_seen   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, service)
);

-- NOTIFY is only a wake-up hint for the claim loops: the claim itself is still
-- SKIP LOCKED, so a missed notification costs a poll interval, nothing more.
-- Identical notifications of one transaction are folded into one by Postgres.
CREATE FUNCTION scheduler.notify_ready() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_task_ready', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER task_ready AFTER INSERT OR UPDATE OF status, ready_at ON scheduler.task
    FOR EACH ROW WHEN (NEW.status = 'active' AND NEW.queued AND NEW.ready_at IS NOT NULL)
    EXECUTE FUNCTION scheduler.notify_ready();
