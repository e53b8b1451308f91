-- The operator's pages of turns (`parley turns`, ListTurns) and relationships (the admin API) are
-- newest first. With no index in that order, a page of an agent's turns sorted every turn the
-- agent ever had (one per message), and a page of relationships every relationship. The room's
-- index gains the id the page breaks ties with, so a room's page does not sort either.
-- Cost: one more index entry per turn row version written outside HOT (received_at never changes,
-- so this index does not by itself stop an update being HOT); a relationship's update
-- (REFLECTION, off the reply's path) moves its entry.
CREATE INDEX turn_recent ON runtime.turn (agent_id, received_at DESC, id DESC);
DROP INDEX runtime.turn_room_recent;
CREATE INDEX turn_room_recent ON runtime.turn (agent_id, room_id, received_at DESC, id DESC);
CREATE INDEX relationship_recent ON runtime.relationship (agent_id, updated_at DESC, id DESC);
