//! Shared test harness: a fresh PostgreSQL database and a fresh Redis key prefix per test, the
//! Gateway simulator, and `spawn_app()` starting a real `cardworker run` in-process on port 0.
//!
//! A test database on the shared server is a clone of a template database migrated once per
//! migration set (`cw_tmpl_<hash of the migrations>`, created by the first test that needs it:
//! [`ensure_template_named`]).
//!
//! Everything a test creates is removed when its guard drops (database dropped with FORCE, every
//! Redis key under the test prefix deleted), also when the test panics.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cardworker::app;
use cardworker::config::Config;
use cardworker::context::{self, AppContext};
use cardworker::sim::{SimHandle, Simulator};
use redis::aio::ConnectionManager;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio::sync::oneshot;

/// Every Redis key pattern the product writes (checked on every prefix this harness cleans up).
pub use crate::inventory;

/// The admin URL that creates and drops the test databases (`CARDWORKER_TEST_PG_ADMIN`).
pub fn admin_url() -> String {
    std::env::var("CARDWORKER_TEST_PG_ADMIN")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/postgres".to_owned())
}

/// The Redis URL of the tests (`CARDWORKER_TEST_REDIS`).
pub fn redis_url() -> String {
    std::env::var("CARDWORKER_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_owned())
}

/// `application_name` of the harness's own sessions ([`TestDb::pool`]), so that a check of the
/// product's statements (the plan guard) can tell the test's own reads and writes apart.
pub const HARNESS_APPLICATION_NAME: &str = "cardworker-test-harness";

/// A fresh database, dropped (WITH FORCE) when this guard drops.
pub struct TestDb {
    /// Its name.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// A pool on it (migrated), for the test's own statements.
    pub pool: PgPool,
    /// The admin URL of the server it lives on (the shared one, or a private cluster).
    admin: String,
}

/// How a test database gets its schema.
enum Schema {
    /// Cloned from the template database of this build's migrations ([`ensure_template_named`]).
    Cloned,
    /// Created empty and migrated.
    Migrated,
}

impl TestDb {
    /// A fresh database on the shared test server, cloned from the template of this build's
    /// migrations (created on first use).
    pub async fn new() -> Self {
        Self::create(&admin_url(), Schema::Cloned).await
    }

    /// A fresh database on the shared test server, created empty and migrated, for the tests of
    /// the migrations themselves.
    pub async fn new_migrated() -> Self {
        Self::create(&admin_url(), Schema::Migrated).await
    }

    /// A fresh database on the server of `admin` (an admin URL ending in `/postgres`), created
    /// empty and migrated: a private cluster lives for one test, so a template there would be
    /// cloned once.
    pub async fn new_on(admin: &str) -> Self {
        Self::create(admin, Schema::Migrated).await
    }

    async fn create(admin: &str, schema: Schema) -> Self {
        let name = format!("cw_test_{}", ulid::Ulid::new().to_string().to_lowercase());
        let mut admin_conn = PgConnection::connect(admin)
            .await
            .expect("connect as admin");
        let create = match schema {
            Schema::Cloned => {
                let template = ensure_template(&mut admin_conn, admin).await;
                format!("CREATE DATABASE {name} TEMPLATE {template}")
            }
            Schema::Migrated => format!("CREATE DATABASE {name}"),
        };
        sqlx::query(&create)
            .execute(&mut admin_conn)
            .await
            .expect("create test database");
        admin_conn
            .close()
            .await
            .expect("close the admin connection");
        let url = database_url(admin, &name);
        let options: sqlx::postgres::PgConnectOptions = url.parse().expect("test database url");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .connect_with(options.application_name(HARNESS_APPLICATION_NAME))
            .await
            .expect("connect to test database");
        if let Schema::Migrated = schema {
            cardworker::storage::migrate(&pool).await.expect("migrate");
        }
        Self {
            name,
            url,
            pool,
            admin: admin.to_owned(),
        }
    }
}

/// The URL of database `name` on the server of `admin`.
fn database_url(admin: &str, name: &str) -> String {
    match admin.rfind('/') {
        Some(i) => format!("{}/{name}", &admin[..i]),
        None => panic!("admin url has no database part"),
    }
}

/// 64-bit FNV-1a of `bytes`.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The name of the template database of this build's migrations: `cw_tmpl_` and a hash of every
/// embedded migration's version and checksum, so that a changed, added or removed migration names
/// another template.
pub fn template_name() -> String {
    let hash = fnv1a(cardworker::storage::MIGRATOR.iter().flat_map(|migration| {
        let mut bytes = migration.version.to_le_bytes().to_vec();
        bytes.extend_from_slice(&migration.checksum);
        bytes
    }));
    format!("cw_tmpl_{hash:016x}")
}

/// [`ensure_template_named`] for the template of this build's migrations ([`template_name`]).
async fn ensure_template(conn: &mut PgConnection, admin: &str) -> String {
    let template = template_name();
    ensure_template_named(conn, admin, &template).await;
    template
}

/// Makes sure the server of `admin` (`conn` is a session on it as admin) has template database
/// `template`, migrated with this build's migrations; true when this call built it.
///
/// A template exists under its name only once it is complete: it is built under a temporary name
/// (`…_wip`), migrated, its pool closed, marked a template that takes no connections, and only
/// then renamed. Test processes starting at once serialise its creation on an advisory lock (keyed
/// by the template's name) on the admin connection, and check again under the lock; one that
/// died while building leaves a `…_wip` database, which the next builder drops under the lock.
/// Templates of other migration sets are left alone: another checkout's tests may be cloning
/// them.
pub async fn ensure_template_named(conn: &mut PgConnection, admin: &str, template: &str) -> bool {
    if database_exists(conn, template).await {
        return false;
    }
    let key = i64::from_ne_bytes(fnv1a(template.bytes()).to_ne_bytes());
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut *conn)
        .await
        .expect("take the template lock");
    let build = !database_exists(conn, template).await;
    if build {
        build_template(conn, admin, template).await;
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .execute(&mut *conn)
        .await
        .expect("release the template lock");
    build
}

/// Whether database `name` exists.
pub async fn database_exists(conn: &mut PgConnection, name: &str) -> bool {
    sqlx::query_scalar::<_, i32>("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_optional(&mut *conn)
        .await
        .expect("look up a database")
        .is_some()
}

/// Builds template `template` (see [`ensure_template_named`]); the caller holds the template lock.
async fn build_template(conn: &mut PgConnection, admin: &str, template: &str) {
    let wip = format!("{template}_wip");
    if database_exists(conn, &wip).await {
        // Left by a builder that died after marking it a template, or before.
        for statement in [
            format!("ALTER DATABASE {wip} WITH IS_TEMPLATE false"),
            format!("DROP DATABASE {wip} WITH (FORCE)"),
        ] {
            sqlx::query(&statement)
                .execute(&mut *conn)
                .await
                .expect("drop a half-built template database");
        }
    }
    sqlx::query(&format!("CREATE DATABASE {wip}"))
        .execute(&mut *conn)
        .await
        .expect("create the template database");
    let options: sqlx::postgres::PgConnectOptions = database_url(admin, &wip)
        .parse()
        .expect("template database url");
    // One connection, closed before the template is published: PostgreSQL refuses to rename or
    // clone a database with a session on it. (A pool's close leaves a connection its migrator
    // returned open for a while.)
    let mut migrating =
        PgConnection::connect_with(&options.application_name(HARNESS_APPLICATION_NAME))
            .await
            .expect("connect to the template database");
    cardworker::storage::MIGRATOR
        .run_direct(&mut migrating)
        .await
        .expect("migrate the template database");
    migrating
        .close()
        .await
        .expect("close the template database's session");
    for statement in [
        format!("ALTER DATABASE {wip} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false"),
        format!("ALTER DATABASE {wip} RENAME TO {template}"),
    ] {
        sqlx::query(&statement)
            .execute(&mut *conn)
            .await
            .expect("publish the template database");
    }
}

/// Runs async cleanup from a `Drop`: on a thread with its own runtime, joined, so the resource is
/// gone before the test returns (the test's own runtime is blocked in the drop).
fn cleanup_blocking(cleanup: impl Future<Output = ()> + Send + 'static) {
    let _ = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(cleanup);
        }
    })
    .join();
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin_url = self.admin.clone();
        // The pool is not closed from here: its connections belong to the test's runtime, which is
        // blocked in this drop; DROP … WITH (FORCE) ends them.
        cleanup_blocking(async move {
            if let Ok(admin) = PgPool::connect(&admin_url).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&admin)
                    .await;
                admin.close().await;
            }
        });
    }
}

/// A fresh Redis key prefix; every key under it is deleted when this guard drops.
pub struct TestRedis {
    /// The prefix (`redis.key_prefix`).
    pub prefix: String,
    /// A connection.
    pub conn: ConnectionManager,
}

impl TestRedis {
    /// A new prefix on the test Redis, as an existing deployment with its Redis intact sees it:
    /// the epoch marker is there, so a starting worker does not take the prefix for one that lost
    /// its data (and sweep every card into a chain).
    pub async fn new() -> Self {
        let prefix = format!("cwtest-{}", ulid::Ulid::new().to_string().to_lowercase());
        let mut conn = context::connect_redis(&redis_url())
            .await
            .expect("connect to redis");
        let _: () = redis::cmd("SET")
            .arg(cardworker::runner::redis_watch::epoch_key(&prefix))
            .arg("test")
            .query_async(&mut conn)
            .await
            .expect("set the epoch marker");
        Self { prefix, conn }
    }

    /// Every key under the prefix.
    pub async fn keys(&self) -> Vec<String> {
        scan_keys(&mut self.conn.clone(), &format!("{}:*", self.prefix)).await
    }
}

async fn scan_keys(conn: &mut ConnectionManager, pattern: &str) -> Vec<String> {
    let mut cursor: u64 = 0;
    let mut out = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .expect("scan");
        out.extend(batch);
        if next == 0 {
            return out;
        }
        cursor = next;
    }
}

/// Writes every key of a test prefix with its type and TTL to `dir/<prefix>.tsv` (the
/// `{prefix}` part replaced), for surveying what the suite writes.
async fn log_keys(conn: &mut ConnectionManager, prefix: &str, keys: &[String], dir: &str) {
    let mut lines = String::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query_async(conn)
            .await
            .unwrap_or_default();
        let ttl: i64 = redis::cmd("TTL")
            .arg(key)
            .query_async(conn)
            .await
            .unwrap_or(-3);
        let name = key.replacen(prefix, "{prefix}", 1);
        lines.push_str(&format!("{name}\t{kind}\t{ttl}\n"));
    }
    let _ = std::fs::write(format!("{dir}/{prefix}.tsv"), lines);
}

impl Drop for TestRedis {
    /// Deletes the prefix's keys; first checks them against the key inventory
    /// (`key_inventory::violations`) and fails the test on a key it does not list.
    fn drop(&mut self) {
        let prefix = self.prefix.clone();
        let found = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let slot = found.clone();
        cleanup_blocking(async move {
            let Ok(client) = redis::Client::open(redis_url()) else {
                return;
            };
            let Ok(mut conn) = client.get_connection_manager().await else {
                return;
            };
            let keys = scan_keys(&mut conn, &format!("{prefix}:*")).await;
            if let Ok(dir) = std::env::var("CARDWORKER_KEY_LOG") {
                log_keys(&mut conn, &prefix, &keys, &dir).await;
            }
            let wrong = inventory::violations(&mut conn, &prefix, &keys).await;
            if let Ok(mut slot) = slot.lock() {
                *slot = wrong;
            }
            for chunk in keys.chunks(500) {
                let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await;
            }
            // apalis-redis's one global key lists every queue it saw: forget ours.
            let queues: Vec<String> = redis::cmd("ZRANGE")
                .arg("core:apalis:queues:list")
                .arg(0)
                .arg(-1)
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            let ours: Vec<&String> = queues.iter().filter(|q| q.starts_with(&prefix)).collect();
            if !ours.is_empty() {
                let _: Result<(), _> = redis::cmd("ZREM")
                    .arg("core:apalis:queues:list")
                    .arg(ours)
                    .query_async(&mut conn)
                    .await;
            }
        });
        let found = found.lock().map(|f| f.clone()).unwrap_or_default();
        if !found.is_empty() && !std::thread::panicking() {
            panic!(
                "Redis keys outside the key inventory (test-kit/src/inventory.rs) under {}:\n{}",
                self.prefix,
                found.join("\n")
            );
        }
    }
}

/// A test configuration on the test database, prefix and simulator.
pub fn test_config(db: &TestDb, redis: &TestRedis, gateway: &str) -> Config {
    let mut config = Config::default();
    config.database.url = db.url.clone().into();
    config.database.max_connections = 10;
    config.redis.url = redis_url().into();
    config.redis.key_prefix = redis.prefix.clone();
    config.gateway.base_url = gateway.into();
    config.gateway.timeout_ms = 2_000;
    config.polling.handler_timeout_secs = 4;
    config.polling.lease_ttl_secs = 10;
    config.telemetry.listen = "127.0.0.1:0".to_owned();
    config.worker.shutdown_grace_secs = 10;
    config
}

/// A running worker process (in-process), its database, prefix and Gateway simulator.
pub struct TestApp {
    /// The process context (pool, redis, producer, config).
    pub ctx: Arc<AppContext>,
    /// The HTTP endpoint.
    pub addr: std::net::SocketAddr,
    /// The simulator.
    pub sim: Simulator,
    /// Stops the worker.
    stop: Option<oneshot::Sender<()>>,
    /// The worker's `Running::wait`.
    join: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// Keeps the simulator up.
    pub sim_handle: SimHandle,
    /// Dropped last: the prefix and the database.
    pub redis: TestRedis,
    /// The database.
    pub db: TestDb,
}

/// Fresh database, prefix and simulator, and a worker started with `tweak` applied to the config.
pub async fn spawn_app_with(tweak: impl FnOnce(&mut Config)) -> TestApp {
    let db = TestDb::new().await;
    let redis = TestRedis::new().await;
    spawn_app_prepared(db, redis, tweak).await
}

/// [`spawn_app_with`] with the database on the server of `admin` (for example a private
/// cluster, [`crate::private::PrivatePg::admin_url`]).
pub async fn spawn_app_on(admin: &str, tweak: impl FnOnce(&mut Config)) -> TestApp {
    let db = TestDb::new_on(admin).await;
    let redis = TestRedis::new().await;
    spawn_app_prepared(db, redis, tweak).await
}

/// [`spawn_app_with`] on a database and prefix the test prepared first.
pub async fn spawn_app_prepared(
    db: TestDb,
    redis: TestRedis,
    tweak: impl FnOnce(&mut Config),
) -> TestApp {
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(0, 0);
    let mut config = test_config(&db, &redis, &sim_handle.base_url());
    tweak(&mut config);
    let (ctx, addr, stop, join) = start_in_process(config).await;
    TestApp {
        ctx,
        addr,
        sim,
        stop: Some(stop),
        join: Some(join),
        sim_handle,
        redis,
        db,
    }
}

/// A worker process started in the test's process on `config` (validated): its context, its
/// endpoint, the sender that stops it and its `Running::wait`.
pub async fn start_in_process(
    config: Config,
) -> (
    Arc<AppContext>,
    std::net::SocketAddr,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    config.validate().expect("test config is valid");
    let ctx = AppContext::connect(config).await.expect("connect");
    let running = app::start(ctx.clone()).await.expect("start");
    let addr = running.addr;
    let (stop, stopped) = oneshot::channel::<()>();
    let join = tokio::spawn(running.wait(async move {
        let _ = stopped.await;
    }));
    (ctx, addr, stop, join)
}

/// [`spawn_app_with`] with the test defaults.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

impl TestApp {
    /// Whether queue `queue` (`payment`, `callback`, …) holds no job: none waiting in its intake,
    /// none in apalis (fed, running, or finished and not yet acknowledged).
    pub async fn queue_idle(&self, queue: &str) -> bool {
        let mut conn = self.ctx.redis.clone();
        let apalis = apalis_redis::Config::default()
            .queue(cardworker_jobs::keys::queue(self.ctx.prefix(), queue));
        let (waiting, jobs): (usize, usize) = redis::pipe()
            .zcard(cardworker_jobs::keys::intake(self.ctx.prefix(), queue))
            .hlen(apalis.job_data_hash())
            .query_async(&mut conn)
            .await
            .expect("queue sizes");
        waiting == 0 && jobs == 0
    }

    /// Stops the worker gracefully and returns how `run` ended.
    pub async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.join.take() {
            Some(join) => join.await.expect("worker task"),
            None => Ok(()),
        }
    }

    /// Waits until `run` returns on its own (for example after a worker died), up to `limit`.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<anyhow::Result<()>> {
        let join = self.join.as_mut()?;
        match tokio::time::timeout(limit, join).await {
            Ok(result) => {
                self.join = None;
                Some(result.expect("worker task"))
            }
            Err(_) => None,
        }
    }

    /// The producer of this app's deployment.
    pub fn producer(&self) -> &cardworker_jobs::Producer<ConnectionManager> {
        &self.ctx.producer
    }

    /// GET a path of the HTTP endpoint: (status, body).
    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = reqwest::get(format!("http://{}{path}", self.addr))
            .await
            .expect("endpoint answers");
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap_or_default())
    }

    /// A card_status poll of `card_ref` through the producer API (a request for a poll of the
    /// card): the card_ref the producer answers with.
    pub async fn enqueue_status_poll(&self, card_ref: &str) -> String {
        let job = cardworker_jobs::PollCardStatus {
            card_ref: card_ref.into(),
            ticket: cardworker_jobs::PollTicket::default(),
        };
        self.producer().enqueue(&job).await.expect("enqueue")
    }

    /// Inserts card `card_ref` and starts its `task` polling, its first poll due after `delay`.
    pub async fn card_with_chain(
        &self,
        task: cardworker::config::Task,
        card_ref: &str,
        delay: Duration,
    ) -> cardworker::polling::due_queue::Restarted {
        self.insert_card(card_ref).await;
        self.start_chain(task, card_ref, delay).await
    }

    /// Starts (or restarts) the polling of `card_ref`'s `task` in the due queue, its first poll
    /// due after `delay` with a fresh state: what it did.
    pub async fn start_chain(
        &self,
        task: cardworker::config::Task,
        card_ref: &str,
        delay: Duration,
    ) -> cardworker::polling::due_queue::Restarted {
        let mut conn = self.ctx.redis.clone();
        cardworker::polling::lease::due_queue(self.ctx.prefix(), task)
            .restart(&mut conn, card_ref, delay)
            .await
            .expect("start polling")
    }

    /// Inserts a card row.
    pub async fn insert_card(&self, card_ref: &str) {
        sqlx::query("INSERT INTO cards (card_ref) VALUES ($1)")
            .bind(card_ref)
            .execute(&self.db.pool)
            .await
            .expect("insert card");
    }
}

impl Drop for TestApp {
    /// Stops the worker before the prefix and the database go (they drop after this). On a
    /// multi-thread runtime the worker's tasks run while this drop blocks: without waiting for the
    /// worker to end, its feeder, crons and probe wrote a few keys under the prefix after
    /// `TestRedis` had cleaned it (3–11 keys a full run). On a current-thread runtime none of the
    /// worker runs while the drop blocks, and the runtime drops its tasks unpolled when the test
    /// returns, so the join is only aborted.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let Some(mut join) = self.join.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                // Longer than the test config's shutdown grace (10 s), so a worker that ends
                // gracefully is always waited for.
                let ended = tokio::task::block_in_place(|| {
                    handle.block_on(tokio::time::timeout(Duration::from_secs(15), &mut join))
                });
                if ended.is_err() {
                    join.abort();
                    // A worker that ignores its stop signal is a defect the test must report; a
                    // test already failing keeps its own panic (a second one would abort).
                    if !std::thread::panicking() {
                        panic!("TestApp: the worker did not stop within 15 s of its stop signal");
                    }
                }
            }
            _ => join.abort(),
        }
    }
}

/// Waits until `check` returns true, polling every 20 ms, up to `limit`; panics with `what`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return;
        }
        if start.elapsed() > limit {
            panic!("timed out after {limit:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to `limit` until the query `sql` (one count) on `pool` answers `want`.
pub async fn wait_for_count(pool: &PgPool, sql: &str, want: i64, limit: Duration, what: &str) {
    wait_until(limit, what, || async {
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(pool)
            .await
            .expect(sql)
            == want
    })
    .await;
}

/// Asserts that the command `what` exited 0, showing its error output otherwise.
pub fn assert_success(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of one Prometheus sample in a `/metrics` text (`name{labels}` exactly as rendered
/// label subset match), or 0.
pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.starts_with(name)
                && l[name.len()..].starts_with(['{', ' '])
                && labels
                    .iter()
                    .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// ---- `cardworker run` as a child process ----

pub use crate::process::Worker;

/// Starts this build's `cardworker run --config CONFIG` ([`crate::cardworker_bin`]) as a child
/// process and waits until it logs its metrics address.
pub fn spawn_worker(config: &std::path::Path) -> Worker {
    let bin = crate::cardworker_bin();
    Worker::spawn(&bin.to_string_lossy(), config).expect("spawn cardworker run")
}

/// Writes a worker's config file into `dir`: the test database (a pool of `connections`) and
/// prefix, the Gateway at `gateway`, a metrics endpoint on port 0, JSON logs, and `body` (the
/// rest of `[gateway]`, then the test's other sections).
pub fn worker_config_file(
    dir: &tempfile::TempDir,
    (db, connections): (&TestDb, u32),
    redis: &TestRedis,
    gateway: &str,
    body: &str,
) -> std::path::PathBuf {
    let path = dir.path().join("cardworker.toml");
    std::fs::write(
        &path,
        format!(
            "[database]\nurl = \"{}\"\nmax_connections = {connections}\n\n[redis]\nurl = \"{}\"\nkey_prefix = \"{}\"\n\n\
             [telemetry]\nlisten = \"127.0.0.1:0\"\nlog_format = \"json\"\n\n\
             [gateway]\nbase_url = \"{gateway}\"\n{body}",
            db.url,
            redis_url(),
            redis.prefix
        ),
    )
    .expect("write the worker config");
    path
}
