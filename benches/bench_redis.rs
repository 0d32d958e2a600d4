//! `make bench-redis`: what one poll costs Redis, end to end, and what an idle pod costs it.
//!
//! The setup of issue 16: a private `redis-server` (so that `INFO` counts only this run), a fresh
//! database on the benches' PostgreSQL, one release `cardworker run` process, the in-process
//! Gateway simulator at 0 ms with no changes (every poll after the first is unchanged),
//! `BENCH_CARDS` cards (default 3,000), both tasks every second, `total_limit = 128` (64 per
//! task, so that the worker's slots, one per task token, never outnumber the total and no acquire
//! is retried for a token another task holds: what is measured is a poll, not a wait). In one run it measures:
//! 1. raw apalis-redis: no-op jobs/s through plain apalis-redis (concurrency 32), on the same
//!    Redis and machine, before the worker starts (the denominator of the 0.7× goal);
//! 2. steady polling over `BENCH_WINDOW_SECS` (default 20) after a warm-up: polls/s, Redis
//!    commands per poll (`INFO commandstats`, which counts the commands inside Lua on their own
//!    lines too), Redis CPU per poll (`used_cpu_sys + used_cpu_user`), bytes into Redis per poll
//!    (`total_net_input_bytes`), worker CPU per poll (`/proc/PID/stat`), PostgreSQL rows written
//!    and read per poll (`pg_stat_database`), and the commands per poll by name;
//! 3. Redis `used_memory` after 1 and after 10 minutes of steady polling (`BENCH_SHORT=1`: after
//!    20 s and 60 s, and a 10 s window);
//! 4. an idle pod: Redis wiped, every chain due in an hour, a fresh worker; commands/s, KB/s into
//!    Redis and Redis CPU while nothing is due, and the commands by name, over `BENCH_IDLE_SECS`
//!    (default: the window of phase 2) after an 8 s settle.
//!
//! `BENCH_AB=<binary>` (`make bench-redis-ab BEFORE=<binary>`) runs phase 2's window alone, for
//! that build and this one in turns, each round beside a raw apalis-redis measurement of its own
//! (`run_ab`).
//!
//! `BENCH_RAW_RUNS=<n>` (`make bench-redis-raw`) runs phase 1 alone, `n` times, and each run's µs a
//! call by command (`raw_runs`).
//!
//! `BENCH_IDLE_ONLY=1` (`make bench-redis-idle`) runs phase 4 alone, over `BENCH_IDLE_SECS`
//! (default 60: a minute holds one run of each per-minute recovery schedule), with no warm-up.
//! `CARDWORKER_BIN` runs another build (main's, for the "before" figures). Prints markdown.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cardworker::config::Task;
use cardworker::sim::Simulator;
use redis::aio::ConnectionManager;

use cardworker_test_kit::bench::{env_or, private_redis};
use cardworker_test_kit::process::Worker;
use cardworker_test_kit::redis_stats::{info, raw_apalis_median, redis_sample, Raw, RedisSample};
use cardworker_test_kit::worker_stage::{
    gateway_calls, process_cpu, start_chains, stop, wait_for_calls, Stage,
};

fn binary() -> String {
    std::env::var("CARDWORKER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_cardworker").to_owned())
}

async fn used_memory(conn: &mut ConnectionManager) -> anyhow::Result<u64> {
    Ok(info(conn, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

/// How long each memory figure is sampled (two trim periods of 5 s).
const MEMORY_SPAN: Duration = Duration::from_secs(10);

/// `used_memory` over `span`, sampled every 250 ms: (mean, min, max).
async fn memory_over(
    conn: &mut ConnectionManager,
    span: Duration,
) -> anyhow::Result<(f64, u64, u64)> {
    let until = Instant::now() + span;
    let mut samples = Vec::new();
    while Instant::now() < until {
        samples.push(used_memory(conn).await?);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mean = samples.iter().sum::<u64>() as f64 / samples.len().max(1) as f64;
    let min = samples.iter().copied().min().unwrap_or(0);
    let max = samples.iter().copied().max().unwrap_or(0);
    Ok((mean, min, max))
}

/// PostgreSQL's own counters of one database.
#[derive(Clone, Copy, Default)]
struct PgSample {
    written: i64,
    read: i64,
    commits: i64,
}

async fn pg_sample(pool: &sqlx::PgPool, db: &str) -> anyhow::Result<PgSample> {
    let (written, read, commits): (i64, i64, i64) = sqlx::query_as(
        "SELECT (tup_inserted + tup_updated + tup_deleted)::bigint, tup_fetched::bigint, \
         xact_commit::bigint FROM pg_stat_database WHERE datname = $1",
    )
    .bind(db)
    .fetch_one(pool)
    .await?;
    Ok(PgSample {
        written,
        read,
        commits,
    })
}

/// Redis's time per poll by call over `span`, from its slow log with every command logged: a
/// script call is labelled by its first key (the deployment prefix and worker names left out) and
/// its first argument when that names an op (the due queue's `fetch`, `batch`).
async fn time_by_call(
    conn: &mut ConnectionManager,
    prefix: &str,
    span: Duration,
    polls: impl Fn() -> u64,
) -> anyhow::Result<String> {
    // Redis's own settings are put back afterwards and the log emptied: a slow log left at
    // 100,000 entries keeps every slow feed call and grows the memory measured later.
    let get = |k: &'static str| redis::cmd("CONFIG").arg("GET").arg(k).clone();
    let set = |k: &'static str, v: &str| redis::cmd("CONFIG").arg("SET").arg(k).arg(v).clone();
    let (_, max_len): (String, String) = get("slowlog-max-len").query_async(conn).await?;
    let (_, slower): (String, String) = get("slowlog-log-slower-than").query_async(conn).await?;
    let _: () = set("slowlog-max-len", "100000").query_async(conn).await?;
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query_async(conn).await?;
    let _: () = set("slowlog-log-slower-than", "0")
        .query_async(conn)
        .await?;
    let p0 = polls();
    tokio::time::sleep(span).await;
    let _: () = set("slowlog-log-slower-than", &slower)
        .query_async(conn)
        .await?;
    let n = (polls() - p0).max(1) as f64;
    let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(conn)
        .await?;
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query_async(conn).await?;
    let _: () = set("slowlog-max-len", &max_len).query_async(conn).await?;
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => format!("{other:?}"),
    };
    let mut totals: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for entry in &log {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let (Some(redis::Value::Int(us)), Some(redis::Value::Array(args))) =
            (fields.get(2), fields.get(3))
        else {
            continue;
        };
        let args: Vec<String> = args.iter().map(text).collect();
        let name = args.first().map(|a| a.to_lowercase()).unwrap_or_default();
        if matches!(name.as_str(), "slowlog" | "config" | "info") {
            continue;
        }
        let label = if name == "evalsha" || name == "eval" {
            let keys: usize = args.get(2).and_then(|k| k.parse().ok()).unwrap_or(0);
            let key = args
                .get(3)
                .map(|k| k.replace(prefix, "{p}"))
                .unwrap_or_default();
            // Worker names and task ids vary per call: keep the key's shape only.
            let key: String = key
                .split(':')
                .map(|part| if part.len() > 20 { "…" } else { part })
                .collect::<Vec<_>>()
                .join(":");
            let op = args
                .get(3 + keys)
                .filter(|a| a.len() <= 14 && a.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                .cloned()
                .unwrap_or_default();
            format!("script({key}) {op}")
        } else {
            name
        };
        let t = totals.entry(label).or_default();
        t.0 += 1;
        t.1 += u64::try_from(*us).unwrap_or(0);
    }
    let mut rows: Vec<(String, (u64, u64))> = totals.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
    Ok(rows
        .iter()
        .take(12)
        .map(|(k, (calls, us))| {
            format!(
                "{k}: {:.1} µs ({:.2} calls, {:.1} µs each)",
                *us as f64 / n,
                *calls as f64 / n,
                *us as f64 / (*calls).max(1) as f64
            )
        })
        .collect::<Vec<_>>()
        .join("; "))
}

fn by_name(before: &RedisSample, after: &RedisSample, per: f64) -> String {
    per_name(&before.calls, &after.calls, per, 2)
}

/// `name value` pairs of `after - before`, divided by `per`, largest first.
fn per_name(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    per: f64,
    decimals: usize,
) -> String {
    let mut rows: Vec<(String, f64)> = after
        .iter()
        .map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (k.clone(), d as f64 / per)
        })
        .filter(|(_, d)| *d > 0.0)
        .collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    rows.iter()
        .map(|(k, d)| format!("{k} {d:.decimals$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let short = std::env::var("BENCH_SHORT").is_ok_and(|v| v == "1");
    let cards: usize = env_or("BENCH_CARDS", "3000").parse()?;
    let window =
        Duration::from_secs(env_or("BENCH_WINDOW_SECS", if short { "10" } else { "20" }).parse()?);
    let (mem_early, mem_late) = if short {
        (Duration::from_secs(20), Duration::from_secs(60))
    } else {
        (Duration::from_secs(60), Duration::from_secs(600))
    };
    let idle_only = std::env::var("BENCH_IDLE_ONLY").is_ok_and(|v| v == "1");
    let idle_window = Duration::from_secs(
        env_or(
            "BENCH_IDLE_SECS",
            &if idle_only { 60 } else { window.as_secs() }.to_string(),
        )
        .parse()?,
    );
    let (redis, mut conn) = private_redis().await?;

    if let Ok(runs) = std::env::var("BENCH_RAW_RUNS") {
        return raw_runs(&conn, runs.parse()?).await;
    }

    // 1. Raw apalis-redis on the same Redis (a warm-up run first).
    let raw = if idle_only {
        Raw::default()
    } else {
        raw_apalis_median(&conn).await?
    };
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;

    // 2. The worker.
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
    sim.set_latency(0, 0);
    sim.set_change_rate(0.0);
    let stage = Stage::new(binary(), redis.url(), sim_handle.base_url()).await?;
    let result = if idle_only {
        run_idle_only(&stage, &sim, &mut conn, cards, idle_window).await
    } else if let Ok(before) = std::env::var("BENCH_AB") {
        let rounds = env_or("BENCH_AB_ROUNDS", "3").parse()?;
        run_ab(&stage, &sim, &mut conn, cards, window, raw, &before, rounds).await
    } else {
        run(
            &stage,
            &sim,
            &mut conn,
            cards,
            window,
            idle_window,
            short,
            mem_early,
            mem_late,
            raw,
        )
        .await
    };
    stage.remove().await;
    drop(redis);
    result
}

#[allow(clippy::too_many_arguments)]
async fn run(
    stage: &Stage,
    sim: &Simulator,
    conn: &mut ConnectionManager,
    cards: usize,
    window: Duration,
    idle_window: Duration,
    short: bool,
    mem_early: Duration,
    mem_late: Duration,
    raw: Raw,
) -> anyhow::Result<()> {
    let (path, refs) = seed_polling(stage, conn, cards).await?;
    let calls = || gateway_calls(sim);
    let worker = Worker::spawn(&binary(), &path)?;
    let started = Instant::now();
    // Warm-up: every card polled at least twice (its first poll writes its state).
    wait_for_calls(
        calls,
        4 * cards as u64,
        Duration::from_secs(300),
        "the warm-up",
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (r0, p0, c0, g0) = (
        redis_sample(conn).await?,
        calls(),
        process_cpu(worker.pid()),
        pg_sample(&stage.pool, &stage.db).await?,
    );
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let (r1, p1, c1, secs) = (
        redis_sample(conn).await?,
        calls(),
        process_cpu(worker.pid()),
        t0.elapsed().as_secs_f64(),
    );
    // PostgreSQL publishes its counters at most every second or so.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let g1 = pg_sample(&stage.pool, &stage.db).await?;
    let polls = (p1 - p0) as f64;
    anyhow::ensure!(polls > 0.0, "no polls in the window");

    // 3. Memory after mem_early and mem_late of steady polling (from the end of the warm-up), each
    // the mean of samples over MEMORY_SPAN: finished jobs' bookkeeping is trimmed every 5 s, so
    // one instant's used_memory swings by megabytes with the trim's sawtooth.
    let until = |d: Duration| async move {
        let left = d.saturating_sub(started.elapsed());
        tokio::time::sleep(left).await;
    };
    until(mem_early).await;
    let m_early = memory_over(conn, MEMORY_SPAN).await?;
    until(mem_late).await;
    let m_late = memory_over(conn, MEMORY_SPAN).await?;

    // 3a. Where Redis's time goes, by script and command: every command in the slow log for 2 s
    // (after the window, since logging every command costs Redis time of its own, and after the
    // memory samples, since the log and its reply take memory until Redis shrinks its buffers).
    let by_call = time_by_call(conn, &stage.prefix, Duration::from_secs(2), &calls).await?;

    // 3b. Changes: 5 % of the Gateway's answers differ from the card's state (each one is recorded).
    sim.set_change_rate(0.05);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (cp0, cg0, ct0) = (
        calls(),
        pg_sample(&stage.pool, &stage.db).await?,
        Instant::now(),
    );
    tokio::time::sleep(window).await;
    let (cp1, csecs) = (calls(), ct0.elapsed().as_secs_f64());
    sim.set_change_rate(0.0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let cg1 = pg_sample(&stage.pool, &stage.db).await?;
    let cpolls = (cp1 - cp0).max(1) as f64;
    let problems = worker.problems.lock().map(|p| p.len()).unwrap_or(0);
    stop(worker);

    // 4. An idle pod: every chain due in an hour.
    let idle = idle(stage, sim, conn, &path, &refs, idle_window).await?;

    let cmds = (r1.total() - r0.total()) as f64;
    let rcpu = r1.cpu_secs - r0.cpu_secs;
    let per_sec = polls / secs;
    println!("| measure ({cards} cards, both tasks every 1 s, total limit 128 (64 per task), 0 ms Gateway, window {:.0} s) | value |", secs);
    println!("| --- | --- |");
    println!("| polls/s, everything on this machine's cores | {per_sec:.0} |");
    println!(
        "| raw apalis-redis no-op jobs/s, same Redis, same run (concurrency 32, median of 3) | {:.0} |",
        raw.rate
    );
    println!(
        "| polls/s ÷ raw apalis-redis jobs/s | {:.2} |",
        per_sec / raw.rate
    );
    println!(
        "| raw apalis-redis: Redis commands and CPU per no-op job (fetch and acknowledgement) | {:.1}, {:.1} µs |",
        raw.cmds, raw.cpu_us
    );
    println!(
        "| Redis commands per poll (commandstats, inner commands counted) | {:.1} |",
        cmds / polls
    );
    println!(
        "| Redis CPU per poll | {:.1} µs (user {:.1}, system {:.1}; one Redis core: {:.0} polls/s) |",
        rcpu * 1e6 / polls,
        (r1.cpu_user - r0.cpu_user) * 1e6 / polls,
        (r1.cpu_sys - r0.cpu_sys) * 1e6 / polls,
        polls / rcpu.max(1e-9)
    );
    println!(
        "| Redis CPU per poll ÷ Redis CPU per raw apalis-redis job (the machine's speed taken out) | {:.2} |",
        rcpu * 1e6 / polls / raw.cpu_us.max(1e-9)
    );
    println!(
        "| bytes into Redis per poll | {:.0} |",
        (r1.input_bytes - r0.input_bytes) as f64 / polls
    );
    println!(
        "| worker CPU per poll | {:.1} µs |",
        (c1 - c0) * 1e6 / polls
    );
    println!(
        "| PostgreSQL rows written / read per poll | {:.3} / {:.2} |",
        (g1.written - g0.written) as f64 / polls,
        (g1.read - g0.read) as f64 / polls
    );
    println!(
        "| PostgreSQL commits per unchanged poll | {:.3} |",
        (g1.commits - g0.commits) as f64 / polls
    );
    println!("| with 5 % of answers changed: polls/s, rows written per poll, commits/s | {:.0}, {:.3}, {:.0} |", cpolls / csecs, (cg1.written - cg0.written) as f64 / cpolls, (cg1.commits - cg0.commits) as f64 / csecs);
    println!(
        "| Redis used_memory after {} s / {} s (mean of 10 s of samples; min–max) | {:.1} MB / {:.1} MB ({:+.1} %; {:.1}–{:.1} / {:.1}–{:.1}) |",
        mem_early.as_secs(),
        mem_late.as_secs(),
        m_early.0 / 1e6,
        m_late.0 / 1e6,
        (m_late.0 / m_early.0.max(1.0) - 1.0) * 100.0,
        m_early.1 as f64 / 1e6,
        m_early.2 as f64 / 1e6,
        m_late.1 as f64 / 1e6,
        m_late.2 as f64 / 1e6
    );
    idle.print_rows();
    println!("| worker warnings/errors logged | {problems} |");
    println!();
    println!("commands per poll by name: {}", by_name(&r0, &r1, polls));
    println!();
    println!(
        "µs of command execution per poll by name (scripts include their inner commands): {}",
        per_name(&r0.usec, &r1.usec, polls, 1)
    );
    println!();
    println!("Redis time per poll by call (slow log of every command over 2 s; µs wall time, so inflated on a loaded machine): {by_call}");
    println!();
    idle.print_by_name();
    if short {
        println!(
            "(short mode: memory at 20 s / 60 s, window {} s)",
            window.as_secs()
        );
    }
    Ok(())
}

/// One window of steady polling by one build (`run_ab`).
struct Turn {
    build: &'static str,
    polls_per_sec: f64,
    cmds: f64,
    cpu_us: f64,
    user_us: f64,
    sys_us: f64,
    worker_us: f64,
    /// PostgreSQL transactions committed per poll (`xact_commit`; a read is one).
    pg_commits: f64,
    /// Redis CPU per raw apalis-redis job, µs, measured in the turn's round (the ratio's
    /// denominator).
    raw_us: f64,
    /// `cpu_us` ÷ `raw_us` (in a median row, the median of the turns' ratios).
    ratio: f64,
}

impl Turn {
    fn row(&self, label: &str) -> String {
        format!(
            "| {label} | {} | {:.0} | {:.2} | {:.1} ({:.1} / {:.1}) | {:.2} ({:.1} µs) | {:.1} | {:.3} |",
            self.build,
            self.polls_per_sec,
            self.cmds,
            self.cpu_us,
            self.user_us,
            self.sys_us,
            self.ratio,
            self.raw_us,
            self.worker_us,
            self.pg_commits
        )
    }
}

/// `BENCH_AB=<binary>` (`make bench-redis-ab BEFORE=<binary>`): phase 2's steady window only, for
/// two builds in turns on the same Redis, database, cards and chains, `BENCH_AB_ROUNDS` (default 3)
/// rounds of one window each, the other build first in odd rounds and this one in even rounds. This
/// VM's speed drifts by tens of per cent within an hour, so two runs of the whole bench cannot
/// tell a change of 10–20 % in a poll's Redis or worker CPU; windows of the two builds a few
/// seconds apart, repeated, with the order alternating against a drift one way, can.
#[allow(clippy::too_many_arguments)]
async fn run_ab(
    stage: &Stage,
    sim: &Simulator,
    conn: &mut ConnectionManager,
    cards: usize,
    window: Duration,
    raw: Raw,
    before: &str,
    rounds: usize,
) -> anyhow::Result<()> {
    let (path, _) = seed_polling(stage, conn, cards).await?;
    let calls = || gateway_calls(sim);
    // Each card's first polls write its state: made once, by this build, before the turns.
    let warm = Worker::spawn(&binary(), &path)?;
    let limit = Duration::from_secs(300);
    wait_for_calls(calls, 4 * cards as u64, limit, "the warm-up").await?;
    stop(warm);
    let builds = [("before", before.to_owned()), ("after", binary())];
    println!("| round | build | polls/s | Redis commands per poll | Redis CPU per poll, µs (user / system) | ÷ raw apalis-redis job (the round's) | worker CPU per poll, µs | PostgreSQL commits per poll |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut turns = Vec::new();
    for round in 1..=rounds {
        // The yardstick moves between runs a few seconds apart (docs/BENCHMARKS.md,
        // bench-redis-raw), so each round measures its own, with no worker running, beside the
        // windows it divides.
        let round_raw = raw_apalis_median(conn).await?;
        // The builds take turns going first, so that a VM whose speed drifts one way through the
        // run favours neither of them.
        let order: Vec<&(&str, String)> = if round % 2 == 1 {
            builds.iter().collect()
        } else {
            builds.iter().rev().collect()
        };
        for (build, bin) in order {
            let worker = Worker::spawn(bin, &path)?;
            // Settled: every card polled once by this worker, and 2 s more.
            wait_for_calls(calls, calls() + 2 * cards as u64, limit, "a turn's settle").await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            let (r0, p0, c0, g0, t0) = (
                redis_sample(conn).await?,
                calls(),
                process_cpu(worker.pid()),
                pg_sample(&stage.pool, &stage.db).await?,
                Instant::now(),
            );
            tokio::time::sleep(window).await;
            let (r1, p1, c1, secs) = (
                redis_sample(conn).await?,
                calls(),
                process_cpu(worker.pid()),
                t0.elapsed().as_secs_f64(),
            );
            stop(worker);
            // PostgreSQL publishes its counters at most every second or so; the worker is gone,
            // so what it committed until the window's end is all counted by then (and a little
            // of its shutdown).
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let g1 = pg_sample(&stage.pool, &stage.db).await?;
            let polls = (p1 - p0).max(1) as f64;
            let cpu_us = (r1.cpu_secs - r0.cpu_secs) * 1e6 / polls;
            let turn = Turn {
                build,
                polls_per_sec: polls / secs,
                cmds: (r1.total() - r0.total()) as f64 / polls,
                cpu_us,
                user_us: (r1.cpu_user - r0.cpu_user) * 1e6 / polls,
                sys_us: (r1.cpu_sys - r0.cpu_sys) * 1e6 / polls,
                worker_us: (c1 - c0) * 1e6 / polls,
                pg_commits: (g1.commits - g0.commits) as f64 / polls,
                raw_us: round_raw.cpu_us,
                ratio: cpu_us / round_raw.cpu_us.max(1e-9),
            };
            println!("{}", turn.row(&round.to_string()));
            turns.push(turn);
        }
    }
    for (build, _) in &builds {
        let median = |f: fn(&Turn) -> f64| {
            let mut v: Vec<f64> = turns.iter().filter(|t| t.build == *build).map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let m = Turn {
            build,
            polls_per_sec: median(|t| t.polls_per_sec),
            cmds: median(|t| t.cmds),
            cpu_us: median(|t| t.cpu_us),
            user_us: median(|t| t.user_us),
            sys_us: median(|t| t.sys_us),
            worker_us: median(|t| t.worker_us),
            pg_commits: median(|t| t.pg_commits),
            raw_us: median(|t| t.raw_us),
            ratio: median(|t| t.ratio),
        };
        println!("{}", m.row("median"));
    }
    // Each round's two windows are a minute apart at most, so their ratio takes out most of the
    // drift that the medians above still carry.
    let by_round = |f: fn(&Turn) -> f64| -> (Vec<String>, f64) {
        let mut ratios: Vec<f64> = turns
            .chunks(2)
            .filter_map(|pair| {
                let of = |build: &str| pair.iter().find(|t| t.build == build).map(f);
                Some(of("after")? / of("before")?.max(1e-9))
            })
            .collect();
        let listed = ratios.iter().map(|r| format!("{r:.2}")).collect();
        ratios.sort_by(f64::total_cmp);
        (listed, ratios.get(ratios.len() / 2).copied().unwrap_or(0.0))
    };
    for (what, f) in [
        (
            "Redis CPU per poll",
            (|t: &Turn| t.cpu_us) as fn(&Turn) -> f64,
        ),
        ("worker CPU per poll", |t: &Turn| t.worker_us),
    ] {
        let (listed, median) = by_round(f);
        println!();
        println!(
            "{what}, after ÷ before, round by round: {}; median {median:.2}",
            listed.join(", ")
        );
    }
    for (build, _) in &builds {
        let listed: Vec<String> = turns
            .iter()
            .filter(|t| t.build == *build)
            .map(|t| format!("{:.2}", t.ratio))
            .collect();
        println!();
        println!(
            "Redis CPU per poll ÷ the round's raw apalis-redis job, {build}, round by round: {}",
            listed.join(", ")
        );
    }
    println!();
    println!(
        "(raw apalis-redis, same Redis before the warm-up: {:.0} no-op jobs/s, {:.1} commands and {:.1} µs of Redis CPU per job; window {} s)",
        raw.rate,
        raw.cmds,
        raw.cpu_us,
        window.as_secs()
    );
    Ok(())
}

/// Both tasks every second.
const INTERVAL_SECS: u64 = 1;

/// The cards, and both tasks' chains of every card started, due over the next second.
async fn seed_polling(
    stage: &Stage,
    conn: &ConnectionManager,
    cards: usize,
) -> anyhow::Result<(std::path::PathBuf, Vec<String>)> {
    stage
        .seed_chains(
            conn,
            cards,
            INTERVAL_SECS,
            Instant::now(),
            Duration::from_secs(1),
        )
        .await
}

/// What phase 4 measured.
struct Idle {
    before: RedisSample,
    after: RedisSample,
    secs: f64,
    /// Gateway calls during the phase (0: nothing was due).
    polls: u64,
    /// Whether a reconcile tick (`polling.reconcile_cron`, every 10 minutes) fell in the window.
    reconciled: bool,
}

impl Idle {
    fn print_rows(&self) {
        let (i0, i1, isecs) = (&self.before, &self.after, self.secs);
        println!(
            "| idle pod (every chain due in an hour): commands/s | {:.1} |",
            (i1.total() - i0.total()) as f64 / isecs
        );
        println!(
            "| idle pod: KB/s into Redis | {:.2} |",
            (i1.input_bytes - i0.input_bytes) as f64 / isecs / 1000.0
        );
        println!(
            "| idle pod: Redis CPU | {:.2} % of a core |",
            (i1.cpu_secs - i0.cpu_secs) / isecs * 100.0
        );
    }

    fn print_by_name(&self) {
        println!(
            "idle commands/s by name: {}",
            by_name(&self.before, &self.after, self.secs)
        );
        if self.polls > 0 {
            println!("(the idle phase made {} Gateway calls)", self.polls);
        }
        if self.reconciled {
            println!("(a reconcile tick fell in the idle window: its pass is counted)");
        }
    }
}

/// Phase 4: Redis wiped, every chain due in an hour (spread over a minute), a fresh worker; after
/// an 8 s settle, `window` of Redis counters.
async fn idle(
    stage: &Stage,
    sim: &Simulator,
    conn: &mut ConnectionManager,
    path: &std::path::Path,
    refs: &[String],
    window: Duration,
) -> anyhow::Result<Idle> {
    let _: () = redis::cmd("FLUSHALL").query_async(conn).await?;
    start_chains(
        conn,
        &stage.prefix,
        refs,
        &Task::ALL,
        Instant::now() + Duration::from_secs(3600),
        Duration::from_secs(60),
    )
    .await?;
    let calls_before = gateway_calls(sim);
    let worker = Worker::spawn(&binary(), path)?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let before = redis_sample(conn).await?;
    let started = std::time::SystemTime::now();
    let it = Instant::now();
    tokio::time::sleep(window).await;
    let after = redis_sample(conn).await?;
    let secs = it.elapsed().as_secs_f64();
    let polls = gateway_calls(sim) - calls_before;
    stop(worker);
    // The default reconcile schedule ticks at every tenth minute (whole minutes in any zone).
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    };
    let (from, to) = (unix(started), unix(started) + window.as_secs() + 1);
    let reconciled = (from / 600) != (to / 600);
    Ok(Idle {
        before,
        after,
        secs,
        polls,
        reconciled,
    })
}

/// `BENCH_RAW_RUNS=<n>`: the yardstick alone, [`raw_apalis_median`] `n` times on one Redis, each
/// median and its system CPU, each on an emptied Redis as the whole bench's is, then each run's µs
/// a call by command: how far the denominator of the Redis CPU ratio moves between runs, and
/// whether some commands move or all of them.
async fn raw_runs(conn: &ConnectionManager, runs: usize) -> anyhow::Result<()> {
    let mut c = conn.clone();
    println!(
        "| run | no-op jobs/s | Redis CPU per job, µs | of it system, µs | commands per job |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    let mut by_command = Vec::new();
    for run in 1..=runs {
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await?;
        let before = redis_sample(&mut c).await?;
        let raw = raw_apalis_median(conn).await?;
        let after = redis_sample(&mut c).await?;
        println!(
            "| {run} | {:.0} | {:.1} | {:.1} | {:.1} |",
            raw.rate, raw.cpu_us, raw.cpu_sys_us, raw.cmds
        );
        by_command.push((run, before, after));
    }
    // Where a run's Redis time went, by command (`INFO commandstats`, the warm-up's jobs and all
    // three runs of the median together): which command's time per call moves between runs.
    let mut names: Vec<String> = by_command
        .iter()
        .flat_map(|(_, _, after)| after.usec.keys().cloned())
        .collect();
    names.sort();
    names.dedup();
    println!();
    println!("| run | {} |", names.join(" µs/call | ") + " µs/call");
    println!("| ---: |{}", " ---: |".repeat(names.len()));
    for (run, before, after) in &by_command {
        let per_call = names.iter().map(|name| {
            let get = |m: &BTreeMap<String, u64>| m.get(name).copied().unwrap_or(0);
            let calls = get(&after.calls).saturating_sub(get(&before.calls));
            let usec = get(&after.usec).saturating_sub(get(&before.usec));
            if calls == 0 {
                "".to_owned()
            } else {
                format!("{:.2}", usec as f64 / calls as f64)
            }
        });
        println!("| {run} | {} |", per_call.collect::<Vec<_>>().join(" | "));
    }
    Ok(())
}

/// `BENCH_IDLE_ONLY=1`: phase 4 alone.
async fn run_idle_only(
    stage: &Stage,
    sim: &Simulator,
    conn: &mut ConnectionManager,
    cards: usize,
    window: Duration,
) -> anyhow::Result<()> {
    let (path, refs) = stage.seed(cards, INTERVAL_SECS).await?;
    let idle = idle(stage, sim, conn, &path, &refs, window).await?;
    println!(
        "| measure ({cards} cards, every chain due in an hour, window {:.0} s) | value |",
        idle.secs
    );
    println!("| --- | --- |");
    idle.print_rows();
    println!();
    idle.print_by_name();
    Ok(())
}
