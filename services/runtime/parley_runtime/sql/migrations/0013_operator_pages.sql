-- The operator's pages of entities and participants (`parley entities`, `parley participants`,
-- the admin API) are in creation order, newest first. With no index in that order, each page
-- sorted every entity or participant of the agent (one per user, one per user and room: they
-- grow with the agent's conversations) to return 50. Written once per new user and per new
-- user in a room, never updated in these columns.
CREATE INDEX entity_recent ON runtime.entity (agent_id, created_at DESC, id DESC);
CREATE INDEX participant_recent ON runtime.participant (agent_id, created_at DESC, room_id, entity_id);
