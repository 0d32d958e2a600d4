//! [`PollingBudgetLayer`]: the tower layer around both polling workers.
//!
//! Where it sits (apalis 1.0 service stack, outer to inner): apalis's `TaskPersistLayer` (acks
//! the job with whatever status the task context holds once our future finishes) -> the
//! worker's concurrency limit -> **this layer** -> apalis's `LifecycleLayer` (counts the attempt,
//! maps the handler's result to a status) -> the generic handler (`queue::worker::handle`).
//!
//! For every job it takes both tokens before the inner service and releases them after it on
//! every path: success, error, panic (caught here) and timeout (`polling.handler_timeout_secs`,
//! applied here, kept below the lease by config validation). The inner service is reachable only
//! with both tokens held. If a token is short it waits briefly (up to [`WAIT_FOR_TOKEN`], woken at
//! once when this process releases a token) and then defers:
//!
//! 1. the same payload, with `deferrals + 1`, goes back through the chain-aware intake writer
//!    ([`crate::polling::chain::schedule`]): the bounded intake the chains use, so a deferral
//!    storm never piles up due jobs in apalis, and a deferral never resurrects a replaced chain;
//! 2. the current job is acknowledged: the inner service is skipped, so apalis's lifecycle never
//!    runs and never counts an attempt; we store `Status::Done` ourselves (left alone, the status
//!    would stay `Pending` as fetched and apalis-redis would reschedule the job at once, a hot
//!    duplicate of the deferred one);
//! 3. `cardworker_poll_deferred_total{task, reason}` is counted.
//!
//! Redis unreachable at acquire: fail closed (no Gateway call), count `budget_unavailable`, and
//! make sure the job comes back: see [`PollingBudgetService`]'s `unavailable`.

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use apalis::prelude::{AbortError, BoxDynError, Status, Task};
use futures::future::BoxFuture;
use futures::FutureExt as _;
use rand::Rng as _;
use tower::{Layer, Service};

use super::{Acquired, Budget, ShortReason};
use crate::config::PollingConfig;
use crate::polling::chain::{self, Liveness, PollJob};
use crate::telemetry::metrics as m;

/// How long a job may wait for a token before it is deferred.
pub const WAIT_FOR_TOKEN: Duration = Duration::from_millis(250);
/// First pause between two acquire attempts while waiting; doubles up to [`MAX_RETRY_STEP`].
const FIRST_RETRY_STEP: Duration = Duration::from_millis(10);
const MAX_RETRY_STEP: Duration = Duration::from_millis(80);
/// An acquire (or a deferral write) slower than this counts as Redis unavailable: the job must not
/// sit on a worker slot for the connection's full response timeout.
pub const REDIS_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The timing the layer needs from `[polling]`.
#[derive(Debug, Clone, Copy)]
struct Timing {
    handler_timeout: Duration,
    defer_delay: Duration,
    defer_max_delay: Duration,
}

/// Wraps one polling worker (job type `J`): both tokens or no handler.
pub struct PollingBudgetLayer<J> {
    budget: Budget,
    timing: Timing,
    job: PhantomData<fn() -> J>,
}

impl<J> Clone for PollingBudgetLayer<J> {
    fn clone(&self) -> Self {
        Self {
            budget: self.budget.clone(),
            timing: self.timing,
            job: PhantomData,
        }
    }
}

impl<J: PollJob> PollingBudgetLayer<J> {
    /// The layer of `J`'s worker on `budget`, with the timeouts and delays of `polling`.
    pub fn new(budget: Budget, polling: &PollingConfig) -> Self {
        Self {
            budget,
            timing: Timing {
                handler_timeout: polling.handler_timeout(),
                defer_delay: polling.defer_delay(),
                defer_max_delay: polling.defer_max_delay(),
            },
            job: PhantomData,
        }
    }
}

impl<S, J> Layer<S> for PollingBudgetLayer<J> {
    type Service = PollingBudgetService<S, J>;

    fn layer(&self, inner: S) -> Self::Service {
        PollingBudgetService {
            inner,
            budget: self.budget.clone(),
            timing: self.timing,
            job: PhantomData,
        }
    }
}

/// The service of [`PollingBudgetLayer`].
pub struct PollingBudgetService<S, J> {
    inner: S,
    budget: Budget,
    timing: Timing,
    job: PhantomData<fn() -> J>,
}

impl<S: Clone, J> Clone for PollingBudgetService<S, J> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            budget: self.budget.clone(),
            timing: self.timing,
            job: PhantomData,
        }
    }
}

impl<S, J> Service<Task<String>> for PollingBudgetService<S, J>
where
    S: Service<Task<String>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError>,
    S::Response: Default + Send + 'static,
    J: PollJob + Send + 'static,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = BoxFuture<'static, Result<S::Response, BoxDynError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<String>) -> Self::Future {
        // Keep the service that was polled ready for this call; leave a fresh clone behind.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let budget = self.budget.clone();
        let timing = self.timing;
        run::<S, J>(inner, budget, timing, task).boxed()
    }
}

#[tracing::instrument(skip_all, fields(task = J::TASK.label()))]
async fn run<S, J>(
    mut inner: S,
    budget: Budget,
    timing: Timing,
    task: Task<String>,
) -> Result<S::Response, BoxDynError>
where
    S: Service<Task<String>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError>,
    S::Response: Default + Send + 'static,
    J: PollJob,
{
    let lease = budget.new_lease_id();
    match acquire_with_wait(&budget, J::TASK, &lease).await {
        Ok(Acquired::Acquired) => run_holding(&mut inner, &budget, lease, timing, task).await,
        Ok(Acquired::Short { reason }) => {
            deferred(J::TASK.label(), reason.label());
            defer::<J, S::Response>(&budget, timing, task, reason).await
        }
        Err(e) => {
            deferred(J::TASK.label(), "budget_unavailable");
            unavailable::<J, S::Response>(&budget, timing, task, &e).await
        }
    }
}

fn deferred(task: &'static str, reason: &'static str) {
    metrics::counter!(m::POLL_DEFERRED, "task" => task, "reason" => reason).increment(1);
}

/// One acquire, bounded by [`REDIS_CALL_TIMEOUT`]. After a timeout the script may still have
/// granted the lease: it is released in the background (release is idempotent).
async fn acquire_once(
    budget: &Budget,
    task: crate::config::Task,
    lease: &str,
) -> anyhow::Result<Acquired> {
    match tokio::time::timeout(REDIS_CALL_TIMEOUT, budget.acquire(task, lease)).await {
        Ok(result) => result,
        Err(_) => {
            let b = budget.clone();
            let id = vec![lease.to_owned()];
            tokio::spawn(async move {
                let _ = b.release(&id).await;
            });
            anyhow::bail!("acquiring {task} polling tokens timed out after {REDIS_CALL_TIMEOUT:?}")
        }
    }
}

/// Acquires, waiting up to [`WAIT_FOR_TOKEN`] while a budget (not a pause) is short.
async fn acquire_with_wait(
    budget: &Budget,
    task: crate::config::Task,
    lease: &str,
) -> anyhow::Result<Acquired> {
    let deadline = Instant::now() + WAIT_FOR_TOKEN;
    let mut step = FIRST_RETRY_STEP;
    loop {
        // Registered before the attempt, so a release between the attempt and the wait is seen.
        let released = budget.released();
        tokio::pin!(released);
        released.as_mut().enable();
        let answer = acquire_once(budget, task, lease).await?;
        let now = Instant::now();
        match answer {
            Acquired::Short {
                reason: ShortReason::Total | ShortReason::Task,
            } if now < deadline => {
                let pause = step.min(deadline - now);
                tokio::select! {
                    () = released => {}
                    () = tokio::time::sleep(pause) => {}
                }
                step = (step * 2).min(MAX_RETRY_STEP);
            }
            other => return Ok(other),
        }
    }
}

/// Releases its lease when dropped without [`LeaseGuard::release`] (the job's future was
/// cancelled, for example when shutdown's grace period ran out); shutdown also releases every
/// lease still held.
struct LeaseGuard {
    budget: Budget,
    lease: Option<String>,
}

impl LeaseGuard {
    async fn release(mut self) {
        if let Some(lease) = self.lease.take() {
            let ids = [lease];
            match tokio::time::timeout(REDIS_CALL_TIMEOUT, self.budget.release(&ids)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(lease = %ids[0], error = %format!("{e:#}"), "cannot release polling tokens; they expire with their lease")
                }
                Err(_) => {
                    tracing::warn!(lease = %ids[0], "releasing polling tokens timed out; they expire with their lease")
                }
            }
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let budget = self.budget.clone();
                rt.spawn(async move {
                    let _ = budget.release(&[lease]).await;
                });
            }
        }
    }
}

/// Runs the inner service while both tokens are held, then releases them, whatever happened.
async fn run_holding<S>(
    inner: &mut S,
    budget: &Budget,
    lease: String,
    timing: Timing,
    task: Task<String>,
) -> Result<S::Response, BoxDynError>
where
    S: Service<Task<String>>,
    S::Error: Into<BoxDynError>,
{
    let guard = LeaseGuard {
        budget: budget.clone(),
        lease: Some(lease),
    };
    let ctx = task.ctx().clone();
    // Ok: the inner service's own result (its status set by apalis's lifecycle). Err: it panicked
    // or ran out of time, and its lifecycle future is gone, so the status is ours to set.
    let outcome: Result<Result<S::Response, BoxDynError>, String> =
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(task))) {
            Ok(fut) => {
                let fut = AssertUnwindSafe(fut).catch_unwind();
                match tokio::time::timeout(timing.handler_timeout, fut).await {
                    Ok(Ok(result)) => Ok(result.map_err(Into::into)),
                    Ok(Err(panic)) => Err(format!(
                        "panic: {}",
                        crate::queue::worker::panic_message(&panic)
                    )),
                    Err(_) => Err(format!(
                        "timed out after polling.handler_timeout_secs = {}",
                        timing.handler_timeout.as_secs()
                    )),
                }
            }
            Err(panic) => Err(format!(
                "panic: {}",
                crate::queue::worker::panic_message(&panic)
            )),
        };
    guard.release().await;
    match outcome {
        Ok(result) => result,
        Err(msg) => {
            let id = ctx.task_id().map(ToString::to_string).unwrap_or_default();
            tracing::error!(task_id = %id, error = %msg, "polling job ended abnormally; recorded as dead, tokens released");
            ctx.raw_status().store(Status::Killed);
            Err(AbortError::new(PollAborted(msg)).into())
        }
    }
}

/// A polling job that panicked or timed out under the layer.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PollAborted(String);

/// The delay of the `deferrals`-th consecutive deferral: random between `defer_delay` and a cap
/// that doubles with each deferral, up to `defer_max_delay`; never under 1 s.
pub fn defer_delay(base: Duration, max: Duration, deferrals: u32) -> Duration {
    let base_ms = u64::try_from(base.as_millis())
        .unwrap_or(u64::MAX)
        .max(1_000);
    let max_ms = u64::try_from(max.as_millis())
        .unwrap_or(u64::MAX)
        .max(base_ms);
    let doublings = deferrals.saturating_sub(1).min(20);
    let cap = base_ms.saturating_mul(1u64 << doublings).min(max_ms);
    Duration::from_millis(rand::rng().random_range(base_ms..=cap))
}

/// Decodes the payload (a job that does not decode is killed, as the handler would).
fn decode<J: PollJob>(
    raw: &str,
    ctx: &apalis::prelude::ExecutionContext,
) -> Result<J, BoxDynError> {
    serde_json::from_str(raw).map_err(|e| {
        tracing::error!(task = J::TASK.label(), error = %e, "poll payload does not decode; recorded as dead");
        ctx.raw_status().store(Status::Killed);
        AbortError::new(PollAborted(format!("payload does not decode: {e}"))).into()
    })
}

/// Re-enqueues the job with `deferrals + 1` through its chain. `Ok(false)`: the chain was
/// replaced meanwhile, so nothing was written (the stale job just ends).
async fn reschedule<J: PollJob>(budget: &Budget, timing: Timing, job: &J) -> anyhow::Result<bool> {
    let mut conn = budget.conn.clone();
    let prefix = budget.prefix.as_str();
    let mut next = job.state().clone();
    next.deferrals = next.deferrals.saturating_add(1);
    if next.chain.is_empty() {
        // A job from a producer that did not start a chain: adopt the card first (as the handler
        // would), else `schedule` would find no live chain and drop it.
        match chain::check(&mut conn, prefix, J::TASK, job.card_ref(), &next).await? {
            Liveness::Adopted(id) => next.chain = id,
            Liveness::Live => {}
            Liveness::Stale => return Ok(false),
        }
    }
    let delay = defer_delay(timing.defer_delay, timing.defer_max_delay, next.deferrals);
    let written = chain::schedule(&mut conn, prefix, J::TASK, job.card_ref(), &next, delay).await?;
    tracing::debug!(
        card_ref = job.card_ref(),
        deferrals = next.deferrals,
        delay_ms = delay.as_millis() as u64,
        written,
        "poll deferred"
    );
    Ok(written)
}

async fn defer<J: PollJob, R: Default>(
    budget: &Budget,
    timing: Timing,
    task: Task<String>,
    reason: ShortReason,
) -> Result<R, BoxDynError> {
    let (raw, ctx) = task.take();
    let job: J = decode(&raw, &ctx)?;
    match tokio::time::timeout(REDIS_CALL_TIMEOUT, reschedule(budget, timing, &job)).await {
        Ok(Ok(written)) => {
            if !written {
                tracing::debug!(
                    card_ref = job.card_ref(),
                    reason = reason.label(),
                    "deferred job's chain was replaced; dropped"
                );
            }
            // Acknowledge: no attempt counted, the successor (if any) is in the intake.
            ctx.raw_status().store(Status::Done);
            Ok(R::default())
        }
        Ok(Err(e)) => keep_for_apalis(timing, &ctx, &format!("{e:#}")).await,
        Err(_) => keep_for_apalis(timing, &ctx, "re-enqueueing a deferred job timed out").await,
    }
}

/// Redis did not answer the acquire. First try the normal deferral (Redis may be back already);
/// if that fails too, see [`keep_for_apalis`].
async fn unavailable<J: PollJob, R: Default>(
    budget: &Budget,
    timing: Timing,
    task: Task<String>,
    error: &anyhow::Error,
) -> Result<R, BoxDynError> {
    tracing::warn!(task = J::TASK.label(), error = %format!("{error:#}"), "polling budget unavailable; failing closed (no Gateway call)");
    let (raw, ctx) = task.take();
    let job: J = decode(&raw, &ctx)?;
    match tokio::time::timeout(REDIS_CALL_TIMEOUT, reschedule(budget, timing, &job)).await {
        Ok(Ok(_)) => {
            ctx.raw_status().store(Status::Done);
            Ok(R::default())
        }
        Ok(Err(e)) => keep_for_apalis(timing, &ctx, &format!("{e:#}")).await,
        Err(_) => keep_for_apalis(timing, &ctx, "re-enqueueing the job timed out").await,
    }
}

/// The one place cardworker lets apalis bring a job back by itself: Redis refused both the
/// acquire and the re-enqueue, so the intake cannot take the job. We return a plain (non-abort)
/// error with status `Failed`:
/// - if the acknowledgement reaches Redis, apalis-redis puts the job back in its scheduled set
///   (`handle_results.lua`: attempt < 25); the layer skipped apalis's lifecycle, so the attempt is
///   not counted and never reaches 25;
/// - if Redis is down for the acknowledgement too, the job stays in this worker's inflight set
///   and apalis's orphan recovery re-enqueues it.
///
/// Either way the job is not lost, and the Gateway was not called. We pause first (the defer
/// delay) because apalis reschedules it with no delay: this keeps a flapping Redis from turning
/// into a hot loop, at most one job per worker slot per pause.
async fn keep_for_apalis<R>(
    timing: Timing,
    ctx: &apalis::prelude::ExecutionContext,
    why: &str,
) -> Result<R, BoxDynError> {
    tracing::warn!(error = %why, "cannot re-enqueue a polling job; leaving it to apalis to bring back");
    tokio::time::sleep(timing.defer_delay.max(Duration::from_secs(1))).await;
    ctx.raw_status().store(Status::Failed);
    Err(BudgetUnavailable(why.to_owned()).into())
}

/// Redis could not be reached for the budget nor for the re-enqueue.
#[derive(Debug, thiserror::Error)]
#[error("polling budget unavailable: {0}")]
pub struct BudgetUnavailable(String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defer_delay_grows_with_jitter_up_to_the_cap_and_never_under_a_second() {
        let base = Duration::from_secs(2);
        let max = Duration::from_secs(30);
        for _ in 0..200 {
            assert_eq!(defer_delay(base, max, 1), base);
            let d = defer_delay(base, max, 3);
            assert!(d >= base && d <= Duration::from_secs(8), "{d:?}");
            let d = defer_delay(base, max, 40);
            assert!(d >= base && d <= max, "{d:?}");
            let d = defer_delay(Duration::ZERO, Duration::ZERO, 1);
            assert_eq!(d, Duration::from_secs(1));
        }
    }
}
