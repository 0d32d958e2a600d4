//! The stage of the benches that run a `cardworker run` process against the in-process Gateway
//! simulator (`benches/bench_redis.rs`, `benches/bench_burst.rs`): a fresh database of the run's
//! own with the bench's cards, the worker's configuration, the cards' chains, the worker's CPU
//! and the simulator's count of Gateway calls.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cardworker::config::Task;
use cardworker::polling::lease;
use cardworker::sim::Simulator;
use redis::aio::ConnectionManager;

use crate::bench;
use crate::process::Worker;

/// A fresh database on the benches' PostgreSQL, a Redis key prefix and a config directory of
/// one bench run, and where its worker finds Redis and the Gateway.
pub struct Stage {
    /// The `cardworker` binary that migrates the database (and that the bench runs).
    pub binary: String,
    pub admin_url: String,
    pub db: String,
    pub db_url: String,
    pub pool: sqlx::PgPool,
    pub redis_url: String,
    pub prefix: String,
    pub dir: tempfile::TempDir,
    pub sim_url: String,
}

impl Stage {
    /// Creates the run's database (`cw_bench_<id>`) and prefix (`cwbench-<id>`).
    pub async fn new(binary: String, redis_url: String, sim_url: String) -> anyhow::Result<Self> {
        let admin_url = bench::admin_url();
        let id = ulid::Ulid::new().to_string().to_lowercase();
        let (db, db_url) = bench::create_database(&admin_url, &format!("cw_bench_{id}")).await?;
        let pool = sqlx::PgPool::connect(&db_url)
            .await
            .with_context(|| format!("connecting to {db_url}"))?;
        Ok(Self {
            binary,
            admin_url,
            db,
            db_url,
            pool,
            redis_url,
            prefix: format!("cwbench-{id}"),
            dir: tempfile::tempdir().context("creating the config directory")?,
            sim_url,
        })
    }

    /// Writes the worker's configuration and migrates the database: `total_limit = 128` and 64
    /// per task, so that the worker's slots (its concurrency is its task's limit) never
    /// outnumber the total and no poll waits for a token another task holds; both tasks every
    /// `interval_secs`; the Gateway at the simulator.
    pub fn config(&self, interval_secs: u64) -> anyhow::Result<PathBuf> {
        self.write_config(
            &self.redis_url,
            20,
            &format!(
                "timeout_ms = 2000\n\n[polling]\ntotal_limit = 128\nhandler_timeout_secs = 10\n\
                 lease_ttl_secs = 30\n\n[polling.carddata]\nlimit = 64\n\
                 interval_secs = {interval_secs}\n\n[polling.card_status]\nlimit = 64\n\
                 interval_secs = {interval_secs}\n"
            ),
        )
    }

    /// Writes `bench.toml` in the stage's directory and migrates the database with the stage's
    /// binary: the database (a pool of `max_connections`), Redis at `redis_url` under the
    /// stage's prefix, `/metrics` on a free port, the Gateway at the simulator, then `body`
    /// (which goes on in the `[gateway]` section).
    pub fn write_config(
        &self,
        redis_url: &str,
        max_connections: u32,
        body: &str,
    ) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join("bench.toml");
        std::fs::write(
            &path,
            format!(
                "[database]\nurl = \"{}\"\nmax_connections = {max_connections}\n\n[redis]\n\
                 url = \"{redis_url}\"\nkey_prefix = \"{}\"\n\n[telemetry]\n\
                 listen = \"127.0.0.1:0\"\nlog_format = \"json\"\n\n[gateway]\n\
                 base_url = \"{}\"\n{body}",
                self.db_url, self.prefix, self.sim_url
            ),
        )
        .with_context(|| format!("writing {}", path.display()))?;
        let out = Command::new(&self.binary)
            .arg("migrate")
            .arg("--config")
            .arg(&path)
            .output()
            .context("running migrate")?;
        anyhow::ensure!(out.status.success(), "migrate failed: {out:?}");
        Ok(path)
    }

    /// [`Stage::config`], and `cards` cards inserted (`r-000000`, …); returns the config and
    /// the card refs.
    pub async fn seed(
        &self,
        cards: usize,
        interval_secs: u64,
    ) -> anyhow::Result<(PathBuf, Vec<String>)> {
        let path = self.config(interval_secs)?;
        let refs: Vec<String> = (0..cards).map(|i| format!("r-{i:06}")).collect();
        self.insert_cards(&refs).await?;
        Ok((path, refs))
    }

    /// [`Stage::seed`], and both tasks' chains of every card started as [`start_chains`] starts
    /// them.
    pub async fn seed_chains(
        &self,
        conn: &ConnectionManager,
        cards: usize,
        interval_secs: u64,
        first_due: Instant,
        spread: Duration,
    ) -> anyhow::Result<(PathBuf, Vec<String>)> {
        let (path, refs) = self.seed(cards, interval_secs).await?;
        start_chains(conn, &self.prefix, &refs, &Task::ALL, first_due, spread).await?;
        Ok((path, refs))
    }

    /// Inserts the cards `refs`.
    pub async fn insert_cards(&self, refs: &[String]) -> anyhow::Result<()> {
        sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
            .bind(refs)
            .execute(&self.pool)
            .await
            .context("inserting the cards")?;
        Ok(())
    }

    /// Closes the pool and drops the run's database.
    pub async fn remove(self) {
        self.pool.close().await;
        bench::drop_database(&self.admin_url, &self.db).await;
    }
}

/// Starts the chains of `tasks` of every card, the first card's due at `first_due` and the
/// others' spread evenly over `spread` after it. Each delay is taken from `first_due` at the moment its
/// chain starts, so the due times do not drift with the time the starting takes (one already past
/// is due at once).
pub async fn start_chains(
    conn: &ConnectionManager,
    prefix: &str,
    cards: &[String],
    tasks: &[Task],
    first_due: Instant,
    spread: Duration,
) -> anyhow::Result<()> {
    let mut c = conn.clone();
    let n = cards.len().max(1) as u128;
    for (i, card) in cards.iter().enumerate() {
        let offset =
            Duration::from_millis(u64::try_from(spread.as_millis() * i as u128 / n).unwrap_or(0));
        let due = first_due + offset;
        for task in tasks {
            lease::start(
                &mut c,
                prefix,
                *task,
                card,
                due.saturating_duration_since(Instant::now()),
            )
            .await?;
        }
    }
    Ok(())
}

/// Gateway calls of both tasks so far.
pub fn gateway_calls(sim: &Simulator) -> u64 {
    let s = sim.stats();
    s.calls_total.get("carddata").copied().unwrap_or(0)
        + s.calls_total.get("card_status").copied().unwrap_or(0)
}

/// Waits until `calls()` reaches `target` (at most `limit`).
pub async fn wait_for_calls(
    calls: impl Fn() -> u64,
    target: u64,
    limit: Duration,
    what: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    while calls() < target {
        anyhow::ensure!(started.elapsed() < limit, "{what} did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Stops the worker (SIGTERM) and waits for it to exit.
pub fn stop(mut worker: Worker) {
    worker.terminate();
    let _ = worker.child.wait();
}

/// CPU seconds (user + system) of process `pid` so far.
pub fn process_cpu(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command name (which may hold spaces) start after the last ')'.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the state field.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| f.get(*i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}
