-- Operator administration (parley rooms|worlds|entities|participants|relationships).
-- Who set a participant's role: a connector's claim (metadata.sender_role, capped by the agent's
-- CONNECTOR_ROLE_CEILING) or the operator (SetParticipantRole). A connector's claim never
-- changes a role the operator set.
ALTER TABLE runtime.participant ADD COLUMN role_source text NOT NULL DEFAULT 'connector'
    CHECK (role_source IN ('connector', 'operator'));

-- Relationships between entities, as elizaOS keeps them: a source, a target, tags and metadata.
CREATE TABLE runtime.relationship (
    agent_id          uuid NOT NULL REFERENCES runtime.agent (id) ON DELETE CASCADE,
    id                uuid NOT NULL,
    source_entity_id  uuid NOT NULL,
    target_entity_id  uuid NOT NULL,
    tags              text[] NOT NULL DEFAULT '{}',
    metadata          jsonb NOT NULL DEFAULT '{}',
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (agent_id, id),
    UNIQUE (agent_id, source_entity_id, target_entity_id),
    FOREIGN KEY (agent_id, source_entity_id) REFERENCES runtime.entity (agent_id, id) ON DELETE CASCADE,
    FOREIGN KEY (agent_id, target_entity_id) REFERENCES runtime.entity (agent_id, id) ON DELETE CASCADE
);
CREATE INDEX relationship_target ON runtime.relationship (agent_id, target_entity_id);
