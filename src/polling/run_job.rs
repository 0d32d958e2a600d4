//! The [`RunJob`](crate::runner::RunJob) side of a poll job, written once for both tasks.
//!
//! Why a macro and not a blanket `impl<J: PollTask> RunJob for J`: maintenance already has the
//! crate's blanket impl (`impl<J: MaintenanceJob> RunJob for J`), and Rust refuses a second
//! blanket impl of the same trait that it cannot prove disjoint. The span name must also be a
//! literal per job (`poll.carddata`, `poll.card_status`), which only a macro can give.

/// Implements `RunJob` for a poll job: its task's limit as the concurrency, the polling handler
/// timeout, the shared flow of [`super::poll`] as its body and after an abnormal end, and the
/// circuit's report slot carried across the job service's spawn.
macro_rules! poll_run_job {
    ($job:ty, $span:literal) => {
        impl $crate::runner::RunJob for $job {
            fn concurrency(config: &$crate::config::Config) -> usize {
                config
                    .polling
                    .task(<$job as $crate::polling::lease::PollJob>::TASK)
                    .limit
                    .into()
            }

            fn timeout(config: &$crate::config::Config) -> std::time::Duration {
                config.polling.handler_timeout()
            }

            #[tracing::instrument(name = $span, skip_all, fields(card_ref = %self.card_ref, lease = self.ticket.lease))]
            async fn run(
                self,
                ctx: std::sync::Arc<$crate::context::AppContext>,
            ) -> anyhow::Result<()> {
                // Boxed: a poll's future is kilobytes, and every wrapper on the way to its task
                // (the job service's guards, the span, the spawn) would move it again.
                Box::pin($crate::polling::poll::run_poll(self, ctx))
                    .await
                    .map(|_| ())
            }

            async fn after_abnormal_end(
                self,
                ctx: std::sync::Arc<$crate::context::AppContext>,
                error: $crate::runner::JobError,
            ) {
                Box::pin($crate::polling::poll::after_abnormal_end(self, ctx, error)).await;
            }

            fn carry<F>(job: F) -> futures::future::BoxFuture<'static, F::Output>
            where
                F: std::future::Future + Send + 'static,
            {
                Box::pin($crate::polling::circuit::carry(job))
            }
        }
    };
}

pub(crate) use poll_run_job;
