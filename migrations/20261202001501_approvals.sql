-- Approvals (issue 15, spec section 7): a request a card channel must decide (issue a card, raise
-- its limit, lift a freeze), kept with the reliable semantics of payments: the row is here before
-- anything is queued or called, every submission carries Idempotency-Key = approval_id, and a
-- decision is applied once whichever way it arrives.

CREATE TABLE approvals (
    approval_id    uuid        PRIMARY KEY,
    card_ref       text        NOT NULL,
    kind           text        NOT NULL,
    amount_minor   bigint,
    status         text        NOT NULL DEFAULT 'requested'
                   CHECK (status IN ('requested', 'pending', 'in_review', 'approved', 'declined',
                                     'failed', 'unknown')),
    channel_ref    text,
    -- Submissions sent to the Gateway, always with Idempotency-Key = approval_id.
    submissions    integer     NOT NULL DEFAULT 0,
    -- The `pending` integration log of the latest submission attempt (as payments.attempt_log_id).
    attempt_log_id bigint,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
-- `kind` and `amount_minor` are not CHECKed here on purpose: a row with an unknown kind or a
-- limit_change without an amount is refused by `enqueue approval` with a clear message (and by
-- the job, which records the refusal), instead of failing the INSERT of whoever wrote it.

-- Recovery finds its work here, never in integration_logs: rows not yet decided and not in
-- review (requested, pending, unknown), oldest first ...
CREATE INDEX approvals_unsettled_idx ON approvals (updated_at)
    WHERE status IN ('requested', 'pending', 'unknown');
-- ... and rows in review, queried again once untouched for approvals.review_query_secs.
CREATE INDEX approvals_in_review_idx ON approvals (updated_at) WHERE status = 'in_review';
-- investigate and the console list a card's approvals.
CREATE INDEX approvals_card_idx ON approvals (card_ref, created_at DESC);
