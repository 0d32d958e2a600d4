//! `make bench-budget`: what the polling budget layer costs and how well it uses the budget.
//!
//! Runs against a private `redis-server` (spawned on a free port, so `INFO commandstats` counts
//! only this bench) and the in-process Gateway simulator. In one run:
//! 1. throughput: N no-op poll jobs through apalis-redis, without and with
//!    [`PollingBudgetLayer`] (limits far above the concurrency, so nothing defers): jobs/s and
//!    the overhead ratio, plus Redis round trips per job (commandstats delta);
//! 2. utilisation under backlog: both polling tasks, `total_limit = 4`, task limits 3 and 3,
//!    worker concurrency 3 each, the simulator at 50 ms per call: mean Gateway in-flight ÷ 4
//!    while a backlog exists (target ≥ 0.9), and the simulator's peak in-flight (never above 4).
//!
//! Prints a markdown table (copied into docs/BENCHMARKS.md).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_redis::RedisStorage;
use cardworker::budget::Budget;
use cardworker::config::{Config, Task};
use cardworker::gateway::GatewayClient;
use cardworker::limit::Limit;
use cardworker::polling::budget_layer::PollingBudgetLayer;
use cardworker::polling::lease;
use cardworker::queue::{intake, QueueName};
use cardworker::sim::Simulator;
use cardworker_jobs::{Job, PollCardData, PollCardStatus};
use redis::aio::ConnectionManager;
use support::private_redis;
use tokio::sync::watch;

use cardworker_test_kit::bench as support;

/// What the bench handler shares.
struct State {
    gateway: Option<GatewayClient>,
    done: AtomicU64,
    cards: Mutex<HashSet<String>>,
}

async fn handler(raw: String, state: Data<Arc<State>>) -> Result<(), BoxDynError> {
    let job: PollCardData = serde_json::from_str(&raw)?;
    if let Some(gateway) = &state.gateway {
        // Card-status jobs have cards named s-…: call the matching endpoint, so that the
        // simulator's per-call peaks are per task.
        if job.card_ref.starts_with("s-") {
            let _ = gateway
                .card_status(&job.card_ref, uuid::Uuid::new_v4())
                .await;
        } else {
            let _ = gateway.card_data(&job.card_ref, uuid::Uuid::new_v4()).await;
        }
    }
    if let Ok(mut cards) = state.cards.lock() {
        cards.insert(job.card_ref.clone());
    }
    state.done.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// A connection that counts its round trips (a pipeline is one), for apalis-redis's share.
#[derive(Clone)]
struct Counting {
    inner: ConnectionManager,
    trips: Arc<AtomicU64>,
}

impl redis::aio::ConnectionLike for Counting {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        self.trips.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_command(cmd)
    }
    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.trips.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_commands(pipeline, offset, count)
    }
    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

static APALIS_TRIPS: LazyLock<Arc<AtomicU64>> = LazyLock::new(Arc::default);

fn storage(
    conn: &ConnectionManager,
    prefix: &str,
    queue: &str,
    batch: usize,
) -> RedisStorage<String, Counting> {
    let conn = Counting {
        inner: conn.clone(),
        trips: APALIS_TRIPS.clone(),
    };
    let config = apalis_redis::Config::default()
        .queue(cardworker_jobs::keys::queue(prefix, queue))
        .batch_size(batch)
        .heartbeat_interval(Duration::from_secs(5))
        .missed_heartbeats(3);
    RedisStorage::new(conn).with_config(config)
}

macro_rules! worker {
    ($conn:expr, $prefix:expr, $queue:expr, $state:expr, $conc:expr $(, layer = $layer:expr)?) => {{
        WorkerBuilder::new(format!("bench-{}-{}", $queue, ulid::Ulid::new()))
            .backend(storage($conn, $prefix, $queue, $conc).poll_with_interval(Duration::from_millis(50)))
            .data($state.clone())
            .concurrency($conc)
            $(.layer($layer))?
            .build(handler)
    }};
}

async fn commands(conn: &mut ConnectionManager) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    Ok(info
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum())
}

fn config(url: &str, prefix: &str, total: u32, task: u32) -> Config {
    let mut c = Config::default();
    c.redis.url = url.into();
    c.redis.key_prefix = prefix.to_owned();
    c.polling.total_limit = Limit::new(total).expect("a limit");
    c.polling.carddata.limit = Limit::new(task).expect("a limit");
    c.polling.card_status.limit = Limit::new(task).expect("a limit");
    c.polling.defer_delay_secs = 1;
    c.polling.defer_max_delay_secs = 2;
    c
}

/// Starts `n` chains of `task` (due now) and moves them into apalis.
async fn fill(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    queue: &str,
    n: usize,
) -> anyhow::Result<()> {
    for i in 0..n {
        lease::start(conn, prefix, task, &format!("c-{i:05}"), Duration::ZERO).await?;
    }
    let q = QueueName::new(prefix, queue);
    while intake::feed(conn, &q).await?.waiting > 0 {}
    Ok(())
}

struct Throughput {
    jobs_per_sec: f64,
    /// Round trips of apalis-redis (fetch, lock, ack, heartbeats) per job.
    apalis_trips_per_job: f64,
    /// Round trips of the budget layer per job.
    budget_trips_per_job: f64,
    /// Commands Redis executed per job, including those inside Lua scripts (commandstats).
    commands_per_job: f64,
    /// Share of the jobs that started on a kept slot (no budget call).
    kept_slot_share: f64,
}

async fn throughput(
    url: &str,
    conn: &ConnectionManager,
    budget: Option<&Budget>,
    n: usize,
) -> anyhow::Result<Throughput> {
    let prefix = format!("bench-{}", ulid::Ulid::new());
    let mut c = conn.clone();
    fill(&mut c, &prefix, Task::Carddata, PollCardData::QUEUE, n).await?;
    let state = Arc::new(State {
        gateway: None,
        done: AtomicU64::new(0),
        cards: Mutex::default(),
    });
    let (stop, stop_rx) = watch::channel(false);
    let stopped = {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
            Ok::<(), std::io::Error>(())
        }
    };
    let cfg = config(url, &prefix, 256, 256);
    let trips_before = budget.map_or(0, Budget::round_trips);
    let reused_before = budget.map_or(0, Budget::reused);
    let before = APALIS_TRIPS.load(Ordering::SeqCst);
    let commands_before = commands(&mut c).await?;
    let start = Instant::now();
    let run = if let Some(budget) = budget {
        let layer = PollingBudgetLayer::<PollCardData>::new(budget.clone(), &cfg.polling);
        tokio::spawn(
            worker!(conn, &prefix, PollCardData::QUEUE, state, 32, layer = layer)
                .run_until(stopped),
        )
    } else {
        tokio::spawn(worker!(conn, &prefix, PollCardData::QUEUE, state, 32).run_until(stopped))
    };
    while state.done.load(Ordering::SeqCst) < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let apalis = APALIS_TRIPS.load(Ordering::SeqCst) - before;
    let commands_after = commands(&mut c).await?;
    stop.send_replace(true);
    let _ = run.await;
    Ok(Throughput {
        jobs_per_sec: n as f64 / elapsed.as_secs_f64(),
        apalis_trips_per_job: apalis as f64 / n as f64,
        budget_trips_per_job: (budget.map_or(0, Budget::round_trips) - trips_before) as f64
            / n as f64,
        kept_slot_share: (budget.map_or(0, Budget::reused) - reused_before) as f64 / n as f64,
        commands_per_job: (commands_after - commands_before) as f64 / n as f64,
    })
}

struct Utilisation {
    jobs: usize,
    seconds: f64,
    mean_in_flight: f64,
    peak: u64,
    peak_carddata: u64,
    peak_card_status: u64,
    deferrals: u64,
}

async fn utilisation(
    url: &str,
    conn: &ConnectionManager,
    per_task: usize,
) -> anyhow::Result<Utilisation> {
    const TOTAL: u32 = 4;
    const TASK: u32 = 3;
    let prefix = format!("bench-{}", ulid::Ulid::new());
    let mut c = conn.clone();
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
    sim.set_latency(50, 0);
    let gateway = GatewayClient::new(&sim_handle.base_url(), Duration::from_secs(2))?;
    let cfg = config(url, &prefix, TOTAL, TASK);
    let budget = Budget::new(conn.clone(), &cfg);
    // Cards in the intake, not yet in apalis: the feeder moves them, as in production.
    for i in 0..per_task {
        lease::start(
            &mut c,
            &prefix,
            Task::Carddata,
            &format!("d-{i:05}"),
            Duration::ZERO,
        )
        .await?;
        lease::start(
            &mut c,
            &prefix,
            Task::CardStatus,
            &format!("s-{i:05}"),
            Duration::ZERO,
        )
        .await?;
    }
    let state = Arc::new(State {
        gateway: Some(gateway),
        done: AtomicU64::new(0),
        cards: Mutex::default(),
    });
    let (stop, stop_rx) = watch::channel(false);
    let stopped = |rx: watch::Receiver<bool>| async move {
        let mut rx = rx;
        let _ = rx.wait_for(|s| *s).await;
        Ok::<(), std::io::Error>(())
    };
    let feeder = intake::Feeder {
        conn: conn.clone(),
        queues: vec![
            QueueName::new(&prefix, PollCardData::QUEUE),
            QueueName::new(&prefix, PollCardStatus::QUEUE),
        ],
        interval: Duration::from_millis(200),
        trim_every: Duration::from_secs(5),
        redis: Default::default(),
        announcements: None,
    };
    let feed_rx = stop_rx.clone();
    let feeder = tokio::spawn(feeder.run(async move {
        let _ = stopped(feed_rx).await;
    }));
    let deferred_before = deferred_total();
    let start = Instant::now();
    let l1 = PollingBudgetLayer::<PollCardData>::new(budget.clone(), &cfg.polling);
    let l2 = PollingBudgetLayer::<PollCardStatus>::new(budget.clone(), &cfg.polling);
    let w1 = tokio::spawn(
        worker!(
            conn,
            &prefix,
            PollCardData::QUEUE,
            state,
            TASK as usize,
            layer = l1
        )
        .run_until(stopped(stop_rx.clone())),
    );
    let w2 = tokio::spawn(
        worker!(
            conn,
            &prefix,
            PollCardStatus::QUEUE,
            state,
            TASK as usize,
            layer = l2
        )
        .run_until(stopped(stop_rx.clone())),
    );
    let n = (2 * per_task) as u64;
    let mut samples = Vec::new();
    // "Under backlog": while more jobs remain than the budget can run at once.
    while state.done.load(Ordering::SeqCst) + u64::from(TOTAL) * 2 < n {
        samples.push(sim.stats().in_flight);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while state.done.load(Ordering::SeqCst) < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    stop.send_replace(true);
    let _ = (w1.await, w2.await, feeder.await);
    let stats = sim.stats();
    let cards = state.cards.lock().map(|c| c.len()).unwrap_or(0);
    anyhow::ensure!(
        cards == 2 * per_task,
        "only {cards} of {} cards completed",
        2 * per_task
    );
    Ok(Utilisation {
        jobs: 2 * per_task,
        seconds,
        mean_in_flight: samples.iter().sum::<u64>() as f64 / samples.len().max(1) as f64,
        peak: stats.peak_in_flight,
        peak_carddata: stats.peak_per_call.get("carddata").copied().unwrap_or(0),
        peak_card_status: stats.peak_per_call.get("card_status").copied().unwrap_or(0),
        deferrals: deferred_total() - deferred_before,
    })
}

static DEFERRED: AtomicU64 = AtomicU64::new(0);

fn deferred_total() -> u64 {
    DEFERRED.load(Ordering::SeqCst)
}

/// Counts `cardworker_poll_deferred_total` increments (a recorder of our own: no exporter).
struct CountDeferred;

impl metrics::Recorder for CountDeferred {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == cardworker::telemetry::metrics::POLL_DEFERRED {
            metrics::Counter::from_arc(Arc::new(DeferCounter))
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

struct DeferCounter;

impl metrics::CounterFn for DeferCounter {
    fn increment(&self, value: u64) {
        DEFERRED.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, _: u64) {}
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    metrics::set_global_recorder(CountDeferred).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (redis, conn) = private_redis().await?;
    const N: usize = 2_000;
    // Warm-up (script cache, connections), then the measured runs. The layer is measured in
    // steady state, as in a pod that has run for more than a second: its budget ran a warm-up
    // batch and renewed the slots it kept once (every 1 s), so the measured polls start on kept
    // slots (`budget::pool`) wherever the budget allows it.
    let budget = Budget::new(
        conn.clone(),
        &config(&redis.url(), "bench-budget", 256, 256),
    );
    let _ = throughput(&redis.url(), &conn, None, 200).await?;
    let _ = throughput(&redis.url(), &conn, Some(&budget), 200).await?;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Each run lasts a fraction of a second, so one pair is noisy on a shared machine: the runs
    // alternate, PAIRS times, and the ratio printed is the median pair's (the range beside it).
    const PAIRS: usize = 7;
    let mut pairs = Vec::with_capacity(PAIRS);
    for _ in 0..PAIRS {
        let plain = throughput(&redis.url(), &conn, None, N).await?;
        let layered = throughput(&redis.url(), &conn, Some(&budget), N).await?;
        pairs.push((plain, layered));
    }
    pairs.sort_by(|a, b| {
        (a.0.jobs_per_sec / a.1.jobs_per_sec).total_cmp(&(b.0.jobs_per_sec / b.1.jobs_per_sec))
    });
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|(p, l)| p.jobs_per_sec / l.jobs_per_sec)
        .collect();
    let (plain, layered) = pairs.swap_remove(PAIRS / 2);
    let util = utilisation(&redis.url(), &conn, 300).await?;

    println!("| measurement | value |");
    println!("| --- | --- |");
    println!("| no-op jobs/s through apalis-redis, without the layer (N = {N}, concurrency 32) | {:.0} |", plain.jobs_per_sec);
    println!(
        "| no-op jobs/s with `PollingBudgetLayer` (limits 256, nothing deferred) | {:.0} |",
        layered.jobs_per_sec
    );
    println!(
        "| overhead ratio (without ÷ with; the median of {PAIRS} alternating pairs, range {:.2}–{:.2}) | {:.2} |",
        ratios[0],
        ratios[PAIRS - 1],
        plain.jobs_per_sec / layered.jobs_per_sec
    );
    println!(
        "| jobs started on a kept slot (no budget call), with the layer | {:.0} % |",
        layered.kept_slot_share * 100.0
    );
    println!(
        "| Redis round trips per job, without the layer (apalis-redis only) | {:.2} |",
        plain.apalis_trips_per_job
    );
    println!("| Redis round trips per job, with the layer (apalis-redis + budget) | {:.2} + {:.2} = {:.2} |", layered.apalis_trips_per_job, layered.budget_trips_per_job, layered.apalis_trips_per_job + layered.budget_trips_per_job);
    println!("| commands Redis executed per job incl. inside Lua (commandstats), without / with | {:.1} / {:.1} |", plain.commands_per_job, layered.commands_per_job);
    println!("| utilisation under backlog: {} jobs, total_limit 4, task limits 3/3, 50 ms Gateway | mean in-flight {:.2} ÷ 4 = **{:.2}** |", util.jobs, util.mean_in_flight, util.mean_in_flight / 4.0);
    println!("| peak Gateway in-flight (total / carddata / card_status) | {} / {} / {} (limits 4 / 3 / 3) |", util.peak, util.peak_carddata, util.peak_card_status);
    println!(
        "| deferrals during the utilisation run | {} ({:.1} s for all jobs) |",
        util.deferrals, util.seconds
    );
    anyhow::ensure!(
        util.peak <= 4 && util.peak_carddata <= 3 && util.peak_card_status <= 3,
        "a limit was exceeded"
    );
    Ok(())
}
