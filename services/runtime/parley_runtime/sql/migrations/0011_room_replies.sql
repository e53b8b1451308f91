-- The room's latest replies, saved with them (save_replies) while their turn holds the room's
-- lease: the ingest of the room's next message reads them, so that turn can make sure they are
-- on the outbound stream before its own (replies in a room are published in message order, even
-- when the replica that saved them has not published them yet).
ALTER TABLE runtime.room ADD COLUMN replies jsonb, ADD COLUMN replied_at timestamptz;
