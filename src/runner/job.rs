//! What a job is to the runner: [`RunJob`], [`Scheduled`] and [`JobError`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cardworker_jobs::Job;
use futures::future::BoxFuture;

use super::spawn;
use crate::config::Config;
use crate::context::AppContext;

/// A job cardworker runs. The payload type comes from `cardworker-jobs`; this adds how to run it.
///
/// A handler acknowledges every job it was given: success, or an error that makes the job dead
/// (kept for [`crate::queue::intake::DEAD_RETENTION`] for inspection). It never relies on
/// apalis's retries; a job that must run again schedules its successor through the intake itself.
pub trait RunJob: Job + Clone {
    /// Worker kind, used in worker names and `cardworker_worker_up{worker}`.
    const KIND: &'static str = Self::QUEUE;

    /// How often this queue's workers heartbeat, and so how often an idle one fetches
    /// (`runner::spawn`): [`spawn::HEARTBEAT`], or [`spawn::QUIET_HEARTBEAT`] for a queue that
    /// sees a job a minute or less, whose idle workers then cost Redis a sixth as much. The orphan
    /// window follows it (at least the job's timeout plus two beats).
    const HEARTBEAT: Duration = spawn::HEARTBEAT;

    /// How many jobs of this kind one process runs at once.
    fn concurrency(_config: &Config) -> usize {
        1
    }

    /// Hard limit on one run, after which the job is recorded as dead.
    fn timeout(_config: &Config) -> Duration {
        Duration::from_secs(300)
    }

    /// Runs the job.
    fn run(self, ctx: Arc<AppContext>) -> impl Future<Output = anyhow::Result<()>> + Send;

    /// Runs after [`RunJob::run`] ended abnormally (an error, a panic or the timeout; `error`
    /// says which), before the job is recorded as dead: the place for a job that must never
    /// simply vanish (a polling chain) to leave its successor. Nothing by default.
    fn after_abnormal_end(
        self,
        _ctx: Arc<AppContext>,
        _error: JobError,
    ) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    /// Wraps the job's future, in the worker's task, before it is spawned on a task of its own
    /// (`runner::service`): a job whose tower layer hands it task-local state (the polling
    /// circuit's report slot) carries that state across the spawn here. Default: as is.
    fn carry<F>(job: F) -> BoxFuture<'static, F::Output>
    where
        F: Future + Send + 'static,
    {
        Box::pin(job)
    }
}

/// A job started by a cron schedule.
pub trait Scheduled: RunJob {
    /// Worker kind of its scheduler.
    const CRON_KIND: &'static str;
    /// The job for one tick (unix seconds).
    fn for_tick(timestamp: i64) -> Self;
}

/// Why a job ended dead (or, for [`JobError::BudgetUnavailable`], was handed back to apalis).
/// Every worker's service and layer ends a job with one of these, so logs and the dead set read
/// the same whatever the job.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JobError {
    /// The payload does not decode into its job type.
    #[error("payload does not decode: {0}")]
    Payload(String),
    /// The job returned an error (its whole context chain).
    #[error("{0}")]
    Failed(String),
    /// The job panicked.
    #[error("panic: {0}")]
    Panicked(String),
    /// The job ran out of time.
    #[error("timed out after {} s", .0.as_secs())]
    TimedOut(Duration),
    /// Redis could not be reached for the polling budget nor for the re-enqueue.
    #[error("polling budget unavailable: {0}")]
    BudgetUnavailable(String),
}
