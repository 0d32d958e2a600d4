//! The one registration list: every queue, every worker and every schedule of `cardworker run`.

use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::*;
use apalis_cron::{CronScheduler, Tick};
use apalis_redis::RedisStorage;
use cardworker_jobs::{
    Job, PollCardData, PollCardStatus, ProcessCallback, RecoverPayments, RunArchive, RunReconcile,
    RunRetention, SubmitPayment,
};
use chrono_tz::{Asia::Shanghai, Tz};
use futures::FutureExt as _;

use super::worker::handle;
use super::{QueueName, RunJob};
use crate::app::{worker_name, AppContext, Supervisor};
use crate::budget::PollingBudgetLayer;

/// Every queue of the deployment, by short name.
pub const QUEUES: &[&str] = &[
    PollCardData::QUEUE,
    PollCardStatus::QUEUE,
    SubmitPayment::QUEUE,
    ProcessCallback::QUEUE,
    RunArchive::QUEUE,
    RunRetention::QUEUE,
    RunReconcile::QUEUE,
    RecoverPayments::QUEUE,
];

/// The Redis names of every queue.
pub fn queue_names(prefix: &str) -> Vec<QueueName> {
    QUEUES.iter().map(|q| QueueName::new(prefix, q)).collect()
}

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

/// Starts one worker for job `$job`, optionally wrapped in tower layers.
macro_rules! spawn_worker {
    ($ctx:expr, $sup:expr, $job:ty $(, layer = $layer:expr)*) => {{
        let ctx: &Arc<AppContext> = $ctx;
        let concurrency = <$job as RunJob>::concurrency(&ctx.config);
        let name = worker_name(<$job as RunJob>::KIND);
        let worker = WorkerBuilder::new(name.as_str())
            .backend(storage::<$job>(ctx, concurrency).poll_with_interval(POLL_INTERVAL))
            .data(ctx.clone())
            .concurrency(concurrency)
            $(.layer($layer))*
            .build(handle::<$job>);
        let stopped = $sup.stopped();
        $sup.spawn(name, <$job as RunJob>::KIND, worker.run_until(stopped).boxed());
    }};
}

/// A job started by a cron schedule.
pub trait Scheduled: RunJob {
    /// Worker kind of its scheduler.
    const CRON_KIND: &'static str;
    /// The job for one tick (unix seconds).
    fn for_tick(timestamp: i64) -> Self;
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
    tracing::info!(queue = J::QUEUE, tick = ts, enqueued = added, "cron tick");
    Ok(added)
}

fn spawn_cron<J: Scheduled>(
    ctx: &Arc<AppContext>,
    sup: &mut Supervisor,
    expression: &str,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let schedule = cron::Schedule::from_str(expression)
        .with_context(|| format!("parsing cron expression {expression:?}"))?;
    let name = worker_name(J::CRON_KIND);
    let worker = WorkerBuilder::new(name.as_str())
        .backend(CronScheduler::new(schedule).with_timezone(Shanghai))
        .data(ctx.clone())
        .build(on_tick::<J>);
    let stopped = sup.stopped();
    sup.spawn(name, J::CRON_KIND, worker.run_until(stopped).boxed());
    Ok(())
}

/// Starts every worker and schedule of `cardworker run`.
pub fn spawn_workers(ctx: &Arc<AppContext>, sup: &mut Supervisor) -> anyhow::Result<()> {
    let config = ctx.config.clone();

    // Polling: both workers run under the fleet-wide budget (both tokens or no handler). The
    // worker concurrency is only the per-process ceiling; the budget is the fleet-wide limit.
    spawn_gauge_refresher(ctx, sup);
    spawn_worker!(
        ctx,
        sup,
        PollCardData,
        layer = PollingBudgetLayer::<PollCardData>::new(ctx.budget.clone(), &config.polling)
    );
    spawn_worker!(
        ctx,
        sup,
        PollCardStatus,
        layer = PollingBudgetLayer::<PollCardStatus>::new(ctx.budget.clone(), &config.polling)
    );
    // Reconcile is always on: it only reads PostgreSQL and restores lost chains.
    spawn_worker!(ctx, sup, RunReconcile);
    spawn_cron::<RunReconcile>(ctx, sup, &config.polling.reconcile_cron)?;

    // The reliable paths: not polling, so no budget layer; always on.
    spawn_worker!(ctx, sup, SubmitPayment);
    spawn_worker!(ctx, sup, ProcessCallback);
    spawn_worker!(ctx, sup, RecoverPayments);
    spawn_cron::<RecoverPayments>(ctx, sup, &config.payments.recovery_cron)?;

    // Maintenance queues are always consumed: while maintenance is off, queued runs are
    // acknowledged as no-ops. Only the schedules depend on the switch.
    spawn_worker!(ctx, sup, RunArchive);
    spawn_worker!(ctx, sup, RunRetention);
    crate::maintenance::register_metrics(config.maintenance.enabled);
    if config.maintenance.enabled {
        // The backlog gauge is measured by a bounded read-only probe; off, no table is touched.
        let measure_ctx = ctx.clone();
        tokio::spawn(async move {
            crate::maintenance::run::measure_days_pending(&measure_ctx).await;
        });
        spawn_cron::<RunArchive>(ctx, sup, &config.maintenance.archive_cron)?;
        spawn_cron::<RunRetention>(ctx, sup, &config.maintenance.retention_cron)?;
        tracing::info!(
            archive_cron = %config.maintenance.archive_cron,
            retention_cron = %config.maintenance.retention_cron,
            cleanup_enabled = config.maintenance.cleanup_enabled,
            "maintenance enabled: archive and retention schedules registered (Asia/Shanghai)"
        );
    } else {
        tracing::info!(
            "maintenance disabled (maintenance.enabled = false): archive and retention schedules \
             are NOT registered; queued runs are acknowledged as no-ops"
        );
    }
    Ok(())
}

/// How often the budget gauges are refreshed between scrapes.
const GAUGE_INTERVAL: Duration = Duration::from_secs(10);

/// Refreshes the fleet-wide gauges before a scrape.
pub async fn refresh_gauges(ctx: &AppContext) {
    ctx.budget.refresh_gauges().await;
}

/// Refreshes the fleet-wide gauges every [`GAUGE_INTERVAL`] until shutdown, so that they stay
/// current between scrapes.
fn spawn_gauge_refresher(ctx: &Arc<AppContext>, sup: &Supervisor) {
    let ctx = ctx.clone();
    let stopped = sup.stopped();
    tokio::spawn(async move {
        let refresh = async {
            loop {
                refresh_gauges(&ctx).await;
                tokio::time::sleep(GAUGE_INTERVAL).await;
            }
        };
        tokio::select! {
            () = refresh => {}
            _ = stopped => {}
        }
    });
}

/// Runs after every worker stopped, before the process exits: releases every polling lease this
/// process still holds, in one call, so the fleet gets its tokens back now instead of after
/// `polling.lease_ttl_secs`.
pub async fn on_shutdown(ctx: &AppContext) {
    let held = ctx.budget.held_count();
    match ctx.budget.release_held().await {
        Ok(released) => tracing::info!(held, released, "polling leases released"),
        Err(e) => {
            tracing::warn!(held, error = %format!("{e:#}"), "cannot release polling leases; they expire with their lease")
        }
    }
}
