//! [`JobService`]: the tower service every worker runs, and [`guarded`], the one panic and
//! timeout policy.
//!
//! apalis hands the service the raw payload (its Args are `String`, see `queue/feed.lua`), so
//! decoding is ours: a payload that does not decode is logged, counted and killed (apalis's dead
//! set), and the worker goes on with the next job. apalis's own `catch-panic` and `timeout` layers
//! are not used: one policy, here, means one limit per job and no race between two timers.

use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis::prelude::{AbortError, BoxDynError, Task};
use futures::future::BoxFuture;
use futures::FutureExt as _;
use tower::Service;

use super::{JobError, RunJob};
use crate::context::AppContext;
use crate::telemetry::metrics as m;

/// The service of job `J`'s worker.
pub struct JobService<J> {
    ctx: Arc<AppContext>,
    /// Jobs of this worker running now, when counted ([`Self::counting_in`]).
    in_flight: Option<Arc<AtomicUsize>>,
    job: PhantomData<fn() -> J>,
}

impl<J> JobService<J> {
    /// The service running `J` jobs in `ctx`.
    pub fn new(ctx: Arc<AppContext>) -> Self {
        Self {
            ctx,
            in_flight: None,
            job: PhantomData,
        }
    }

    /// Counts the jobs running now in `in_flight` (the worker's heartbeat keeper reads it).
    pub fn counting_in(mut self, in_flight: Arc<AtomicUsize>) -> Self {
        self.in_flight = Some(in_flight);
        self
    }
}

impl<J> Clone for JobService<J> {
    fn clone(&self) -> Self {
        Self {
            ctx: self.ctx.clone(),
            in_flight: self.in_flight.clone(),
            job: PhantomData,
        }
    }
}

/// One job counted in a worker's in-flight count for as long as it lives.
struct InFlight(Option<Arc<AtomicUsize>>);

impl InFlight {
    fn start(count: Option<Arc<AtomicUsize>>) -> Self {
        if let Some(c) = &count {
            c.fetch_add(1, Ordering::AcqRel);
        }
        Self(count)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            c.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl<J: RunJob + Send + 'static> Service<Task<String>> for JobService<J> {
    type Response = ();
    type Error = BoxDynError;
    type Future = BoxFuture<'static, Result<(), BoxDynError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, task: Task<String>) -> Self::Future {
        let id = task
            .ctx()
            .task_id()
            .map(ToString::to_string)
            .unwrap_or_default();
        let (raw, _) = task.take();
        let counted = InFlight::start(self.in_flight.clone());
        // The job runs in a task of its own: if the worker's stream ends under it (a Redis
        // outage), the job still finishes and schedules what comes next; only its
        // acknowledgement is lost, and apalis's orphan recovery (or the job's own successor)
        // covers that.
        let run = self
            .ctx
            .shutdown
            .spawn_job(J::carry(handle::<J>(raw, self.ctx.clone(), id)));
        async move {
            let _counted = counted;
            match run.await {
                Ok(Some(result)) => result,
                Ok(None) => Err(AbortError::new(JobError::Failed(
                    "the process stopped first".into(),
                ))
                .into()),
                Err(e) => Err(AbortError::new(JobError::Panicked(e.to_string())).into()),
            }
        }
        .boxed()
    }
}

/// Decodes and runs one job; every failure becomes an [`AbortError`] (dead, never retried by
/// apalis).
///
/// Its span is at debug: every job's `run` has a span of its own that names what the job is
/// about (the card, the payment); a second span per job at info is formatted, stored and closed
/// for every poll, a share of the worker's CPU per poll that `perf` shows (docs/BENCHMARKS.md);
/// and the events here name the queue and the task id themselves.
#[tracing::instrument(level = "debug", skip_all, fields(queue = J::QUEUE, task_id = %id))]
async fn handle<J: RunJob>(
    raw: String,
    ctx: Arc<AppContext>,
    id: String,
) -> Result<(), BoxDynError> {
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
            return Err(AbortError::new(JobError::Payload(e.to_string())).into());
        }
    };
    let limit = J::timeout(&ctx.config);
    let copy = job.clone();
    match guarded(limit, job.run(ctx.clone())).await {
        Ok(()) => {
            finished(J::QUEUE, "succeeded");
            Ok(())
        }
        Err(e) => {
            tracing::error!(queue = J::QUEUE, task_id = %id, error = %e, "job ended abnormally; recorded as dead");
            finished(J::QUEUE, "dead");
            // The job's own follow-up (a polling chain's successor, say), bounded by the same
            // limit so that a stuck follow-up cannot hold the worker slot.
            let follow_up = copy.after_abnormal_end(ctx, e.clone());
            if tokio::time::timeout(limit, follow_up).await.is_err() {
                tracing::error!(queue = J::QUEUE, task_id = %id, "the follow-up of an abnormal end timed out too");
            }
            Err(AbortError::new(e).into())
        }
    }
}

/// The one panic and timeout policy: runs `job` for at most `limit`, catching a panic. A job
/// that panics or runs out of time is dropped at once, so whatever it holds (a polling lease, a
/// database connection) is released by its guards.
pub async fn guarded<F>(limit: Duration, job: F) -> Result<(), JobError>
where
    F: Future<Output = anyhow::Result<()>>,
{
    match tokio::time::timeout(limit, AssertUnwindSafe(job).catch_unwind()).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(e))) => Err(JobError::Failed(format!("{e:#}"))),
        Ok(Err(panic)) => Err(JobError::Panicked(panic_message(&panic))),
        Err(_) => Err(JobError::TimedOut(limit)),
    }
}

fn finished(queue: &'static str, result: &'static str) {
    metrics::counter!(m::JOBS_FINISHED, "queue" => queue, "result" => result).increment(1);
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The message of a caught panic.
fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failing_job_keeps_its_whole_error_chain() {
        let e = guarded(Duration::from_secs(1), async {
            Err(anyhow::anyhow!("inner").context("outer"))
        })
        .await;
        assert!(
            matches!(e, Err(JobError::Failed(ref m)) if m == "outer: inner"),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn a_panicking_job_is_caught_with_its_message() {
        let e = guarded(Duration::from_secs(1), async {
            if std::hint::black_box(true) {
                panic!("boom");
            }
            Ok(())
        })
        .await;
        assert!(
            matches!(e, Err(JobError::Panicked(ref m)) if m == "boom"),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn a_job_over_its_limit_is_cut_off() {
        let limit = Duration::from_millis(20);
        let e = guarded(limit, async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        })
        .await;
        assert!(
            matches!(e, Err(JobError::TimedOut(d)) if d == limit),
            "{e:?}"
        );
    }

    #[test]
    fn truncation_respects_character_boundaries() {
        assert_eq!(truncate("äöü", 2), "äö");
        assert_eq!(truncate("ab", 5), "ab");
    }
}
