-- Custom actions registered live through the operator API (parley_runtime/custom).

CREATE TABLE runtime.custom_action (
    agent_id    uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id          text NOT NULL CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$'),
    name        text NOT NULL CHECK (name ~ '^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$'),
    definition  jsonb NOT NULL CHECK (jsonb_typeof(definition) = 'object'),
    enabled     boolean NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id)
);
CREATE UNIQUE INDEX custom_action_name ON runtime.custom_action (agent_id, name);

-- Bumped by the statement that changes an agent's custom actions; each replica reads it before a
-- turn and reloads the definitions when it moved.
CREATE TABLE runtime.custom_action_revision (
    agent_id  uuid PRIMARY KEY REFERENCES runtime.agent (id) ON DELETE CASCADE,
    revision  bigint NOT NULL CHECK (revision > 0)
);
