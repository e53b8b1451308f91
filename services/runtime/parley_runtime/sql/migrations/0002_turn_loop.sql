-- The complete turn loop: timed mutes, embeddings, why a turn ended, secrets at rest.

CREATE EXTENSION IF NOT EXISTS vector;

ALTER TABLE runtime.participant ADD COLUMN mute_until timestamptz;

-- Embeddings of messages and facts; the dimension is the embedding model's (reported by the gateway).
ALTER TABLE runtime.memory ADD COLUMN embedding vector;
ALTER TABLE runtime.memory ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}';
CREATE INDEX memory_kind_recent ON runtime.memory (agent_id, kind, created_at DESC, id DESC);

-- Why a turn ended the way it did: self, muted, not_addressed, disabled, no_reply, ...
ALTER TABLE runtime.turn ADD COLUMN reason text;
ALTER TABLE runtime.turn ADD COLUMN started_at timestamptz;

-- Character secrets, encrypted (AES-256-GCM, see parley_runtime/secrets.py).
CREATE TABLE runtime.agent_secret (
    agent_id    uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    name        text NOT NULL CHECK (name <> ''),
    ciphertext  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, name)
);
