-- The console's money page lists the latest failed callbacks (`state = 'failed'`, newest first).
-- `inbound_callbacks` grows forever (it is the idempotency record), so that list must not read the
-- table: this partial index holds only failed rows, which a later successful delivery turns into
-- `applied` (and out of the index), so it stays small.
CREATE INDEX inbound_callbacks_failed_idx ON inbound_callbacks (last_received_at DESC)
    WHERE state = 'failed';
