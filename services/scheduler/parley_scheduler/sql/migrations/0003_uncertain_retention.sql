-- Uncertain attempts are kept for a retention period (PARLEY_SCHEDULER_UNCERTAIN_RETENTION_DAYS),
-- then pruned oldest first by the maintenance loop.
CREATE INDEX uncertain_attempt_reclaimed ON scheduler.uncertain_attempt (reclaimed_at);
