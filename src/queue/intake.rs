//! The bounded intake: moves due entries into apalis only while a queue's apalis backlog is under
//! the high-water mark, and trims what apalis keeps of finished jobs.
//!
//! Every process runs one [`Feeder`]; the Lua scripts are atomic, so any number of pods can feed
//! and trim the same queues concurrently without moving an entry twice.
//!
//! What it costs Redis. A feed tick (every 200 ms) reads the deployment's due hint
//! ([`cardworker_jobs::keys::intake_due_hint`]: intake key -> a time never later than its earliest
//! entry; every intake writer lowers it, each feed sets it exactly): one command for every queue.
//! Only a queue whose hint is due is fed, and the feed script makes the apalis task ids itself.
//! When a read finds nothing due, the feeder remembers the earliest hinted time and sends nothing
//! on the ticks before it, unless a writer announces an earlier entry ([`super::announce`]: the
//! writer publishes when it lowered the hint), the subscription was lost or renewed, or
//! [`QUIET_READ_EVERY_TICKS`] ticks passed: an idle pod reads the hint once a second. Every
//! [`SWEEP_EVERY_TICKS`] ticks it sweeps instead: the earliest entry of every intake, in one
//! pipeline, feeding what is due and repairing the hint; an entry written by a producer that does
//! not lower the hint (an older build) waits at most that long (10 s), and a hint lost with Redis
//! comes back. Trimming visits the queues this pod fed lately, and every queue once a minute. When
//! a feed moves jobs, this process's workers of that queue are woken ([`super::wake`]), so a job
//! that becomes due is fetched within one tick.

use std::sync::LazyLock;
use std::time::Duration;

use anyhow::Context as _;
use redis::aio::ConnectionManager;
use redis::Script;

use super::QueueName;
use crate::telemetry::metrics as m;

/// apalis backlog (active + scheduled) per queue above which the feeder waits. apalis-redis
/// 1.0.0 fails every fetch once about 8,000 jobs are due at once; 2,000 leaves a wide margin.
pub const HIGH_WATER_MARK: usize = 2_000;
/// Entries moved per script call (bounded, so one call never blocks Redis for long).
pub const FEED_BATCH: usize = 500;
/// How long dead jobs stay inspectable in apalis before they are trimmed.
pub const DEAD_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Sweep stale worker metadata every this many trim passes.
const WORKER_SWEEP_EVERY: u64 = 60;
/// Done ids trimmed per script call.
const TRIM_BATCH: usize = 1_000;
/// Every this many feed ticks the feeder sweeps every intake instead of trusting the due hint
/// ([`sweep_queues`]): entries written by a producer that does not lower the hint (a build from
/// before it) wait at most this many ticks, and a hint lost with Redis is rebuilt.
pub const SWEEP_EVERY_TICKS: u64 = 50;
/// How far past its own estimate of the Redis clock the feeder reads the due hint: the estimate
/// (this process's clock plus the offset seen in the last feed) may lag by a round trip, and an
/// entry read a little early costs only a feed call that moves nothing (the script decides on the
/// Redis clock).
const HINT_SLACK_MS: i64 = 20;
/// Every this many trim passes every queue is trimmed (dead jobs past retention, done jobs acked
/// for jobs another pod fed); in between only the queues this pod fed lately.
const FULL_TRIM_EVERY: u64 = 12;
/// While the feeder may skip ticks (nothing due by the earliest time it knows of, and the
/// announcements live), it still reads the due hint every this many ticks (1 s at the default
/// 200 ms): the bound on what a message lost on a silently dead subscription can delay.
pub const QUIET_READ_EVERY_TICKS: u64 = 5;

static FEED: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("feed.lua")));
static TRIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("trim.lua")));

/// What one feed call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fed {
    /// Entries moved into apalis.
    pub moved: usize,
    /// apalis backlog (active + scheduled) afterwards.
    pub backlog: usize,
    /// Entries still waiting in the intake (due or not).
    pub waiting: usize,
    /// Entries moved straight to the dead set (not valid UTF-8: apalis could not decode them).
    pub poisoned: usize,
    /// The Redis clock when the script ran (unix ms): the feeder corrects its own clock with it
    /// when it asks the due hint.
    pub redis_now_ms: i64,
}

/// 12 random Crockford base32 characters: the per-call part of the task ids feed.lua makes.
fn id_nonce() -> String {
    // The 16 random characters of a fresh ULID; 12 of them carry 60 random bits.
    ulid::Ulid::new().to_string()[10..22].to_owned()
}

/// Moves up to [`FEED_BATCH`] due entries of one queue into apalis.
pub async fn feed_once(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<Fed> {
    let mut inv = FEED.prepare_invoke();
    inv.key(&queue.intake)
        .key(&queue.intake_payload)
        .key(format!("{}:active", queue.apalis))
        .key(format!("{}:scheduled", queue.apalis))
        .key(format!("{}:data", queue.apalis))
        .key(format!("{}:signal", queue.apalis))
        .key(format!("{}:meta", queue.apalis))
        .key(format!("{}:dead", queue.apalis))
        .key(&queue.due_hint);
    let (moved, backlog, waiting, poisoned, redis_now_ms): (usize, usize, usize, usize, i64) = inv
        .arg(HIGH_WATER_MARK)
        .arg(FEED_BATCH)
        .arg(id_nonce())
        .invoke_async(conn)
        .await
        .with_context(|| format!("feeding queue {}", queue.apalis))?;
    if poisoned > 0 {
        metrics::counter!(m::JOBS_FINISHED, "queue" => queue.short.clone(), "result" => "dead")
            .increment(poisoned as u64);
        tracing::error!(queue = %queue.short, poisoned, "intake entries that are not valid UTF-8 moved to the dead set (reason in their meta hash)");
    }
    Ok(Fed {
        moved,
        backlog,
        waiting,
        poisoned,
        redis_now_ms,
    })
}

/// Feeds one queue until nothing more is due or the high-water mark is reached. Wakes this
/// process's workers of the queue when it moved anything ([`super::wake`]).
pub async fn feed(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<Fed> {
    let mut moved = 0;
    let result = loop {
        let fed = feed_once(conn, queue).await?;
        moved += fed.moved;
        if fed.moved + fed.poisoned < FEED_BATCH || fed.backlog >= HIGH_WATER_MARK {
            break fed;
        }
    };
    if moved > 0 {
        super::wake::notify(&queue.apalis);
    }
    Ok(result)
}

/// What the due hint says at `now_ms`: the queues (indices into `queues`) whose hint is at or
/// before it, those that may have an entry due, and the earliest hint after it (`None`: no
/// queue has one). One command for every queue of the deployment.
pub async fn due_queues(
    conn: &mut ConnectionManager,
    queues: &[QueueName],
    now_ms: i64,
) -> anyhow::Result<(Vec<usize>, Option<i64>)> {
    let Some(first) = queues.first() else {
        return Ok((Vec::new(), None));
    };
    // The whole hint (one member per queue): which are due, and when the next one is.
    let hint: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&first.due_hint)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(conn)
        .await
        .context("reading the intakes' due hint")?;
    let mut due = Vec::new();
    let mut next: Option<i64> = None;
    for (i, q) in queues.iter().enumerate() {
        let Some((_, at)) = hint.iter().find(|(k, _)| *k == q.intake) else {
            continue;
        };
        if *at <= now_ms as f64 {
            due.push(i);
        } else {
            // Rounded down: waking a millisecond early costs one read, late would cost latency.
            let at = at.floor() as i64;
            next = Some(next.map_or(at, |n| n.min(at)));
        }
    }
    Ok((due, next))
}

/// The sweep of [`Feeder::feed_tick`]: reads the earliest entry of every intake and the whole due
/// hint in one pipeline, repairs the hint where
/// it is missing or later than a queue's earliest waiting entry (an entry written without lowering
/// it), and returns the queues with an entry due by `now_ms`. One command per set, plus one; the
/// repair only when something needs it.
pub async fn sweep_queues(
    conn: &mut ConnectionManager,
    queues: &[QueueName],
    now_ms: i64,
) -> anyhow::Result<Vec<usize>> {
    let Some(first) = queues.first() else {
        return Ok(Vec::new());
    };
    let mut pipe = redis::pipe();
    pipe.cmd("ZRANGE")
        .arg(&first.due_hint)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES");
    for q in queues {
        pipe.cmd("ZRANGE")
            .arg(&q.intake)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES");
    }
    let mut answers: Vec<Vec<(String, f64)>> = pipe
        .query_async(conn)
        .await
        .context("sweeping the intakes' earliest entries")?;
    let hint: Vec<(String, f64)> = if answers.is_empty() {
        Vec::new()
    } else {
        answers.remove(0)
    };
    let mut answers = answers.into_iter();
    let mut due = Vec::new();
    let mut repair = redis::pipe();
    let mut repairs = 0;
    for (i, q) in queues.iter().enumerate() {
        let earliest: Option<f64> = answers.next().and_then(|e| e.first().map(|(_, s)| *s));
        let Some(at) = earliest.as_ref() else {
            continue;
        };
        let hinted = hint.iter().find(|(k, _)| *k == q.intake).map(|(_, s)| *s);
        if hinted.is_none_or(|h| h > *at) {
            repair
                .cmd("ZADD")
                .arg(&q.due_hint)
                .arg("LT")
                .arg(*at)
                .arg(&q.intake)
                .ignore();
            repairs += 1;
        }
        if *at <= now_ms as f64 {
            due.push(i);
        }
    }
    if repairs > 0 {
        let _: () = repair
            .query_async(conn)
            .await
            .context("repairing the intakes' due hint")?;
        tracing::debug!(
            repairs,
            "intake due hint repaired (entries written without lowering it)"
        );
    }
    Ok(due)
}

/// What one trim pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trimmed {
    /// Done jobs whose bookkeeping was removed.
    pub done: usize,
    /// Dead jobs past retention whose bookkeeping was removed.
    pub dead: usize,
}

/// Trims every finished job of one queue: all done jobs, and the dead ones past `dead_retention`.
pub async fn trim(
    conn: &mut ConnectionManager,
    queue: &QueueName,
    dead_retention: Duration,
) -> anyhow::Result<Trimmed> {
    let mut total = Trimmed::default();
    let mut cursor = "0".to_owned();
    loop {
        let (done, dead, next): (usize, usize, String) = TRIM
            .key(format!("{}:done", queue.apalis))
            .key(format!("{}:dead", queue.apalis))
            .key(format!("{}:data", queue.apalis))
            .key(format!("{}:meta", queue.apalis))
            .arg(TRIM_BATCH)
            .arg(dead_retention.as_secs())
            .arg(&cursor)
            .arg(TRIM_BATCH)
            .invoke_async(conn)
            .await
            .with_context(|| format!("trimming queue {}", queue.apalis))?;
        total.done += done;
        total.dead += dead;
        cursor = next;
        if done < TRIM_BATCH && cursor == "0" {
            return Ok(total);
        }
    }
}

/// Removes the metadata apalis-redis leaves for every worker that ever registered on a queue
/// (`{queue}:workers:metadata:{name}`): once apalis has dropped a worker from `{queue}:workers`
/// (graceful stop, or orphan recovery after a crash re-enqueued its jobs), the hash is dead
/// weight, and unique worker names would otherwise leave one per pod start forever.
pub async fn trim_workers(
    conn: &mut ConnectionManager,
    queue: &QueueName,
) -> anyhow::Result<usize> {
    let pattern = format!("{}:workers:metadata:*", queue.apalis);
    let workers_set = format!("{}:workers", queue.apalis);
    let prefix_len = pattern.len() - 1;
    let mut cursor: u64 = 0;
    let mut removed = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(500)
            .query_async(conn)
            .await
            .with_context(|| format!("scanning worker metadata of {}", queue.apalis))?;
        for key in keys {
            let name = &key[prefix_len..];
            let seen: Option<f64> = redis::cmd("ZSCORE")
                .arg(&workers_set)
                .arg(name)
                .query_async(conn)
                .await
                .context("reading a worker's heartbeat")?;
            if seen.is_none() {
                let _: () = redis::cmd("DEL")
                    .arg(&key)
                    .query_async(conn)
                    .await
                    .context("deleting stale worker metadata")?;
                removed += 1;
            }
        }
        if next == 0 {
            return Ok(removed);
        }
        cursor = next;
    }
}

/// Adds the read of one queue's waiting entries (its intake's) to `pipe`.
fn waiting_reads(pipe: &mut redis::Pipeline, queue: &QueueName) {
    pipe.zcard(&queue.intake);
}

/// Entries waiting in one queue's intake. One round trip.
pub async fn waiting(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<u64> {
    let mut pipe = redis::pipe();
    waiting_reads(&mut pipe, queue);
    let counts: Vec<u64> = pipe
        .query_async(conn)
        .await
        .with_context(|| format!("reading the intake of queue {}", queue.apalis))?;
    Ok(counts.iter().sum())
}

/// Jobs waiting in one queue, fleet-wide: intake entries plus the apalis backlog.
pub async fn depth(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<u64> {
    let mut pipe = redis::pipe();
    waiting_reads(&mut pipe, queue);
    pipe.llen(format!("{}:active", queue.apalis))
        .zcard(format!("{}:scheduled", queue.apalis));
    let counts: Vec<u64> = pipe
        .query_async(conn)
        .await
        .with_context(|| format!("reading the depth of queue {}", queue.apalis))?;
    Ok(counts.iter().sum())
}

/// Publishes `cardworker_queue_depth` for every queue; stops at the first queue it cannot read.
pub async fn publish_depths(
    conn: &mut ConnectionManager,
    queues: &[QueueName],
) -> anyhow::Result<()> {
    for queue in queues {
        let d = depth(conn, queue).await?;
        metrics::gauge!(m::QUEUE_DEPTH, "queue" => queue.short.clone()).set(d as f64);
    }
    Ok(())
}

/// The feeder of one process: feeds every queue every `interval`, and trims finished jobs every
/// `trim_every`. Errors (Redis unreachable, say) are logged and counted and the loop goes on: the
/// intake keeps its entries, so nothing is lost while Redis is away.
pub struct Feeder {
    /// Shared Redis connection.
    pub conn: ConnectionManager,
    /// Every queue of the deployment.
    pub queues: Vec<QueueName>,
    /// Feed period.
    pub interval: Duration,
    /// Trim period.
    pub trim_every: Duration,
    /// The Redis probe's verdict: while Redis is down the feeder skips its ticks instead of
    /// logging one failure per queue every interval.
    pub redis: crate::telemetry::RedisStatus,
    /// The process's subscription to earlier-due announcements ([`super::announce`]): while it
    /// is live, a tick with nothing due by the time the feeder knows of sends nothing. `None`:
    /// the due hint is read on every tick.
    pub announcements: Option<super::announce::Announcements>,
}

/// What a [`Feeder`] remembers between its ticks.
#[derive(Debug, Default)]
pub struct FeedState {
    /// Feed ticks so far.
    ticks: u64,
    /// Trim passes so far.
    trims: u64,
    /// The Redis clock minus this process's clock, in ms, from the last feed call.
    offset_ms: i64,
    /// The trim pass at which this pod last fed each queue.
    fed_at: Vec<Option<u64>>,
    /// The earliest due hint after the last read that found nothing due (unix ms on the Redis
    /// clock), `Some(i64::MAX)` when no queue had one; `None` when unknown, so the next tick
    /// reads. Only meaningful together with a live subscription of [`Self::generation`].
    horizon_ms: Option<i64>,
    /// The subscription generation the horizon was read under.
    generation: u64,
    /// Ticks since the hint was last read.
    quiet_ticks: u64,
}

impl Feeder {
    /// Runs until `shutdown` resolves.
    ///
    /// Each feed tick asks the due hint which queues may have an entry due (one command) and feeds
    /// only those; every [`SWEEP_EVERY_TICKS`] ticks it feeds every queue. A queue is trimmed
    /// when this pod fed it within the last two trim periods, and every queue every
    /// `FULL_TRIM_EVERY` passes. An idle pod therefore sends one command per feed tick, plus
    /// the sweeps.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut feed_tick = tokio::time::interval(self.interval);
        feed_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut trim_tick = tokio::time::interval(self.trim_every);
        trim_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut state = FeedState::default();
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = feed_tick.tick() => {
                    if self.redis.is_up() {
                        self.feed_tick(&mut state).await;
                    }
                }
                _ = trim_tick.tick() => {
                    if self.redis.is_up() {
                        self.trim_pass(&mut state).await;
                    }
                }
            }
        }
    }

    /// One feed tick: feeds the queues the due hint names (on a sweep tick, the first one
    /// included, those whose earliest entry is due). Returns the entries moved. Errors are logged
    /// and counted.
    ///
    /// With live announcements, a tick sends nothing while the earliest due time the feeder
    /// knows of (from its last read of the hint, or announced since) is still ahead, for at
    /// most [`QUIET_READ_EVERY_TICKS`] ticks in a row ([`super::announce`]).
    pub async fn feed_tick(&mut self, state: &mut FeedState) -> usize {
        state.fed_at.resize(self.queues.len(), None);
        let sweep = state.ticks.is_multiple_of(SWEEP_EVERY_TICKS);
        state.ticks += 1;
        let now_ms = local_ms() + state.offset_ms + HINT_SLACK_MS;
        if !sweep && self.may_skip(state, now_ms) {
            state.quiet_ticks += 1;
            return 0;
        }
        state.quiet_ticks = 0;
        // Taken before the read: an announcement racing it stays for the next decision.
        if let Some(a) = &self.announcements {
            a.take();
            state.generation = a.generation();
        }
        let due = if sweep {
            sweep_queues(&mut self.conn, &self.queues, now_ms)
                .await
                .map(|due| (due, None))
        } else {
            due_queues(&mut self.conn, &self.queues, now_ms).await
        };
        let (due, next) = {
            match due {
                Ok(due) => due,
                Err(e) => {
                    state.horizon_ms = None;
                    metrics::counter!("cardworker_intake_errors_total", "op" => "feed")
                        .increment(1);
                    tracing::warn!(error = %format!("{e:#}"), "reading the intakes' due hint failed; will retry");
                    return 0;
                }
            }
        };
        // Nothing due: sleep until the next hinted time. Something due (or a sweep, which reads
        // no scores): read again next tick, since a feed changes the hint.
        state.horizon_ms = (!sweep && due.is_empty()).then(|| next.unwrap_or(i64::MAX));
        let mut moved = 0;
        for i in due {
            let queue = &self.queues[i];
            match feed(&mut self.conn, queue).await {
                Ok(fed) => {
                    state.offset_ms = fed.redis_now_ms - local_ms();
                    if fed.moved + fed.poisoned > 0 {
                        state.fed_at[i] = Some(state.trims);
                    }
                    moved += fed.moved;
                }
                Err(e) => {
                    metrics::counter!("cardworker_intake_errors_total", "op" => "feed")
                        .increment(1);
                    tracing::warn!(queue = %queue.short, error = %format!("{e:#}"), "intake feed failed; will retry");
                }
            }
        }
        moved
    }

    /// Whether this tick may send nothing: the announcements are live and of the generation the
    /// horizon was read under, nothing is due by the horizon or by an announcement, and the
    /// hint was read within [`QUIET_READ_EVERY_TICKS`] ticks.
    fn may_skip(&self, state: &FeedState, now_ms: i64) -> bool {
        let Some(a) = &self.announcements else {
            return false;
        };
        let Some(horizon) = state.horizon_ms else {
            return false;
        };
        let quiet = state.quiet_ticks + 1 < QUIET_READ_EVERY_TICKS;
        let next = a.earliest().map_or(horizon, |at| at.min(horizon));
        quiet && a.live() && a.generation() == state.generation && now_ms < next
    }

    /// One trim pass: the queues this pod fed within the last two passes, or every queue on a
    /// full pass (the first one included). Errors are logged and counted.
    pub async fn trim_pass(&mut self, state: &mut FeedState) {
        state.fed_at.resize(self.queues.len(), None);
        let full = state.trims.is_multiple_of(FULL_TRIM_EVERY);
        state.trims += 1;
        let trims = state.trims;
        for (i, queue) in self.queues.iter().enumerate() {
            // Worker metadata accumulates per pod start, not per job: a slow sweep.
            if trims.is_multiple_of(WORKER_SWEEP_EVERY) {
                if let Err(e) = trim_workers(&mut self.conn, queue).await {
                    tracing::warn!(queue = %queue.short, error = %format!("{e:#}"), "worker metadata sweep failed; will retry");
                }
            }
            // Fed in this period or the one before: its jobs may be acked by now.
            let recent = state.fed_at[i].is_some_and(|at| at + 2 >= trims);
            if !(full || recent) {
                continue;
            }
            if let Err(e) = trim(&mut self.conn, queue, DEAD_RETENTION).await {
                metrics::counter!("cardworker_intake_errors_total", "op" => "trim").increment(1);
                tracing::warn!(queue = %queue.short, error = %format!("{e:#}"), "trim failed; will retry");
            }
        }
    }
}

/// This process's clock, unix ms.
fn local_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
