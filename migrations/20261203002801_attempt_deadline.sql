-- Money submitted once, whatever is repeated.
--
-- attempt_deadline: when the open submission attempt's job is certain to have ended (the job's
-- own time limit, counted from the pending commit). Until then the attempt may still be in
-- flight, so recovery never queries nor resubmits a `pending` row before it, whatever
-- recovery_after_secs says: a 404 for a POST still on the wire would otherwise send the same
-- key a second time, concurrently.
ALTER TABLE payments ADD COLUMN attempt_deadline timestamptz;
ALTER TABLE approvals ADD COLUMN attempt_deadline timestamptz;

-- failure_reason: why an approval the worker refused to submit (unknown card, a kind or amount
-- the contract does not allow) is final `failed`. Written once, with the status.
ALTER TABLE approvals ADD COLUMN failure_reason text;
