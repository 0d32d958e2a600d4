-- The open submission attempt of a payment: the id of the `pending` integration log its latest
-- submission committed before calling the Gateway. It lets whoever settles the payment (the
-- attempt itself, recovery, or a payment.result callback) close exactly that log row, without
-- ever scanning integration_logs, and lets an attempt that lost the race to a newer attempt
-- recognise that it may no longer mark the payment failed or unknown.
ALTER TABLE payments ADD COLUMN attempt_log_id bigint;
