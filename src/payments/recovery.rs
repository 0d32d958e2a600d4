//! `RecoverPayments`: settles payments left `pending` (a worker died mid-call) or `unknown` (the
//! Gateway may have acted) by asking the Gateway, and resubmits `requested` payments whose
//! `SubmitPayment` job never came (lost with Redis); then sweeps channel callbacks left
//! `received` the same way (`callback::sweep_received`).
//!
//! The pass itself is `crate::reliable::recover`'s, shared with approvals: work is found in the
//! `payments` table (`payments_unsettled_idx`: status `requested`, `pending` or `unknown`, oldest
//! `updated_at` first, untouched for `payments.recovery_after_secs`), never by scanning
//! `integration_logs` or Redis; a run takes a bounded batch and the cron
//! (`payments.recovery_cron`, always registered) brings the next; a payment is submitted again
//! only when the Gateway never saw it (404), with the same `Idempotency-Key`.

use std::sync::Arc;
use std::time::Duration;

use cardworker_jobs::RecoverPayments;

use crate::config::Config;
use crate::context::AppContext;
use crate::reliable::payment::PaymentCall;
pub use crate::reliable::RecoveryReport;
use crate::reliable::Thresholds;
use crate::runner::RunJob;
use crate::runner::Scheduled;

/// Payments examined per run. Queries run one after another, so a run is bounded by
/// `RECOVERY_BATCH × gateway.timeout_ms`.
pub const RECOVERY_BATCH: i64 = 50;

impl RunJob for RecoverPayments {
    const KIND: &'static str = "payment_recovery";
    // A job a minute at most (its cron): an idle worker beats and fetches every 30 s; this pod's
    // feeder wakes it at once for a job it moved (`runner::spawn`).
    const HEARTBEAT: Duration = crate::runner::spawn::QUIET_HEARTBEAT;

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

/// One recovery pass over at most `batch` payments unsettled for longer than `older_than`.
pub async fn recover(
    ctx: &AppContext,
    older_than: Duration,
    batch: i64,
) -> anyhow::Result<RecoveryReport> {
    let thresholds = Thresholds {
        undecided: older_than,
        waiting: older_than,
    };
    crate::reliable::recover::recover::<PaymentCall>(ctx, thresholds, batch).await
}
