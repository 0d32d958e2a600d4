//! The flow of one poll, shared by card data and card status.
//!
//! 1. The job holds its card's lease in the due queue (`super::due_queue`): no other poll of the
//!    card runs while it does, so there is nothing to check first.
//! 2. Load the card (a read). Unknown or no longer pollable: acknowledge, no call. Parked: the
//!    chain waits for its retry (`polling.<task>.parked_retry_secs` after parking); the job due
//!    then is the retry, one poll: a valid answer un-parks the card (one `poll.unparked` record),
//!    a failure leaves it parked until the next retry.
//! 3. Correlation id (UUID v7) in memory, call the Gateway, classify, and report the outcome to
//!    the Gateway circuit ([`super::circuit::report`]; the budget layer counts it fleet-wide).
//!    The call is handed to the budget layer as it is sent ([`super::circuit::at_gateway`]): a
//!    call the poll stops waiting for at `gateway.timeout_ms` still holds the poll's tokens until
//!    it is answered or `polling.handler_timeout_secs` after it was sent (`budget::abandoned`).
//!    A poll that is a probe of a half-open circuit and fails records nothing and does not
//!    advance the card's failures: the failure is the Gateway's, and the circuit re-opens.
//! 4. By outcome:
//!    - valid and unchanged: **no PostgreSQL write at all**; count `skipped_unchanged`, and
//!      schedule the next poll after the jittered interval in the chain script call that also
//!      counts the poll in the card's tally and the fleet's hourly counter
//!      ([`super::unchanged`]); a recorded change or failure resets the tally;
//!    - valid and changed: one transaction with the terminal `succeeded` log, the optimistic card
//!      update, its audit event + link and its outbox event; count `persisted_change`;
//!    - failed or unknown: one transaction with the terminal `failed`/`unknown` log (error and
//!      what happens next) and its audit event + link; count `persisted_failure`; the next attempt
//!      comes after a capped, jittered exponential back-off, or the chain is parked in PostgreSQL
//!      (same transaction) after `max_consecutive_failures` and its retry is scheduled.
//!
//! Nothing here ever writes a `pending` log or updates `integration_logs`: the terminal path is
//! [`records::insert_terminal_log`] only. A transient infrastructure error (PostgreSQL down while
//! recording) never loses the card: the job schedules a retry through its acknowledgement (which
//! keeps trying in the background while Redis refuses and the lease lasts; past it the card is
//! due again by itself). A deterministic database error (the
//! record or the change itself is refused) is recorded as a failure and counted, never retried
//! forever ([`crate::storage::fault`]). An abnormal end (error, panic, timeout) still leaves a
//! successor: [`after_abnormal_end`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use super::circuit;
use super::due_queue::{DueQueue, Lease, PollState, Standing, Step, Successor};
use super::lease::{self, PollJob};
use crate::backoff::{self as backoff_rule, Backoff, Jitter};
use crate::cards::apply::{Applied, ChangeSource};
use crate::config::Task;
use crate::context::AppContext;
use crate::gateway::{GatewayClient, Outcome, SentRead};
use crate::runner::{JobError, RunJob};
use crate::storage::cards::{self, Card};
use crate::storage::fault::{self, DbFault};
use crate::storage::records::{self, AuditRecord, LogRecord, LogState};
use crate::telemetry::metrics as m;

mod failure;

pub use failure::after_abnormal_end;
use failure::{persist_unpark, record_failure};

/// Failure back-off: the first retry comes after `min(interval, BACKOFF_BASE)`, doubling.
pub const BACKOFF_BASE: Duration = Duration::from_secs(10);
/// Failure back-off ceiling (or the interval, when that is longer).
pub const BACKOFF_CAP: Duration = Duration::from_secs(600);

/// One polling task as the shared flow needs it: the Gateway call, what counts as a change, and
/// how a change is applied.
pub trait PollTask: PollJob + RunJob {
    /// A valid observation.
    type Obs: std::fmt::Debug + Send + Sync + 'static;
    /// `integration_logs.scenario`.
    const SCENARIO: &'static str;

    /// Sends the Gateway call (it runs on a task of its own; [`SentRead::answer`] waits for it).
    fn send(gateway: &GatewayClient, card_ref: &str, correlation_id: Uuid) -> SentRead<Self::Obs>;

    /// Whether `obs` differs from the stored card.
    fn is_change(card: &Card, obs: &Self::Obs) -> bool;

    /// Applies `obs` to `card` in the caller's transaction.
    fn apply<'c>(
        tx: &'c mut PgConnection,
        card: &'c Card,
        obs: &'c Self::Obs,
        correlation_id: Uuid,
        source: &'c ChangeSource,
    ) -> impl Future<Output = sqlx::Result<Applied>> + Send + 'c;

    /// Whether the chain ends once the card holds `obs` (data ready, status final).
    fn ends_chain(obs: &Self::Obs) -> bool;

    /// A short description of the observation for summaries (never a PAN or CVV).
    fn describe(obs: &Self::Obs) -> String;
}

/// What one poll ended with (for tests and the benchmark).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollOutcome {
    /// The job's lease no longer held its card (it ended, and the card went to another poll):
    /// no call.
    Stale,
    /// No such card: acknowledged, no call, chain finished.
    UnknownCard,
    /// The chain is parked or the card needs no more polling: acknowledged, no call.
    NotPolled,
    /// Valid and unchanged: nothing written to PostgreSQL.
    Unchanged,
    /// Valid and changed: recorded.
    Changed,
    /// Failed or unknown: recorded (and maybe parked).
    Failed {
        /// Whether this failure parked the chain.
        parked: bool,
    },
    /// Recording failed for an infrastructure reason; a retry was scheduled.
    RetryScheduled,
    /// A probe of a half-open circuit failed: nothing recorded, failures unchanged, retry
    /// scheduled.
    ProbeFailed,
    /// A parked chain's job came before its retry was due: rescheduled for the retry, no call.
    ParkedWaiting,
    /// The poll failed, but an operator restarted the card's polling meanwhile (`enqueue`,
    /// `unpark`): nothing recorded, nothing parked, the restart's fresh state kept.
    StaleFailure,
}

/// The delay before attempt `failures + 1` after `failures` consecutive failures: exponential from
/// `min(interval, 10 s)`, capped at `max(interval, 10 min)`, with ±20% jitter (still capped).
pub fn backoff(interval: Duration, failures: u32) -> Duration {
    Backoff::new(
        interval.min(BACKOFF_BASE),
        interval.max(BACKOFF_CAP),
        Jitter::Proportional(0.2),
    )
    .delay(failures)
}

/// The `outcome` label of `cardworker_poll_outcomes_total` for an unchanged poll.
pub const SKIPPED_UNCHANGED: &str = "skipped_unchanged";
/// The `outcome` label for a recorded change.
pub const PERSISTED_CHANGE: &str = "persisted_change";
/// The `outcome` label for a recorded failure or unknown answer.
pub const PERSISTED_FAILURE: &str = "persisted_failure";
/// Every `outcome` label, for registering the series at zero.
pub const OUTCOMES: [&str; 3] = [SKIPPED_UNCHANGED, PERSISTED_CHANGE, PERSISTED_FAILURE];

fn count(task: Task, outcome: &'static str) {
    metrics::counter!(m::POLL_OUTCOMES, "task" => task.label(), "outcome" => outcome).increment(1);
}

/// What a successor's write does to the card's unchanged-poll tally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Nothing (a retry after an infrastructure error, a parked card waiting).
    Keep,
    /// The poll recorded a change or a failure: the count starts again from 0, since now.
    Reset,
    /// The poll was unchanged (at this time, which picks the fleet-wide hourly counter): one more
    /// in the card's tally, and one more in this process's count for that hour
    /// ([`super::unchanged::count_fleet`], written every few seconds).
    Unchanged(DateTime<Utc>),
}

/// Everything one run needs to know about its job.
struct Run<'a, J: PollTask> {
    ctx: &'a AppContext,
    queue: DueQueue,
    card_ref: String,
    /// The lease the poll holds its card under.
    lease: Lease,
    /// The card's state as the fetch handed it out (failures, deferrals, tally).
    state: PollState,
    /// When the lease ends, on this process's clock (the successor is retried until then).
    lease_ends: std::time::Instant,
    /// No successor is due before this: the Gateway may still be working on this poll's call,
    /// which the poll stopped waiting for, and the card is never polled twice at once.
    not_before: Option<std::time::Instant>,
    _job: std::marker::PhantomData<J>,
}

impl<'a, J: PollTask> Run<'a, J> {
    /// The run of `job`, whose card's lease ends no sooner than `lease_ends`.
    fn new(ctx: &'a AppContext, job: &J, lease_ends: std::time::Instant) -> Self {
        Self {
            ctx,
            queue: lease::due_queue(ctx.prefix(), J::TASK),
            card_ref: job.card_ref().to_owned(),
            lease: job.lease(),
            state: job.state(),
            lease_ends,
            not_before: None,
            _job: std::marker::PhantomData,
        }
    }

    fn interval(&self) -> Duration {
        self.ctx.config.polling.task(J::TASK).interval()
    }

    fn max_failures(&self) -> u32 {
        self.ctx
            .config
            .polling
            .task(J::TASK)
            .max_consecutive_failures
    }

    fn parked_retry(&self) -> Duration {
        self.ctx.config.polling.task(J::TASK).parked_retry()
    }

    /// Acknowledges the poll with its card's next poll after `delay` with `failures`, its
    /// unchanged-poll tally left as it is. Returns whether the lease still held the card.
    async fn schedule(&mut self, failures: u32, delay: Duration) -> anyhow::Result<bool> {
        self.schedule_counted(failures, delay, Count::Keep).await
    }

    /// [`Self::schedule`], with what this poll does to the card's unchanged-poll tally (in the
    /// same write).
    async fn schedule_counted(
        &mut self,
        failures: u32,
        delay: Duration,
        count: Count,
    ) -> anyhow::Result<bool> {
        let next = self.next_state(failures, count);
        self.acknowledge(delay, next, count).await
    }

    /// The card's state after this poll.
    fn next_state(&self, failures: u32, count: Count) -> PollState {
        let step = match count {
            Count::Keep => Step::Keep,
            Count::Reset => Step::Reset,
            Count::Unchanged(_) => Step::Unchanged,
        };
        self.state.after(step, failures, Utc::now())
    }

    /// Writes the successor: due after `delay` (never before `not_before`) with `next`.
    async fn acknowledge(
        &mut self,
        delay: Duration,
        next: PollState,
        count: Count,
    ) -> anyhow::Result<bool> {
        let delay = match self.not_before {
            Some(at) => delay.max(at.saturating_duration_since(std::time::Instant::now())),
            None => delay,
        };
        let successor = Successor {
            card_ref: &self.card_ref,
            lease: self.lease,
            next_in: delay,
            next,
        };
        // Redis refusing the successor (after a PostgreSQL commit, say) is retried in the
        // background while the lease lasts; past it the card is due again by itself.
        let written = lease::ack_or_retry(
            &self.ctx.poll_acks,
            &self.ctx.shutdown,
            &self.queue,
            successor,
            self.lease_ends,
        )
        .await;
        if let (true, Count::Unchanged(at)) = (written, count) {
            // The fleet-wide hourly counter is added up in this process and written every few
            // seconds: one INCRBY per counter and flush, not one INCR per poll.
            super::unchanged::count_fleet(self.ctx.prefix(), J::TASK, at);
        }
        Ok(written)
    }

    /// The next regular poll (failures reset), with `count` applied to the unchanged-poll tally.
    async fn schedule_next(&mut self, count: Count) -> anyhow::Result<()> {
        let delay = backoff_rule::spread(self.interval(), 0.1);
        if !self.schedule_counted(0, delay, count).await? {
            tracing::debug!(card_ref = %self.card_ref, "lease ended meanwhile; the card's next poll is another's");
        }
        Ok(())
    }

    /// The card needs no more polls: its due entry and state go (under the lease).
    async fn finish(&mut self) -> anyhow::Result<()> {
        let mut conn = self.ctx.redis.clone();
        self.queue
            .finish(&mut conn, &self.card_ref, self.lease)
            .await
            .map(|_| ())
    }

    /// Whether an operator restarted the card's polling while this poll ran (its state is no
    /// longer the one the fetch handed out), or its lease no longer holds the card. A Redis that
    /// does not answer counts as neither: a failure lost is worse than one recorded twice.
    async fn is_replaced(&self) -> bool {
        let mut conn = self.ctx.redis.clone();
        match self.queue.entry(&mut conn, &self.card_ref).await {
            Ok(Some((Standing::Leased { deadline_ms }, state))) => {
                deadline_ms != self.lease.deadline_ms() || state != self.state
            }
            Ok(_) => true,
            Err(_) => false,
        }
    }

    /// An infrastructure error (PostgreSQL unavailable, say) while reading or recording: keep the
    /// card polled with a back-off retry; fail the job only when even that cannot be scheduled.
    async fn retry_after_infra_error(
        &mut self,
        error: anyhow::Error,
    ) -> anyhow::Result<PollOutcome> {
        // The failure count is not raised: nothing about the Gateway was learnt or recorded.
        let delay = backoff(self.interval(), self.state.failures + 1);
        tracing::warn!(
            task = %J::TASK,
            card_ref = %self.card_ref,
            error = %format!("{error:#}"),
            retry_in_ms = delay.as_millis() as u64,
            "poll could not be completed (infrastructure); retry scheduled"
        );
        let failures = self.state.failures;
        self.schedule(failures, delay)
            .await
            .map_err(|e| error.context(format!("and scheduling the retry failed too: {e:#}")))?;
        Ok(PollOutcome::RetryScheduled)
    }
}

/// When the lease of a poll that starts now ends at the soonest, on this process's clock: the
/// fetch's lease less what the poll may already have spent (its handler's limit covers it).
fn lease_ends(ctx: &AppContext) -> std::time::Instant {
    std::time::Instant::now() + ctx.config.polling.handler_timeout()
}

/// Runs one poll of job `job` (the body of both polling handlers).
pub async fn run_poll<J: PollTask>(job: J, ctx: Arc<AppContext>) -> anyhow::Result<PollOutcome> {
    let task = J::TASK;
    let mut run = Run::<J>::new(&ctx, &job, lease_ends(&ctx));

    let card = match ctx.card_reads.load(&run.card_ref).await {
        Ok(Some(card)) => card,
        Ok(None) => {
            tracing::warn!(%task, card_ref = %run.card_ref, "poll for an unknown card acknowledged without a Gateway call; chain ended");
            run.finish().await?;
            return Ok(PollOutcome::UnknownCard);
        }
        Err(e) if fault::classify(&e) == DbFault::Deterministic => {
            // A card_ref PostgreSQL refuses (a NUL in a hand-written payload, say) names no card.
            tracing::warn!(%task, card_ref = %run.card_ref, error = %e, "card_ref refused by PostgreSQL; poll acknowledged without a Gateway call, chain ended");
            run.finish().await?;
            return Ok(PollOutcome::UnknownCard);
        }
        Err(e) => {
            return run
                .retry_after_infra_error(anyhow::Error::new(e).context("loading the card"))
                .await
        }
    };
    // A parked chain stays scheduled for its retry; the job due then is that retry.
    let parked_retry = match card.parked_at(task) {
        Some(parked_at) if card.wants_polling(task) => {
            let due = parked_at
                + chrono::Duration::from_std(run.parked_retry()).unwrap_or(chrono::Duration::MAX);
            let early = (due - Utc::now()).to_std().unwrap_or_default();
            if !early.is_zero() {
                let failures = run.state.failures;
                run.schedule(failures, early).await?;
                return Ok(PollOutcome::ParkedWaiting);
            }
            true
        }
        _ => false,
    };
    if !parked_retry && !card.is_pollable(task) {
        tracing::info!(%task, card_ref = %run.card_ref, "card needs no poll; chain ended");
        run.finish().await?;
        return Ok(PollOutcome::NotPolled);
    }

    let correlation_id = Uuid::now_v7();
    let started_at = Utc::now();
    let sent = J::send(&ctx.gateway, &run.card_ref, correlation_id);
    let at_gateway = sent.at_gateway();
    // Until it is answered, the call holds the poll's tokens, also past the client's timeout.
    circuit::at_gateway(at_gateway.clone());
    let result = sent.answer().await;
    if !at_gateway.has_ended() {
        run.not_before = Some(at_gateway.sent() + ctx.config.polling.handler_timeout());
    }
    let finished_at = Utc::now();
    circuit::report(&run.card_ref, result.outcome.is_valid());
    let log = |state: LogState, error: Option<String>, recovery: Option<String>| LogRecord {
        correlation_id,
        resource_type: "card",
        resource_id: run.card_ref.clone(),
        scenario: J::SCENARIO,
        state,
        request_summary: result.request_summary.clone(),
        response_summary: result.response_summary.clone(),
        http_status: result.http_status,
        error,
        recovery_summary: recovery,
        started_at,
        finished_at,
    };

    match &result.outcome {
        Outcome::Valid(obs) => {
            if parked_retry {
                if let Err(e) = persist_unpark::<J>(&ctx, &run.card_ref, correlation_id).await {
                    return run.retry_after_infra_error(e).await;
                }
                tracing::info!(%task, card_ref = %run.card_ref, %correlation_id, "parked chain's retry got a valid answer; card un-parked, polling resumes");
            }
            let mut card = card;
            // One re-decision after a version conflict (a callback changed the card meanwhile).
            for attempt in 0..2 {
                if !J::is_change(&card, obs) {
                    return unchanged(&mut run, finished_at).await;
                }
                let record = log(LogState::Succeeded, None, None);
                match persist_change::<J>(&ctx, &card, obs, correlation_id, &record).await {
                    Ok(Applied::Changed { version, .. }) => {
                        count(task, PERSISTED_CHANGE);
                        super::unchanged::count_fleet_outcome(
                            ctx.prefix(),
                            task,
                            PERSISTED_CHANGE,
                            finished_at,
                        );
                        tracing::info!(%task, card_ref = %run.card_ref, %correlation_id, version, change = %J::describe(obs), "card change recorded");
                        if J::ends_chain(obs) {
                            run.finish().await?;
                        } else {
                            run.schedule_next(Count::Reset).await?;
                        }
                        return Ok(PollOutcome::Changed);
                    }
                    Ok(Applied::Unchanged) => return unchanged(&mut run, finished_at).await,
                    Ok(Applied::Conflict) if attempt == 0 => {
                        match cards::load(&ctx.pool, &run.card_ref).await {
                            Ok(Some(fresh)) => {
                                if !fresh.is_pollable(task) {
                                    run.finish().await?;
                                    return Ok(PollOutcome::NotPolled);
                                }
                                card = fresh;
                            }
                            Ok(None) => {
                                run.finish().await?;
                                return Ok(PollOutcome::UnknownCard);
                            }
                            Err(e) => {
                                return run
                                    .retry_after_infra_error(
                                        anyhow::Error::new(e).context("reloading the card"),
                                    )
                                    .await
                            }
                        }
                    }
                    Ok(Applied::Conflict) => {
                        tracing::warn!(%task, card_ref = %run.card_ref, "card changed twice under the poll; next poll decides again");
                        run.schedule_next(Count::Keep).await?;
                        return Ok(PollOutcome::RetryScheduled);
                    }
                    Err(e) if fault::classify_chain(&e) == DbFault::Transient => {
                        return run.retry_after_infra_error(e).await
                    }
                    Err(e) => {
                        // The same write would fail the same way forever: a failure, counted.
                        let reason = format!("the observed change could not be recorded: {e:#}");
                        let record = log(LogState::Failed, None, None);
                        return record_failure(&mut run, record, reason, parked_retry).await;
                    }
                }
            }
            run.schedule_next(Count::Keep).await?;
            Ok(PollOutcome::RetryScheduled)
        }
        Outcome::Failed(failure) | Outcome::Unknown(failure) if circuit::is_probe() => {
            // The Gateway is still failing: the circuit re-opens; this card is not to blame.
            let failures = run.state.failures;
            let delay = backoff(run.interval(), failures + 1);
            tracing::info!(%task, card_ref = %run.card_ref, reason = %failure.reason, retry_in_ms = delay.as_millis() as u64, "circuit probe failed; nothing recorded, failures unchanged");
            run.schedule(failures, delay).await?;
            Ok(PollOutcome::ProbeFailed)
        }
        Outcome::Failed(failure) | Outcome::Unknown(failure) => {
            let state = if result.outcome.is_failed() {
                LogState::Failed
            } else {
                LogState::Unknown
            };
            let record = log(state, None, None);
            record_failure(&mut run, record, failure.reason.clone(), parked_retry).await
        }
    }
}

async fn unchanged<J: PollTask>(
    run: &mut Run<'_, J>,
    at: DateTime<Utc>,
) -> anyhow::Result<PollOutcome> {
    count(J::TASK, SKIPPED_UNCHANGED);
    // The count goes with the successor: one script call updates the card's tally and the
    // fleet's hourly counter (super::unchanged).
    run.schedule_next(Count::Unchanged(at)).await?;
    Ok(PollOutcome::Unchanged)
}

/// The change transaction: terminal `succeeded` log, card update, audit + link, outbox.
async fn persist_change<J: PollTask>(
    ctx: &AppContext,
    card: &Card,
    obs: &J::Obs,
    correlation_id: Uuid,
    record: &LogRecord,
) -> anyhow::Result<Applied> {
    let mut tx = ctx
        .pool
        .begin()
        .await
        .context("starting the change transaction")?;
    let log_id = records::insert_terminal_log(&mut tx, record)
        .await
        .context("writing the poll's integration log")?;
    let applied = J::apply(
        &mut tx,
        card,
        obs,
        correlation_id,
        &ChangeSource::poll(log_id),
    )
    .await
    .context("applying the card change")?;
    match applied {
        Applied::Changed { .. } => {
            tx.commit().await.context("committing the card change")?;
        }
        // Nothing of it should stay: not even the log (the next decision writes its own).
        Applied::Unchanged | Applied::Conflict => {
            tx.rollback().await.context("rolling back")?;
        }
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_and_stays_capped() {
        let interval = Duration::from_secs(30);
        for _ in 0..50 {
            let first = backoff(interval, 1);
            assert!(first >= Duration::from_secs(8) && first <= Duration::from_secs(12));
            let third = backoff(interval, 3);
            assert!(third >= Duration::from_secs(32) && third <= Duration::from_secs(48));
            assert!(backoff(interval, 40) <= BACKOFF_CAP);
        }
        let fast = backoff(Duration::from_millis(200), 1);
        assert!(fast <= Duration::from_millis(240));
    }

    #[test]
    fn the_future_a_poll_job_hands_the_job_service_holds_the_poll_boxed() {
        use cardworker_jobs::PollCardData;

        use crate::runner::RunJob;

        fn future_size<A, B, F>(_f: fn(A, B) -> F) -> usize {
            std::mem::size_of::<F>()
        }
        // The job service, the circuit's carry, the task-local scope and the spawn each move
        // the job's future; the poll's own (kilobytes of state across its Gateway call and its
        // writes) is boxed inside it, so only a pointer to it moves. Were it inline, every poll
        // would copy it several times.
        let poll = future_size(run_poll::<PollCardData>);
        let job = future_size(<PollCardData as RunJob>::run);
        assert!(
            job < 1024 && job < poll / 4,
            "a poll job's future is {job} bytes (the poll's own: {poll})"
        );
    }
}
