//! `cardworker run`: connects, starts the HTTP endpoint, the intake feeder and every worker of
//! [`crate::workers`], and supervises them until shutdown.
//!
//! Shutdown is one [`crate::shutdown::Shutdown`] in two phases: the drain (workers stop fetching
//! and finish in-flight jobs within `worker.shutdown_grace_secs`, while `/metrics` and the feeder
//! keep running), then the shutdown hooks (polling leases released), then the stop (every
//! background task cancelled and awaited) and the pool closed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::config::Config;
use crate::context::AppContext;
use crate::queue::intake;
use crate::runner::redis_watch::RedisWatch;
use crate::runner::Supervisor;
use crate::telemetry::{self, http};
use crate::workers;

/// Runs every worker of this process and the HTTP endpoint until `shutdown` resolves. Returns an
/// error when a worker stopped unexpectedly, so that `main` exits non-zero.
///
/// `shutdown` is listened to from the first moment, not only once the process has started: a
/// start can wait long on PostgreSQL or Redis, and a pod asked to stop meanwhile (a rolling
/// deploy, a node drain) stops at once and exits 0, with nothing admitted yet.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut shutdown = Box::pin(shutdown);
    let starting = async {
        let ctx = AppContext::connect(config).await?;
        start(ctx).await
    };
    let running = tokio::select! {
        running = starting => running?,
        () = &mut shutdown => {
            tracing::info!("asked to stop while starting; stopped before any worker ran");
            return Ok(());
        }
    };
    running.wait(shutdown).await
}

/// A started process: endpoint, feeder and workers.
pub struct Running {
    /// The process context.
    pub ctx: Arc<AppContext>,
    /// Where the HTTP endpoint listens.
    pub addr: std::net::SocketAddr,
    /// The workers.
    supervisor: Supervisor,
}

/// Starts the endpoint, the feeder and every worker.
pub async fn start(ctx: Arc<AppContext>) -> anyhow::Result<Running> {
    let metrics = telemetry::metrics_handle()?;
    // Before any poll is admitted: whether the deployment ran before decides whether Redis
    // without the budget's fence hash lost its data (`budget::Budget::record_start`).
    ctx.budget.record_start(&ctx.pool).await?;
    // Before the polling workers fetch: the release before's chains become due-queue entries.
    crate::polling::takeover::on_start(&ctx).await;
    workers::register_metrics(&ctx);
    let addr = serve_endpoint(&ctx, metrics).await?;
    start_feeder(&ctx)?;
    // This process's unchanged polls, added up in memory, go to the fleet's hourly counters every
    // few seconds (the last ones in `workers::on_shutdown`, after the drain).
    ctx.shutdown.spawn(crate::polling::unchanged::flush_every(
        ctx.redis.clone(),
        ctx.prefix().to_owned(),
        ctx.shutdown.stopping(),
    ));
    watch_redis(&ctx);
    let mut supervisor = Supervisor::new(
        ctx.health.clone(),
        ctx.shutdown.clone(),
        ctx.redis_status.clone(),
        ctx.config.worker.redis_outage_grace(),
    );
    workers::spawn_workers(&ctx, &mut supervisor)?;
    Ok(Running {
        ctx,
        addr,
        supervisor,
    })
}

/// Starts the HTTP endpoint (`/metrics`, `/healthz`, `/readyz`) with the fleet-wide gauges, and
/// returns where it listens.
async fn serve_endpoint(
    ctx: &Arc<AppContext>,
    metrics: PrometheusHandle,
) -> anyhow::Result<std::net::SocketAddr> {
    // The fleet-wide gauges are read in the background: a scrape waits on Redis or PostgreSQL
    // only when it wakes a paused refresh, and at most `fleet::FRESH_WAIT`. One round before the
    // endpoint serves, so that the first scrape has them; the loop runs until the process stops,
    // so they stay fresh while it drains.
    let fleet = telemetry::fleet::FleetGauges::new(ctx.config.telemetry.fleet_gauges_idle());
    let round = Arc::new(tokio::sync::Mutex::new(workers::FleetRound::new(
        ctx.clone(),
    )));
    fleet
        .refresh(async { round.lock().await.run().await })
        .await;
    ctx.shutdown.spawn(
        fleet
            .clone()
            .run(ctx.config.telemetry.fleet_gauges_every(), move || {
                let round = round.clone();
                async move { round.lock().await.run().await }
            }),
    );
    let state = http::EndpointState {
        metrics,
        health: ctx.health.clone(),
        pool: ctx.pool.clone(),
        redis: ctx.redis.clone(),
        fleet: Some(fleet),
    };
    let (addr, endpoint) =
        http::serve(&ctx.config.telemetry.listen, state, ctx.shutdown.stopping()).await?;
    tracing::info!(%addr, "metrics at http://{addr}/metrics, health at /healthz and /readyz");
    ctx.shutdown.spawn(endpoint);
    Ok(addr)
}

/// Starts the intake feeder, woken by the intake announcements.
fn start_feeder(ctx: &Arc<AppContext>) -> anyhow::Result<()> {
    // The feeder sleeps while nothing is due and is told of earlier entries on this channel.
    let announcements = crate::queue::announce::Announcements::default();
    let client = redis::Client::open(ctx.config.redis.url.expose())
        .context("parsing redis.url for the intake announcements")?;
    ctx.shutdown.spawn(announcements.clone().run(
        client,
        cardworker_jobs::keys::intake_wake(ctx.prefix()),
        ctx.shutdown.stopping(),
    ));
    let feeder = intake::Feeder {
        conn: ctx.redis.clone(),
        queues: workers::queue_names(ctx.prefix()),
        interval: Duration::from_millis(200),
        trim_every: Duration::from_secs(5),
        redis: ctx.redis_status.clone(),
        announcements: Some(announcements),
    };
    ctx.shutdown.spawn(feeder.run(ctx.shutdown.stopping()));
    Ok(())
}

/// Starts the Redis probe: up or down, data lost or not, and what this process does about it.
fn watch_redis(ctx: &Arc<AppContext>) {
    let watch = RedisWatch {
        conn: ctx.redis.clone(),
        prefix: ctx.prefix().to_owned(),
        status: ctx.redis_status.clone(),
        on_data_lost: workers::on_redis_data_lost(ctx),
        on_data_lost_here: workers::on_redis_data_lost_here(ctx),
        budget: Some(ctx.budget.clone()),
        epoch: None,
        answered_before: false,
        restore_pending: false,
    };
    ctx.shutdown.spawn(watch.run(ctx.shutdown.stopping()));
}

impl Running {
    /// Supervises until `shutdown` resolves or a worker fails, then stops everything.
    pub async fn wait(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let grace = self.ctx.config.worker.shutdown_grace();
        let failed = self.supervisor.supervise(shutdown, grace).await;
        workers::on_shutdown(&self.ctx).await;
        self.ctx.shutdown.finish().await;
        // Close the pool so PostgreSQL sees the sessions end now (and flushes their statistics),
        // not when the process exits.
        self.ctx.pool.close().await;
        match failed {
            Some(worker) => anyhow::bail!("worker stopped unexpectedly: {worker}"),
            None => {
                tracing::info!("stopped cleanly");
                Ok(())
            }
        }
    }
}
