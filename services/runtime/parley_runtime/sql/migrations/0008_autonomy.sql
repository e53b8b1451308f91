-- Autonomy (parley_runtime/autonomy): who started each turn, and each agent's autonomy switch.
-- Existing turns were all started by a connector's message or a continuation; they read as 'user'.
ALTER TABLE runtime.turn ADD COLUMN origin text NOT NULL DEFAULT 'user'
    CHECK (origin IN ('user', 'continuation', 'autonomous'));
CREATE INDEX turn_origin_recent ON runtime.turn (agent_id, origin, received_at DESC);

-- The operator's switch (`parley autonomy on|off`); without a row the character's
-- AUTONOMY_ENABLED setting decides. Each switch from off to on starts a new generation, which
-- names the agent's recurring think section in the model gateway's prompt batcher.
CREATE TABLE runtime.autonomy (
    agent_id    uuid PRIMARY KEY REFERENCES runtime.agent (id) ON DELETE CASCADE,
    enabled     boolean NOT NULL,
    generation  bigint NOT NULL CHECK (generation > 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
