-- The reliable paths: payments (pending before the call) and inbound callbacks (idempotent on
-- (channel, callback_id)).

CREATE TABLE payments (
    payment_id    uuid        PRIMARY KEY,
    card_ref      text        NOT NULL,
    amount_minor  bigint      NOT NULL CHECK (amount_minor > 0),
    currency      text        NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status        text        NOT NULL DEFAULT 'requested'
                  CHECK (status IN ('requested', 'pending', 'accepted', 'rejected', 'unknown')),
    channel_ref   text,
    -- Submissions sent to the Gateway, always with Idempotency-Key = payment_id.
    submissions   integer     NOT NULL DEFAULT 0,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
-- Recovery finds its work here: payments still pending or unknown, oldest first.
CREATE INDEX payments_unsettled_idx ON payments (updated_at) WHERE status IN ('pending', 'unknown');
CREATE INDEX payments_card_idx ON payments (card_ref, created_at DESC);

CREATE TABLE inbound_callbacks (
    id                 bigserial   PRIMARY KEY,
    channel            text        NOT NULL,
    callback_id        text        NOT NULL,
    body               text        NOT NULL,
    state              text        NOT NULL CHECK (state IN ('applied', 'failed')),
    reason             text,
    resource_type      text,
    resource_id        text,
    deliveries         integer     NOT NULL DEFAULT 1,
    first_received_at  timestamptz NOT NULL DEFAULT now(),
    last_received_at   timestamptz NOT NULL DEFAULT now(),
    applied_at         timestamptz,
    UNIQUE (channel, callback_id)
);
CREATE INDEX inbound_callbacks_resource_idx ON inbound_callbacks (resource_type, resource_id);
