//! `RecoverApprovals` (cron `approvals.recovery_cron`, not gated by the maintenance switch): the
//! shared recovery pass (`crate::reliable::recover`) over approvals: `requested`, `pending` and
//! `unknown` rows untouched for `approvals.recovery_after_secs` (`approvals_unsettled_idx`), then
//! `in_review` rows not queried for `approvals.review_query_secs` (`approvals_in_review_idx`),
//! each asked with `GET /v1/approvals/{id}`. A 404 for an undecided row resubmits it with the
//! same key; a 404 is never read as a decision.

use std::sync::Arc;
use std::time::Duration;

use cardworker_jobs::RecoverApprovals;

use crate::config::Config;
use crate::context::AppContext;
use crate::reliable::approval::Approval;
pub use crate::reliable::RecoveryReport;
use crate::reliable::Thresholds;
use crate::runner::{RunJob, Scheduled};

/// Approvals examined per run (queries one after another, each bounded by the Gateway timeout).
pub const RECOVERY_BATCH: i64 = 50;

impl RunJob for RecoverApprovals {
    const KIND: &'static str = "approval_recovery";
    // A job a minute at most (its cron): an idle worker beats and fetches every 30 s; this pod's
    // feeder wakes it at once for a job it moved (`runner::spawn`).
    const HEARTBEAT: Duration = crate::runner::spawn::QUIET_HEARTBEAT;

    fn timeout(config: &Config) -> Duration {
        (config.gateway.timeout() + Duration::from_secs(1)) * RECOVERY_BATCH as u32
            + Duration::from_secs(30)
    }

    #[tracing::instrument(name = "job.recover_approvals", skip_all, fields(scheduled_for = %crate::telemetry::rfc3339_opt(self.scheduled_for)))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        let report = recover(&ctx, thresholds(&ctx.config), RECOVERY_BATCH).await?;
        tracing::info!(?report, "approval recovery run finished");
        Ok(())
    }
}

impl Scheduled for RecoverApprovals {
    const CRON_KIND: &'static str = "approval_recovery_cron";

    fn for_tick(timestamp: i64) -> Self {
        RecoverApprovals {
            scheduled_for: Some(timestamp),
        }
    }
}

/// The configured thresholds.
pub fn thresholds(config: &Config) -> Thresholds {
    Thresholds {
        undecided: config.approvals.recovery_after(),
        waiting: config.approvals.review_query(),
    }
}

/// One recovery pass over at most `batch` approvals due under `thresholds`.
pub async fn recover(
    ctx: &AppContext,
    thresholds: Thresholds,
    batch: i64,
) -> anyhow::Result<RecoveryReport> {
    crate::reliable::recover::recover::<Approval>(ctx, thresholds, batch).await
}
