//! Spawning workers and cron schedules under the [`Supervisor`]: each is handed over as a recipe
//! (a factory), so that the supervisor can build it again after a Redis outage.

use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use apalis::layers::limit::ConcurrencyLimitLayer;
use apalis::prelude::*;
use apalis_core::worker::lifecycle::LifecycleService;
use apalis_cron::{CronScheduler, Tick};
use apalis_redis::RedisStorage;
use cardworker_jobs::Job;
use chrono_tz::{Asia::Shanghai, Tz};
use futures::FutureExt as _;
use tower::layer::util::{Identity, Stack};
use tower::{Layer, Service};

use super::{JobService, RunJob, Scheduled, Supervisor};
use crate::context::AppContext;
use crate::pod;

/// How often an idle worker asks apalis for work (apalis otherwise waits for a heartbeat).
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// The apalis storage of one job's queue, on the shared connection.
pub fn storage<J: Job>(ctx: &AppContext, batch: usize) -> RedisStorage<String> {
    let config = apalis_redis::Config::default()
        .queue(cardworker_jobs::keys::queue(ctx.prefix(), J::QUEUE))
        .batch_size(batch.max(1))
        .heartbeat_interval(Duration::from_secs(5))
        // Orphaned jobs of a crashed pod come back after 3 missed heartbeats, not apalis's 10.
        .missed_heartbeats(3);
    RedisStorage::new(ctx.redis.clone()).with_config(config)
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
type Middleware<L> = Stack<L, Stack<ConcurrencyLimitLayer, Identity>>;

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
            let builder: WorkerBuilder<_, _, Middleware<L>> = WorkerBuilder::new(name.as_str())
                .backend(storage::<J>(&ctx, concurrency).poll_with_interval(POLL_INTERVAL))
                .concurrency(concurrency)
                .layer(layer.clone());
            let worker = builder.build(JobService::<J>::new(ctx.clone()));
            (name, worker.run_until(stopped(&shutdown)).boxed())
        }),
    );
}

/// A future that resolves when the drain begins, in the shape apalis's `run_until` wants.
fn stopped(
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
