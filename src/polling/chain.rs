//! Polling chains in Redis: at most one live chain per card and task.
//!
//! A chain is an entry in `{prefix}:chain:{task}` (card_ref ->
//! `chain_id|unchanged|last|since|state`: the id, the chain's unchanged-poll tally,
//! [`super::unchanged`], and the state of its next job) and one in the chain due set
//! `{prefix}:chain:{task}:due` ([`cardworker_jobs::keys::chain_due`]): the due time of its next
//! poll while that waits, or [`FED`] + that time once its job exists (fed into apalis, running).
//! That one sorted set is both the polling intake (the feeder reads the waiting range and builds
//! each job's payload from its chain entry) and the index reconcile reads (so a waiting poll
//! costs no payload hash entry and no second sorted set: Redis memory per card). Every job carries
//! its chain id; a job whose id is no longer the card's chain is stale and is acknowledged without
//! calling the Gateway. Scheduling the next poll writes the card's entry only if the job's chain is
//! still live (or gone: the job then adopts the card), atomically, so a stale job can never
//! overwrite the entry of the chain that replaced it. The script is
//! `cardworker_jobs::chain::SCRIPT`, shared with the producer API, whose poll jobs merge into the
//! live chain instead of replacing its entry.
//!
//! One file of over 800 lines on purpose: it is the Rust side of one script
//! (`jobs/src/chain.lua`), and every function here builds that script's eight arguments and
//! reads its answers the same way; split, the halves would share the ops' argument order across
//! files. The key names alone stand apart ([`crate::keys`]), since other modules read them. Reconcile's filter (`live.lua`, [`maybe_dead`]) reads the same
//! two keys.
//!
//! A poll's check and successor go through the process's batched calls ([`Via::Batched`],
//! `AppContext::chain_calls`, `queue::batch`): concurrent polls share script calls, each call
//! answered as it would be alone. Everything else calls the script on a connection
//! ([`Via::Direct`]).
//!
//! Every way out of a poll leaves one successor or a deliberate finish: the regular paths in
//! `poll`, an abnormal end (error, panic, timeout) in `poll::after_abnormal_end`, and a successor
//! that Redis refused after the PostgreSQL commit through [`schedule_or_retry`], which keeps
//! trying in the background.
//!
//! Redis holds the schedule, not authoritative state: if it is lost, reconcile restarts every
//! card that should be polled (parking lives in PostgreSQL), and a job that finds no chain adopts
//! the card. The worst case is one extra poll, never a stuck card. A chain that died without its
//! job (its job vanished after it was fed) is found through the due set's FED range, in time
//! proportional to the number of overdue chains ([`overdue`]).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use anyhow::Context as _;
pub use cardworker_jobs::chain::FED;
use cardworker_jobs::{keys, ChainState, Job, PollCardData, PollCardStatus};
use chrono::{DateTime, Utc};
use redis::aio::ConnectionManager;
use redis::Script;

use super::unchanged;
use crate::config::Task;
pub use crate::keys::{chain_key, due_key, late_key, queue_of};
use crate::queue::batch::ScriptCalls;

static CHAIN: LazyLock<Script> = LazyLock::new(|| Script::new(cardworker_jobs::chain::SCRIPT));

/// A polling job: one of the two payloads, seen through its chain.
pub trait PollJob: Job + Clone {
    /// Which task it is.
    const TASK: Task;
    /// A job for `card_ref` in `state`.
    fn new(card_ref: String, state: ChainState) -> Self;
    /// The card.
    fn card_ref(&self) -> &str;
    /// Its chain bookkeeping.
    fn state(&self) -> &ChainState;
}

impl PollJob for PollCardData {
    const TASK: Task = Task::Carddata;
    fn new(card_ref: String, state: ChainState) -> Self {
        Self { card_ref, state }
    }
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn state(&self) -> &ChainState {
        &self.state
    }
}

impl PollJob for PollCardStatus {
    const TASK: Task = Task::CardStatus;
    fn new(card_ref: String, state: ChainState) -> Self {
        Self { card_ref, state }
    }
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn state(&self) -> &ChainState {
        &self.state
    }
}

/// What a running job learns about its chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// The job's chain is the card's live chain.
    Live,
    /// The card had no chain (Redis lost it, or an outside producer enqueued): the job adopted
    /// the card under this chain id.
    Adopted(String),
    /// Another chain replaced this one: acknowledge without calling the Gateway.
    Stale,
    /// The job's chain is live, but it replaced a chain whose poll may still run (a restart by
    /// `enqueue`, `unpark`, reconcile or a producer while that poll was at the Gateway): wait this
    /// long at most, then check again, so that the card is never polled twice at once.
    Busy(Duration),
    /// This very job is running on another delivery (apalis handed it out again while its first
    /// delivery was under way) whose run marker stands this much longer: this delivery must not
    /// poll, and hands the chain to [`defer_when_free`], which writes the deferral once the
    /// marker has stood its time (stale by then if the first delivery wrote its successor).
    Running(Duration),
}

fn invoke<'a>(
    prefix: &str,
    task: Task,
    op: &str,
    card_ref: &str,
    chain: &str,
) -> redis::ScriptInvocation<'a> {
    let mut inv = CHAIN.prepare_invoke();
    for key in keys_of(prefix, task) {
        inv.key(key);
    }
    inv.arg(op).arg(card_ref).arg(chain);
    inv
}

/// The chain script's keys for `task`: chain hash, intake, intake payloads, chain due set.
fn keys_of(prefix: &str, task: Task) -> [String; 4] {
    let queue = queue_of(task);
    [
        chain_key(prefix, task),
        keys::intake(prefix, queue),
        keys::intake_payload(prefix, queue),
        due_key(prefix, task),
    ]
}

/// Where a chain call goes: straight to Redis on a connection (the CLI, reconcile, tests), or
/// into the process's batched calls ([`ScriptCalls`], `AppContext::chain_calls`), which the polls
/// use: their checks and successors then share script calls, the largest part of a poll's
/// Redis cost.
pub enum Via<'a> {
    /// One script call of its own on this connection.
    Direct(&'a mut ConnectionManager),
    /// The next script call of the process's batched calls.
    Batched(&'a ScriptCalls),
}

impl<'a> From<&'a mut ConnectionManager> for Via<'a> {
    fn from(conn: &'a mut ConnectionManager) -> Self {
        Via::Direct(conn)
    }
}

impl<'a> From<&'a ScriptCalls> for Via<'a> {
    fn from(calls: &'a ScriptCalls) -> Self {
        Via::Batched(calls)
    }
}

impl Via<'_> {
    /// Calls the chain script for `task` with `args` (ARGV[1..], at most
    /// [`cardworker_jobs::chain::BATCH_WIDTH`]).
    async fn call<T: redis::FromRedisValue>(
        self,
        prefix: &str,
        task: Task,
        args: Vec<String>,
    ) -> anyhow::Result<T> {
        match self {
            Via::Direct(conn) => {
                let mut inv = CHAIN.prepare_invoke();
                for key in keys_of(prefix, task) {
                    inv.key(key);
                }
                for arg in &args {
                    inv.arg(arg);
                }
                Ok(inv.invoke_async(conn).await?)
            }
            Via::Batched(calls) => {
                let value = calls.call(Arc::from(keys_of(prefix, task)), args).await?;
                Ok(redis::from_redis_value(value)?)
            }
        }
    }
}

/// The owned form of a [`Via`], for a call retried in the background.
enum Link {
    Direct(ConnectionManager),
    Batched(ScriptCalls),
}

impl Link {
    fn of(via: &Via<'_>) -> Self {
        match via {
            Via::Direct(conn) => Link::Direct((**conn).clone()),
            Via::Batched(calls) => Link::Batched((*calls).clone()),
        }
    }

    fn via(&mut self) -> Via<'_> {
        match self {
            Link::Direct(conn) => Via::Direct(conn),
            Link::Batched(calls) => Via::Batched(calls),
        }
    }
}

/// A job's turn as the chain script's ARGV[8]: empty when unknown.
fn turn_arg(turn: u64) -> String {
    if turn == 0 {
        String::new()
    } else {
        turn.to_string()
    }
}

/// A new chain id ([`cardworker_jobs::chain::fresh_chain_id`]: 8 random characters).
fn fresh_chain() -> String {
    cardworker_jobs::chain::fresh_chain_id()
}

use cardworker_jobs::chain::ms;

/// Starts (or restarts, replacing any live chain) the card's chain; its first poll is due after
/// `delay`. Returns the new chain id.
pub async fn start(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    delay: Duration,
) -> anyhow::Result<String> {
    let id = fresh_chain();
    let _: i64 = invoke(prefix, task, "start", card_ref, &id)
        .arg(ms(delay))
        .arg(0)
        .arg(0)
        .invoke_async(conn)
        .await
        .with_context(|| format!("starting the {task} chain of {card_ref}"))?;
    Ok(id)
}

/// Starts the card's chain unless a live one exists (one whose next poll is not overdue by more
/// than `grace`). Returns whether it started one. Used by reconcile.
pub async fn start_if_dead(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    delay: Duration,
    grace: Duration,
) -> anyhow::Result<bool> {
    let id = fresh_chain();
    let started: i64 = invoke(prefix, task, "start_if_dead", card_ref, &id)
        .arg(ms(delay))
        .arg(0)
        .arg(0)
        .arg(ms(grace))
        .invoke_async(conn)
        .await
        .with_context(|| format!("reconciling the {task} chain of {card_ref}"))?;
    Ok(started == 1)
}

/// Cards whose liveness [`maybe_dead`] reads per script call.
pub const LIVENESS_BATCH: usize = 500;

static LIVE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("live.lua")));

/// The cards of `card_refs` that [`start_if_dead`] may act on: those without a live chain (no
/// entry, or one overdue by more than `grace`), and those whose entry is missing from the due
/// index (an entry from before it, which the chain script indexes). Reconcile's filter: one call
/// of `live.lua` per [`LIVENESS_BATCH`] cards reads the chain hash and the due set (`HMGET`,
/// `ZMSCORE`, on the Redis clock) and returns only those cards, so that a pass over cards whose
/// chains are all live costs four commands per 500 cards instead of a script call per card,
/// and each card ref is sent once. Only the chain script decides, atomically: a chain
/// that dies after the read is found by the next pass.
pub async fn maybe_dead<'a>(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_refs: &[&'a str],
    grace: Duration,
) -> anyhow::Result<Vec<&'a str>> {
    let (hash, due) = (chain_key(prefix, task), due_key(prefix, task));
    let mut out = Vec::new();
    for batch in card_refs.chunks(LIVENESS_BATCH) {
        let mut inv = LIVE.prepare_invoke();
        inv.key(&hash).key(&due).arg(ms(grace)).arg(batch);
        let dead: Vec<String> = inv
            .invoke_async(conn)
            .await
            .with_context(|| format!("reading the liveness of {} {task} chains", batch.len()))?;
        // Back in `batch`'s order (the script keeps it), as borrows of the caller's refs.
        let mut dead = dead.into_iter().peekable();
        for card in batch {
            if dead.peek().is_some_and(|d| d == card) {
                out.push(*card);
                dead.next();
            }
        }
    }
    Ok(out)
}

/// Removes the card's chain if it is dead (overdue by more than `grace`): reconcile's answer to an
/// overdue chain of a card that needs no more polling. Returns whether it removed it.
pub async fn drop_if_dead(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    grace: Duration,
) -> anyhow::Result<bool> {
    let dropped: i64 = invoke(prefix, task, "drop_if_dead", card_ref, "")
        .arg(0)
        .arg(0)
        .arg(0)
        .arg(ms(grace))
        .invoke_async(conn)
        .await
        .with_context(|| format!("dropping the dead {task} chain of {card_ref}"))?;
    Ok(dropped == 1)
}

/// Schedules the job's successor (next poll, back-off after a failure, a wait for a replaced
/// chain's poll; a deferral goes through [`defer`]) after
/// `delay`, if the job's chain is still live or gone (the job then adopts the card) and still
/// waits on the job's turn (`next.turn`, the writing job's own; 0 when unknown), leaving the
/// chain's unchanged-poll tally as it is. Returns false for a stale job (nothing written).
pub async fn schedule<'a>(
    via: impl Into<Via<'a>>,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
) -> anyhow::Result<bool> {
    schedule_counted(via, prefix, task, card_ref, next, delay, &Count::Keep).await
}

/// [`schedule`], and in the same script call what the poll did to the chain's unchanged-poll
/// tally ([`Count`]): an unchanged poll costs no round trip of its own.
pub async fn schedule_counted<'a>(
    via: impl Into<Via<'a>>,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
    count: &Count,
) -> anyhow::Result<bool> {
    let tally = match count {
        Count::Keep => "k",
        Count::Reset => "r",
        Count::Unchanged(_) => "u",
    };
    let args = vec![
        "schedule".to_owned(),
        card_ref.to_owned(),
        next.chain.clone(),
        ms(delay).to_string(),
        next.failures.to_string(),
        next.deferrals.to_string(),
        tally.to_owned(),
        turn_arg(next.turn),
    ];
    let done: i64 = via
        .into()
        .call(prefix, task, args)
        .await
        .with_context(|| format!("scheduling the next {task} poll of {card_ref}"))?;
    if let (1, Count::Unchanged(at)) = (done, count) {
        // The fleet-wide hourly counter is added up in this process and written every few
        // seconds: one INCRBY per counter and flush, not one INCR per poll.
        unchanged::count_fleet(prefix, task, *at);
    }
    Ok(done == 1)
}

/// What a deferral's write did ([`defer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deferred {
    /// The deferred poll is the chain's next, after the delay.
    Written,
    /// The chain was replaced or its turn is over: nothing written, the job just ends.
    Stale,
    /// Another delivery of this very job runs its poll, and its run marker stands this much
    /// longer: nothing written ([`defer_when_free`] writes it once the marker has stood its time).
    Running(Duration),
}

/// Writes a deferred job back into its chain, after `delay`, with `next`'s failures and
/// deferrals and the chain's tally kept: [`schedule`]'s write, except that a deferral never takes
/// the turn from another delivery of the same job that checked in and may be at the Gateway
/// ([`Deferred::Running`]; `marker_ttl`, the lease TTL, is how long such a delivery's run marker
/// stands).
pub async fn defer<'a>(
    via: impl Into<Via<'a>>,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
    marker_ttl: Duration,
) -> anyhow::Result<Deferred> {
    let args = vec![
        "defer".to_owned(),
        card_ref.to_owned(),
        next.chain.clone(),
        ms(delay).to_string(),
        next.failures.to_string(),
        next.deferrals.to_string(),
        ms(marker_ttl).to_string(),
        turn_arg(next.turn),
    ];
    let via = via.into();
    let first_deferral = match &via {
        Via::Direct(conn) if next.deferrals == 1 => Some((**conn).clone()),
        _ => None,
    };
    let answer: redis::Value = via
        .call(prefix, task, args)
        .await
        .with_context(|| format!("deferring the {task} poll of {card_ref}"))?;
    let deferred = match answer {
        redis::Value::Int(1) => Deferred::Written,
        redis::Value::Int(_) => Deferred::Stale,
        other => {
            let (_, left): (String, String) =
                redis::from_redis_value(other).with_context(|| {
                    format!("reading the deferral of the {task} poll of {card_ref}")
                })?;
            Deferred::Running(Duration::from_millis(left.parse().unwrap_or(1000)))
        }
    };
    if let (Deferred::Written, Some(mut conn)) = (deferred, first_deferral) {
        note_deferred(&mut conn, prefix, task, card_ref, next.turn).await;
    }
    Ok(deferred)
}

/// Hands a job that another delivery of it is running ([`Deferred::Running`],
/// [`Liveness::Running`]) to a background task: once the running delivery's marker has stood
/// `left`, it writes the job's deferral ([`defer`], `delay` after then). The running delivery has
/// written its successor by then if it lived (the write is stale), and if it died after its
/// check the chain goes on from this write instead of waiting for reconcile. A Redis error is
/// retried with back-off for up to [`RETRY_SUCCESSOR_FOR`], as a successor is. The task is
/// tracked by `shutdown` when given (a stop ends it: reconcile restores the chain if the
/// running delivery died too).
#[allow(clippy::too_many_arguments)]
pub fn defer_when_free(
    mut conn: ConnectionManager,
    shutdown: Option<&crate::shutdown::Shutdown>,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
    marker_ttl: Duration,
    left: Duration,
) {
    let (prefix, card_ref, next) = (prefix.to_owned(), card_ref.to_owned(), next.clone());
    let watch = async move {
        let backoff = crate::backoff::Backoff::new(
            Duration::from_millis(500),
            Duration::from_secs(10),
            crate::backoff::Jitter::Proportional(0.2),
        );
        let started = std::time::Instant::now();
        // A little past the marker's end, so that the write finds it over.
        let mut wait = left + Duration::from_millis(100);
        let mut failed = 0;
        loop {
            tokio::time::sleep(wait).await;
            match defer(
                &mut conn, &prefix, task, &card_ref, &next, delay, marker_ttl,
            )
            .await
            {
                Ok(Deferred::Running(more)) => wait = more + Duration::from_millis(100),
                Ok(done) => {
                    tracing::debug!(%task, %card_ref, ?done, "a second delivery's deferral written once the first delivery's turn was over");
                    return;
                }
                Err(e) if started.elapsed() < RETRY_SUCCESSOR_FOR => {
                    failed += 1;
                    wait = backoff.delay(failed);
                    tracing::debug!(%task, %card_ref, error = %format!("{e:#}"), "a second delivery's deferral refused by Redis; retrying");
                }
                Err(e) => {
                    tracing::error!(%task, %card_ref, error = %format!("{e:#}"), "a second delivery's deferral given up; reconcile restores the chain");
                    return;
                }
            }
        }
    };
    match shutdown {
        Some(shutdown) => shutdown.spawn(watch),
        None => {
            tokio::spawn(watch);
        }
    }
}

/// Keeps the due time of a poll deferred for the first time in its task's late set
/// ([`late_key`]): `turn` is the deferred job's own turn, the due time it was fed for (the local
/// clock when unknown). One command, on a deferral only; a failure costs only the accuracy of
/// the lateness gauges, so it is logged, not returned.
async fn note_deferred(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    turn: u64,
) {
    let due = if turn == 0 {
        u64::try_from(Utc::now().timestamp_millis()).unwrap_or_default()
    } else {
        turn
    };
    let written: redis::RedisResult<i64> = redis::cmd("ZADD")
        .arg(late_key(prefix, task))
        .arg(due)
        .arg(card_ref)
        .query_async(conn)
        .await;
    if let Err(e) = written {
        tracing::debug!(%task, %card_ref, error = %e, "a deferred poll's due time is not in the late set");
    }
}

/// How late one task's polling runs, fleet-wide ([`lateness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lateness {
    /// Polls due and not yet started: waiting to be fed, fed and not running, or deferred.
    pub due_now: u64,
    /// How long past its due time the oldest of them is (zero when none is).
    pub overdue: Duration,
}

/// Entries of the fed range and of the late set [`lateness`] looks at, oldest first: the bound
/// of its one call.
pub const LATENESS_WALK: usize = 256;

static LATENESS: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lateness.lua")));

/// Reads how late the task's polling runs in one script call (`lateness.lua`): the head and
/// count of the due set's due range, the oldest [`LATENESS_WALK`] fed entries not yet running,
/// and the oldest [`LATENESS_WALK`] deferred polls at the time they were first due.
pub async fn lateness(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
) -> anyhow::Result<Lateness> {
    let (now, oldest, due_now): (i64, i64, u64) = LATENESS
        .key(due_key(prefix, task))
        .key(late_key(prefix, task))
        .key(chain_key(prefix, task))
        .arg(FED)
        .arg(LATENESS_WALK)
        .invoke_async(conn)
        .await
        .with_context(|| format!("reading how late the {task} polls run"))?;
    let overdue = if oldest < 0 {
        Duration::ZERO
    } else {
        Duration::from_millis(u64::try_from(now.saturating_sub(oldest)).unwrap_or_default())
    };
    Ok(Lateness { due_now, overdue })
}

/// What a successor's write does to the chain's unchanged-poll tally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Nothing (a deferral, a retry after an infrastructure error, a parked chain waiting).
    Keep,
    /// The poll recorded a change or a failure: the count starts again from 0, since now.
    Reset,
    /// The poll was unchanged (at this time, which picks the fleet-wide hourly counter): one more
    /// in the chain entry's tally, and one more in this process's count for that hour
    /// ([`unchanged::count_fleet`], written every few seconds).
    Unchanged(DateTime<Utc>),
}

/// Checks a running job against the card's chain (adopting the card if it has none). `lease_ttl`
/// (`polling.lease_ttl_secs`) bounds how long a replaced chain's poll can still run: a restarted
/// chain waits for it at most that long after the restart ([`Liveness::Busy`]).
pub async fn check<'a>(
    via: impl Into<Via<'a>>,
    prefix: &str,
    task: Task,
    card_ref: &str,
    state: &ChainState,
    lease_ttl: Duration,
) -> anyhow::Result<Liveness> {
    let args = vec![
        "check".to_owned(),
        card_ref.to_owned(),
        state.chain.clone(),
        fresh_chain(),
        ms(lease_ttl).to_string(),
        String::new(),
        String::new(),
        turn_arg(state.turn),
    ];
    let answer: redis::Value = via
        .into()
        .call(prefix, task, args)
        .await
        .with_context(|| format!("checking the {task} chain of {card_ref}"))?;
    // chain.lua answers a bare 1 for the common case, the job's own chain being live (a reply
    // table per check is a large share of the op's cost to Redis), and `{verdict, chain id}`
    // otherwise.
    if answer == redis::Value::Int(1) {
        return Ok(Liveness::Live);
    }
    let (verdict, id): (String, String) = redis::from_redis_value(answer)
        .with_context(|| format!("reading the check of the {task} chain of {card_ref}"))?;
    Ok(match verdict.as_str() {
        "adopted" => Liveness::Adopted(id),
        "busy" => Liveness::Busy(Duration::from_millis(id.parse().unwrap_or(1000))),
        "running" => Liveness::Running(Duration::from_millis(id.parse().unwrap_or(1000))),
        _ => Liveness::Stale,
    })
}

/// Ends the card's chain (data ready, status final, parked) if it is still the job's chain and
/// the chain still waits on the job's turn (`state.turn`, 0 when unknown).
pub async fn finish(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    state: &ChainState,
) -> anyhow::Result<bool> {
    let done: i64 = invoke(prefix, task, "finish", card_ref, &state.chain)
        .arg("")
        .arg("")
        .arg("")
        .arg("")
        .arg(turn_arg(state.turn))
        .invoke_async(conn)
        .await
        .with_context(|| format!("finishing the {task} chain of {card_ref}"))?;
    Ok(done == 1)
}

/// The live chain of each card (`None` when the card has no chain in Redis).
pub async fn live_chains(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_refs: &[String],
) -> anyhow::Result<Vec<Option<String>>> {
    if card_refs.is_empty() {
        return Ok(Vec::new());
    }
    let raw: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(chain_key(prefix, task))
        .arg(card_refs)
        .query_async(conn)
        .await
        .with_context(|| format!("reading {task} chains"))?;
    Ok(raw
        .into_iter()
        .map(|v| v.map(|s| s.split('|').next().unwrap_or_default().to_owned()))
        .collect())
}

/// How long [`schedule_or_retry`] keeps trying a successor Redis refused.
pub const RETRY_SUCCESSOR_FOR: Duration = Duration::from_secs(3600);

/// [`schedule`], and if Redis refuses (an outage after the job's PostgreSQL commit), keeps trying
/// in the background with back-off until Redis answers: the successor is the chain's only future,
/// and the chain-checked write stays safe however late it lands. Returns `false` only for a stale
/// chain (nothing to write); `true` when written now or handed to the background.
pub async fn schedule_or_retry<'a>(
    via: impl Into<Via<'a>>,
    shutdown: &crate::shutdown::Shutdown,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
) -> bool {
    schedule_counted_or_retry(
        via,
        shutdown,
        prefix,
        task,
        card_ref,
        next,
        delay,
        Count::Keep,
    )
    .await
}

/// [`schedule_or_retry`] with the tally change of [`schedule_counted`] (retried with it).
#[allow(clippy::too_many_arguments)]
pub async fn schedule_counted_or_retry<'a>(
    via: impl Into<Via<'a>>,
    shutdown: &crate::shutdown::Shutdown,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
    count: Count,
) -> bool {
    let via = via.into();
    let link = Link::of(&via);
    match schedule_counted(via, prefix, task, card_ref, next, delay, &count).await {
        Ok(written) => written,
        Err(e) => {
            let (mut link, prefix, card_ref, next) =
                (link, prefix.to_owned(), card_ref.to_owned(), next.clone());
            tracing::warn!(%task, %card_ref, error = %format!("{e:#}"), "successor refused by Redis; retrying in the background");
            shutdown.spawn(async move {
                let backoff = crate::backoff::Backoff::new(
                    Duration::from_millis(500),
                    Duration::from_secs(10),
                    crate::backoff::Jitter::Proportional(0.2),
                );
                let started = std::time::Instant::now();
                let mut attempt = 0;
                loop {
                    attempt += 1;
                    tokio::time::sleep(backoff.delay(attempt)).await;
                    match schedule_counted(
                        link.via(),
                        &prefix,
                        task,
                        &card_ref,
                        &next,
                        delay,
                        &count,
                    )
                    .await
                    {
                        Ok(written) => {
                            tracing::info!(%task, %card_ref, attempt, written, "successor written after Redis came back");
                            return;
                        }
                        Err(e) if started.elapsed() < RETRY_SUCCESSOR_FOR => {
                            tracing::debug!(%task, %card_ref, attempt, error = %format!("{e:#}"), "successor still refused");
                        }
                        Err(e) => {
                            tracing::error!(%task, %card_ref, error = %format!("{e:#}"), "successor given up; reconcile restores the chain");
                            return;
                        }
                    }
                }
            });
            true
        }
    }
}

/// Up to `limit` cards of each range of the due set whose chain was due before `before_ms` (unix
/// ms, Redis clock), oldest first: first the chains whose job was fed that long ago and never
/// wrote a successor (the FED range: the job vanished), then those still waiting (the feeder fell
/// that far behind). Two range reads in one round trip, however many cards there are.
pub async fn overdue(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    before_ms: u64,
    limit: usize,
) -> anyhow::Result<Vec<String>> {
    let key = due_key(prefix, task);
    let (mut fed, waiting): (Vec<String>, Vec<String>) = redis::pipe()
        .cmd("ZRANGEBYSCORE")
        .arg(&key)
        .arg(FED)
        .arg(format!("({}", FED + before_ms))
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .cmd("ZRANGEBYSCORE")
        .arg(&key)
        .arg("-inf")
        .arg(format!("({before_ms}"))
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .query_async(conn)
        .await
        .with_context(|| format!("reading the overdue {task} chains"))?;
    fed.extend(waiting);
    Ok(fed)
}

/// When the card's next poll is due (Redis clock), and whether its job already exists (fed into
/// apalis or running: it is then the due time it was fed for). `None` without an entry.
pub async fn next_due(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
) -> anyhow::Result<Option<(DateTime<Utc>, bool)>> {
    let score: Option<f64> = redis::cmd("ZSCORE")
        .arg(due_key(prefix, task))
        .arg(card_ref)
        .query_async(conn)
        .await
        .with_context(|| format!("reading when the {task} chain of {card_ref} is due"))?;
    Ok(score.and_then(|s| {
        let s = s as u64;
        let (due, fed) = if s >= FED {
            (s - FED, true)
        } else {
            (s, false)
        };
        DateTime::from_timestamp_millis(i64::try_from(due).ok()?).map(|d| (d, fed))
    }))
}

/// The Redis clock, unix milliseconds (every due time is on it).
pub async fn redis_now_ms(conn: &mut ConnectionManager) -> anyhow::Result<u64> {
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(conn)
        .await
        .context("reading the Redis clock")?;
    Ok(secs * 1000 + micros / 1000)
}
