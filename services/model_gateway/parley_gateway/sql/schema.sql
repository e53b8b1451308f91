-- The model gateway's schema: token budgets, the usage ledger, prompt batcher sections and drains.
CREATE SCHEMA IF NOT EXISTS model;

-- One budget per agent: tokens (input + output) per window. Calls reserve before they run and
-- commit (or release) after; the reservation is one conditional UPDATE, so replicas never overspend.
CREATE TABLE model.budget (
    agent_id          text        PRIMARY KEY CHECK (agent_id <> ''),
    limit_tokens      bigint      NOT NULL CHECK (limit_tokens > 0),
    window_seconds    bigint      NOT NULL CHECK (window_seconds > 0),
    window_started_at timestamptz NOT NULL DEFAULT now(),
    spent_tokens      bigint      NOT NULL DEFAULT 0 CHECK (spent_tokens >= 0),
    reserved_tokens   bigint      NOT NULL DEFAULT 0 CHECK (reserved_tokens >= 0),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- The usage ledger: running totals per agent, provider, model, model type and kind of call.
CREATE TABLE model.usage (
    agent_id            text        NOT NULL,
    provider            text        NOT NULL,
    model               text        NOT NULL,
    model_type          text        NOT NULL,
    kind                text        NOT NULL CHECK (kind IN ('generate', 'stream', 'embed', 'batch')),
    requests            bigint      NOT NULL DEFAULT 0 CHECK (requests >= 0),
    input_tokens        bigint      NOT NULL DEFAULT 0 CHECK (input_tokens >= 0),
    output_tokens       bigint      NOT NULL DEFAULT 0 CHECK (output_tokens >= 0),
    cached_input_tokens bigint      NOT NULL DEFAULT 0 CHECK (cached_input_tokens >= 0),
    first_at            timestamptz NOT NULL DEFAULT now(),
    last_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, provider, model, model_type, kind)
);

-- Prompt batcher sections, idempotent per (agent, id). A drain moves the due ones from pending to
-- draining under its sequence number, then back to pending (per-drain, recurring) or delivered (once).
CREATE TABLE model.batch_section (
    agent_id     text        NOT NULL,
    id           text        NOT NULL,
    affinity     text        NOT NULL,
    spec         jsonb       NOT NULL,
    frequency    text        NOT NULL CHECK (frequency IN ('once', 'per_drain', 'recurring')),
    min_cycle_ms bigint      NOT NULL DEFAULT 0 CHECK (min_cycle_ms >= 0),
    owner        text        NOT NULL DEFAULT '',
    state        text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'draining', 'delivered')),
    drain_seq    bigint,
    last_run_at  timestamptz,
    deliveries   bigint      NOT NULL DEFAULT 0,
    last_result  jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id),
    CONSTRAINT batch_section_draining_has_seq CHECK ((state = 'draining') = (drain_seq IS NOT NULL)),
    CONSTRAINT batch_section_recurring_cycle CHECK ((frequency = 'recurring') = (min_cycle_ms > 0))
);
CREATE INDEX batch_section_affinity_state ON model.batch_section (affinity, state);
-- The sections still to deliver, for the batcher's status (delivered ones stay until disposed of).
CREATE INDEX batch_section_undelivered ON model.batch_section (affinity, state, frequency, min_cycle_ms)
    WHERE state <> 'delivered';
CREATE INDEX batch_section_owner ON model.batch_section (agent_id, owner) WHERE owner <> '';

-- One row per affinity: the drain lease that serialises drains across replicas.
CREATE TABLE model.batch_affinity (
    affinity       text        PRIMARY KEY,
    drain_seq      bigint      NOT NULL DEFAULT 0,
    draining_until timestamptz,
    holder         text,
    drains         bigint      NOT NULL DEFAULT 0,
    last_drain_at  timestamptz
);

-- Every finished drain, for status and for proving drains of one affinity never overlap.
CREATE TABLE model.batch_drain (
    affinity    text        NOT NULL,
    seq         bigint      NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    sections    integer     NOT NULL CHECK (sections >= 0),
    calls       integer     NOT NULL CHECK (calls >= 0),
    PRIMARY KEY (affinity, seq)
);
