//! The one trait a job implements to be run, and the generic apalis handler around it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::{AbortError, BoxDynError, Data, TaskId};
use cardworker_jobs::Job;
use futures::FutureExt as _;

use crate::app::AppContext;
use crate::config::Config;
use crate::telemetry::metrics as m;

/// A job cardworker runs. The payload type comes from `cardworker-jobs`; this adds how to run it.
///
/// A handler acknowledges every job it was given: success, or an error that makes the job dead
/// (kept for [`super::intake::DEAD_RETENTION`] for inspection). It never relies on apalis's
/// retries; a job that must run again schedules its successor through the intake itself.
pub trait RunJob: Job + Clone {
    /// Worker kind, used in worker names and `cardworker_worker_up{worker}`.
    const KIND: &'static str = Self::QUEUE;

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
}

/// The apalis handler of every queue. apalis hands us the raw payload (its Args are `String`, see
/// `feed.lua`), so decoding is ours: a payload that does not decode is logged, counted and
/// killed (apalis's dead set), and the worker goes on with the next job.
pub async fn handle<J: RunJob>(
    raw: String,
    ctx: Data<Arc<AppContext>>,
    id: TaskId,
) -> Result<(), BoxDynError> {
    let ctx = ctx.0.clone();
    let job: J = match serde_json::from_str(&raw) {
        Ok(job) => job,
        Err(e) => {
            tracing::error!(
                queue = J::QUEUE,
                task_id = %id,
                error = %e,
                payload = %truncate(&raw, 256),
                "job payload does not decode; recorded as dead, not retried"
            );
            finished(J::QUEUE, "dead");
            return Err(AbortError::new(PayloadError(e.to_string())).into());
        }
    };
    let limit = J::timeout(&ctx.config);
    let run = AssertUnwindSafe(job.run(ctx)).catch_unwind();
    match tokio::time::timeout(limit, run).await {
        Ok(Ok(Ok(()))) => {
            finished(J::QUEUE, "succeeded");
            Ok(())
        }
        Ok(Ok(Err(e))) => {
            tracing::error!(queue = J::QUEUE, task_id = %id, error = %format!("{e:#}"), "job failed; recorded as dead");
            finished(J::QUEUE, "dead");
            Err(AbortError::new(JobFailed(format!("{e:#}"))).into())
        }
        Ok(Err(panic)) => {
            let msg = panic_message(&panic);
            tracing::error!(queue = J::QUEUE, task_id = %id, panic = %msg, "job panicked; recorded as dead");
            finished(J::QUEUE, "dead");
            Err(AbortError::new(JobFailed(format!("panic: {msg}"))).into())
        }
        Err(_) => {
            tracing::error!(queue = J::QUEUE, task_id = %id, timeout_secs = limit.as_secs(), "job timed out; recorded as dead");
            finished(J::QUEUE, "dead");
            Err(AbortError::new(JobFailed(format!("timed out after {limit:?}"))).into())
        }
    }
}

fn finished(queue: &'static str, result: &'static str) {
    metrics::counter!(m::JOBS_FINISHED, "queue" => queue, "result" => result).increment(1);
}

/// A payload that does not decode into its job type.
#[derive(Debug, thiserror::Error)]
#[error("payload does not decode: {0}")]
pub struct PayloadError(String);

/// A job that failed for good.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct JobFailed(String);

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The message of a caught panic.
pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned())
}
