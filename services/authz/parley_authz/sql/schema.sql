-- The declared authz schema. tests/integration/test_migrations.py proves that
-- applying sql/migrations/ in order builds exactly this.

CREATE SCHEMA IF NOT EXISTS authz;

-- Tool-call decisions (human-in-the-loop approvals). A record moves
-- pending -> claimed -> settled (approve) or pending -> settled (deny, expiry);
-- it never moves back, and a claim is only settled with its own token.
CREATE TABLE authz.tool_call (
    agent_id         uuid NOT NULL,
    id               text NOT NULL CHECK (length(id) BETWEEN 1 AND 200),
    conversation_id  text NOT NULL CHECK (length(conversation_id) BETWEEN 1 AND 200),
    message_id       text NOT NULL CHECK (length(message_id) BETWEEN 1 AND 200),
    call_index       integer NOT NULL CHECK (call_index >= 0),
    tool             text NOT NULL CHECK (length(tool) BETWEEN 1 AND 200),
    args_digest      text NOT NULL CHECK (args_digest ~ '^[0-9a-f]{64}$'),
    summary          text NOT NULL DEFAULT '',
    proposed_at      timestamptz NOT NULL,
    expires_at       timestamptz CHECK (expires_at > proposed_at),
    on_expiry        text NOT NULL CHECK (on_expiry IN ('approve', 'deny')),
    status           text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'claimed', 'settled')),
    decision         text CHECK (decision IN ('approve', 'deny')),
    reason           text,
    decided_by       text,
    decided_at       timestamptz,
    claim_token      uuid,
    claimed_at       timestamptz,
    outcome          text CHECK (outcome IN ('success', 'failure', 'indeterminate', 'denied', 'expired')),
    result           text,
    settled_by       text,
    settled_at       timestamptz,
    -- The last status published as an event: a decision whose event was lost
    -- (the replica died after the commit) is published again by the sweeper.
    announced        text CHECK (announced IN ('claimed', 'settled')),
    PRIMARY KEY (agent_id, id),
    UNIQUE (agent_id, conversation_id, message_id, call_index),
    CONSTRAINT tool_call_pending_undecided CHECK (
        status <> 'pending' OR (decision IS NULL AND claim_token IS NULL AND outcome IS NULL)),
    CONSTRAINT tool_call_claimed_approved CHECK (
        status <> 'claimed' OR (decision = 'approve' AND claim_token IS NOT NULL AND outcome IS NULL)),
    CONSTRAINT tool_call_settled_final CHECK (
        status <> 'settled' OR (decision IS NOT NULL AND outcome IS NOT NULL AND settled_at IS NOT NULL)),
    -- A denial never ran; an approval ends only in what its executor or an operator reports.
    CONSTRAINT tool_call_outcome_fits_decision CHECK (
        outcome IS NULL
        OR (decision = 'deny' AND outcome IN ('denied', 'expired') AND claim_token IS NULL)
        OR (decision = 'approve' AND outcome IN ('success', 'failure', 'indeterminate')
            AND claim_token IS NOT NULL))
);
CREATE INDEX tool_call_pending ON authz.tool_call (agent_id, proposed_at, id) WHERE status = 'pending';
CREATE INDEX tool_call_pending_expiry ON authz.tool_call (expires_at)
    WHERE status = 'pending' AND expires_at IS NOT NULL;
CREATE INDEX tool_call_claimed ON authz.tool_call (agent_id, claimed_at, id) WHERE status = 'claimed';
CREATE INDEX tool_call_unannounced ON authz.tool_call (decided_at)
    WHERE status <> 'pending' AND announced IS DISTINCT FROM status;

-- The account snapshots capability decisions are bound to. The newest row of
-- an account is its snapshot, current unless revoked; a version is never
-- current again once replaced or revoked, so a reconnected account cannot
-- revive consent given before.
CREATE TABLE authz.account_snapshot (
    agent_id          uuid NOT NULL,
    account_id        text NOT NULL CHECK (length(account_id) BETWEEN 1 AND 200),
    snapshot_version  text NOT NULL CHECK (length(snapshot_version) BETWEEN 1 AND 200),
    seq               bigint GENERATED ALWAYS AS IDENTITY,
    created_at        timestamptz NOT NULL DEFAULT now(),
    revoked_at        timestamptz,
    PRIMARY KEY (agent_id, account_id, snapshot_version),
    UNIQUE (seq)
);
CREATE INDEX account_snapshot_newest ON authz.account_snapshot (agent_id, account_id, seq DESC);

CREATE FUNCTION authz.snapshot_is_current(p_agent uuid, p_account text, p_version text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT s.snapshot_version = p_version AND s.revoked_at IS NULL
                       FROM authz.account_snapshot s
                      WHERE s.agent_id = p_agent AND s.account_id = p_account
                      ORDER BY s.seq DESC
                      LIMIT 1), false)
$$;

-- Every decision and confirmation id ever registered: each is usable once, ever.
CREATE TABLE authz.capability_id (
    agent_id       uuid NOT NULL,
    kind           text NOT NULL CHECK (kind IN ('decision', 'confirmation')),
    id             text NOT NULL CHECK (length(id) BETWEEN 1 AND 200),
    registered_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, kind, id)
);

-- Live one-shot authority: Authorize deletes the row (consumed, or burned when
-- the account snapshot is no longer current or the decision expired).
CREATE TABLE authz.capability_decision (
    agent_id          uuid NOT NULL,
    decision_id       text NOT NULL,
    decision_digest   text NOT NULL CHECK (decision_digest ~ '^[0-9a-f]{64}$'),
    request_digest    text NOT NULL CHECK (request_digest ~ '^[0-9a-f]{64}$'),
    outcome           text NOT NULL CHECK (outcome IN ('allowed', 'confirmation_required')),
    confirmation_id   text,
    account_id        text NOT NULL,
    snapshot_version  text NOT NULL,
    capability        text NOT NULL,
    operation         text NOT NULL,
    risk              text NOT NULL CHECK (risk IN ('R0', 'R1', 'R2', 'R3')),
    input_digest      text NOT NULL CHECK (input_digest ~ '^[0-9a-f]{64}$'),
    issued_at         timestamptz NOT NULL,
    expires_at        timestamptz NOT NULL,
    registered_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, decision_id),
    CHECK (issued_at < expires_at),
    CHECK ((outcome = 'confirmation_required') = (confirmation_id IS NOT NULL))
);

CREATE TABLE authz.capability_confirmation (
    agent_id         uuid NOT NULL,
    confirmation_id  text NOT NULL,
    decision_id      text NOT NULL,
    state            text NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'issued', 'consumed', 'burned')),
    grant_id         text,
    grant_digest     text CHECK (grant_digest ~ '^[0-9a-f]{64}$'),
    issued_by        text,
    issued_at        timestamptz,
    -- A grant expires with its decision.
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    PRIMARY KEY (agent_id, confirmation_id),
    UNIQUE (agent_id, decision_id),
    CHECK (state <> 'pending' OR grant_id IS NULL),
    CHECK (state NOT IN ('issued', 'consumed') OR (grant_id IS NOT NULL AND grant_digest IS NOT NULL))
);
CREATE INDEX capability_confirmation_pending ON authz.capability_confirmation (expires_at) INCLUDE (created_at)
    WHERE state = 'pending';

-- What Authorize granted: one per decision, ever. A receipt must cite it.
CREATE TABLE authz.capability_authorization (
    agent_id          uuid NOT NULL,
    id                text NOT NULL CHECK (id ~ '^[0-9a-f]{64}$'),
    request_digest    text NOT NULL,
    decision_id       text NOT NULL,
    decision_digest   text NOT NULL,
    grant_digest      text,
    account_id        text NOT NULL,
    snapshot_version  text NOT NULL,
    capability        text NOT NULL,
    operation         text NOT NULL,
    risk              text NOT NULL,
    input_digest      text NOT NULL,
    authorized_at     timestamptz NOT NULL,
    PRIMARY KEY (agent_id, id),
    UNIQUE (agent_id, decision_id)
);

CREATE TABLE authz.capability_receipt (
    agent_id          uuid NOT NULL,
    authorization_id  text NOT NULL,
    receipt_digest    text NOT NULL CHECK (receipt_digest ~ '^[0-9a-f]{64}$'),
    status            text NOT NULL CHECK (status IN ('committed', 'failed')),
    error_code        text CHECK (error_code IN ('authentication_failed', 'authorization_failed', 'conflict',
                                                 'invalid_request', 'provider_error', 'rate_limited',
                                                 'schema_drift', 'timeout', 'unknown_error')),
    committed_at      timestamptz,
    observed_at       timestamptz NOT NULL,
    recorded_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, authorization_id),
    FOREIGN KEY (agent_id, authorization_id) REFERENCES authz.capability_authorization (agent_id, id),
    CHECK ((status = 'committed') = (committed_at IS NOT NULL)),
    CHECK ((status = 'failed') = (error_code IS NOT NULL)),
    CHECK (committed_at IS NULL OR committed_at <= observed_at)
);

-- Interaction leases on shared resources: one row per resource, taken over
-- only once the holder's lease has expired by the database's clock. Every grant
-- takes a new fencing token from the sequence.
CREATE SEQUENCE authz.lease_fencing_token;

CREATE TABLE authz.lease (
    agent_id       uuid NOT NULL,
    resource_kind  text NOT NULL CHECK (resource_kind ~ '^[a-z][a-z0-9_-]{0,31}$'),
    resource_id    text NOT NULL CHECK (length(resource_id) BETWEEN 1 AND 200),
    lease_id       text NOT NULL CHECK (length(lease_id) BETWEEN 1 AND 200),
    session_id     text NOT NULL,
    owner          text NOT NULL,
    generation     bigint NOT NULL CHECK (generation >= 0),
    fencing_token  bigint NOT NULL,
    acquired_at    timestamptz NOT NULL,
    renewed_at     timestamptz NOT NULL,
    expires_at     timestamptz NOT NULL,
    PRIMARY KEY (agent_id, resource_kind, resource_id),
    -- A lease id names one resource at a time.
    UNIQUE (agent_id, lease_id),
    CHECK (acquired_at <= renewed_at AND renewed_at < expires_at
           AND expires_at <= renewed_at + interval '60 seconds')
);

-- Interaction confirmations: registered (pending), issued with a grant,
-- consumed once. Rows are kept so that a replay is recognised as one.
CREATE TABLE authz.interaction_confirmation (
    agent_id         uuid NOT NULL,
    confirmation_id  text NOT NULL CHECK (length(confirmation_id) BETWEEN 1 AND 200),
    action_digest    text NOT NULL CHECK (action_digest ~ '^[0-9a-f]{64}$'),
    state            text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'issued', 'consumed')),
    grant_id         text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    issued_at        timestamptz,
    consumed_at      timestamptz,
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (agent_id, confirmation_id),
    CHECK ((state = 'pending') = (grant_id IS NULL)),
    CHECK (state <> 'consumed' OR consumed_at IS NOT NULL)
);
CREATE INDEX interaction_confirmation_pending ON authz.interaction_confirmation (expires_at) INCLUDE (created_at)
    WHERE state = 'pending';
