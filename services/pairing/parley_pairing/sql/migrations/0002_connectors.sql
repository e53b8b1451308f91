-- Connectors: identities that may publish one agent's inbound messages for one source and read
-- that source's replies. The pairing service admits them to NATS (auth callout) while they are
-- not revoked; only digests of their secrets are stored.
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
