//! `cardworker run`: connects, starts the HTTP endpoint, the intake feeder and every worker, and
//! supervises them until shutdown.
//!
//! Why a supervisor of our own instead of apalis's `Monitor`: with a shutdown timeout the Monitor
//! discards worker errors, and a failed worker stays dead while the others run on. An operator
//! needs the opposite: if one worker stops unexpectedly, `/healthz` fails at once and the process
//! exits non-zero so that the orchestrator restarts it. Each worker still runs through apalis's
//! own `Worker::run_until`, so fetching stops and in-flight jobs drain on shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use apalis::prelude::WorkerError;
use cardworker_jobs::Producer;
use futures::future::BoxFuture;
use redis::aio::ConnectionManager;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::Config;
use crate::gateway::GatewayClient;
use crate::queue::{intake, registry};
use crate::telemetry::{self, http, Health};

/// Everything a job needs, shared by every worker of the process.
pub struct AppContext {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// PostgreSQL: authoritative state.
    pub pool: PgPool,
    /// The one Redis connection, shared with apalis-redis: coordination and counts only.
    pub redis: ConnectionManager,
    /// Writes into the intake (next polls, retries, cron ticks).
    pub producer: Producer<ConnectionManager>,
    /// The Gateway.
    pub gateway: GatewayClient,
    /// Which workers run.
    pub health: Health,
    /// The fleet-wide polling budget and the leases this process holds.
    pub budget: crate::budget::Budget,
}

impl AppContext {
    /// Connects to PostgreSQL and Redis and builds the Gateway client.
    pub async fn connect(config: Config) -> anyhow::Result<Arc<Self>> {
        let pool = crate::storage::connect(&config.database).await?;
        let redis = connect_redis(config.redis.url.expose()).await?;
        let gateway =
            GatewayClient::new(config.gateway.base_url.expose(), config.gateway.timeout())
                .context("building the Gateway client")?;
        let producer = Producer::new(redis.clone(), config.redis.key_prefix.clone());
        let budget = crate::budget::Budget::new(redis.clone(), &config);
        Ok(Arc::new(Self {
            config: Arc::new(config),
            pool,
            redis,
            producer,
            gateway,
            health: Health::default(),
            budget,
        }))
    }

    /// The key prefix of this deployment.
    pub fn prefix(&self) -> &str {
        &self.config.redis.key_prefix
    }
}

/// Opens the shared Redis connection (`redis://` or `rediss://`).
pub async fn connect_redis(url: &str) -> anyhow::Result<ConnectionManager> {
    let client = redis::Client::open(url).context("parsing redis.url")?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(5)))
        .set_response_timeout(Some(Duration::from_secs(10)))
        .set_number_of_retries(2);
    tokio::time::timeout(
        Duration::from_secs(10),
        redis::aio::ConnectionManager::new_with_config(client, config),
    )
    .await
    .context("connecting to Redis timed out")?
    .context("connecting to Redis")
}

/// A unique worker name across the fleet: apalis refuses a name it saw within a heartbeat, and
/// pods restart with the same host name, so a fresh ULID is part of it.
pub fn worker_name(kind: &str) -> String {
    let pod = std::env::var("CARDWORKER_POD_NAME")
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "local".to_owned());
    format!("{kind}-{pod}-{}", ulid::Ulid::new())
}

/// How the workers of one process are started and stopped.
pub struct Supervisor {
    /// Running workers: each yields its name, kind and how it ended.
    workers: JoinSet<Ended>,
    /// Fires shutdown for every worker.
    stop: watch::Sender<bool>,
    /// Liveness, as `/healthz` reports it.
    health: Health,
}

impl Supervisor {
    /// A supervisor reporting into `health`.
    pub fn new(health: Health) -> Self {
        let (stop, _) = watch::channel(false);
        Self {
            workers: JoinSet::new(),
            stop,
            health,
        }
    }

    /// A future that resolves when shutdown begins, in the shape apalis's `run_until` wants.
    pub fn stopped(&self) -> impl Future<Output = Result<(), std::io::Error>> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            // An error means the sender is gone, which also means: stop.
            let _ = rx.wait_for(|stop| *stop).await;
            Ok(())
        }
    }

    /// Starts one worker, given its run future.
    pub fn spawn(
        &mut self,
        name: String,
        kind: &'static str,
        run: BoxFuture<'static, Result<(), WorkerError>>,
    ) {
        self.health.set(&name, kind, true);
        tracing::info!(worker = %name, kind, "worker started");
        self.workers.spawn(async move { (name, kind, run.await) });
    }

    /// Begins a graceful shutdown of every worker.
    pub fn shutdown(&self) {
        self.stop.send_replace(true);
    }

    /// Waits until `shutdown` resolves or a worker stops on its own. Returns the first worker that
    /// stopped unexpectedly, if any, after stopping the others within `grace`.
    pub async fn supervise(
        mut self,
        shutdown: impl Future<Output = ()>,
        grace: Duration,
    ) -> Option<String> {
        let mut failed = None;
        tokio::select! {
            () = shutdown => tracing::info!("shutdown requested; draining in-flight jobs"),
            ended = self.workers.join_next() => {
                if let Some(Ok((name, kind, _))) = &ended {
                    self.health.set(name, kind, false);
                }
                let what = describe(ended);
                tracing::error!(worker = %what, "a worker stopped unexpectedly; stopping the process");
                failed = Some(what);
            }
        }
        self.shutdown();
        let drain = async {
            while let Some(ended) = self.workers.join_next().await {
                if let Ok((name, kind, result)) = &ended {
                    self.health.set(name, kind, false);
                    if let Err(e) = result {
                        tracing::warn!(worker = %name, error = %e, "worker ended with an error during shutdown");
                    }
                }
            }
        };
        if tokio::time::timeout(grace, drain).await.is_err() {
            tracing::warn!(grace_secs = grace.as_secs(), "shutdown grace period over; abandoning in-flight jobs (apalis re-enqueues them as orphans)");
            self.workers.abort_all();
        }
        failed
    }
}

/// How one worker ended: its name, kind and result.
type Ended = (String, &'static str, Result<(), WorkerError>);

fn describe(ended: Option<Result<Ended, tokio::task::JoinError>>) -> String {
    match ended {
        Some(Ok((name, _, Ok(())))) => format!("{name} (returned)"),
        Some(Ok((name, _, Err(e)))) => format!("{name}: {e}"),
        Some(Err(e)) => format!("worker task failed: {e}"),
        None => "no workers registered".to_owned(),
    }
}

/// Runs every worker of this process and the HTTP endpoint until `shutdown` resolves. Returns an
/// error when a worker stopped unexpectedly, so that `main` exits non-zero.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ctx = AppContext::connect(config).await?;
    let running = start(ctx.clone()).await?;
    running.wait(shutdown).await
}

/// A started process: endpoint, feeder and workers.
pub struct Running {
    /// The process context.
    pub ctx: Arc<AppContext>,
    /// Where the HTTP endpoint listens.
    pub addr: std::net::SocketAddr,
    supervisor: Supervisor,
    stop_background: watch::Sender<bool>,
    background: JoinSet<()>,
}

/// Starts the endpoint, the feeder and every worker.
pub async fn start(ctx: Arc<AppContext>) -> anyhow::Result<Running> {
    let metrics = telemetry::metrics_handle()?;
    telemetry::register_series();
    let queues = registry::queue_names(ctx.prefix());
    let (stop_background, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let refresh_ctx = ctx.clone();
    let refresh_queues = queues.clone();
    let refresh: Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync> = Arc::new(move || {
        let ctx = refresh_ctx.clone();
        let queues = refresh_queues.clone();
        Box::pin(async move {
            let mut conn = ctx.redis.clone();
            intake::publish_depths(&mut conn, &queues).await;
            registry::refresh_gauges(&ctx).await;
        })
    });
    let state = http::EndpointState {
        metrics,
        health: ctx.health.clone(),
        pool: ctx.pool.clone(),
        redis: ctx.redis.clone(),
        refresh: Some(refresh),
    };
    let (addr, endpoint) = http::serve(&ctx.config.telemetry.listen, state, stopped()).await?;
    tracing::info!(%addr, "metrics at http://{addr}/metrics, health at /healthz and /readyz");

    let mut background = JoinSet::new();
    background.spawn(async move {
        let _ = endpoint.await;
    });
    let feeder = intake::Feeder {
        conn: ctx.redis.clone(),
        queues,
        interval: Duration::from_millis(200),
        trim_every: Duration::from_secs(5),
    };
    background.spawn(feeder.run(stopped()));

    let mut supervisor = Supervisor::new(ctx.health.clone());
    registry::spawn_workers(&ctx, &mut supervisor)?;
    Ok(Running {
        ctx,
        addr,
        supervisor,
        stop_background,
        background,
    })
}

impl Running {
    /// Supervises until `shutdown` resolves or a worker fails, then stops everything.
    pub async fn wait(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let grace = self.ctx.config.worker.shutdown_grace();
        let failed = self.supervisor.supervise(shutdown, grace).await;
        registry::on_shutdown(&self.ctx).await;
        self.stop_background.send_replace(true);
        let mut background = self.background;
        while background.join_next().await.is_some() {}
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
