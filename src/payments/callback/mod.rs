//! `ProcessCallback`: applies one channel callback (spec 1b) exactly once, in PostgreSQL.
//!
//! One transaction per delivery:
//! 1. `INSERT … ON CONFLICT (channel, callback_id) DO UPDATE` on `inbound_callbacks` counts the
//!    delivery and **locks the row**: concurrent deliveries of the same callback queue up here,
//!    and each sees what the one before it committed.
//! 2. Already final (`applied`, or failed as a contradiction): commit the delivery count, apply
//!    nothing.
//! 3. Otherwise apply the change (card status under the optimistic version check, reloading and
//!    deciding again on a conflict; or the payment result), write its terminal integration log
//!    (`succeeded`, scenario `callback`), audit event and link, and the outbox event, and mark the
//!    row `applied` — all in the same commit.
//!
//! A callback that cannot be applied (unknown card or payment, malformed body, a result that
//! contradicts a settled payment) is committed as `failed` with the reason, and the job is
//! acknowledged: nothing is silently dropped, and a later delivery of the same (channel, id)
//! is processed again, except after a contradiction of a final decision ([`CONTRADICTION`]),
//! which is final too: a later delivery is only counted, like one of an applied callback.
//! A database error retries the delivery through the intake with back-off.
//!
//! Redis loss costs nothing: `cardworker enqueue callback` commits the delivery first
//! ([`record_received`]: the row `received`, with its body) and only then enqueues the job (with
//! `recorded`, so the job does not count the delivery twice). Should the job be lost with Redis,
//! [`sweep_received`] (run with payment recovery) re-enqueues every `received` row untouched for
//! `payments.recovery_after_secs`; applying stays idempotent on (channel, callback id).
//!
//! Recording, processing and sweeping a callback share the `inbound_callbacks` row's states, and
//! their rules are easiest to check side by side, so they stay in this file.
//!
//! # Layout
//! - this file: the job, one delivery's transaction ([`process`]), recording a delivery before it
//!   is queued ([`record_received`]) and the sweep of `received` rows ([`sweep_received`]).
//! - [`body`]: the body (spec 1b): parsing, the stored and queued form, the keys the contract
//!   accepts.
//! - `apply`: applying a parsed callback (card status, payment or approval decision) with its
//!   records.

mod apply;
pub mod body;

pub use apply::CONTRADICTION;
pub use body::{check_key, known_fields, parse, CallbackBody};

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::ProcessCallback;
use chrono::{DateTime, Utc};
use serde_json::json;

use super::submit::backoff;
use crate::context::AppContext;
use crate::reliable::approval::Approval;
use crate::reliable::payment::PaymentCall;
use crate::reliable::{Arrival, Kind};
use crate::runner::RunJob;
use crate::storage::fault::clean;
use crate::storage::ident::{self, IdentError};
use crate::storage::records::{insert_audit, AuditRecord};

/// Redeliveries through the intake after database errors before the job gives up (dead, logged).
pub const MAX_RETRIES: u32 = 8;

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
    let (row_id, state, reason, inserted) = count_delivery(&mut tx, job).await?;
    if !inserted && (state == "applied" || reason.starts_with(CONTRADICTION)) {
        tx.commit()
            .await
            .context("counting the duplicate delivery")?;
        return Ok(Delivery::Duplicate);
    }

    let parsed = parse(&job.body);
    let outcome = match &parsed {
        Err(reason) => Err(reason.clone()),
        Ok(body) => apply::apply(&mut tx, job, row_id, body).await?,
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
            record_failed(&mut tx, job, row_id, &reason).await?;
            Delivery::Failed(reason)
        }
    };
    tx.commit().await.context("committing the callback")?;
    if let (Delivery::Applied { changed: true }, Ok(body)) = (&delivery, &parsed) {
        count_decision(body);
    }
    Ok(delivery)
}

/// Counts the delivery on its `inbound_callbacks` row (inserted when new) and locks the row for
/// the delivery's transaction. Returns its id, state, reason and whether it is new.
async fn count_delivery(
    conn: &mut sqlx::PgConnection,
    job: &ProcessCallback,
) -> anyhow::Result<(i64, String, String, bool)> {
    // A fresh row is inserted as `failed`/"processing" and always rewritten below before the
    // commit, so no other transaction ever sees that placeholder.
    // A delivery committed by whoever enqueued it (`recorded`) is not counted again.
    // A contradiction (`$5`) found `received` is final: it is `failed` again, so the sweep leaves
    // it alone. Only a release whose `record_received` reset contradictions leaves such a row;
    // this CASE can go once `SELECT count(*) FROM inbound_callbacks WHERE state = 'received' AND
    // reason LIKE 'contradicts%'` is 0 in every deployment.
    let row: (i64, String, String, bool) = sqlx::query_as(
        "INSERT INTO inbound_callbacks (channel, callback_id, body, state, reason)
         VALUES ($1, $2, $3, 'failed', 'processing')
         ON CONFLICT (channel, callback_id) DO UPDATE
            SET deliveries = inbound_callbacks.deliveries + $4,
                last_received_at = CASE WHEN $4 = 0 THEN inbound_callbacks.last_received_at
                                        ELSE now() END,
                state = CASE WHEN inbound_callbacks.state = 'received'
                               AND starts_with(coalesce(inbound_callbacks.reason, ''), $5)
                             THEN 'failed'
                             ELSE inbound_callbacks.state END
         RETURNING id, state, coalesce(reason, ''), (xmax = 0)",
    )
    .bind(&job.channel)
    .bind(&job.callback_id)
    .bind(known_fields(&job.body))
    .bind(i32::from(!job.recorded))
    .bind(CONTRADICTION)
    .fetch_one(conn)
    .await
    .context("recording the callback delivery")?;
    Ok(row)
}

/// A callback that cannot be applied: the row `failed` with the reason, and one
/// `callback.failed` audit event.
async fn record_failed(
    conn: &mut sqlx::PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    reason: &str,
) -> anyhow::Result<()> {
    let resource = body::loose_resource(&job.body);
    sqlx::query(
        "UPDATE inbound_callbacks
            SET state = 'failed', reason = $2, body = $3, resource_type = $4,
                resource_id = $5
          WHERE id = $1",
    )
    .bind(row_id)
    .bind(clean(reason))
    .bind(known_fields(&job.body))
    .bind(resource.as_ref().map(|r| r.0))
    .bind(resource.as_ref().map(|r| r.1.as_str()))
    .execute(&mut *conn)
    .await?;
    insert_audit(
        conn,
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
    Ok(())
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
    /// Committed as `received` (new, or a redelivery of one not final yet): enqueue it.
    Recorded,
    /// Already applied: the delivery is counted, nothing is enqueued.
    AlreadyApplied,
    /// Already failed as a contradiction of a final decision ([`CONTRADICTION`]), which is final
    /// too: the delivery is counted, the row kept as it is, nothing is enqueued.
    AlreadyContradicted,
}

/// The first half of `enqueue callback`: commits the delivery as `received` with its body, before
/// anything is in Redis. A redelivery of a callback that is not final yet is `received` again
/// (with the new body); a final one (applied, or failed as a contradiction) only counts the
/// delivery, so the sweep of `received` rows never sees it again.
pub async fn record_received(
    pool: &sqlx::PgPool,
    channel: &str,
    callback_id: &str,
    body: &str,
) -> sqlx::Result<Received> {
    // `$4`: the reason's prefix that makes a failed callback final (`CONTRADICTION`).
    let (state, is_final): (String, bool) = sqlx::query_as(
        "INSERT INTO inbound_callbacks (channel, callback_id, body, state, queued_at)
         VALUES ($1, $2, $3, 'received', now())
         ON CONFLICT (channel, callback_id) DO UPDATE
            SET deliveries = inbound_callbacks.deliveries + 1,
                last_received_at = now(),
                body = CASE WHEN inbound_callbacks.state = 'applied'
                              OR starts_with(coalesce(inbound_callbacks.reason, ''), $4)
                            THEN inbound_callbacks.body
                            ELSE EXCLUDED.body END,
                state = CASE WHEN inbound_callbacks.state = 'applied' THEN 'applied'
                             WHEN starts_with(coalesce(inbound_callbacks.reason, ''), $4)
                             THEN 'failed'
                             ELSE 'received' END,
                queued_at = now()
         RETURNING state,
                   state = 'applied' OR starts_with(coalesce(reason, ''), $4)",
    )
    .bind(channel)
    .bind(callback_id)
    .bind(known_fields(body))
    .bind(CONTRADICTION)
    .fetch_one(pool)
    .await?;
    Ok(match (state.as_str(), is_final) {
        ("applied", _) => Received::AlreadyApplied,
        (_, true) => Received::AlreadyContradicted,
        (_, false) => Received::Recorded,
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
