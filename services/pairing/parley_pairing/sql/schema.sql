-- The declared pairing schema. tests/integration/test_migrations.py proves that
-- applying sql/migrations/ in order builds exactly this.

CREATE SCHEMA IF NOT EXISTS pairing;

-- The pairing service's data: who may talk to an agent through a connector.
-- Every row carries agent_id and every query filters on it. The TTL of a
-- pending request is a setting, so the cut-off is applied in each query
-- (created_at > now() - ttl) rather than stored.

-- Deterministic id of an allowlist entry. The channel's length is part of the
-- input so that ('a/b', 'c') and ('a', 'b/c') cannot collide.
CREATE FUNCTION pairing.allowlist_id(agent_id uuid, channel text, sender_id text) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT md5(agent_id::text || '/' || length(channel) || '/' || channel || '/' || sender_id)::uuid $$;

-- A sender waiting for an operator's approval. One row per (agent, channel,
-- sender); an expired row is invisible and replaced by the sender's next
-- request. `slot` numbers the live requests of a channel from 1 to max_pending:
-- unique per channel, it is what keeps a channel from ever holding more than
-- max_pending live requests, whichever replica inserts them.
CREATE TABLE pairing.request (
    agent_id      uuid NOT NULL,
    channel       text NOT NULL CHECK (channel ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    sender_id     text NOT NULL CHECK (sender_id <> '' AND length(sender_id) <= 256),
    id            uuid NOT NULL DEFAULT gen_random_uuid(),
    code          text NOT NULL CHECK (code ~ '^[ABCDEFGHJKLMNPQRSTUVWXYZ23456789]{8}$'),
    slot          integer NOT NULL CHECK (slot > 0),
    created_at    timestamptz NOT NULL DEFAULT now(),
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    metadata      jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    PRIMARY KEY (agent_id, channel, sender_id)
);
-- Codes are unique among the agent's requests (expired ones included until
-- they are cleaned up): a collision is a constraint violation, never a read.
CREATE UNIQUE INDEX request_code ON pairing.request (agent_id, code);
CREATE UNIQUE INDEX request_slot ON pairing.request (agent_id, channel, slot);
-- Pages: newest first, id breaking ties; the TTL cut-off is a range on created_at.
-- (No index of its own for the background clean-up: a channel holds at most
-- max_pending live requests, so the table stays small and a scan is cheap, and
-- a second created_at index would tempt the planner away from this one.)
CREATE INDEX request_page ON pairing.request (agent_id, channel, created_at DESC, id DESC);

CREATE TABLE pairing.allowlist (
    agent_id    uuid NOT NULL,
    channel     text NOT NULL CHECK (channel ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$'),
    sender_id   text NOT NULL CHECK (sender_id <> '' AND length(sender_id) <= 256),
    id          uuid NOT NULL GENERATED ALWAYS AS (pairing.allowlist_id(agent_id, channel, sender_id)) STORED,
    created_at  timestamptz NOT NULL DEFAULT now(),
    added_by    text NOT NULL CHECK (added_by <> '' AND length(added_by) <= 256),
    metadata    jsonb NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(metadata) = 'object'),
    PRIMARY KEY (agent_id, channel, sender_id)
);
CREATE INDEX allowlist_page ON pairing.allowlist (agent_id, channel, created_at DESC, id DESC);

-- The pairing reply told to a sender: claimed at most once per TTL window and
-- code, so a chatty sender is told its code once, not on every message.
CREATE TABLE pairing.reply_claim (
    agent_id    uuid NOT NULL,
    channel     text NOT NULL,
    sender_id   text NOT NULL,
    -- The code the reply carried; NULL when the channel was full and there was none.
    code        text,
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, channel, sender_id)
);
CREATE INDEX reply_claim_expiry ON pairing.reply_claim (claimed_at);
CREATE TABLE pairing.connector (
    name          text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,62}$'),
    namespace     text NOT NULL CHECK (namespace ~ '^[a-z][a-z0-9_]{0,31}$'),
    agent_id      uuid NOT NULL,
    source        text NOT NULL CHECK (source ~ '^[A-Za-z0-9_-]{1,64}$'),
    kind          text NOT NULL CHECK (kind IN ('nats', 'web')),
    secret_digest bytea NOT NULL CHECK (length(secret_digest) = 32),
    api_key_digest bytea CHECK (api_key_digest IS NULL OR length(api_key_digest) = 32),
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    CHECK ((kind = 'web') = (api_key_digest IS NOT NULL))
);
CREATE INDEX connector_agent ON pairing.connector (agent_id, created_at DESC);
CREATE UNIQUE INDEX connector_api_key ON pairing.connector (api_key_digest) WHERE api_key_digest IS NOT NULL;

-- The NATS connections a connector was admitted with (server and client id), so that revoking
-- it can close them at once.
CREATE TABLE pairing.connector_session (
    connector     text NOT NULL REFERENCES pairing.connector (name) ON DELETE CASCADE,
    server_id     text NOT NULL,
    client_id     bigint NOT NULL,
    connected_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (connector, server_id, client_id)
);
