//! `RecoverPayments`: settles payments left `pending` (a worker died mid-call) or `unknown` (the
//! Gateway may have acted) by asking the Gateway, and resubmits `requested` payments whose
//! `SubmitPayment` job never came (lost with Redis); then sweeps channel callbacks left
//! `received` the same way (`callback::sweep_received`).
//!
//! Work is found in the `payments` table itself (`payments_unsettled_idx`: status `requested`,
//! `pending` or `unknown`, oldest `updated_at` first, untouched for `payments.recovery_after_secs`),
//! never by scanning `integration_logs` or Redis; a run takes a bounded batch and the cron
//! (`payments.recovery_cron`, always registered) brings the next. A `requested` payment is asked
//! about too before it is resubmitted: whatever its history, the Gateway's record decides, so a
//! payment is submitted again only when the Gateway never saw it.
//!
//! The query `GET /v1/payments/{id}` is a read: repeating it is harmless and it moves no money,
//! so it is recorded on the **terminal** path (one finished log row, written with its
//! consequence), not with a pending row of its own. A crash mid-query loses nothing: the payment
//! is still unsettled and the next run asks again. For each payment, one transaction writes:
//! - an answer: the query log (`succeeded`), the payment settled from the Gateway's record, the
//!   dead attempt's `pending` log closed (`succeeded`, "settled by recovery"), audit, outbox;
//! - 404 (the Gateway never saw it): the query log, the dead attempt's log closed (`failed`), the
//!   payment back to `requested` (nothing is open any more), and a resubmission through
//!   `SubmitPayment` — the reliable path again, pending first, and with the same
//!   `Idempotency-Key = payment_id` (there is no other key). A payment never submitted gets the
//!   job's whole retry budget; one submitted before gets one attempt per recovery period, so a
//!   payment the Gateway keeps refusing is not hammered;
//! - a failed or unknown query: the query log (`failed`/`unknown`) saying it is left for the
//!   next run; the payment is moved to the back of the line.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::{RecoverPayments, SubmitPayment};
use chrono::Utc;
use serde_json::json;
use uuid::Uuid;

use super::store;
use crate::config::Config;
use crate::context::AppContext;
use crate::gateway::{CallResult, Outcome, PaymentQuery};
use crate::runner::RunJob;
use crate::runner::Scheduled;
use crate::storage::fault::DbFault;
use crate::storage::records::{
    insert_audit, insert_terminal_log, AuditRecord, LogRecord, LogState,
};
use crate::storage::reliable::FinalState;

/// Payments examined per run. Queries run one after another, so a run is bounded by
/// `RECOVERY_BATCH × gateway.timeout_ms`.
pub const RECOVERY_BATCH: i64 = 50;

impl RunJob for RecoverPayments {
    const KIND: &'static str = "payment_recovery";

    fn timeout(config: &Config) -> Duration {
        (config.gateway.timeout() + Duration::from_secs(1)) * RECOVERY_BATCH as u32
            + Duration::from_secs(30)
    }

    #[tracing::instrument(name = "job.recover_payments", skip_all, fields(scheduled_for = %crate::telemetry::rfc3339_opt(self.scheduled_for)))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        let after = ctx.config.payments.recovery_after();
        // Both halves run whatever the other did.
        let report = recover(&ctx, after, RECOVERY_BATCH).await;
        let swept =
            super::callback::sweep_received(&ctx, after, super::callback::SWEEP_BATCH).await;
        let report = report?;
        tracing::info!(?report, "payment recovery run finished");
        let requeued = swept?;
        if requeued > 0 {
            tracing::warn!(
                requeued,
                "received callbacks whose job never came re-enqueued"
            );
        }
        Ok(())
    }
}

impl Scheduled for RecoverPayments {
    const CRON_KIND: &'static str = "payment_recovery_cron";

    fn for_tick(timestamp: i64) -> Self {
        RecoverPayments {
            scheduled_for: Some(timestamp),
        }
    }
}

/// What one recovery run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Unsettled payments examined.
    pub examined: usize,
    /// Settled from the Gateway's record.
    pub settled: usize,
    /// Unknown to the Gateway: resubmitted with the same key.
    pub resubmitted: usize,
    /// The Gateway could not answer: left for the next run.
    pub left: usize,
    /// Changed meanwhile by another path: nothing done.
    pub skipped: usize,
}

/// One recovery pass over at most `batch` payments unsettled for longer than `older_than`.
pub async fn recover(
    ctx: &AppContext,
    older_than: Duration,
    batch: i64,
) -> anyhow::Result<RecoveryReport> {
    let secs = older_than.as_secs_f64();
    // The predicate repeats the partial index's, so the scan is an index range scan.
    let due: Vec<Uuid> = sqlx::query_scalar(
        "SELECT payment_id FROM payments
          WHERE status IN ('requested', 'pending', 'unknown')
            AND updated_at < now() - make_interval(secs => $1)
          ORDER BY updated_at
          LIMIT $2",
    )
    .bind(secs)
    .bind(batch)
    .fetch_all(&ctx.pool)
    .await
    .context("finding unsettled payments")?;

    let mut report = RecoveryReport::default();
    for payment_id in due {
        report.examined += 1;
        let correlation_id = Uuid::new_v4();
        let result = ctx.gateway.query_payment(payment_id, correlation_id).await;
        let step = match settle_one(ctx, payment_id, correlation_id, secs, &result).await {
            Ok(step) => step,
            // A record PostgreSQL refuses would fail the same way every run: the others of the
            // batch go on (the next run asks about this one again).
            Err(e) if crate::storage::fault::classify_chain(&e) == DbFault::Deterministic => {
                tracing::error!(%payment_id, error = %format!("{e:#}"), "recovery of this payment could not be recorded; the others go on");
                report.left += 1;
                continue;
            }
            Err(e) => {
                return Err(e.context(format!("recording the recovery of payment {payment_id}")))
            }
        };
        match step {
            Step::Settled => report.settled += 1,
            Step::Resubmit { submitted_before } => {
                // After the commit: if this enqueue is lost, the payment is still unsettled and
                // the next run asks again.
                let job = SubmitPayment {
                    payment_id,
                    retries: if submitted_before {
                        super::submit::MAX_RETRIES
                    } else {
                        0
                    },
                };
                ctx.producer
                    .enqueue(&job)
                    .await
                    .with_context(|| format!("resubmitting payment {payment_id}"))?;
                report.resubmitted += 1;
            }
            Step::Left => report.left += 1,
            Step::Skipped => report.skipped += 1,
        }
    }
    Ok(report)
}

enum Step {
    Settled,
    Resubmit { submitted_before: bool },
    Left,
    Skipped,
}

async fn settle_one(
    ctx: &AppContext,
    payment_id: Uuid,
    correlation_id: Uuid,
    older_than_secs: f64,
    result: &CallResult<PaymentQuery>,
) -> anyhow::Result<Step> {
    let mut tx = ctx.pool.begin().await?;
    let Some(payment) = store::lock(&mut tx, payment_id).await? else {
        return Ok(Step::Skipped);
    };
    // Re-check under the lock: a new attempt or a callback may have moved it since the scan.
    let still_due = !payment.is_settled()
        && (Utc::now() - payment.updated_at).num_milliseconds() as f64 >= older_than_secs * 1000.0;

    let (state, recovery_summary, step) = if !still_due {
        (
            log_state(&result.outcome),
            format!(
                "payment changed meanwhile (now {}); recovery did nothing",
                payment.status
            ),
            Step::Skipped,
        )
    } else {
        match &result.outcome {
            Outcome::Valid(PaymentQuery::Found(r)) => (
                LogState::Succeeded,
                format!("the Gateway's record says {}: payment settled by recovery", r.status),
                Step::Settled,
            ),
            Outcome::Valid(PaymentQuery::NotFound) => (
                LogState::Succeeded,
                format!(
                    "the Gateway never saw this payment (404): resubmitted through the reliable \
                     path with Idempotency-Key = {payment_id}"
                ),
                Step::Resubmit {
                    submitted_before: payment.submissions > 0,
                },
            ),
            Outcome::Failed(_) | Outcome::Unknown(_) => (
                log_state(&result.outcome),
                format!(
                    "the Gateway could not answer: payment left {}; the next recovery run asks again",
                    payment.status
                ),
                Step::Left,
            ),
        }
    };

    let started_at = Utc::now()
        - chrono::Duration::from_std(result.elapsed).unwrap_or_else(|_| chrono::Duration::zero());
    let query_log = insert_terminal_log(
        &mut tx,
        &LogRecord {
            correlation_id,
            resource_type: "payment",
            resource_id: payment_id.to_string(),
            scenario: "payment_recovery_query",
            state,
            request_summary: result.request_summary.clone(),
            response_summary: result.response_summary.clone(),
            http_status: result.http_status,
            error: result.outcome.failure().map(|f| f.reason.clone()),
            recovery_summary: Some(recovery_summary.clone()),
            started_at,
            finished_at: Utc::now(),
        },
    )
    .await?;

    let mut outbox = None;
    let mut closed = None;
    match (&step, &result.outcome) {
        (Step::Settled, Outcome::Valid(PaymentQuery::Found(r))) => {
            if store::settle(&mut tx, payment_id, r.status, &r.channel_ref).await? {
                outbox = Some(store::settled_event(
                    &payment,
                    r.status,
                    &r.channel_ref,
                    "recovery",
                ));
            }
            closed = store::close_open_attempt(
                &mut tx,
                &payment,
                FinalState::Succeeded,
                format!(
                    "(from recovery query log #{query_log}) {}",
                    result.response_summary
                ),
                format!(
                    "the worker stopped before the answer; settled by recovery: {}",
                    r.status
                ),
            )
            .await?;
        }
        (Step::Resubmit { .. }, _) => {
            closed = store::close_open_attempt(
                &mut tx,
                &payment,
                FinalState::Failed,
                format!("(from recovery query log #{query_log}) the Gateway never saw it (404)"),
                "resubmitted by recovery with the same Idempotency-Key".to_owned(),
            )
            .await?;
            store::reopen_for_resubmission(&mut tx, payment_id).await?;
        }
        (Step::Left, _) => store::touch(&mut tx, payment_id).await?,
        _ => {}
    }

    let event_type = match step {
        Step::Settled => "payment.recovered",
        Step::Resubmit { .. } => "payment.resubmitted",
        Step::Left => "payment.recovery_query_failed",
        Step::Skipped => "payment.recovery_skipped",
    };
    insert_audit(
        &mut tx,
        &AuditRecord {
            event_type,
            correlation_id: Some(correlation_id),
            summary: format!("payment {payment_id} recovery: {recovery_summary}"),
            details: json!({
                "payment_id": payment_id,
                "status_before": payment.status,
                "query_outcome": result.outcome.kind(),
                "closed_attempt_log": closed,
            }),
            resource_type: "payment",
            resource_id: payment_id.to_string(),
        },
        Some(query_log),
    )
    .await?;
    if let Some(event) = outbox {
        event.insert(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(step)
}

fn log_state<T>(outcome: &Outcome<T>) -> LogState {
    match outcome {
        Outcome::Valid(_) => LogState::Succeeded,
        Outcome::Failed(_) => LogState::Failed,
        Outcome::Unknown(_) => LogState::Unknown,
    }
}
