//! What Redis says of a bench's run: its counters (`INFO`) at an instant, and the yardstick every
//! Redis-cost bench divides by, plain apalis-redis running no-op jobs on the same Redis.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_redis::RedisStorage;
use cardworker::queue::{intake, QueueName};

use redis::aio::ConnectionManager;
use tokio::sync::watch;

/// `INFO` of one section as `field -> value`.
pub async fn info(
    conn: &mut ConnectionManager,
    section: &str,
) -> anyhow::Result<BTreeMap<String, String>> {
    let text: String = redis::cmd("INFO").arg(section).query_async(conn).await?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect())
}

/// What Redis reports at one instant.
#[derive(Clone, Default)]
pub struct RedisSample {
    /// Calls per command name (without INFO, CONFIG and the bench's own reads).
    pub calls: BTreeMap<String, u64>,
    /// Microseconds spent executing each command (`usec=`; a script's inner commands are counted
    /// both on their own lines and in the script's).
    pub usec: BTreeMap<String, u64>,
    /// Redis's `used_cpu_user` and `used_cpu_sys` (seconds).
    pub cpu_user: f64,
    pub cpu_sys: f64,
    /// `used_cpu_user + used_cpu_sys`.
    pub cpu_secs: f64,
    pub input_bytes: u64,
    /// `used_memory` (bytes).
    pub used_memory: u64,
}

impl RedisSample {
    pub fn total(&self) -> u64 {
        self.calls.values().sum()
    }
}

pub async fn redis_sample(conn: &mut ConnectionManager) -> anyhow::Result<RedisSample> {
    let stats = info(conn, "commandstats").await?;
    let field = |v: &str, f: &str| -> Option<u64> {
        v.split(&format!("{f}="))
            .nth(1)?
            .split(',')
            .next()?
            .parse()
            .ok()
    };
    let mut calls = BTreeMap::new();
    let mut usec = BTreeMap::new();
    for (k, v) in &stats {
        let Some(name) = k.strip_prefix("cmdstat_") else {
            continue;
        };
        if matches!(name, "info" | "config" | "flushall" | "memory") {
            continue;
        }
        if let Some(n) = field(v, "calls") {
            calls.insert(name.to_owned(), n);
        }
        if let Some(n) = field(v, "usec") {
            usec.insert(name.to_owned(), n);
        }
    }
    let cpu = info(conn, "cpu").await?;
    let secs = |k: &str| {
        cpu.get(k)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let (cpu_user, cpu_sys) = (secs("used_cpu_user"), secs("used_cpu_sys"));
    let s = info(conn, "stats").await?;
    let input_bytes = s
        .get("total_net_input_bytes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let used_memory = info(conn, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok(RedisSample {
        calls,
        usec,
        cpu_user,
        cpu_sys,
        cpu_secs: cpu_user + cpu_sys,
        input_bytes,
        used_memory,
    })
}

/// What plain apalis-redis did with no-op jobs, the yardstick of a poll's cost on this machine.
#[derive(Clone, Copy, Default)]
pub struct Raw {
    /// No-op jobs/s.
    pub rate: f64,
    /// Redis CPU per job, µs (fetch and acknowledgement only: the jobs were fed before).
    pub cpu_us: f64,
    /// Of `cpu_us`, the system CPU (mostly Redis's socket reads and writes).
    pub cpu_sys_us: f64,
    /// Redis commands per job (inner commands counted), fetch and acknowledgement.
    pub cmds: f64,
    /// Redis memory per job still held once every job is done (`used_memory` after the run less
    /// before it, the jobs fed in between): the finished job's records apalis-redis keeps.
    pub kept_bytes: f64,
}

/// The queue [`raw_apalis`] runs its jobs through.
const RAW_QUEUE: &str = "raw";

/// Raw apalis-redis: no-op jobs/s through plain apalis-redis, concurrency 32, and what its fetch
/// and acknowledgement cost Redis per job. `n` at most the high-water mark: the jobs are fed
/// before the worker starts.
pub async fn raw_apalis(conn: &ConnectionManager, n: usize) -> anyhow::Result<Raw> {
    // The jobs are fed before the worker starts, and the feeder stops at the high-water mark: a
    // larger `n` would wait for jobs that never come.
    anyhow::ensure!(
        n <= intake::HIGH_WATER_MARK,
        "raw_apalis runs at most {} jobs, not {n}",
        intake::HIGH_WATER_MARK
    );
    let prefix = format!("raw-{}", ulid::Ulid::new());
    let mut c = conn.clone();
    let empty = redis_sample(&mut c).await?.used_memory;
    // Jobs of the size of a poll's payload, written into the intake of a queue of their own.
    let producer = cardworker_jobs::Producer::new(c.clone(), prefix.clone());
    for i in 0..n {
        let card = format!("c-{i:05}");
        producer
            .enqueue_raw(
                RAW_QUEUE,
                &card,
                &format!(r#"{{"card_ref":"{card}"}}"#),
                Duration::ZERO,
            )
            .await?;
    }
    let q = QueueName::new(&prefix, RAW_QUEUE);
    while intake::feed(&mut c, &q).await?.waiting > 0 {}
    let done = Arc::new(AtomicU64::new(0));
    let (stop, stop_rx) = watch::channel(false);
    let stopped = async move {
        let mut rx = stop_rx;
        let _ = rx.wait_for(|s| *s).await;
        Ok::<(), std::io::Error>(())
    };
    let config = apalis_redis::Config::default()
        .queue(cardworker_jobs::keys::queue(&prefix, RAW_QUEUE))
        .batch_size(32)
        .heartbeat_interval(Duration::from_secs(5))
        .missed_heartbeats(3);
    let storage: RedisStorage<String> = RedisStorage::new(conn.clone()).with_config(config);
    let counter = done.clone();
    let before = redis_sample(&mut c).await?;
    let start = Instant::now();
    let worker = WorkerBuilder::new(format!("raw-{}", ulid::Ulid::new()))
        .backend(storage.poll_with_interval(Duration::from_millis(50)))
        .data(counter)
        .concurrency(32)
        .build(|_raw: String, done: Data<Arc<AtomicU64>>| async move {
            done.fetch_add(1, Ordering::SeqCst);
            Ok::<(), BoxDynError>(())
        });
    let run = tokio::spawn(worker.run_until(stopped));
    while done.load(Ordering::SeqCst) < n as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let after = redis_sample(&mut c).await?;
    stop.send_replace(true);
    let _ = run.await;
    Ok(Raw {
        rate,
        cpu_us: (after.cpu_secs - before.cpu_secs) * 1e6 / n as f64,
        cpu_sys_us: (after.cpu_sys - before.cpu_sys) * 1e6 / n as f64,
        cmds: (after.total() - before.total()) as f64 / n as f64,
        kept_bytes: (after.used_memory as f64 - empty as f64) / n as f64,
    })
}

/// The yardstick: [`raw_apalis`] once with 300 jobs (connections, script loads), then the median
/// by rate of three runs of 2,000 jobs (the high-water mark; a fifth of a second each).
pub async fn raw_apalis_median(conn: &ConnectionManager) -> anyhow::Result<Raw> {
    let _ = raw_apalis(conn, 300).await?;
    let mut runs = Vec::new();
    for _ in 0..3 {
        runs.push(raw_apalis(conn, intake::HIGH_WATER_MARK).await?);
    }
    runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    Ok(runs[1])
}
