-- Core schema: cards, the investigable records (integration log + unified audit), the outbox and
-- the archive tables. Archive walks integration_logs, audit_events and audit_resources by the
-- Asia/Shanghai day of created_at, so each has an index on created_at ("oldest finished row" and
-- "the rows of one day" are index range scans).

CREATE TABLE cards (
    id                     bigserial PRIMARY KEY,
    card_ref               text        NOT NULL UNIQUE,
    data_state             text        NOT NULL DEFAULT 'pending'
                           CHECK (data_state IN ('pending', 'ready')),
    card_token             text,
    pan_last4              text        CHECK (pan_last4 ~ '^[0-9]{4}$'),
    expiry_month           smallint    CHECK (expiry_month BETWEEN 1 AND 12),
    expiry_year            smallint,
    status                 text        NOT NULL DEFAULT 'inactive'
                           CHECK (status IN ('inactive', 'active', 'frozen', 'cancelled', 'expired')),
    -- Optimistic concurrency: every change is `UPDATE … WHERE version = $seen`.
    version                bigint      NOT NULL DEFAULT 0,
    -- A polling chain parked after max_consecutive_failures. Kept here, not in Redis, so that a
    -- Redis loss never restarts parked chains; only `cardworker enqueue` clears it.
    carddata_parked_at     timestamptz,
    card_status_parked_at  timestamptz,
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now()
);

-- Reconcile walks the cards that should be polled, in id order, in batches.
CREATE INDEX cards_carddata_due_idx ON cards (id)
    WHERE data_state = 'pending' AND carddata_parked_at IS NULL;
CREATE INDEX cards_card_status_due_idx ON cards (id)
    WHERE status NOT IN ('cancelled', 'expired') AND card_status_parked_at IS NULL;

CREATE TABLE integration_logs (
    id                bigserial   PRIMARY KEY,
    correlation_id    uuid        NOT NULL,
    resource_type     text        NOT NULL,
    resource_id       text        NOT NULL,
    scenario          text        NOT NULL,
    state             text        NOT NULL
                      CHECK (state IN ('pending', 'succeeded', 'failed', 'unknown')),
    request_summary   text,
    response_summary  text,
    http_status       integer,
    error             text,
    recovery_summary  text,
    started_at        timestamptz NOT NULL,
    finished_at       timestamptz,
    duration_ms       integer,
    created_at        timestamptz NOT NULL DEFAULT now(),
    CHECK ((state = 'pending') = (finished_at IS NULL))
);

-- Archive: oldest finished row and one day's finished rows.
CREATE INDEX integration_logs_finished_created_idx ON integration_logs (created_at)
    WHERE state <> 'pending';
-- Investigation: one resource's timeline, newest first.
CREATE INDEX integration_logs_resource_idx ON integration_logs (resource_type, resource_id, created_at DESC);

CREATE TABLE audit_events (
    id                  bigserial   PRIMARY KEY,
    event_type          text        NOT NULL,
    actor               text        NOT NULL DEFAULT 'cardworker',
    correlation_id      uuid,
    integration_log_id  bigint,
    summary             text        NOT NULL,
    details             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_events_created_idx ON audit_events (created_at);

CREATE TABLE audit_resources (
    id              bigserial   PRIMARY KEY,
    audit_event_id  bigint      NOT NULL REFERENCES audit_events (id),
    resource_type   text        NOT NULL,
    resource_id     text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_resources_created_idx ON audit_resources (created_at);
CREATE INDEX audit_resources_event_idx ON audit_resources (audit_event_id);
CREATE INDEX audit_resources_resource_idx ON audit_resources (resource_type, resource_id, created_at DESC);

-- Written in the same transaction as the change it announces; another service publishes it.
CREATE TABLE outbox_events (
    id              bigserial   PRIMARY KEY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz
);
CREATE INDEX outbox_events_unpublished_idx ON outbox_events (id) WHERE published_at IS NULL;

-- Archive tables: same columns, same primary keys (a rerun inserts ON CONFLICT DO NOTHING, so a
-- crashed run finishes its day without duplicates), plus when the row was archived.
CREATE TABLE integration_logs_archive (
    LIKE integration_logs INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id)
);
CREATE INDEX integration_logs_archive_created_idx ON integration_logs_archive (created_at);
CREATE INDEX integration_logs_archive_resource_idx ON integration_logs_archive (resource_type, resource_id, created_at DESC);

CREATE TABLE audit_events_archive (
    LIKE audit_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id)
);
CREATE INDEX audit_events_archive_created_idx ON audit_events_archive (created_at);

CREATE TABLE audit_resources_archive (
    LIKE audit_resources INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id)
);
CREATE INDEX audit_resources_archive_created_idx ON audit_resources_archive (created_at);
CREATE INDEX audit_resources_archive_resource_idx ON audit_resources_archive (resource_type, resource_id, created_at DESC);
