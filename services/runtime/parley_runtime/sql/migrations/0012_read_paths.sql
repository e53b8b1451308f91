-- A room's recent messages (the ingest's history, list_memories of a room) by an index that has
-- the kind after the room. With (agent_id, room_id, created_at) the planner preferred
-- memory_kind_recent, (agent_id, kind, created_at), and filtered it by room: a turn read every
-- newer message of the agent's other rooms to find its room's last ones (1,890 rows dropped by
-- the filter for 32 kept with 64 busy rooms; all of them for a quiet room of a busy agent). The
-- new index is the same index with kind inserted, so nothing else loses its path.
DROP INDEX runtime.memory_room_recent;
CREATE INDEX memory_room_recent ON runtime.memory (agent_id, room_id, kind, created_at DESC, id DESC);

-- A turn's stored replies (list_replies, when a replied message is redelivered after a crash) by
-- the turn they answer. Without it the statement walked every message of the agent (6,000 read
-- to return 1 at 3,000 turns): recovery after a crash slowed with the agent's whole history. Only
-- memories that answer a turn are in it (replies and ignore records, one or a few per turn), in
-- the statement's order: needing no sort, it is never costlier than memory_kind_recent's ordered
-- walk (which a CI run's planner preferred to the unordered (agent_id, in_reply_to)).
CREATE INDEX memory_replies ON runtime.memory (agent_id, in_reply_to, created_at, id) WHERE in_reply_to IS NOT NULL;

-- A participant by agent, entity and room (the ingest reads the agent's and the sender's rows of
-- the room; lift_expired_mute updates one). Beside the primary key (agent_id, room_id,
-- entity_id), participant_entity (agent_id, entity_id) cost the same to the planner, and the
-- generic plan took it and filtered by room: every room the agent or the sender was ever in
-- (2,999 rows dropped for 1). With the room appended it is exact; its prefix still serves the
-- lookups by entity.
DROP INDEX runtime.participant_entity;
CREATE INDEX participant_entity ON runtime.participant (agent_id, entity_id, room_id);

-- The operator's page of an agent's rooms, newest first (list_rooms_admin), without sorting all of
-- them. Rooms are inserted once and their updated columns are not in it.
CREATE INDEX room_recent ON runtime.room (agent_id, created_at DESC, id DESC);

-- The memories still waiting for an embedding (missing_embeddings, the backfill every minute per
-- agent): without it the backfill read every memory of the agent to find the few, also when there
-- were none (12,197 read for 3). A memory is in it from its insert until its embedding is stored.
CREATE INDEX memory_missing_embedding ON runtime.memory (agent_id, created_at DESC)
    WHERE embedding IS NULL AND kind IN ('messages', 'facts') AND coalesce(content ->> 'text', '') <> '';
