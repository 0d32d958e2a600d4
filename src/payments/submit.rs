//! `SubmitPayment`: one payment row to `POST /v1/payments`, through the reliable path.
//!
//! The steps (pending first, the call with `Idempotency-Key = payment_id`, the answer finalised
//! on the same log row, decided once) are `crate::reliable::submit`'s, shared with approvals; a
//! payment is described by [`PaymentCall`]: `accepted`/`rejected` final, and a refused
//! request (connection refused, 4xx) retried with the same key while no earlier attempt can have
//! reached the Gateway.

use std::sync::Arc;
use std::time::Duration;

use cardworker_jobs::SubmitPayment;

use crate::config::Config;
use crate::context::AppContext;
pub use crate::reliable::attempt::{backoff, Submitted, MAX_RETRIES};
use crate::reliable::payment::PaymentCall;
use crate::runner::RunJob;

impl RunJob for SubmitPayment {
    const KIND: &'static str = "payment";

    fn concurrency(config: &Config) -> usize {
        config.payments.concurrency as usize
    }

    /// The Gateway timeout bounds the call; the rest is two short transactions. Recovery
    /// leaves a `pending` row alone until this limit has passed since its pending commit.
    fn timeout(config: &Config) -> Duration {
        crate::reliable::attempt::attempt_limit(config)
    }

    #[tracing::instrument(name = "job.submit_payment", skip_all, fields(payment_id = %self.payment_id, retries = self.retries))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        crate::reliable::submit::run_job::<PaymentCall>(&ctx, self.payment_id, self.retries).await
    }
}

/// Steps 1 to 3 of `crate::reliable::submit` for one payment.
pub async fn submit(ctx: &AppContext, job: &SubmitPayment) -> anyhow::Result<Submitted> {
    crate::reliable::submit::submit::<PaymentCall>(ctx, job.payment_id, job.retries).await
}
