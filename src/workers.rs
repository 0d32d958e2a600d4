//! The one list: every queue, every worker and every schedule of `cardworker run`.
//!
//! Like crates.io's job list, this is the top of the wiring: it names every job module and the
//! runner that starts them, and nothing below imports it. Adding a job means one line here (and
//! its queue in [`QUEUES`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use cardworker_jobs::{
    Job, PollCardData, PollCardStatus, ProcessCallback, RecoverApprovals, RecoverPayments,
    RunArchive, RunReconcile, RunRetention, SubmitApproval, SubmitPayment,
};

use crate::context::AppContext;
use crate::polling::backend::FetchPause;
use crate::polling::budget_layer::PollingBudgetLayer;
use crate::queue::QueueName;
use crate::runner::spawn::{spawn_cron, spawn_worker};
use crate::runner::Supervisor;

/// Every queue of the deployment, by short name (the polling tasks are not queues: their
/// workers fetch from the due queue).
pub const QUEUES: &[&str] = &[
    SubmitPayment::QUEUE,
    ProcessCallback::QUEUE,
    RunArchive::QUEUE,
    RunRetention::QUEUE,
    RunReconcile::QUEUE,
    RecoverPayments::QUEUE,
    SubmitApproval::QUEUE,
    RecoverApprovals::QUEUE,
];

/// The Redis names of every queue.
pub fn queue_names(prefix: &str) -> Vec<QueueName> {
    QUEUES.iter().map(|q| QueueName::new(prefix, q)).collect()
}

/// Registers every metric series of the worker's jobs at zero, so that dashboards and alert
/// rules see them before the first event.
pub fn register_metrics(ctx: &AppContext) {
    crate::telemetry::register_series();
    crate::gateway::register_metrics();
    crate::reliable::approval::register_metrics();
    crate::polling::register_metrics();
    crate::maintenance::register_metrics(crate::maintenance::switch::enabled(
        &ctx.config.maintenance,
    ));
}

/// Starts every worker and schedule of `cardworker run`.
pub fn spawn_workers(ctx: &Arc<AppContext>, sup: &mut Supervisor) -> anyhow::Result<()> {
    let config = ctx.config.clone();

    // Polling: both workers run under the fleet-wide budget (both tokens and a closed Gateway
    // circuit, or no handler). The worker concurrency is only the per-process ceiling; the
    // budget is the fleet-wide limit.
    let budget = || ctx.budget.clone();
    let data_pause = FetchPause::default();
    let data_layer = PollingBudgetLayer::<PollCardData>::new(budget(), &config.polling)
        .recording_into(ctx.pool.clone(), ctx.shutdown.clone())
        .pausing(data_pause.clone());
    crate::polling::worker::spawn::<PollCardData, _>(ctx, sup, data_layer, data_pause);
    let status_pause = FetchPause::default();
    let status_layer = PollingBudgetLayer::<PollCardStatus>::new(budget(), &config.polling)
        .recording_into(ctx.pool.clone(), ctx.shutdown.clone())
        .pausing(status_pause.clone());
    crate::polling::worker::spawn::<PollCardStatus, _>(ctx, sup, status_layer, status_pause);
    // Reconcile is always on: it only reads PostgreSQL and restores lost chains.
    spawn_worker::<RunReconcile>(ctx, sup);
    spawn_cron::<RunReconcile>(ctx, sup, &config.polling.reconcile_cron)?;

    // The reliable paths: not polling, so no budget layer; always on.
    spawn_worker::<SubmitPayment>(ctx, sup);
    spawn_worker::<ProcessCallback>(ctx, sup);
    spawn_worker::<RecoverPayments>(ctx, sup);
    spawn_cron::<RecoverPayments>(ctx, sup, &config.payments.recovery_cron)?;
    spawn_worker::<SubmitApproval>(ctx, sup);
    spawn_worker::<RecoverApprovals>(ctx, sup);
    spawn_cron::<RecoverApprovals>(ctx, sup, &config.approvals.recovery_cron)?;

    // Maintenance queues are always consumed: while maintenance is off, queued runs are
    // acknowledged as no-ops. Only the schedules depend on the switch.
    spawn_worker::<RunArchive>(ctx, sup);
    spawn_worker::<RunRetention>(ctx, sup);
    if crate::maintenance::switch::enabled(&config.maintenance) {
        // The backlog gauge is measured by a bounded read-only probe; off, no table is touched.
        let measure_ctx = ctx.clone();
        ctx.shutdown.spawn(async move {
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

/// What the pod that finds Redis came back empty does (`runner::redis_watch`): one full
/// reconcile, through the intake, so that every chain restarts within seconds and, should this
/// pod die meanwhile, apalis hands the job to another pod.
pub fn on_redis_data_lost(ctx: &Arc<AppContext>) -> crate::runner::redis_watch::OnDataLost {
    let ctx = ctx.clone();
    Arc::new(move || {
        let ctx = ctx.clone();
        Box::pin(async move {
            let job = RunReconcile {
                scheduled_for: None,
                full: true,
            };
            ctx.producer
                .enqueue(&job)
                .await
                .context("enqueueing a full reconcile after a Redis data loss")?;
            Ok(())
        })
    })
}

/// What every pod that notices Redis came back empty does first (`runner::redis_watch`): the
/// budget leases of its running polls, lost with the data while those polls were at the Gateway,
/// are written back, so that their tokens still count. Their cards need nothing: the budget's
/// fence admits no poll until they are over, and the full reconcile adds the cards back.
pub fn on_redis_data_lost_here(ctx: &Arc<AppContext>) -> crate::runner::redis_watch::OnDataLost {
    let ctx = ctx.clone();
    Arc::new(move || {
        let ctx = ctx.clone();
        Box::pin(async move {
            let leases = ctx.budget.reassert_running().await?;
            tracing::info!(
                leases,
                "running polls' leases written back after a Redis data loss"
            );
            Ok(())
        })
    })
}

/// The most one source of the fleet-wide gauges may take in one round: a hung read counts as a
/// failed one (the gauges' age grows) and does not hold the other sources back.
pub const FLEET_READ_LIMIT: Duration = Duration::from_secs(5);

/// One round of the fleet-wide gauges' background refresh (`telemetry::fleet`): the budget
/// (tokens, limits, circuits), the queue depths and the polls' lateness from Redis, the parked
/// chains from PostgreSQL.
/// While the Redis probe finds Redis down, the Redis reads are skipped (they would wait out the
/// reconnect). A source that fails is logged when it starts failing and when it reads again.
pub struct FleetRound {
    ctx: Arc<AppContext>,
    queues: Vec<QueueName>,
    /// Whether each source's last read succeeded: budget, queue depths, lateness, parked chains.
    ok: [bool; 4],
}

impl FleetRound {
    /// A round over `ctx`'s deployment.
    pub fn new(ctx: Arc<AppContext>) -> Self {
        let queues = queue_names(ctx.prefix());
        Self {
            ctx,
            queues,
            ok: [true; 4],
        }
    }

    /// Reads every source and publishes what it read; answers whether every read succeeded.
    pub async fn run(&mut self) -> bool {
        let ctx = self.ctx.clone();
        let redis_up = ctx.redis_status.is_up();
        let mut conn = ctx.redis.clone();
        let results = [
            if redis_up {
                bounded(ctx.budget.publish_gauges()).await
            } else {
                Err(anyhow::anyhow!("Redis is down"))
            },
            if redis_up {
                bounded(crate::queue::intake::publish_depths(
                    &mut conn,
                    &self.queues,
                ))
                .await
            } else {
                Err(anyhow::anyhow!("Redis is down"))
            },
            if redis_up {
                bounded(crate::polling::publish_lateness(&ctx)).await
            } else {
                Err(anyhow::anyhow!("Redis is down"))
            },
            bounded(crate::polling::publish_parked_chains(&ctx)).await,
        ];
        let names = [
            "polling budget",
            "queue depths",
            "polling lateness",
            "parked chains",
        ];
        for ((result, was_ok), name) in results.iter().zip(&mut self.ok).zip(names) {
            match (result, *was_ok) {
                (Err(e), true) => {
                    tracing::warn!(source = name, error = %format!("{e:#}"), "a fleet-wide gauge cannot be read; /metrics shows its last value (cardworker_fleet_gauges_age_seconds)")
                }
                (Ok(()), false) => tracing::info!(source = name, "a fleet-wide gauge reads again"),
                _ => {}
            }
            *was_ok = result.is_ok();
        }
        results.iter().all(Result::is_ok)
    }
}

async fn bounded(
    read: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    tokio::time::timeout(FLEET_READ_LIMIT, read)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {FLEET_READ_LIMIT:?}"))?
}

/// Runs after every worker stopped, before the process exits: writes the unchanged polls this
/// process counted to the fleet's hourly counters, and releases every polling lease it still
/// holds, in one call, so the fleet gets its tokens back now instead of after
/// `polling.lease_ttl_secs`.
pub async fn on_shutdown(ctx: &AppContext) {
    match crate::polling::unchanged::flush(&mut ctx.redis.clone(), ctx.prefix()).await {
        Ok(polls) => tracing::debug!(polls, "unchanged-poll counters written"),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "the last unchanged polls are not in the fleet's hourly counters")
        }
    }
    let held = ctx.budget.held_count();
    match ctx.budget.release_held().await {
        Ok(released) => tracing::info!(held, released, "polling leases released"),
        Err(e) => {
            tracing::warn!(held, error = %format!("{e:#}"), "cannot release polling leases; they expire with their lease")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::runner::spawn::{
        orphan_window, orphan_window_of, HEARTBEAT, MARGIN_BEATS, ORPHAN_MARGIN, QUIET_HEARTBEAT,
    };
    use crate::runner::RunJob;

    fn window_covers<J: RunJob>(config: &crate::config::Config) {
        let timeout = J::timeout(config);
        let window = orphan_window_of::<J>(config);
        assert!(
            window >= timeout + ORPHAN_MARGIN,
            "{}: timeout {timeout:?}, window {window:?}",
            J::QUEUE
        );
        assert!(
            window >= timeout + J::HEARTBEAT * MARGIN_BEATS,
            "{}: timeout {timeout:?}, beat {:?}, window {window:?}",
            J::QUEUE,
            J::HEARTBEAT
        );
    }

    /// No configuration can make a queue's orphan window shorter than its jobs: the window is
    /// derived from the same timeout the job service enforces, and from the queue's own beat.
    #[test]
    fn every_queue_s_orphan_window_outlasts_its_longest_job_under_any_config() {
        let mut longest = crate::config::Config::default();
        longest.gateway.timeout_ms = 60_000;
        longest.polling.handler_timeout_secs = 3595;
        longest.polling.lease_ttl_secs = 3600;
        for config in [crate::config::Config::default(), longest] {
            window_covers::<PollCardData>(&config);
            window_covers::<PollCardStatus>(&config);
            window_covers::<SubmitPayment>(&config);
            window_covers::<ProcessCallback>(&config);
            window_covers::<RecoverPayments>(&config);
            window_covers::<SubmitApproval>(&config);
            window_covers::<RecoverApprovals>(&config);
            window_covers::<RunArchive>(&config);
            window_covers::<RunRetention>(&config);
            window_covers::<RunReconcile>(&config);
        }
        assert_eq!(
            orphan_window(
                PollCardData::timeout(&crate::config::Config::default()),
                HEARTBEAT
            ),
            Duration::from_secs(25)
        );
    }

    /// The queues that see a job a minute or less beat every 30 s (an idle worker's heartbeat
    /// and fetch cost Redis about ten commands); the busy ones keep the 5 s beat, so that a job
    /// another pod fed, or an orphan, waits at most 5 s for them.
    #[test]
    fn the_quiet_queues_beat_every_30_s_and_the_busy_ones_every_5_s() {
        assert_eq!(RecoverPayments::HEARTBEAT, QUIET_HEARTBEAT);
        assert_eq!(RecoverApprovals::HEARTBEAT, QUIET_HEARTBEAT);
        assert_eq!(RunReconcile::HEARTBEAT, QUIET_HEARTBEAT);
        assert_eq!(RunArchive::HEARTBEAT, QUIET_HEARTBEAT);
        assert_eq!(RunRetention::HEARTBEAT, QUIET_HEARTBEAT);
        assert_eq!(PollCardData::HEARTBEAT, HEARTBEAT);
        assert_eq!(PollCardStatus::HEARTBEAT, HEARTBEAT);
        assert_eq!(SubmitPayment::HEARTBEAT, HEARTBEAT);
        assert_eq!(ProcessCallback::HEARTBEAT, HEARTBEAT);
        assert_eq!(SubmitApproval::HEARTBEAT, HEARTBEAT);
    }
}
