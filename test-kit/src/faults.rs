//! The setup the fault tests share: a worker's configuration on a private Redis, a worker run in
//! the test's process that the test stops (or that stops itself), the Gateway simulator, the
//! cards and payments a test starts from, and `cardworker run` as a child process that is killed
//! when its guard drops.

use std::sync::Arc;
use std::time::Duration;

use cardworker::config::Config;
use cardworker::context::AppContext;
use cardworker::sim::{SimHandle, Simulator};
use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::harness::{metric_value, start_in_process, TestDb};
use crate::private::PrivateRedis;

/// The Redis key prefix of every fault test: its Redis is its own.
pub const PREFIX: &str = "cw";

/// A schedule that never fires during a test (1 January, midnight).
pub const NEVER: &str = "0 0 0 1 1 *";

/// A worker's configuration on database `db_url`, Redis `redis_url` (prefix [`PREFIX`]) and the
/// Gateway at `gateway`, its endpoint on port 0, and neither payment recovery nor reconcile on a
/// schedule: a fault test calls them, or asserts that they ran, itself.
pub fn config_on(db_url: &str, redis_url: &str, gateway: &str) -> Config {
    let mut config = Config::default();
    config.database.url = db_url.to_owned().into();
    config.redis.url = redis_url.to_owned().into();
    config.redis.key_prefix = PREFIX.to_owned();
    config.gateway.base_url = gateway.to_owned().into();
    config.telemetry.listen = "127.0.0.1:0".to_owned();
    config.payments.recovery_cron = NEVER.to_owned();
    config.polling.reconcile_cron = NEVER.to_owned();
    config
}

/// Calls may take `call_secs` at the Gateway (`gateway.timeout_ms`), their polls 2 s more
/// (`polling.handler_timeout_secs`), and a lease lives `lease_ttl_secs`.
pub fn slow_calls(config: &mut Config, call_secs: u64, lease_ttl_secs: u64) {
    config.gateway.timeout_ms = call_secs * 1000;
    config.polling.handler_timeout_secs = call_secs + 2;
    config.polling.lease_ttl_secs = lease_ttl_secs;
}

/// Waits up to 60 s until two polls are at the simulator at once (both tokens of a two-token
/// budget held).
pub async fn two_polls_at_the_gateway(sim: &Simulator) {
    crate::harness::wait_until(
        Duration::from_secs(60),
        "two polls at the Gateway",
        || async { sim.stats().in_flight_polls == 2 },
    )
    .await;
}

/// A worker run in the test's process, on whatever services its config names; stopped (and its
/// task aborted) when dropped.
pub struct InProcess {
    /// Its context.
    pub ctx: Arc<AppContext>,
    /// Its HTTP endpoint.
    pub addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcess {
    /// Starts a worker on `config` (validated).
    pub async fn start(config: Config) -> Self {
        let (ctx, addr, stop, join) = start_in_process(config).await;
        Self {
            ctx,
            addr,
            stop: Some(stop),
            join: Some(join),
        }
    }

    /// Whether `run` has returned on its own.
    pub fn exited(&self) -> bool {
        self.join.as_ref().is_none_or(|j| j.is_finished())
    }

    /// Waits until `run` returns on its own (for example once the Redis outage grace is over), up
    /// to `limit`, and returns how it ended; `None` when it still runs.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<anyhow::Result<()>> {
        let join = self.join.as_mut()?;
        match tokio::time::timeout(limit, join).await {
            Ok(result) => {
                self.join = None;
                Some(result.expect("joined"))
            }
            Err(_) => None,
        }
    }

    /// GET a path of its endpoint (10 s timeout): (status, body).
    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = reqwest::Client::new()
            .get(format!("http://{}{path}", self.addr))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("endpoint answers");
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap_or_default())
    }

    /// The value of one sample of its `/metrics` ([`metric_value`]).
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let (_, text) = self.get("/metrics").await;
        metric_value(&text, name, labels)
    }

    /// Stops it gracefully and returns how `run` ended.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.join.take().expect("running").await.expect("joined")
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(join) = self.join.take() {
            join.abort();
        }
    }
}

/// `cardworker run` (or another command of the binary) as a child process, killed and reaped
/// when dropped.
pub struct Child(pub std::process::Child);

impl Child {
    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.0.try_wait().ok().flatten().is_none()
    }

    /// Kills it with SIGKILL (no shutdown of its own, as `kill -9` does) and reaps it.
    pub fn kill_9(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The context of a process on the config file `file` (its endpoint on port 0), through which a
/// test acts as the CLI on that deployment does.
pub async fn context_of(file: &std::path::Path) -> Arc<AppContext> {
    let mut config = Config::load(Some(file)).expect("config");
    config.telemetry.listen = "127.0.0.1:0".to_owned();
    AppContext::connect(config).await.expect("connect")
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What most fault tests start from: a fresh database, a redis-server of the test's own (no
/// persistence) and the Gateway simulator on a free port, answering after `latency_ms`.
pub async fn services(latency_ms: u64) -> (TestDb, PrivateRedis, Simulator, SimHandle) {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let (sim, sim_handle) = simulator().await;
    sim.set_latency(latency_ms, 0);
    (db, redis, sim, sim_handle)
}

/// The Gateway simulator on a free port, answering at once.
pub async fn simulator() -> (Simulator, SimHandle) {
    let (_, sim, handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(0, 0);
    (sim, handle)
}

/// Inserts cards `c-000` … `c-{n-1}` and returns their refs.
pub async fn insert_cards(pool: &PgPool, n: usize) -> Vec<String> {
    let cards: Vec<String> = (0..n).map(|i| format!("c-{i:03}")).collect();
    sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
        .bind(&cards)
        .execute(pool)
        .await
        .expect("insert cards");
    cards
}

/// Inserts a payment of 1.00 CNY on card `c-000` and returns its id.
pub async fn insert_payment(pool: &PgPool) -> uuid::Uuid {
    let payment = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, 'c-000', 100, 'CNY')",
    )
    .bind(payment)
    .execute(pool)
    .await
    .expect("payment");
    payment
}

/// The status of payment `payment`.
pub async fn payment_status(pool: &PgPool, payment: uuid::Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM payments WHERE payment_id = $1")
        .bind(payment)
        .fetch_one(pool)
        .await
        .expect("status")
}

/// The one `bigint` that `sql` selects.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// [`config_on`] for a budget test: 2 tokens in all and 2 per task, every card due each second,
/// a deferred poll tried again after 1 to 2 s, a 5 s shutdown grace, a Redis outage of up to
/// 120 s ridden out, and no approval recovery on a schedule either. The Gateway's timeout and the
/// poll's own stay the caller's.
pub fn two_token_config(db_url: &str, redis_url: &str, gateway: &str) -> Config {
    let mut config = config_on(db_url, redis_url, gateway);
    let two = cardworker::limit::Limit::new(2).expect("a limit");
    config.polling.total_limit = two;
    config.polling.carddata.limit = two;
    config.polling.card_status.limit = two;
    config.polling.carddata.interval_secs = 1;
    config.polling.card_status.interval_secs = 1;
    config.polling.defer_delay_secs = 1;
    config.polling.defer_max_delay_secs = 2;
    config.worker.shutdown_grace_secs = 5;
    config.worker.redis_outage_grace_secs = 120;
    config.approvals.recovery_cron = NEVER.to_owned();
    config
}

/// Writes a worker's config file `cardworker.toml` into `dir`: database `db_url`, Redis
/// `redis_url` (prefix [`PREFIX`]), the Gateway at `gateway`, then `rest`, which goes on in the
/// `[gateway]` section (its `timeout_ms`, say) before the test's other sections.
pub fn config_file(
    dir: &std::path::Path,
    db_url: &str,
    redis_url: &str,
    gateway: &str,
    rest: &str,
) -> std::path::PathBuf {
    let file = dir.join("cardworker.toml");
    std::fs::write(
        &file,
        format!(
            "[database]\nurl = \"{db_url}\"\n[redis]\nurl = \"{redis_url}\"\nkey_prefix = \"{PREFIX}\"\n\
             [gateway]\nbase_url = \"{gateway}\"\n{rest}"
        ),
    )
    .expect("write the worker's config file");
    file
}

/// Starts the chains of every card of both tasks, as the reconcile sweep does.
pub async fn start_chains(ctx: &AppContext) {
    for task in cardworker::config::Task::ALL {
        cardworker::polling::reconcile::sweep(ctx, task)
            .await
            .expect("start chains");
    }
}
