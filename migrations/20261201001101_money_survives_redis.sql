-- Money survives a Redis loss (issue 11): what is queued for money is in PostgreSQL before it is
-- in Redis, and the recovery runs find it there.
--
-- Payments: recovery also picks up `requested` payments (an enqueued SubmitPayment lost with
-- Redis), so the partial index behind its scan covers them too. Same name, wider predicate: the
-- scan `status IN ('requested', 'pending', 'unknown') AND updated_at < … ORDER BY updated_at`
-- stays an index range scan.
DROP INDEX payments_unsettled_idx;
CREATE INDEX payments_unsettled_idx ON payments (updated_at)
    WHERE status IN ('requested', 'pending', 'unknown');

-- Callbacks: `enqueue callback` commits the row as `received` (with its body) before it enqueues
-- the job; `queued_at` is when it was last handed to the queue, and the sweep re-enqueues
-- `received` rows whose job has not come for longer than payments.recovery_after_secs.
ALTER TABLE inbound_callbacks DROP CONSTRAINT inbound_callbacks_state_check;
ALTER TABLE inbound_callbacks ADD CONSTRAINT inbound_callbacks_state_check
    CHECK (state IN ('received', 'applied', 'failed'));
ALTER TABLE inbound_callbacks ADD COLUMN queued_at timestamptz;
CREATE INDEX inbound_callbacks_received_idx ON inbound_callbacks (queued_at)
    WHERE state = 'received';
