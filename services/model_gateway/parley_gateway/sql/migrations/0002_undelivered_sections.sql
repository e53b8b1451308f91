-- The batcher's status (every drain of an affinity, every gauge refresh, BatcherStatus) counts the
-- sections still to deliver. A delivered section stays until its owner disposes of it, and the
-- count read all of them: every delivered section of the affinity, and of every affinity for the
-- gauges. This index holds only the sections still to deliver.
CREATE INDEX batch_section_undelivered ON model.batch_section (affinity, state, frequency, min_cycle_ms)
    WHERE state <> 'delivered';
