//! `ProcessCallback`: applies one channel callback (spec 1b) exactly once, in PostgreSQL.
//!
//! One transaction per delivery:
//! 1. `INSERT … ON CONFLICT (channel, callback_id) DO UPDATE` on `inbound_callbacks` counts the
//!    delivery and **locks the row**: concurrent deliveries of the same callback queue up here,
//!    and each sees what the one before it committed.
//! 2. Already `applied`: commit the delivery count, apply nothing.
//! 3. Otherwise apply the change (card status under the optimistic version check, reloading and
//!    deciding again on a conflict; or the payment result), write its terminal integration log
//!    (`succeeded`, scenario `callback`), audit event and link, and the outbox event, and mark the
//!    row `applied` — all in the same commit.
//!
//! A callback that cannot be applied (unknown card or payment, malformed body, a result that
//! contradicts a settled payment) is committed as `failed` with the reason, and the job is
//! acknowledged: nothing is silently dropped, and a later delivery of the same (channel, id)
//! is processed again. A database error retries the delivery through the intake with back-off.
//!
//! Redis loss costs nothing: `cardworker enqueue callback` commits the delivery first
//! ([`record_received`]: the row `received`, with its body) and only then enqueues the job (with
//! `recorded`, so the job does not count the delivery twice). Should the job be lost with Redis,
//! [`sweep_received`] (run with payment recovery) re-enqueues every `received` row untouched for
//! `payments.recovery_after_secs`; applying stays idempotent on (channel, callback id).
//!
//! One file on purpose: recording, applying and sweeping a callback share the
//! `inbound_callbacks` row's states, and their rules are easiest to check side by side.

use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::ProcessCallback;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::submit::backoff;
use crate::cards::{apply_status, Applied, ChangeSource};
use crate::context::AppContext;
use crate::gateway::{redact_digits, CardStatus, PaymentStatus};
use crate::runner::RunJob;
use crate::settle::approval::Approval;
use crate::settle::decide::{close_open_attempt, decide};
use crate::settle::payment::PaymentCall;
use crate::settle::{table, Arrival, Decided, Kind, Row as _};
use crate::storage::cards;
use crate::storage::fault::clean;
use crate::storage::ident::{self, IdentError};
use crate::storage::records::LogState;
use crate::storage::records::{insert_audit, insert_terminal_log, AuditRecord, LogRecord};
use crate::storage::reliable::FinalState;

/// Redeliveries through the intake after database errors before the job gives up (dead, logged).
pub const MAX_RETRIES: u32 = 8;

/// Version conflicts tolerated in one delivery before it is failed (and retried).
const MAX_VERSION_CONFLICTS: u32 = 10;

impl RunJob for ProcessCallback {
    const KIND: &'static str = "callback";

    fn concurrency(_config: &crate::config::Config) -> usize {
        4
    }

    fn timeout(_config: &crate::config::Config) -> Duration {
        Duration::from_secs(60)
    }

    #[tracing::instrument(name = "job.process_callback", skip_all, fields(channel = %self.channel, callback_id = %self.callback_id))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        match process(&ctx, &self).await {
            Ok(outcome) => {
                tracing::info!(?outcome, "callback handled");
                Ok(())
            }
            Err(e) if self.retries < MAX_RETRIES => {
                let delay = backoff(self.retries);
                let next = ProcessCallback {
                    retries: self.retries + 1,
                    ..self.clone()
                };
                ctx.producer
                    .enqueue_after(&next, delay)
                    .await
                    .with_context(|| {
                        format!("callback could not be processed ({e:#}) nor redelivered")
                    })?;
                tracing::warn!(error = %format!("{e:#}"), retry_in_ms = delay.as_millis() as u64, "callback not processed; redelivery scheduled");
                Ok(())
            }
            Err(e) => Err(e.context(format!(
                "callback given up after {} redeliveries",
                self.retries
            ))),
        }
    }
}

/// What one delivery did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// Applied now (`changed` is false when the state already was what the callback says).
    Applied {
        /// Whether the domain changed.
        changed: bool,
    },
    /// Already applied by an earlier delivery: nothing applied.
    Duplicate,
    /// Recorded as failed with this reason; a later delivery tries again.
    Failed(String),
}

/// The body of a callback (spec 1b).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type")]
pub enum CallbackBody {
    /// A card status change.
    #[serde(rename = "card.status")]
    CardStatus {
        /// The card.
        card_ref: String,
        /// The new status.
        status: String,
    },
    /// A payment result.
    #[serde(rename = "payment.result")]
    PaymentResult {
        /// The payment.
        payment_id: Uuid,
        /// `accepted` or `rejected`.
        status: String,
        /// The channel's reference.
        channel_ref: String,
    },
    /// An approval's decision (spec section 7).
    #[serde(rename = "approval.result")]
    ApprovalResult {
        /// The approval.
        approval_id: Uuid,
        /// `approved` or `declined`.
        status: String,
        /// The channel's reference.
        channel_ref: String,
    },
}

/// The fields of a callback body the contract knows (spec 1b): only these are stored.
const KNOWN_FIELDS: [&str; 6] = [
    "type",
    "card_ref",
    "status",
    "payment_id",
    "approval_id",
    "channel_ref",
];

/// A body as it is stored and queued: a JSON object reduced to its `KNOWN_FIELDS` (anything else
/// a channel sent, a card number in an extra field say, is dropped), with its identifiers
/// (`card_ref`, `payment_id`, `approval_id`, `channel_ref`) kept exactly and its free fields
/// (`type`, `status`, and any value of an unexpected JSON type) masked for card numbers
/// (`storage::fault::clean_json`); anything that is not a JSON object is replaced by a note of
/// its size. Parsing it gives what parsing the raw body gives, so the stored body is also what a
/// re-enqueued delivery is processed from, and it may be written anywhere: PostgreSQL, the
/// callback job's payload in Redis, a log line.
pub fn known_fields(body: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(o)) => {
            let kept: serde_json::Map<String, serde_json::Value> = o
                .into_iter()
                .filter(|(k, _)| KNOWN_FIELDS.contains(&k.as_str()))
                .collect();
            let kept = serde_json::Value::Object(kept);
            crate::storage::fault::clean_json(&kept).to_string()
        }
        _ => format!("(not stored: not a JSON object, {} bytes)", body.len()),
    }
}

/// Refuses a callback whose `channel` or `callback_id` the contract forbids (empty, too long,
/// a control character: `storage::ident`). Such a callback has no key to be recorded under.
pub fn check_key(channel: &str, callback_id: &str) -> Result<(), IdentError> {
    ident::check("channel", channel)?;
    ident::check("callback_id", callback_id)
}

/// Parses and validates a raw body. The error is the reason kept on the failed row.
///
/// The reason of a refused body is stored and logged, and serde quotes the values it refuses, so
/// every run of digits that could be a card number is masked first.
pub fn parse(body: &str) -> Result<CallbackBody, String> {
    let refused = |why: String| redact_digits(&format!("malformed body: {why}"));
    let parsed: CallbackBody = serde_json::from_str(body).map_err(|e| refused(e.to_string()))?;
    let identifier =
        |what, value: &str| ident::check(what, value).map_err(|e| format!("malformed body: {e}"));
    match &parsed {
        CallbackBody::CardStatus { status, card_ref } => {
            identifier("card_ref", card_ref)?;
            CardStatus::from_str(status).map_err(|e| refused(e.to_string()))?;
        }
        CallbackBody::PaymentResult {
            status,
            channel_ref,
            ..
        } => {
            identifier("channel_ref", channel_ref)?;
            PaymentStatus::from_str(status).map_err(|_| {
                refused(format!(
                    "payment status {status:?} is not accepted or rejected"
                ))
            })?;
        }
        CallbackBody::ApprovalResult {
            status,
            channel_ref,
            ..
        } => {
            identifier("channel_ref", channel_ref)?;
            if !matches!(status.as_str(), "approved" | "declined") {
                return Err(refused(format!(
                    "approval status {status:?} is not approved or declined"
                )));
            }
        }
    }
    Ok(parsed)
}

/// How the reason of a callback that contradicts a final decision begins. Such a callback is
/// final too (a final decision never changes): a later delivery is counted, not processed again,
/// so its conflict is audited once.
pub const CONTRADICTION: &str = "contradicts the recorded result";

/// The whole delivery, in one transaction (module docs).
pub async fn process(ctx: &AppContext, job: &ProcessCallback) -> anyhow::Result<Delivery> {
    if let Err(refused) = check_key(&job.channel, &job.callback_id) {
        return refuse_key(ctx, job, &refused).await;
    }
    let mut tx = ctx
        .pool
        .begin()
        .await
        .context("beginning the callback transaction")?;
    // A fresh row is inserted as `failed`/"processing" and always rewritten below before the
    // commit, so no other transaction ever sees that placeholder.
    // A delivery committed by whoever enqueued it (`recorded`) is not counted again.
    let (row_id, state, reason, inserted): (i64, String, String, bool) = sqlx::query_as(
        "INSERT INTO inbound_callbacks (channel, callback_id, body, state, reason)
         VALUES ($1, $2, $3, 'failed', 'processing')
         ON CONFLICT (channel, callback_id) DO UPDATE
            SET deliveries = inbound_callbacks.deliveries + $4,
                last_received_at = CASE WHEN $4 = 0 THEN inbound_callbacks.last_received_at
                                        ELSE now() END
         RETURNING id, state, coalesce(reason, ''), (xmax = 0)",
    )
    .bind(&job.channel)
    .bind(&job.callback_id)
    .bind(known_fields(&job.body))
    .bind(i32::from(!job.recorded))
    .fetch_one(&mut *tx)
    .await
    .context("recording the callback delivery")?;

    if !inserted && (state == "applied" || reason.starts_with(CONTRADICTION)) {
        tx.commit()
            .await
            .context("counting the duplicate delivery")?;
        return Ok(Delivery::Duplicate);
    }

    let parsed = parse(&job.body);
    let outcome = match &parsed {
        Err(reason) => Err(reason.clone()),
        Ok(body) => apply(&mut tx, job, row_id, body).await?,
    };
    let delivery = match outcome {
        Ok((resource_type, resource_id, changed)) => {
            sqlx::query(
                "UPDATE inbound_callbacks
                    SET state = 'applied', reason = NULL, body = $2, resource_type = $3,
                        resource_id = $4, applied_at = now()
                  WHERE id = $1",
            )
            .bind(row_id)
            .bind(known_fields(&job.body))
            .bind(resource_type)
            .bind(&resource_id)
            .execute(&mut *tx)
            .await?;
            Delivery::Applied { changed }
        }
        Err(reason) => {
            let resource = loose_resource(&job.body);
            sqlx::query(
                "UPDATE inbound_callbacks
                    SET state = 'failed', reason = $2, body = $3, resource_type = $4,
                        resource_id = $5
                  WHERE id = $1",
            )
            .bind(row_id)
            .bind(clean(&reason))
            .bind(known_fields(&job.body))
            .bind(resource.as_ref().map(|r| r.0))
            .bind(resource.as_ref().map(|r| r.1.as_str()))
            .execute(&mut *tx)
            .await?;
            insert_audit(
                &mut tx,
                &AuditRecord {
                    event_type: "callback.failed",
                    correlation_id: None,
                    summary: format!(
                        "callback {}/{} not applied: {reason}; a later delivery is processed again",
                        job.channel, job.callback_id
                    ),
                    details: json!({ "channel": job.channel, "callback_id": job.callback_id, "reason": reason }),
                    resource_type: resource.as_ref().map_or("callback", |r| r.0),
                    resource_id: resource
                        .as_ref()
                        .map_or_else(|| format!("{}/{}", job.channel, job.callback_id), |r| r.1.clone()),
                },
                None,
            )
            .await?;
            tracing::warn!(%reason, "callback recorded as failed");
            Delivery::Failed(reason)
        }
    };
    tx.commit().await.context("committing the callback")?;
    if let (Delivery::Applied { changed: true }, Ok(body)) = (&delivery, &parsed) {
        count_decision(body);
    }
    Ok(delivery)
}

/// A delivery whose key the contract forbids: recorded once as a `callback.refused` audit event
/// (there is no `inbound_callbacks` key to record it under), linked to the key as `{:?}` renders
/// it (escaped, so a control character is visible and storable), and acknowledged. The ingress
/// that sends `enqueue callback` is refused the same key with exit 2, so only a job written by
/// hand into Redis gets here.
async fn refuse_key(
    ctx: &AppContext,
    job: &ProcessCallback,
    refused: &IdentError,
) -> anyhow::Result<Delivery> {
    let shown: String = format!("{:?}/{:?}", job.channel, job.callback_id)
        .chars()
        .take(ident::MAX_CHARS)
        .collect();
    let reason = format!("callback key refused: {refused}");
    let mut tx = ctx
        .pool
        .begin()
        .await
        .context("beginning the refused callback's record")?;
    insert_audit(
        &mut tx,
        &AuditRecord {
            event_type: "callback.refused",
            correlation_id: None,
            summary: format!("callback {shown} not recorded: {reason}"),
            details: json!({ "reason": reason, "key": shown, "body": known_fields(&job.body) }),
            resource_type: "callback",
            resource_id: shown,
        },
        None,
    )
    .await
    .context("recording the refused callback")?;
    tx.commit()
        .await
        .context("committing the refused callback's record")?;
    tracing::warn!(%reason, "callback refused");
    Ok(Delivery::Failed(reason))
}

/// Counts the final decision a committed callback applied (after the commit: a rolled-back
/// transaction is processed again and must not count twice).
fn count_decision(body: &CallbackBody) {
    fn count<K: Kind>(status: &str) {
        if K::is_final(status) {
            K::count_decision(status, Arrival::Callback);
        }
    }
    match body {
        CallbackBody::PaymentResult { status, .. } => count::<PaymentCall>(status),
        CallbackBody::ApprovalResult { status, .. } => count::<Approval>(status),
        CallbackBody::CardStatus { .. } => {}
    }
}

/// What [`record_received`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// Committed as `received` (new, or a redelivery of one not applied yet): enqueue it.
    Recorded,
    /// Already applied: the delivery is counted, nothing is enqueued.
    AlreadyApplied,
}

/// The first half of `enqueue callback`: commits the delivery as `received` with its body, before
/// anything is in Redis. A redelivery of a callback that is not applied yet is `received` again
/// (with the new body); an applied one only counts the delivery.
pub async fn record_received(
    pool: &sqlx::PgPool,
    channel: &str,
    callback_id: &str,
    body: &str,
) -> sqlx::Result<Received> {
    let state: String = sqlx::query_scalar(
        "INSERT INTO inbound_callbacks (channel, callback_id, body, state, queued_at)
         VALUES ($1, $2, $3, 'received', now())
         ON CONFLICT (channel, callback_id) DO UPDATE
            SET deliveries = inbound_callbacks.deliveries + 1,
                last_received_at = now(),
                body = CASE WHEN inbound_callbacks.state = 'applied' THEN inbound_callbacks.body
                            ELSE EXCLUDED.body END,
                state = CASE WHEN inbound_callbacks.state = 'applied' THEN 'applied'
                             ELSE 'received' END,
                queued_at = now()
         RETURNING state",
    )
    .bind(channel)
    .bind(callback_id)
    .bind(known_fields(body))
    .fetch_one(pool)
    .await?;
    Ok(if state == "applied" {
        Received::AlreadyApplied
    } else {
        Received::Recorded
    })
}

/// `received` callbacks re-enqueued per sweep.
pub const SWEEP_BATCH: i64 = 200;

/// Re-enqueues up to `batch` callbacks still `received` after `older_than` (their job was lost
/// with Redis, or is stuck): oldest `queued_at` first, along `inbound_callbacks_received_idx`.
/// Each is touched before it is enqueued, so a lost enqueue is retried by a later sweep and a
/// working one is not repeated at once. Returns how many were re-enqueued.
pub async fn sweep_received(
    ctx: &AppContext,
    older_than: Duration,
    batch: i64,
) -> anyhow::Result<usize> {
    let rows: Vec<(i64, String, String, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT id, channel, callback_id, body, queued_at FROM inbound_callbacks
          WHERE state = 'received' AND queued_at < now() - make_interval(secs => $1)
          ORDER BY queued_at
          LIMIT $2",
    )
    .bind(older_than.as_secs_f64())
    .bind(batch)
    .fetch_all(&ctx.pool)
    .await
    .context("finding received callbacks whose job never came")?;
    let mut requeued = 0;
    for (id, channel, callback_id, body, queued_at) in rows {
        // Compare-and-set on the `queued_at` just read: of two pods sweeping at once, one
        // re-enqueues. The condition on `queued_at` also keeps the plan on an index key (the
        // row id, or the partial index's leading column), never a walk of the partial index.
        let touched = sqlx::query(
            "UPDATE inbound_callbacks SET queued_at = now()
              WHERE id = $1 AND state = 'received' AND queued_at = $2",
        )
        .bind(id)
        .bind(queued_at)
        .execute(&ctx.pool)
        .await
        .context("touching a received callback")?;
        if touched.rows_affected() == 0 {
            continue;
        }
        ctx.producer
            .enqueue(&ProcessCallback {
                channel,
                callback_id,
                body,
                retries: 0,
                recorded: true,
            })
            .await
            .context("re-enqueueing a received callback")?;
        requeued += 1;
    }
    Ok(requeued)
}

/// Applies a parsed callback. `Ok(Err(reason))` is a callback that cannot be applied.
async fn apply(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    body: &CallbackBody,
) -> anyhow::Result<Result<(&'static str, String, bool), String>> {
    let source = format!("callback {}/{}", job.channel, job.callback_id);
    let started_at = Utc::now();
    match body {
        CallbackBody::CardStatus { card_ref, status } => {
            let Ok(new_status) = CardStatus::from_str(status) else {
                return Ok(Err(format!("malformed body: card status {status:?}")));
            };
            let change_source = ChangeSource {
                kind: "callback",
                integration_log_id: None,
                detail: Some(format!(
                    "channel={} callback_id={}",
                    job.channel, job.callback_id
                )),
            };
            let mut conflicts = 0;
            loop {
                let Some(card) = cards::load(&mut *conn, card_ref).await? else {
                    return Ok(Err(format!("unknown card {card_ref}")));
                };
                let correlation_id = Uuid::new_v4();
                // The same status-change function as polling: one optimistic update, one audit
                // event, one outbox event, whoever observed the change.
                match apply_status(conn, &card, new_status, correlation_id, &change_source).await? {
                    Applied::Changed {
                        version,
                        audit_event_id,
                        ..
                    } => {
                        let summary = format!(
                            "status {} -> {status} (version {} -> {version}) by {source}",
                            card.status, card.version
                        );
                        let log_id = insert_callback_log(
                            conn,
                            job,
                            row_id,
                            "card",
                            card_ref,
                            started_at,
                            correlation_id,
                            summary,
                        )
                        .await?;
                        sqlx::query(
                            "UPDATE audit_events SET integration_log_id = $2 WHERE id = $1",
                        )
                        .bind(audit_event_id)
                        .bind(log_id)
                        .execute(&mut *conn)
                        .await?;
                        return Ok(Ok(("card", card_ref.clone(), true)));
                    }
                    Applied::Unchanged => {
                        record(
                            conn,
                            job,
                            row_id,
                            "card",
                            card_ref,
                            started_at,
                            format!(
                                "status already {status} (version {}): nothing changed",
                                card.version
                            ),
                            "callback.applied",
                            false,
                        )
                        .await?;
                        return Ok(Ok(("card", card_ref.clone(), false)));
                    }
                    Applied::Conflict => {
                        // Another writer (a poll, another callback) changed the card since we
                        // read it: reload and decide again on the current state.
                        conflicts += 1;
                        if conflicts >= MAX_VERSION_CONFLICTS {
                            anyhow::bail!(
                                "card {card_ref}: {conflicts} version conflicts in a row"
                            );
                        }
                    }
                }
            }
        }
        CallbackBody::PaymentResult {
            payment_id,
            status,
            channel_ref,
        } => {
            apply_decision::<PaymentCall>(conn, job, row_id, *payment_id, status, channel_ref).await
        }
        CallbackBody::ApprovalResult {
            approval_id,
            status,
            channel_ref,
        } => apply_decision::<Approval>(conn, job, row_id, *approval_id, status, channel_ref).await,
    }
}

/// A decision callback (`payment.result`, `approval.result`) through the one decide-once path
/// of `crate::settle`: the first final decision wins; the same one again changes nothing; a
/// different one after a final one is a conflict, on record (a payment's callback is then
/// failed with the reason, an approval's is processed with its conflict kept).
async fn apply_decision<K: Kind>(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    id: Uuid,
    status: &str,
    channel_ref: &str,
) -> anyhow::Result<Result<(&'static str, String, bool), String>> {
    let source = format!("callback {}/{}", job.channel, job.callback_id);
    let started_at = Utc::now();
    let Some(row) = table::lock::<K>(conn, id).await? else {
        return Ok(Err(format!("unknown {} {id}", K::RESOURCE)));
    };
    let decided = decide::<K>(
        conn,
        &row,
        status,
        Some(channel_ref),
        Arrival::Callback,
        (None, None),
    )
    .await?;
    let (summary, event, changed) = match decided {
        Decided::Applied | Decided::Waiting => {
            close_open_attempt::<K>(
                conn,
                &row,
                FinalState::Succeeded,
                format!("(from {source}) status={status} channel_ref={channel_ref}"),
                format!("settled by {source}"),
            )
            .await?;
            (
                format!(
                    "{} {} -> {status} (channel_ref {channel_ref}) by {source}",
                    K::RESOURCE,
                    row.status()
                ),
                K::decision_event(status),
                true,
            )
        }
        Decided::Repeated => (
            format!("{} already {status}: nothing changed", K::RESOURCE),
            "callback.applied",
            false,
        ),
        Decided::Conflict { recorded } if K::CONFLICTING_CALLBACK_FAILS => {
            return Ok(Err(format!(
                "{CONTRADICTION}: {} {id} is {recorded}, callback says {status}",
                K::RESOURCE
            )));
        }
        Decided::Conflict { recorded } => (
            format!(
                "{} {id} is {recorded}; callback says {status}: not applied, kept as a conflict",
                K::RESOURCE
            ),
            "callback.applied",
            false,
        ),
    };
    record(
        conn,
        job,
        row_id,
        K::RESOURCE,
        &id.to_string(),
        started_at,
        summary,
        event,
        changed,
    )
    .await?;
    Ok(Ok((K::RESOURCE, id.to_string(), changed)))
}

/// The change's terminal integration log (`succeeded`, scenario `callback`). Returns its id.
#[allow(clippy::too_many_arguments)]
async fn insert_callback_log(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    resource_type: &'static str,
    resource_id: &str,
    started_at: chrono::DateTime<Utc>,
    correlation_id: Uuid,
    summary: String,
) -> sqlx::Result<i64> {
    insert_terminal_log(
        conn,
        &LogRecord {
            correlation_id,
            resource_type,
            resource_id: resource_id.to_owned(),
            scenario: "callback",
            state: LogState::Succeeded,
            request_summary: format!(
                "callback {}/{} (inbound_callbacks #{row_id})",
                job.channel, job.callback_id
            ),
            response_summary: summary,
            http_status: None,
            error: None,
            recovery_summary: None,
            started_at,
            finished_at: Utc::now(),
        },
    )
    .await
}

/// The records of an applied callback: terminal log, audit event (`event_type`) and link. The
/// outbox event of a change is written by whoever applied it.
#[allow(clippy::too_many_arguments)]
async fn record(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    resource_type: &'static str,
    resource_id: &str,
    started_at: chrono::DateTime<Utc>,
    summary: String,
    event_type: &'static str,
    changed: bool,
) -> anyhow::Result<()> {
    let correlation_id = Uuid::new_v4();
    let log_id = insert_callback_log(
        conn,
        job,
        row_id,
        resource_type,
        resource_id,
        started_at,
        correlation_id,
        summary.clone(),
    )
    .await?;
    insert_audit(
        conn,
        &AuditRecord {
            event_type,
            correlation_id: Some(correlation_id),
            summary,
            details: json!({
                "channel": job.channel,
                "callback_id": job.callback_id,
                "inbound_callback_id": row_id,
                "changed": changed,
            }),
            resource_type,
            resource_id: resource_id.to_owned(),
        },
        Some(log_id),
    )
    .await?;
    Ok(())
}

/// The resource a callback is about, read loosely so that a malformed body that still names its
/// card or payment is found by `investigate`.
fn loose_resource(body: &str) -> Option<(&'static str, String)> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    [
        ("card_ref", "card"),
        ("payment_id", "payment"),
        ("approval_id", "approval"),
    ]
    .into_iter()
    .find_map(|(field, resource)| {
        value
            .get(field)
            .and_then(|v| v.as_str())
            .filter(|id| ident::check(field, id).is_ok())
            .map(|id| (resource, id.to_owned()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_body_keeps_only_the_known_fields() {
        let body = r#"{"type":"card.status","card_ref":"c-1","status":"frozen","pan":"4111111111111111","note":{"x":1}}"#;
        let stored = known_fields(body);
        assert!(
            !stored.contains("4111") && !stored.contains("note"),
            "{stored}"
        );
        assert_eq!(parse(&stored), parse(body));
        assert_eq!(
            known_fields("card 4111 1111 1111 1111"),
            "(not stored: not a JSON object, 24 bytes)"
        );
    }

    #[test]
    fn a_refused_body_names_the_problem_without_quoting_a_card_number() {
        for body in [
            r#"{"type":"card.status","card_ref":4111111111111111,"status":"frozen"}"#,
            r#"{"type":"card.status","card_ref":"c-1","status":"4111 1111 1111 1111"}"#,
            r#"{"type":"payment.result","payment_id":"4111111111111111","status":"accepted","channel_ref":"x"}"#,
        ] {
            let reason = parse(body).expect_err(body);
            assert!(reason.starts_with("malformed body: "), "{reason}");
            assert!(!reason.contains("4111111111111111"), "{reason}");
            assert!(!reason.contains("4111 1111 1111 1111"), "{reason}");
        }
    }

    #[test]
    fn a_valid_card_status_callback_parses() {
        let body = r#"{"type":"card.status","card_ref":"c-1","status":"frozen"}"#;
        assert!(matches!(parse(body), Ok(CallbackBody::CardStatus { .. })));
    }
}
