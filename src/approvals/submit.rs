//! `SubmitApproval`: one approval row to `POST /v1/approvals` through the reliable path
//! (`crate::reliable::submit`): pending first, `Idempotency-Key = approval_id`, the answer
//! finalised on the same log row and decided once.

use std::sync::Arc;
use std::time::Duration;

use cardworker_jobs::SubmitApproval;

use crate::config::Config;
use crate::context::AppContext;
use crate::reliable::approval::Approval;
pub use crate::reliable::Submitted;
use crate::runner::RunJob;

impl RunJob for SubmitApproval {
    const KIND: &'static str = "approval";

    fn concurrency(config: &Config) -> usize {
        config.approvals.concurrency as usize
    }

    /// The Gateway timeout bounds the call; the rest is two short transactions. Recovery
    /// leaves a `pending` row alone until this limit has passed since its pending commit.
    fn timeout(config: &Config) -> Duration {
        crate::reliable::attempt::attempt_limit(config)
    }

    #[tracing::instrument(name = "job.submit_approval", skip_all, fields(approval_id = %self.approval_id, retries = self.retries))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        crate::reliable::submit::run_job::<Approval>(&ctx, self.approval_id, self.retries).await
    }
}

/// One submission of `job`'s approval.
pub async fn submit(ctx: &AppContext, job: &SubmitApproval) -> anyhow::Result<Submitted> {
    crate::reliable::submit::submit::<Approval>(ctx, job.approval_id, job.retries).await
}
