//! Spawning workers and cron schedules under the [`Supervisor`]: each is handed over as a recipe
//! (a factory), so that the supervisor can build it again after a Redis outage.
//!
//! # Each queue beats at its own pace
//! An idle apalis-redis worker costs Redis about ten commands per heartbeat: its keep-alive, the
//! orphan check of its peers, and the fetch that follows each beat. Most queues beat every
//! [`HEARTBEAT`] (5 s); the quiet ones, which see a job a minute or less (payment and approval
//! recovery, reconcile, archive, retention), every [`QUIET_HEARTBEAT`] (30 s), through
//! [`RunJob::HEARTBEAT`]: an idle pod's heartbeats are most of what it costs Redis, so the
//! queues that rarely see a job beat less often. A job this pod's feeder moves into a quiet queue
//! is fetched at once all the same (the feeder wakes its own workers, [`crate::queue::wake`]);
//! only a job that waits for another pod's quiet worker (its feeding pod's worker busy, or an
//! orphan re-queued by apalis) may wait up to one quiet beat. Everything below uses the queue's
//! own beat.
//!
//! # A worker is never declared dead while its jobs run within their timeouts
//! apalis-redis writes a worker's heartbeat only when the worker's stream is polled in its
//! ready state; while every slot holds a long job (and fetched jobs wait in its buffer) the
//! heartbeat stops, a peer's heartbeat finds it older than the orphan window, re-queues the
//! worker's in-flight jobs (a second run of each) and drops the worker, whose own next heartbeat
//! then fails (`worker not registered`) and stops the process. Two defences, both always on:
//! - **a heartbeat of our own** ([`keep_heartbeat`]): a task beside each worker refreshes the
//!   worker's score every beat of its queue, whatever its slots are doing, while the worker has
//!   a job in flight. It only refreshes a worker that is still registered (`ZADD XX`): one that a
//!   peer has already declared dead stays dead, as apalis expects.
//! - **an orphan window that follows the job's timeout** ([`missed_heartbeats`]): each queue's
//!   window is at least its job's timeout plus [`ORPHAN_MARGIN`] and plus two of its beats, and
//!   never under [`MIN_MISSED_HEARTBEATS`] beats, so that even apalis's own heartbeat alone
//!   (which may pause for as long as one job holds the last slot, and then comes up to a beat
//!   later) never lets the window pass under a job that runs within its timeout. It is derived
//!   from the same `RunJob::timeout` the job service enforces, at start-up, so no configuration
//!   can make the window shorter than a job.
//!
//! The price: the jobs of a pod that really died come back after that window (25 s for polls
//! with the default `handler_timeout_secs = 15`) instead of 15 s.

use std::str::FromStr as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use apalis::layers::limit::ConcurrencyLimitLayer;
use apalis::prelude::*;
use apalis_core::worker::lifecycle::LifecycleService;
use apalis_cron::{CronScheduler, Tick};
use apalis_redis::RedisStorage;
use chrono_tz::{Asia::Shanghai, Tz};
use futures::FutureExt as _;
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;
use tower::layer::util::{Identity, Stack};
use tower::{Layer, Service};

use super::{JobService, RunJob, Scheduled, Supervisor};
use crate::context::AppContext;
use crate::pod;
use crate::queue::backend::QueueBackend;

// An idle worker asks apalis for work after each of its heartbeats (every beat of its queue,
// [`RunJob::HEARTBEAT`]: apalis fetches when its stream is driven again) and at once when this
// process's feeder moved jobs into its queue ([`crate::queue::wake`]). Jobs moved by another pod's
// feeder, or re-queued by apalis itself (an orphan, a retry of `keep_for_apalis`), are fetched by
// this pod within a beat; the feeding pod's own workers fetch them at once. There is no polling
// fetch of its own: a timer beside the heartbeat's fetch would only add fetches that find nothing
// (an idle pod's commands come mostly from its workers' fetches).

/// How often a worker's heartbeat is written (by apalis, and by [`keep_heartbeat`]), for every
/// queue but the quiet ones.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// The heartbeat of the quiet queues (a job a minute or less: the recoveries, reconcile,
/// maintenance). A job that waits for another pod's quiet worker waits up to this long.
pub const QUIET_HEARTBEAT: Duration = Duration::from_secs(30);
/// Beats of a queue's heartbeat that its orphan window adds to its job's timeout at least: the
/// worst gap between two of apalis's own heartbeats is one job in the last slot plus one beat.
pub const MARGIN_BEATS: u32 = 2;
/// The fewest missed heartbeats after which a worker counts as dead (apalis's default is 10).
pub const MIN_MISSED_HEARTBEATS: usize = 3;
/// What the orphan window adds to a job's timeout: the job service's acknowledgement and, for
/// polls, the budget layer's acquire and release (each bounded by a 2 s Redis timeout).
pub const ORPHAN_MARGIN: Duration = Duration::from_secs(10);

/// Missed heartbeats after which a peer re-queues a worker's in-flight jobs, for a queue that
/// beats every `beat` and whose jobs run at most `job_timeout`: the window (`beat` × this) is at
/// least `job_timeout + ORPHAN_MARGIN` and `job_timeout` + [`MARGIN_BEATS`] beats, and never
/// under [`MIN_MISSED_HEARTBEATS`] beats.
pub fn missed_heartbeats(job_timeout: Duration, beat: Duration) -> usize {
    let margin = ORPHAN_MARGIN.max(beat.saturating_mul(MARGIN_BEATS));
    let needed = job_timeout.saturating_add(margin).as_millis();
    let beat = beat.as_millis().max(1);
    let n = usize::try_from(needed.div_ceil(beat)).unwrap_or(usize::MAX);
    n.max(MIN_MISSED_HEARTBEATS)
}

/// The orphan window of a queue that beats every `beat` and whose jobs run at most
/// `job_timeout`.
pub fn orphan_window(job_timeout: Duration, beat: Duration) -> Duration {
    let n = u32::try_from(missed_heartbeats(job_timeout, beat)).unwrap_or(u32::MAX);
    beat.saturating_mul(n)
}

/// The orphan window of job `J`'s queue under `config`.
pub fn orphan_window_of<J: RunJob>(config: &crate::config::Config) -> Duration {
    orphan_window(J::timeout(config), J::HEARTBEAT)
}

/// The apalis storage of job `J`'s queue, on the shared connection, with `J`'s heartbeat and the
/// orphan window of `J`'s timeout under `ctx`'s configuration. Workers run it inside a
/// [`QueueBackend`], which replaces its fetch and its acknowledgement of done jobs.
pub fn storage<J: RunJob>(ctx: &AppContext, batch: usize) -> RedisStorage<String> {
    let config = apalis_redis::Config::default()
        .queue(cardworker_jobs::keys::queue(ctx.prefix(), J::QUEUE))
        .batch_size(batch.max(1))
        .heartbeat_interval(J::HEARTBEAT)
        .missed_heartbeats(missed_heartbeats(J::timeout(&ctx.config), J::HEARTBEAT))
        // No per-job lock: `fetch_next.lua` already moves each fetched job into this worker's
        // inflight set, which is what the orphan recovery reads. The lock script re-checked that
        // and ran an `LREM` over the whole active list per job (finding nothing), plus an `HSET`
        // and a `PUBLISH`: several commands per poll, and the most expensive one.
        .lock_tasks(false)
        // Nobody subscribes to apalis's task events: one `PUBLISH` per acknowledgement less.
        .emit_events(false);
    RedisStorage::new(ctx.redis.clone()).with_config(config)
}

/// Refreshes worker `name`'s heartbeat in `workers_set` every `beat` (its queue's,
/// [`RunJob::HEARTBEAT`]), independently of its slots, until the returned future is dropped,
/// while the worker has a job in flight (`in_flight` > 0): that is when busy slots can keep
/// apalis from driving its own heartbeat (notes §8); an idle worker's stream is driven, and
/// heartbeats, on its own. Only a worker still registered is refreshed (`ZADD XX`), with
/// apalis's own score (unix seconds of this process's clock).
pub async fn keep_heartbeat(
    mut conn: ConnectionManager,
    workers_set: String,
    name: String,
    in_flight: Arc<AtomicUsize>,
    beat: Duration,
) {
    let mut tick = tokio::time::interval(beat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if in_flight.load(Ordering::Acquire) == 0 {
            continue;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let refreshed: redis::RedisResult<i64> = redis::cmd("ZADD")
            .arg(&workers_set)
            .arg("XX")
            .arg("CH")
            .arg(now)
            .arg(&name)
            .query_async(&mut conn)
            .await;
        if let Err(e) = refreshed {
            tracing::debug!(worker = %name, error = %e, "worker heartbeat not refreshed; apalis's own heartbeat and the orphan window remain");
        }
    }
}

/// Starts one worker for job `J` with no layer of its own.
pub fn spawn_worker<J>(ctx: &Arc<AppContext>, sup: &mut Supervisor)
where
    J: RunJob + Send + 'static,
{
    spawn_layered::<J, Identity>(ctx, sup, Identity::new());
}

/// The middleware of a worker with layer `L`: apalis applies the concurrency limit outside `L`,
/// and `L` sits outside apalis's lifecycle (which counts attempts and maps results).
pub type Middleware<L> = Stack<L, Stack<ConcurrencyLimitLayer, Identity>>;

/// Starts one worker for job `J`, its service wrapped in `layer` (the polling budget, say). The
/// supervisor keeps the recipe: after a Redis outage it builds the worker again, under a fresh
/// name, with a clone of `layer`.
pub fn spawn_layered<J, L>(ctx: &Arc<AppContext>, sup: &mut Supervisor, layer: L)
where
    J: RunJob + Send + 'static,
    L: Layer<LifecycleService<JobService<J>>> + Clone + Send + Sync + 'static,
    L::Service: Service<Task<String>, Response = (), Error = BoxDynError> + Send + 'static,
    <L::Service as Service<Task<String>>>::Future: Send + 'static,
{
    let ctx = ctx.clone();
    let shutdown = sup.shutdown().clone();
    sup.spawn(
        J::KIND,
        Box::new(move || {
            let concurrency = J::concurrency(&ctx.config);
            let name = pod::worker_name(J::KIND);
            let wake =
                crate::queue::wake::handle(&cardworker_jobs::keys::queue(ctx.prefix(), J::QUEUE));
            let backend =
                QueueBackend::new(storage::<J>(&ctx, concurrency), ctx.redis.clone(), wake);
            let workers_set = backend.apalis_config().workers_set();
            let builder: WorkerBuilder<_, _, Middleware<L>> = WorkerBuilder::new(name.as_str())
                .backend(backend)
                .concurrency(concurrency)
                .layer(layer.clone());
            let in_flight = Arc::new(AtomicUsize::new(0));
            let worker =
                builder.build(JobService::<J>::new(ctx.clone()).counting_in(in_flight.clone()));
            // The heartbeat of our own runs beside the worker, on its own task, until the
            // worker ends (this build of it: a rebuilt worker gets a keeper of its own).
            let ended = CancellationToken::new();
            let keeper = keep_heartbeat(
                ctx.redis.clone(),
                workers_set,
                name.clone(),
                in_flight,
                J::HEARTBEAT,
            );
            let worker_ended = ended.clone();
            shutdown.spawn(async move {
                tokio::select! {
                    () = worker_ended.cancelled() => {}
                    () = keeper => {}
                }
            });
            let stopped = stopped(&shutdown);
            let run = async move {
                let _ended = ended.drop_guard();
                worker.run_until(stopped).await
            };
            (name, run.boxed())
        }),
    );
}

/// A future that resolves when the drain begins, in the shape apalis's `run_until` wants.
pub fn stopped(
    shutdown: &crate::shutdown::Shutdown,
) -> impl std::future::Future<Output = Result<(), std::io::Error>> + Send + 'static {
    let draining = shutdown.draining();
    async move {
        draining.await;
        Ok(())
    }
}

/// Enqueues the tick's job once across every pod: the claim `{queue}:tick:{ts}` is taken by the
/// first pod to see the tick, and the others' ticks are dropped.
async fn on_tick<J: Scheduled>(
    tick: Tick<Tz>,
    ctx: Data<Arc<AppContext>>,
) -> Result<(), BoxDynError> {
    let ts = i64::try_from(tick.get_timestamp()).unwrap_or(i64::MAX);
    enqueue_tick::<J>(&ctx, ts).await?;
    Ok(())
}

/// What a cron tick does on every pod: enqueues the tick's job unless another pod already claimed
/// the tick (`{queue}:tick:{ts}`). Returns whether this pod enqueued it.
pub async fn enqueue_tick<J: Scheduled>(
    ctx: &AppContext,
    ts: i64,
) -> Result<bool, cardworker_jobs::EnqueueError> {
    let claim = format!("{}:tick:{ts}", J::QUEUE);
    let added = ctx
        .producer
        .enqueue_once(&J::for_tick(ts), &claim, Duration::from_secs(86_400))
        .await?;
    tracing::info!(queue = J::QUEUE, tick = %crate::telemetry::rfc3339(ts), enqueued = added, "cron tick");
    Ok(added)
}

/// Starts the cron schedule of `J` (Asia/Shanghai). A tick only enqueues, so a schedule's worker
/// is never blocked long enough for apalis-cron to miss the next tick.
pub fn spawn_cron<J: Scheduled>(
    ctx: &Arc<AppContext>,
    sup: &mut Supervisor,
    expression: &str,
) -> anyhow::Result<()> {
    let schedule = cron::Schedule::from_str(expression)
        .with_context(|| format!("parsing cron expression {expression:?}"))?;
    let ctx = ctx.clone();
    let shutdown = sup.shutdown().clone();
    sup.spawn(
        J::CRON_KIND,
        Box::new(move || {
            let name = pod::worker_name(J::CRON_KIND);
            let worker = WorkerBuilder::new(name.as_str())
                .backend(CronScheduler::new(schedule.clone()).with_timezone(Shanghai))
                .data(ctx.clone())
                .build(on_tick::<J>);
            (name, worker.run_until(stopped(&shutdown)).boxed())
        }),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_orphan_window_covers_the_job_timeout_plus_the_margin_and_never_goes_under_three_beats() {
        assert_eq!(missed_heartbeats(Duration::from_secs(1), HEARTBEAT), 3);
        assert_eq!(
            orphan_window(Duration::from_secs(1), HEARTBEAT),
            Duration::from_secs(15)
        );
        // Polls with the default handler timeout: 15 + 10 s.
        assert_eq!(
            orphan_window(Duration::from_secs(15), HEARTBEAT),
            Duration::from_secs(25)
        );
        // A slow handler: 27 s.
        assert_eq!(
            orphan_window(Duration::from_secs(27), HEARTBEAT),
            Duration::from_secs(40)
        );
        for secs in [0, 1, 4, 5, 6, 29, 30, 31, 299, 3595, 3600, 86_400] {
            let timeout = Duration::from_millis(secs * 1000 + 1);
            let window = orphan_window(timeout, HEARTBEAT);
            assert!(window >= timeout + ORPHAN_MARGIN, "{timeout:?}: {window:?}");
            assert!(
                window < timeout + ORPHAN_MARGIN + HEARTBEAT,
                "{timeout:?}: {window:?}"
            );
        }
    }

    #[test]
    fn a_quiet_queue_s_orphan_window_covers_its_job_timeout_plus_two_of_its_beats() {
        // Reconcile: 600 s + 2 × 30 s.
        assert_eq!(
            orphan_window(Duration::from_secs(600), QUIET_HEARTBEAT),
            Duration::from_secs(660)
        );
        assert_eq!(
            orphan_window(Duration::from_secs(1), QUIET_HEARTBEAT),
            QUIET_HEARTBEAT * 3
        );
        for secs in [0, 1, 29, 30, 31, 180, 600, 3600, 86_400] {
            let timeout = Duration::from_millis(secs * 1000 + 1);
            let window = orphan_window(timeout, QUIET_HEARTBEAT);
            assert!(
                window >= timeout + QUIET_HEARTBEAT * MARGIN_BEATS,
                "{timeout:?}: {window:?}"
            );
            assert!(window >= timeout + ORPHAN_MARGIN, "{timeout:?}: {window:?}");
            assert!(
                window >= QUIET_HEARTBEAT * 3,
                "never under three beats: {window:?}"
            );
            assert!(
                window < timeout + QUIET_HEARTBEAT * (MARGIN_BEATS + 1),
                "{timeout:?}: {window:?}"
            );
        }
    }
}
