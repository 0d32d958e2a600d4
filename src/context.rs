//! [`AppContext`]: what every job and command shares in one process (configuration, pool, Redis
//! connection, producer, Gateway client, budget, shutdown), and how it is connected.
//!
//! It sits above the infrastructure modules (storage, gateway, queue, budget) and below every job,
//! so that a job imports its context without importing the wiring (`workers`, `app`) that starts
//! it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::Producer;
use redis::aio::ConnectionManager;
use sqlx::PgPool;

use crate::budget::Budget;
use crate::config::Config;
use crate::gateway::GatewayClient;
use crate::queue::batch::ScriptCalls;
use crate::shutdown::Shutdown;
use crate::storage::card_reads::CardReads;
use crate::telemetry::{Health, RedisStatus};

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
    /// Whether Redis answers (the probe's verdict), shared by the supervisor and the feeder.
    pub redis_status: RedisStatus,
    /// The fleet-wide polling budget and the leases this process holds.
    pub budget: Budget,
    /// The process's shutdown signal and the tracker of every task it spawns.
    pub shutdown: Shutdown,
    /// The polls' acknowledgements, sent several to a script call (`queue::batch`,
    /// `polling::lease`).
    pub poll_acks: ScriptCalls,
    /// The polls' card reads, sent several to a query (`storage::card_reads`).
    pub card_reads: CardReads,
}

impl AppContext {
    /// Connects to PostgreSQL and Redis and builds the Gateway client.
    pub async fn connect(config: Config) -> anyhow::Result<Arc<Self>> {
        let pool = crate::storage::connect(&config.database).await?;
        let redis = connect_redis(config.redis.url.expose()).await?;
        let gateway =
            GatewayClient::new(config.gateway.base_url.expose(), config.gateway.timeout())
                .context("building the Gateway client")?
                .holding_reads_for(config.polling.handler_timeout());
        let producer = Producer::new(redis.clone(), config.redis.key_prefix.clone());
        let shutdown = Shutdown::new();
        let budget = Budget::new(redis.clone(), &config).tracked_by(shutdown.clone());
        let poll_acks = crate::queue::batch::poll_acks(&redis);
        let card_reads = CardReads::new(pool.clone());
        Ok(Arc::new(Self {
            config: Arc::new(config),
            pool,
            redis,
            producer,
            gateway,
            health: Health::default(),
            redis_status: RedisStatus::default(),
            budget,
            shutdown,
            poll_acks,
            card_reads,
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
