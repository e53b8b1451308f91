-- Non-blocking repeat tasks: a run of its own per claimed slot, each with its own lease.

-- A non-blocking task's ready_at is NULL for the moment between the claim of its slot and the
-- claimer's computing the next slot: nobody claims it twice meanwhile.
ALTER TABLE scheduler.task ALTER COLUMN ready_at DROP NOT NULL;
ALTER TABLE scheduler.task
    ADD CONSTRAINT task_held_is_repeat CHECK (ready_at IS NOT NULL OR repeat);

-- Holding a slot wakes nobody; setting the next one does.
DROP TRIGGER task_ready ON scheduler.task;
CREATE TRIGGER task_ready AFTER INSERT OR UPDATE OF status, ready_at ON scheduler.task
    FOR EACH ROW WHEN (NEW.status = 'active' AND NEW.queued AND NEW.ready_at IS NOT NULL)
    EXECUTE FUNCTION scheduler.notify_ready();

-- The runs in flight of non-blocking tasks (a blocking task's one run is leased on its row).
-- The fencing token comes from the same sequence as the task leases'.
CREATE TABLE scheduler.run (
    lease_token       bigint PRIMARY KEY,
    task_id           uuid NOT NULL REFERENCES scheduler.task (id) ON DELETE CASCADE,
    slot              timestamptz,
    attempt           integer NOT NULL CHECK (attempt >= 1),
    lease_owner       text NOT NULL,
    lease_expires_at  timestamptz NOT NULL,
    claimed_at        timestamptz NOT NULL
);

CREATE INDEX run_task ON scheduler.run (task_id);
CREATE INDEX run_leased ON scheduler.run (lease_expires_at);
CREATE UNIQUE INDEX run_one_per_slot ON scheduler.run (task_id, slot) WHERE slot IS NOT NULL;
