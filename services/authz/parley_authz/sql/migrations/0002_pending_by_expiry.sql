-- The gauges count pending confirmations that have not expired. Keyed by when they were created,
-- these indexes made that count read every confirmation that ever expired while pending (nothing
-- deletes them: 30,000 read for 100 live in an audit); keyed by expiry, it reads the live ones
-- only. No other statement uses them.
DROP INDEX authz.capability_confirmation_pending;
CREATE INDEX capability_confirmation_pending ON authz.capability_confirmation (expires_at) INCLUDE (created_at)
    WHERE state = 'pending';
DROP INDEX authz.interaction_confirmation_pending;
CREATE INDEX interaction_confirmation_pending ON authz.interaction_confirmation (expires_at) INCLUDE (created_at)
    WHERE state = 'pending';
