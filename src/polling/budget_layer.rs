//! [`PollingBudgetLayer`]: the tower layer around both polling workers.
//!
//! It lives with polling, not with the budget, because it knows the polling due queue: a deferred
//! poll's card is given back to it. The budget module only knows its own leases.
//!
//! Where it sits (apalis 1.0 service stack, outer to inner): apalis's `TaskPersistLayer` (acks
//! the job with whatever status the task context holds once our future finishes) -> the
//! worker's concurrency limit -> **this layer** -> apalis's `LifecycleLayer` (counts the attempt,
//! maps the handler's result to a status) -> the job service (`runner::JobService`).
//!
//! For every job it takes both tokens before the inner service (`Budget::admit`: most polls
//! start on a slot their process kept from its previous poll, without a Redis call; see
//! `budget::pool`). The lease then belongs to the poll, not to this layer's future: the job
//! service spawns the poll on a task of its own and carries the lease into it
//! (`circuit::carry`), and that task ends the lease (`Budget::finish_poll`) when the poll is
//! over. apalis drops a worker's in-flight futures when its stream ends (a Redis timeout, a reset
//! connection, a worker whose registration was removed), while the spawned poll runs on to its
//! end; a lease held here would go back under a running Gateway call and let the fleet admit more
//! polls than the limits. The poll always ends: the job service catches panics and applies
//! `polling.handler_timeout_secs` (the one policy, `runner::service::guarded`), which config
//! validation keeps below the lease. Should the poll's task be cancelled anyway (the process stops
//! past its grace), the lease guard releases in the background. The inner service is reachable only with
//! both tokens held. If a token is short it waits briefly (up to [`WAIT_FOR_TOKEN`], woken at
//! once when this process releases a token) and then defers:
//!
//! 1. the card is given back unpolled at the due time it was fetched with (it keeps its place:
//!    under a backlog the oldest due cards go first), and the worker fetches nothing for a
//!    [`crate::backoff`] delay that grows with the deferrals in a row, so a card is not fetched
//!    again and again only to be given back;
//! 2. the inner service is skipped, so apalis's lifecycle never runs and never counts an
//!    attempt;
//! 3. `cardworker_poll_deferred_total{task, reason}` is counted.
//!
//! The same call asks the task's Gateway circuit (`budget::circuit`): while it is open the job
//! is deferred the same way (reason `gateway_circuit_open`, after the rest of the cool-down), so
//! an outage costs no Gateway call, no PostgreSQL write, no failure and no attempt. The poll runs
//! inside [`super::circuit::scoped`], and the outcome it reports is handed to the lease release,
//! which counts it in the circuit's window in the same script call; the one process whose call
//! opened or closed the circuit writes its audit event ([`super::circuit::on_transition`]). The
//! release itself rides on the process's next acquire (`budget::carry`): one budget round trip
//! per admitted poll. That acquire takes over the finished poll's lease id when it is granted
//! (`Budget::acquire_slot`: the member is re-scored in place), so the lease a poll holds is the
//! one the acquire answered with, not necessarily the fresh id it asked with.
//!
//! Redis unreachable at acquire: fail closed (no Gateway call), count `budget_unavailable`, and
//! defer; if the card cannot be given back either, it is due again when its lease ends.

use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use apalis::prelude::{AbortError, BoxDynError, Status, Task};
use futures::future::BoxFuture;
use futures::FutureExt as _;
use sqlx::PgPool;
use tower::{Layer, Service};

use super::backend::FetchPause;
use super::circuit::{self, Reported};
use super::lease::{self, PollJob};
use crate::backoff::{Backoff, Jitter};
use crate::budget::circuit::CIRCUIT_OPEN_REASON;
use crate::budget::{Acquired, Budget, ShortReason, Slot};
use crate::config::{PollingConfig, Task as PollTask};
use crate::gateway::AtGateway;
use crate::runner::JobError;
use crate::shutdown::Shutdown;
use crate::telemetry::metrics as m;

/// How long a job may wait for a token before it is deferred.
pub const WAIT_FOR_TOKEN: Duration = Duration::from_millis(250);
/// First pause between two acquire attempts while waiting; doubles up to [`MAX_RETRY_STEP`].
const FIRST_RETRY_STEP: Duration = Duration::from_millis(10);
const MAX_RETRY_STEP: Duration = Duration::from_millis(80);
/// An acquire (or a deferral write) slower than this counts as Redis unavailable: the job must not
/// sit on a worker slot for the connection's full response timeout.
pub const REDIS_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// What the layer shares between its services: the budget (whose connection and prefix the
/// deferrals use too), the deferral back-off of `[polling]`, and where circuit transitions
/// are recorded.
#[derive(Clone)]
struct Shared {
    budget: Budget,
    /// `polling.defer_delay_secs` (at least 1 s) doubling up to `polling.defer_max_delay_secs`.
    defer: Backoff,
    /// PostgreSQL for the circuit's audit events, and the tracker of the tasks writing them
    /// (`None`: transitions are only logged, as in the budget benchmark).
    records: Option<(PgPool, Shutdown)>,
    /// The worker's pause in fetching after a deferral, and its deferrals in a row.
    pause: FetchPause,
}

/// Wraps one polling worker (job type `J`): both tokens or no handler.
pub struct PollingBudgetLayer<J> {
    /// Shared, not cloned, by every poll's call: a budget is a few dozen handles.
    shared: Arc<Shared>,
    job: PhantomData<fn() -> J>,
}

impl<J> Clone for PollingBudgetLayer<J> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            job: PhantomData,
        }
    }
}

impl<J: PollJob> PollingBudgetLayer<J> {
    /// The layer of `J`'s worker on `budget`, with the delays of `polling`. Circuit transitions
    /// are only logged until [`Self::recording_into`] names where their audit events go.
    pub fn new(budget: Budget, polling: &PollingConfig) -> Self {
        install_transition_hook(&budget, None);
        Self {
            shared: Arc::new(Shared {
                budget,
                defer: defer_backoff(polling.defer_delay(), polling.defer_max_delay()),
                records: None,
                pause: FetchPause::default(),
            }),
            job: PhantomData,
        }
    }

    /// This layer pausing its worker's fetching through `pause` (the worker's backend's) when it
    /// defers a poll.
    pub fn pausing(mut self, pause: FetchPause) -> Self {
        Arc::make_mut(&mut self.shared).pause = pause;
        self
    }

    /// This layer writing the circuit's audit events into `pool`, from tasks tracked by
    /// `shutdown`.
    pub fn recording_into(mut self, pool: PgPool, shutdown: Shutdown) -> Self {
        install_transition_hook(&self.shared.budget, Some((pool.clone(), shutdown.clone())));
        Arc::make_mut(&mut self.shared).records = Some((pool, shutdown));
        self
    }
}

/// The circuit transitions that a poll's end made arrive with the call that carried that end
/// (`budget::carry`), which may be another poll's acquire or a flush: the budget hands them to
/// this hook, which writes the audit event from a tracked task (or only logs, without records).
fn install_transition_hook(budget: &Budget, records: Option<(PgPool, Shutdown)>) {
    budget.on_transition(std::sync::Arc::new(
        move |which, transition| match &records {
            Some((pool, shutdown)) => {
                let pool = pool.clone();
                shutdown.spawn_detached(async move {
                    circuit::on_transition(Some(&pool), which, transition).await;
                });
            }
            None => {
                tokio::spawn(circuit::on_transition(None, which, transition));
            }
        },
    ));
}

/// The deferral back-off: uniform between the base (never under 1 s, so a deferral storm cannot
/// spin) and a value that doubles with each consecutive deferral, up to the max.
pub fn defer_backoff(base: Duration, max: Duration) -> Backoff {
    let base = base.max(Duration::from_secs(1));
    Backoff::new(base, max, Jitter::FromBase)
}

impl<S, J> Layer<S> for PollingBudgetLayer<J> {
    type Service = PollingBudgetService<S, J>;

    fn layer(&self, inner: S) -> Self::Service {
        PollingBudgetService {
            inner,
            shared: self.shared.clone(),
            job: PhantomData,
        }
    }
}

/// The service of [`PollingBudgetLayer`].
pub struct PollingBudgetService<S, J> {
    inner: S,
    shared: Arc<Shared>,
    job: PhantomData<fn() -> J>,
}

impl<S: Clone, J> Clone for PollingBudgetService<S, J> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
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
        run::<S, J>(inner, self.shared.clone(), task).boxed()
    }
}

// A span of its own only at debug: at info, the fmt layer formats, stores and closes it for every
// poll, which `perf` shows in the worker's CPU per poll (docs/BENCHMARKS.md); the poll's own span
// names its card, and every event below names its task itself.
#[tracing::instrument(level = "debug", skip_all, fields(task = J::TASK.label()))]
async fn run<S, J>(
    mut inner: S,
    shared: Arc<Shared>,
    task: Task<String>,
) -> Result<S::Response, BoxDynError>
where
    S: Service<Task<String>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError>,
    S::Response: Default + Send + 'static,
    J: PollJob,
{
    let fresh = shared.budget.new_lease_id();
    match acquire_with_wait(&shared.budget, J::TASK, &fresh).await {
        Ok((granted @ (Acquired::Acquired | Acquired::Probe { .. }), slot)) => {
            shared.pause.admitted();
            let held = Held {
                task: J::TASK,
                slot,
                probe_round: granted.probe_round(),
            };
            run_holding(&mut inner, &shared, held, task).await
        }
        Ok((Acquired::Short { reason }, _)) => {
            deferred(J::TASK.label(), reason.label());
            defer::<J, S::Response>(
                &shared,
                task,
                reason.label(),
                Duration::ZERO,
                Growth::InARow,
            )
            .await
        }
        Ok((Acquired::Fenced { retry_in }, _)) => {
            // A fence counts as the budget being unavailable: the spec's label set has no value
            // of its own for it, and Redis having lost the budget's data is that. The job comes
            // back once the fence is over (plus the back-off's jitter), not within it.
            deferred(J::TASK.label(), super::BUDGET_UNAVAILABLE);
            defer::<J, S::Response>(
                &shared,
                task,
                super::BUDGET_UNAVAILABLE,
                retry_in,
                Growth::None,
            )
            .await
        }
        Ok((Acquired::CircuitOpen { retry_in }, _)) => {
            deferred(J::TASK.label(), CIRCUIT_OPEN_REASON);
            defer::<J, S::Response>(&shared, task, CIRCUIT_OPEN_REASON, retry_in, Growth::None)
                .await
        }
        Err(e) => {
            tracing::warn!(task = J::TASK.label(), error = %format!("{e:#}"), "polling budget unavailable; failing closed (no Gateway call)");
            deferred(J::TASK.label(), super::BUDGET_UNAVAILABLE);
            defer::<J, S::Response>(
                &shared,
                task,
                super::BUDGET_UNAVAILABLE,
                Duration::ZERO,
                Growth::None,
            )
            .await
        }
    }
}

fn deferred(task: &'static str, reason: &'static str) {
    metrics::counter!(m::POLL_DEFERRED, "task" => task, "reason" => reason).increment(1);
}

/// One admission, bounded by [`REDIS_CALL_TIMEOUT`]: on a slot this process kept, or with an
/// acquire that may take over the lease of a finish it carries (`Budget::admit`); answers with
/// the slot the poll holds. After a timeout the script may still have granted a lease: `lease`
/// is released in the background, and so is every carried finish's (their batch was dropped
/// unanswered; release is idempotent).
async fn acquire_once(
    budget: &Budget,
    task: PollTask,
    lease: &str,
) -> anyhow::Result<(Acquired, Slot)> {
    match tokio::time::timeout(REDIS_CALL_TIMEOUT, budget.admit(task, lease)).await {
        Ok(result) => result,
        Err(_) => {
            budget.release_in_background(lease.to_owned());
            anyhow::bail!("acquiring {task} polling tokens timed out after {REDIS_CALL_TIMEOUT:?}")
        }
    }
}

/// Acquires, waiting up to [`WAIT_FOR_TOKEN`] while a budget (not a pause) is short. Answers with
/// the slot the poll holds when granted (a kept one, `lease`, or a finished poll's that it took
/// over).
async fn acquire_with_wait(
    budget: &Budget,
    task: PollTask,
    lease: &str,
) -> anyhow::Result<(Acquired, Slot)> {
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
            (
                Acquired::Short {
                    reason: ShortReason::Total | ShortReason::Task,
                },
                _,
            ) if now < deadline => {
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

/// A granted lease: whose it is and whether its poll probes a half-open circuit.
struct Held {
    task: PollTask,
    slot: Slot,
    /// The half-open round it probes for (0: not a probe).
    probe_round: u64,
}

/// A granted lease, owned by the poll it admitted: ended by [`LeaseGuard::finish`] once the poll
/// is over, or, when dropped unfinished (the poll's task was cancelled when the process stopped
/// past its grace), left to count until the handler's limit, since its call may be at the
/// Gateway. The
/// job service moves it into the poll's own task (`circuit::carry`), so that it lives exactly as
/// long as the poll, never as long as a future that apalis may drop.
struct LeaseGuard {
    /// The layer's budget (shared with it).
    shared: Arc<Shared>,
    held: Option<Held>,
}

impl circuit::Lease for LeaseGuard {
    /// Ends the poll: its slot is kept for this process's next poll (`budget::pool`), or its
    /// release and outcome ride on this process's next acquire (or a flush a few ms later:
    /// `budget::carry`), so a poll costs at most one budget round trip.
    fn finish(mut self: Box<Self>, reported: Reported) {
        if let Some(held) = self.held.take() {
            self.shared.budget.run_ended(&held.slot.lease);
            self.shared.budget.finish_poll(
                held.task,
                held.slot,
                reported.report,
                held.probe_round,
                &reported.card_ref,
            );
        }
    }

    /// Ends a poll whose Gateway call it stopped waiting for: the outcome (the timeout, a
    /// failure) counts in the circuit now, and the tokens stay held until the call is over or
    /// `polling.handler_timeout_secs` after it was sent (`budget::abandoned`, which extends the
    /// lease when that is past its expiry).
    fn finish_after(mut self: Box<Self>, reported: Reported, call: AtGateway) {
        if let Some(held) = self.held.take() {
            self.shared.budget.report_outcome(
                held.task,
                reported.report,
                held.probe_round,
                &reported.card_ref,
            );
            let until = call.sent() + self.shared.budget.handler_timeout();
            tracing::debug!(
                task = held.task.label(),
                card_ref = %reported.card_ref,
                hold_ms = until.saturating_duration_since(Instant::now()).as_millis() as u64,
                "Gateway call abandoned at the client's timeout; its tokens stay held until it is answered"
            );
            self.shared
                .budget
                .hold_abandoned(held.task, held.slot, until, call.ended());
        }
    }
}

impl Drop for LeaseGuard {
    /// The poll's task was cancelled before the poll finished: its call may be at the Gateway,
    /// so its tokens count until the handler's limit ([`Budget::leave_unfinished`]).
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            self.shared.budget.leave_unfinished(held.slot.lease);
        }
    }
}

/// Runs the inner service while both tokens are held. The lease goes with the poll: the job
/// service carries it into the task it spawns for the poll, which ends it with the outcome the
/// poll reported once the poll is over; an inner service that runs the poll in place leaves it
/// here, and it ends when the inner call returns.
async fn run_holding<S>(
    inner: &mut S,
    shared: &Arc<Shared>,
    held: Held,
    task: Task<String>,
) -> Result<S::Response, BoxDynError>
where
    S: Service<Task<String>>,
    S::Error: Into<BoxDynError>,
{
    let probe = held.probe_round > 0;
    shared.budget.run_started(held.task, &held.slot.lease);
    let guard = Box::new(LeaseGuard {
        shared: shared.clone(),
        held: Some(held),
    });
    // The inner call runs inside the scope (an async block, not an argument evaluated before
    // it), so that the job service's `carry` finds the slot and the lease when it spawns the poll.
    circuit::scoped(probe, guard, async { inner.call(task).await })
        .await
        .map_err(Into::into)
}

/// Decodes the payload (a job that does not decode is killed, as the handler would).
fn decode<J: PollJob>(
    raw: &str,
    ctx: &apalis::prelude::ExecutionContext,
) -> Result<J, BoxDynError> {
    serde_json::from_str(raw).map_err(|e| {
        tracing::error!(task = J::TASK.label(), error = %e, "poll payload does not decode; recorded as dead");
        ctx.raw_status().store(Status::Killed);
        AbortError::new(JobError::Payload(e.to_string())).into()
    })
}

/// Whether a deferral's back-off grows with the deferrals in a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Growth {
    /// It does: the budget is short or the task paused, which can last.
    InARow,
    /// It does not: the wait comes from Redis (a fence's or a circuit's time left) or Redis did
    /// not answer, and the back-off is only the first delay's jitter on top.
    None,
}

/// Defers the job: gives its card back unpolled at the due time it was fetched with, so it keeps
/// its place among the due cards (the oldest due still go first once tokens are free), and
/// pauses this worker's fetching for `wait` (the rest of a circuit's cool-down, a fence's time
/// left) plus the deferral back-off, which grows with the deferrals in a row when `growth` says
/// so ([`super::backend::FetchPause`]): the card is not fetched again only to be given back.
/// `reason` is the deferral's label: a short budget, a paused task, an open circuit, or
/// `budget_unavailable` when Redis did not answer the acquire. If Redis refuses the release too,
/// nothing is lost: the card is due again when its lease ends.
async fn defer<J: PollJob, R: Default>(
    shared: &Shared,
    task: Task<String>,
    reason: &'static str,
    wait: Duration,
    growth: Growth,
) -> Result<R, BoxDynError> {
    let (raw, ctx) = task.take();
    let job: J = decode(&raw, &ctx)?;
    let first = shared.defer.delay(1);
    let back_off = match growth {
        // Never longer than the worker has been refused: a brief refusal after a long one (a
        // burst of cards fetched together, the budget back after an outage) costs the first
        // delay, while a shortage that lasts still grows to the cap.
        Growth::InARow => shared
            .defer
            .delay(shared.pause.deferrals().saturating_add(1))
            .min(shared.pause.refused_for().max(first)),
        Growth::None => first,
    };
    let delay = wait + back_off;
    let in_a_row = shared.pause.defer_until(Instant::now() + delay);
    let queue = lease::due_queue(shared.budget.prefix(), J::TASK);
    let mut conn = shared.budget.conn();
    let released = queue.release_at(&mut conn, job.card_ref(), job.lease(), job.ticket().due_ms);
    match tokio::time::timeout(REDIS_CALL_TIMEOUT, released).await {
        Ok(Ok(held)) => {
            tracing::debug!(
                card_ref = job.card_ref(),
                reason,
                in_a_row,
                pause_ms = delay.as_millis() as u64,
                ?held,
                "poll deferred: card given back at its due time"
            );
        }
        Ok(Err(e)) => {
            tracing::warn!(task = J::TASK.label(), card_ref = job.card_ref(), reason, error = %format!("{e:#}"), "deferred card not given back; it is due again when its lease ends");
        }
        Err(_) => {
            tracing::warn!(
                task = J::TASK.label(),
                card_ref = job.card_ref(),
                reason,
                "giving a deferred card back timed out; it is due again when its lease ends"
            );
        }
    }
    ctx.raw_status().store(Status::Done);
    Ok(R::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defer_delay_grows_with_jitter_up_to_the_cap_and_never_under_a_second() {
        let b = defer_backoff(Duration::from_secs(2), Duration::from_secs(30));
        for _ in 0..200 {
            assert_eq!(b.delay(1), Duration::from_secs(2));
            let d = b.delay(3);
            assert!(
                d >= Duration::from_secs(2) && d <= Duration::from_secs(8),
                "{d:?}"
            );
            let d = b.delay(40);
            assert!(
                d >= Duration::from_secs(2) && d <= Duration::from_secs(30),
                "{d:?}"
            );
            let floor = defer_backoff(Duration::ZERO, Duration::ZERO);
            assert_eq!(floor.delay(1), Duration::from_secs(1));
        }
    }
}
