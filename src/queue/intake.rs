//! The bounded intake: moves due entries into apalis only while a queue's apalis backlog is under
//! the high-water mark, and trims what apalis keeps of finished jobs.
//!
//! Every process runs one [`Feeder`]; the Lua scripts are atomic, so any number of pods can feed
//! and trim the same queues concurrently without moving an entry twice.

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

static FEED: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("feed.lua")));
static TRIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("trim.lua")));

/// What one feed call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fed {
    /// Entries moved into apalis.
    pub moved: usize,
    /// apalis backlog (active + scheduled) afterwards.
    pub backlog: usize,
    /// Entries still in the intake (due or not).
    pub waiting: usize,
    /// Entries moved straight to the dead set (not valid UTF-8: apalis could not decode them).
    pub poisoned: usize,
}

/// Moves up to [`FEED_BATCH`] due entries of one queue into apalis.
pub async fn feed_once(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<Fed> {
    let mut invocation = FEED.prepare_invoke();
    invocation
        .key(&queue.intake)
        .key(&queue.intake_payload)
        .key(format!("{}:active", queue.apalis))
        .key(format!("{}:scheduled", queue.apalis))
        .key(format!("{}:data", queue.apalis))
        .key(format!("{}:signal", queue.apalis))
        .key(format!("{}:meta", queue.apalis))
        .key(format!("{}:dead", queue.apalis))
        .arg(HIGH_WATER_MARK);
    for _ in 0..FEED_BATCH {
        invocation.arg(ulid::Ulid::new().to_string());
    }
    let (moved, backlog, waiting, poisoned): (usize, usize, usize, usize) = invocation
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
    })
}

/// Feeds one queue until nothing more is due or the high-water mark is reached.
pub async fn feed(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<Fed> {
    loop {
        let fed = feed_once(conn, queue).await?;
        if fed.moved + fed.poisoned < FEED_BATCH || fed.backlog >= HIGH_WATER_MARK {
            return Ok(fed);
        }
    }
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

/// Jobs waiting in one queue, fleet-wide: intake entries plus the apalis backlog.
pub async fn depth(conn: &mut ConnectionManager, queue: &QueueName) -> anyhow::Result<u64> {
    let (intake, active, scheduled): (u64, u64, u64) = redis::pipe()
        .zcard(&queue.intake)
        .llen(format!("{}:active", queue.apalis))
        .zcard(format!("{}:scheduled", queue.apalis))
        .query_async(conn)
        .await
        .with_context(|| format!("reading the depth of queue {}", queue.apalis))?;
    Ok(intake + active + scheduled)
}

/// Publishes `cardworker_queue_depth` for every queue.
pub async fn publish_depths(conn: &mut ConnectionManager, queues: &[QueueName]) {
    for queue in queues {
        match depth(conn, queue).await {
            Ok(d) => metrics::gauge!(m::QUEUE_DEPTH, "queue" => queue.short.clone()).set(d as f64),
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "queue depth unavailable"),
        }
    }
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
}

impl Feeder {
    /// Runs until `shutdown` resolves.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut feed_tick = tokio::time::interval(self.interval);
        feed_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut trim_tick = tokio::time::interval(self.trim_every);
        trim_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut trims: u64 = 0;
        loop {
            tokio::select! {
                _ = &mut shutdown => return,
                _ = feed_tick.tick() => {
                    if !self.redis.is_up() {
                        continue;
                    }
                    for queue in &self.queues {
                        if let Err(e) = feed(&mut self.conn, queue).await {
                            metrics::counter!("cardworker_intake_errors_total", "op" => "feed").increment(1);
                            tracing::warn!(queue = %queue.short, error = %format!("{e:#}"), "intake feed failed; will retry");
                        }
                    }
                }
                _ = trim_tick.tick() => {
                    if !self.redis.is_up() {
                        continue;
                    }
                    trims += 1;
                    for queue in &self.queues {
                        // Worker metadata accumulates per pod start, not per job: a slow sweep.
                        if trims.is_multiple_of(WORKER_SWEEP_EVERY) {
                            if let Err(e) = trim_workers(&mut self.conn, queue).await {
                                tracing::warn!(queue = %queue.short, error = %format!("{e:#}"), "worker metadata sweep failed; will retry");
                            }
                        }
                        if let Err(e) = trim(&mut self.conn, queue, DEAD_RETENTION).await {
                            metrics::counter!("cardworker_intake_errors_total", "op" => "trim").increment(1);
                            tracing::warn!(queue = %queue.short, error = %format!("{e:#}"), "trim failed; will retry");
                        }
                    }
                }
            }
        }
    }
}
