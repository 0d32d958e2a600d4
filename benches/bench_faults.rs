//! `make bench-outage` and `make bench-slowdown`: Gateway trouble against real `cardworker run`
//! processes and the in-process Gateway simulator, on a fresh database and Redis prefix.
//!
//! - **outage** (`BENCH_SCENARIO=outage`): `BENCH_CARDS` cards (default 1000), both tasks every
//!   `BENCH_INTERVAL_SECS` (default 10), one worker. After every card was polled once, the
//!   Gateway answers 503 to every card call for each duration of `BENCH_OUTAGE_SECS` (default
//!   `60,600`, one fresh run each), then recovers; each card's state changes at recovery, so a
//!   poll after it shows in PostgreSQL. Reports the records written during the outage
//!   (integration logs, audit events), the chains parked, and the time until every card was
//!   polled again for both tasks (waiting at most `BENCH_RESUME_LIMIT_SECS`, default 900).
//! - **slowdown** (`BENCH_SCENARIO=slowdown`): 24 cards, a quarter of them answering after 20 s,
//!   `gateway.timeout_ms = 25000`, `handler_timeout_secs = 27`, `lease_ttl_secs = 40`, both tasks
//!   every `BENCH_INTERVAL_SECS` (default 2), two workers, `BENCH_SLOW_SECS` (default 100).
//!   Reports whether each worker is alive at the end (or when it exited), the most concurrent
//!   calls about one card (2 = a card polled twice at once) and the Gateway's peaks.
//!
//! - **scrape** (`BENCH_SCENARIO=scrape`, `make bench-scrape`): one worker on a private
//!   redis-server, 100 cards, both tasks every 2 s; `BENCH_SCRAPES` (default 100) scrapes of
//!   `/metrics` one after the other with Redis up, then as many from the moment the redis-server
//!   is killed. Reports each phase's p50, p99 and max latency and the scrapes that failed.
//!
//! `CARDWORKER_BIN` runs another build of `cardworker` (main's, for the "before" numbers); the
//! config file names only keys that main knows, so that both builds load it (this build applies
//! its defaults for the rest). `CARDWORKER_BENCH_PG_ADMIN` and `CARDWORKER_BENCH_REDIS` as for
//! the other benches.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cardworker::config::Task;
use cardworker::gateway::CardStatus;
use cardworker::sim::Simulator;

use support::env_or;

fn binary() -> String {
    std::env::var("CARDWORKER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_cardworker").to_owned())
}

/// A fresh database, a fresh Redis prefix and a simulator; removed by [`Stage::drop_all`].
struct Stage {
    base: worker_stage::Stage,
    redis: redis::aio::ConnectionManager,
    sim: Simulator,
    _sim_handle: cardworker::sim::SimHandle,
}

impl Stage {
    async fn new() -> anyhow::Result<Self> {
        let redis_url = support::redis_url();
        let redis = cardworker::context::connect_redis(&redis_url).await?;
        let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
        let base = worker_stage::Stage::new(binary(), redis_url, sim_handle.base_url()).await?;
        Ok(Self {
            base,
            redis,
            sim,
            _sim_handle: sim_handle,
        })
    }

    /// Writes the config file (only keys main knows) and migrates with the binary under test.
    fn config(&self, body: &str) -> anyhow::Result<std::path::PathBuf> {
        self.config_on(&self.base.redis_url, body)
    }

    /// [`Stage::config`] on another Redis (a private one).
    fn config_on(&self, redis_url: &str, body: &str) -> anyhow::Result<std::path::PathBuf> {
        self.base.write_config(redis_url, 10, body)
    }

    async fn insert_cards(&self, cards: &[String]) -> anyhow::Result<()> {
        self.base.insert_cards(cards).await
    }

    async fn start_chains(
        &self,
        cards: &[String],
        tasks: &[Task],
        spread: Duration,
    ) -> anyhow::Result<()> {
        worker_stage::start_chains(
            &self.redis,
            &self.base.prefix,
            cards,
            tasks,
            Instant::now(),
            spread,
        )
        .await
    }

    async fn scalar(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(sql).fetch_one(&self.base.pool).await?)
    }

    fn calls(&self, call: &str) -> u64 {
        self.sim.stats().calls_total.get(call).copied().unwrap_or(0)
    }

    async fn drop_all(self) {
        let mut conn = self.redis.clone();
        support::delete_prefix(&mut conn, &self.base.prefix).await;
        self.base.remove().await;
    }
}

use cardworker_test_kit::bench as support;
use cardworker_test_kit::process::Worker;
use cardworker_test_kit::worker_stage::{self, stop};

/// The sum of the samples of `name` whose labels contain `label`, or `None` when there is none
/// (an older build may not export it).
async fn metric(worker: &Worker, name: &str, label: &str) -> Option<f64> {
    let text = worker.metrics().await;
    let samples: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!samples.is_empty()).then(|| samples.iter().sum())
}

async fn wait_for(limit: Duration, mut check: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

/// One outage of `outage` over `cards` cards; prints one table row.
async fn outage_run(
    cards: usize,
    outage: Duration,
    interval: u64,
    resume_limit: Duration,
) -> anyhow::Result<()> {
    let stage = Stage::new().await?;
    stage.sim.set_latency(20, 10);
    let path = stage.config(&format!(
        "timeout_ms = 2000\n\n[polling]\ntotal_limit = 32\nhandler_timeout_secs = 10\n\
         lease_ttl_secs = 30\n\n[polling.carddata]\nlimit = 16\ninterval_secs = {interval}\n\n\
         [polling.card_status]\nlimit = 16\ninterval_secs = {interval}\n"
    ))?;
    let refs: Vec<String> = (0..cards).map(|i| format!("b-{i:05}")).collect();
    stage.insert_cards(&refs).await?;
    let worker = Worker::spawn(&binary(), &path)?;
    stage
        .start_chains(&refs, &Task::ALL, Duration::from_secs(interval))
        .await?;
    let warm = wait_for(Duration::from_secs(300), async || {
        stage.calls("carddata") >= cards as u64 && stage.calls("card_status") >= cards as u64
    })
    .await;
    anyhow::ensure!(warm.is_some(), "the warm-up did not poll every card");
    let logs_before = stage
        .scalar("SELECT count(*) FROM integration_logs")
        .await?;
    let audits_before = stage.scalar("SELECT count(*) FROM audit_events").await?;

    stage.sim.set_error_rate(1.0);
    let began = Instant::now();
    let mut open_seen = false;
    while began.elapsed() < outage {
        tokio::time::sleep(Duration::from_secs(2)).await;
        if metric(
            &worker,
            "cardworker_gateway_circuit_open",
            "task=\"carddata\"",
        )
        .await
            == Some(1.0)
        {
            open_seen = true;
        }
    }
    let logs = stage
        .scalar("SELECT count(*) FROM integration_logs")
        .await?
        - logs_before;
    let audits = stage.scalar("SELECT count(*) FROM audit_events").await? - audits_before;
    let parked = stage
        .scalar(
            "SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL \
             OR card_status_parked_at IS NOT NULL",
        )
        .await?;

    stage.sim.set_error_rate(0.0);
    for card in &refs {
        stage.sim.set_card_status(card, CardStatus::Frozen);
        stage.sim.set_card_ready(card, "tok_b", "4242", 12, 2030);
    }
    let recovered = Instant::now();
    let all = cards as i64;
    let resumed = wait_for(resume_limit, async || {
        stage
            .scalar("SELECT count(*) FROM cards WHERE status = 'frozen' AND data_state = 'ready'")
            .await
            .unwrap_or(0)
            == all
    })
    .await;
    let done = stage
        .scalar("SELECT count(*) FROM cards WHERE status = 'frozen' AND data_state = 'ready'")
        .await?;
    let resume = match resumed {
        Some(t) => format!("{:.0} s", t.as_secs_f64()),
        None => format!(
            "not within {} s ({done} of {cards} cards polled again)",
            recovered.elapsed().as_secs()
        ),
    };
    println!(
        "| {} s | {cards} | {logs} | {audits} | {parked} | {} | {resume} |",
        outage.as_secs(),
        if open_seen { "yes" } else { "no" },
    );
    stop(worker);
    stage.drop_all().await;
    Ok(())
}

async fn outage() -> anyhow::Result<()> {
    let cards: usize = env_or("BENCH_CARDS", "1000")
        .parse()
        .context("BENCH_CARDS")?;
    let interval: u64 = env_or("BENCH_INTERVAL_SECS", "10")
        .parse()
        .context("BENCH_INTERVAL_SECS")?;
    let resume_limit = Duration::from_secs(
        env_or("BENCH_RESUME_LIMIT_SECS", "900")
            .parse()
            .context("BENCH_RESUME_LIMIT_SECS")?,
    );
    println!(
        "bench-outage: {} ({cards} cards, both tasks every {interval} s, 20 ms Gateway)\n",
        binary()
    );
    println!(
        "| outage | cards | integration logs written | audit events written | chains parked | circuit opened | every card polled again after recovery |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | --- | --- |");
    for secs in env_or("BENCH_OUTAGE_SECS", "60,600").split(',') {
        let secs: u64 = secs.trim().parse().context("BENCH_OUTAGE_SECS")?;
        outage_run(cards, Duration::from_secs(secs), interval, resume_limit).await?;
    }
    Ok(())
}

async fn slowdown() -> anyhow::Result<()> {
    let run_for = Duration::from_secs(
        env_or("BENCH_SLOW_SECS", "100")
            .parse()
            .context("BENCH_SLOW_SECS")?,
    );
    let interval: u64 = env_or("BENCH_INTERVAL_SECS", "2")
        .parse()
        .context("BENCH_INTERVAL_SECS")?;
    let stage = Stage::new().await?;
    stage.sim.set_latency(20, 10);
    let path = stage.config(&format!(
        "timeout_ms = 25000\n\n[polling]\nhandler_timeout_secs = 27\nlease_ttl_secs = 40\n\n\
         [polling.carddata]\ninterval_secs = {interval}\n\n[polling.card_status]\n\
         interval_secs = {interval}\n"
    ))?;
    let refs: Vec<String> = (0..24).map(|i| format!("s-{i:02}")).collect();
    stage.insert_cards(&refs).await?;
    for card in refs.iter().step_by(4) {
        stage.sim.set_card_latency(card, Some(20_000));
    }
    let workers = [
        Worker::spawn(&binary(), &path)?,
        Worker::spawn(&binary(), &path)?,
    ];
    stage
        .start_chains(&refs, &Task::ALL, Duration::from_secs(interval))
        .await?;
    let started = Instant::now();
    let mut exited: [Option<(Duration, String)>; 2] = [None, None];
    let mut workers = workers.map(Some);
    while started.elapsed() < run_for {
        for (i, w) in workers.iter_mut().enumerate() {
            if let Some(worker) = w {
                if let Ok(Some(status)) = worker.child.try_wait() {
                    let last = worker.last_error().unwrap_or_default();
                    exited[i] = Some((started.elapsed(), format!("{status}; {last}")));
                    *w = None;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let stats = stage.sim.stats();
    println!("bench-slowdown: {} ({} s, 24 cards, 6 answering after 20 s, both tasks every {interval} s)\n", binary(), run_for.as_secs());
    println!("| worker | alive after the run |");
    println!("| --- | --- |");
    for (i, e) in exited.iter().enumerate() {
        match e {
            None => println!("| {i} | yes |"),
            Some((at, why)) => println!(
                "| {i} | no: exited after {:.0} s ({}) |",
                at.as_secs_f64(),
                why.chars().take(300).collect::<String>()
            ),
        }
    }
    println!(
        "\nmost concurrent calls about one card: {} (2 or more = polled twice at once)\n\
         Gateway peaks: in flight {} (total_limit 8), carddata {}, card_status {} (limits 4); \
         calls: {:?}",
        stats.peak_same_card,
        stats.peak_in_flight,
        stats.peak_per_call.get("carddata").copied().unwrap_or(0),
        stats.peak_per_call.get("card_status").copied().unwrap_or(0),
        stats.calls_total
    );
    for w in workers.into_iter().flatten() {
        stop(w);
    }
    stage.drop_all().await;
    Ok(())
}

/// `n` scrapes of `/metrics` one after the other: each one's latency (ms) and whether it
/// answered 200 within `limit`.
async fn scrapes(worker: &Worker, n: usize, limit: Duration) -> (Vec<f64>, usize) {
    let client = reqwest::Client::builder()
        .timeout(limit)
        .build()
        .unwrap_or_default();
    let (mut ms, mut failed) = (Vec::with_capacity(n), 0);
    for _ in 0..n {
        let start = Instant::now();
        let ok = match client
            .get(format!("http://{}/metrics", worker.metrics))
            .send()
            .await
        {
            Ok(r) => r.status().is_success() && r.text().await.is_ok(),
            Err(_) => false,
        };
        ms.push(start.elapsed().as_secs_f64() * 1000.0);
        if !ok {
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (ms, failed)
}

/// One table row: p50, p99, max (ms) and the failed scrapes.
fn scrape_row(what: &str, (mut ms, failed): (Vec<f64>, usize)) {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    println!(
        "| {what} | {} | {:.1} | {:.1} | {:.1} | {failed} |",
        ms.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}

/// `make bench-scrape`: how long `GET /metrics` takes with Redis up and while Redis is down.
async fn scrape() -> anyhow::Result<()> {
    let n: usize = env_or("BENCH_SCRAPES", "100")
        .parse()
        .context("BENCH_SCRAPES")?;
    let stage = Stage::new().await?;
    stage.sim.set_latency(5, 5);
    let (redis, _conn) = support::private_redis().await?;
    let path = stage.config_on(
        &redis.url(),
        "\n[worker]\nredis_outage_grace_secs = 3600\n\n[polling.carddata]\ninterval_secs = 2\n\n\
         [polling.card_status]\ninterval_secs = 2\n",
    )?;
    let refs: Vec<String> = (0..100).map(|i| format!("m-{i:03}")).collect();
    stage.insert_cards(&refs).await?;
    let worker = Worker::spawn(&binary(), &path)?;
    // The fresh Redis has no epoch marker: the worker's first probe starts every chain.
    wait_for(Duration::from_secs(60), async || {
        metric(
            &worker,
            "cardworker_poll_outcomes_total",
            "skipped_unchanged",
        )
        .await
        .is_some_and(|n| n > 100.0)
    })
    .await
    .context("the worker did not start polling")?;
    println!(
        "bench-scrape: {} (100 cards, both tasks every 2 s; {n} scrapes one after the other, 100 ms apart, 30 s client timeout)\n",
        binary()
    );
    println!("| Redis | scrapes | p50 ms | p99 ms | max ms | failed |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    let limit = Duration::from_secs(30);
    scrape_row("up", scrapes(&worker, n, limit).await);
    drop(redis);
    // Scrapes from the moment Redis is gone (the probe notices within about 2 s).
    scrape_row("stopped", scrapes(&worker, n, limit).await);
    stop(worker);
    stage.drop_all().await;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match env_or("BENCH_SCENARIO", "outage").as_str() {
        "outage" => outage().await,
        "slowdown" => slowdown().await,
        "scrape" => scrape().await,
        other => anyhow::bail!("BENCH_SCENARIO {other:?}: outage, slowdown or scrape"),
    }
}
