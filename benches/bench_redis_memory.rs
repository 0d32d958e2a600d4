//! `make bench-redis-memory`: Redis memory per card after the first round and at steady state
//! (issue 19), with a breakdown per key pattern.
//!
//! 1. A private `redis-server` on a free port (so `INFO memory` counts only this run) and a fresh
//!    database with `BENCH_CARDS` cards (default 100000); both tasks at a 3,600 s interval, the
//!    in-process Gateway simulator at 0 ms answering every card as stored (every poll unchanged).
//! 2. One worker (the product's `app::start`, in process) and a full reconcile sweep of both tasks
//!    (`reconcile::sweep`: first polls spread over a minute), then the first round: every card
//!    polled once per task, every successor waiting (in its task's due queue). used_memory is read
//!    then (minus the empty deployment's, read after the worker started and before any card was
//!    added), with `MEMORY USAGE` per key pattern.
//! 3. 48 hours of hour boundaries, with the clock pushed ahead instead of waited for: for each
//!    simulated hour h = 1..=48, `BENCH_HOUR_SAMPLE` cards per task (default 2000) have an
//!    unchanged poll counted at now + h hours: the state its acknowledgement writes
//!    (`PollState::after` with `Step::Unchanged`, exactly what a poll's successor holds) and the
//!    fleet counter it adds to, so every hour's fleet counter is written; at h = 48 every card has
//!    one (so each card's state holds its grown tally). Counters written ahead all live (49 h TTL), so this is the most a real 48 h
//!    can hold. used_memory and the breakdown again: the steady state.
//!
//! Env: `BENCH_CARDS`, `BENCH_HOUR_SAMPLE`, `CARDWORKER_BENCH_PG_ADMIN` (default
//! `postgres://root@127.0.0.1:5432/postgres`). Prints markdown (docs/BENCHMARKS.md).

use cardworker_test_kit::bench as support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cardworker::config::{Config, Task};
use cardworker::context::AppContext;
use cardworker::limit::Limit;
use cardworker::polling::due_queue::{PollState, Step, LEASED};
use cardworker::polling::{lease, reconcile};
use cardworker::queue::intake;
use cardworker::sim::Simulator;
use cardworker_test_kit::redis_stats::raw_apalis;

use redis::aio::ConnectionManager;

async fn info_field(
    conn: &mut ConnectionManager,
    section: &str,
    field: &str,
) -> anyhow::Result<u64> {
    let info: String = redis::cmd("INFO").arg(section).query_async(conn).await?;
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("INFO {section} has no {field}"))
}

/// A key's pattern: the prefix replaced, and ids, numbers and worker names made placeholders.
fn pattern(prefix: &str, key: &str) -> String {
    let rest = key.strip_prefix(prefix).unwrap_or(key);
    let segments: Vec<String> = rest
        .split(':')
        .map(|s| {
            let ulid = s.len() == 26 && s.chars().all(|c| c.is_ascii_alphanumeric());
            if ulid {
                "<id>".to_owned()
            } else if !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()) {
                "<n>".to_owned()
            } else if s.contains("-local-") || s.contains("-pod-") {
                "<worker>".to_owned()
            } else {
                s.to_owned()
            }
        })
        .collect();
    format!("{{prefix}}{}", segments.join(":"))
}

/// Per pattern: (keys, bytes by `MEMORY USAGE … SAMPLES 1000`; patterns with more than 500 keys
/// are sampled and extrapolated).
async fn breakdown(
    conn: &mut ConnectionManager,
    prefix: &str,
) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    let mut by: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        for key in batch {
            by.entry(pattern(prefix, &key)).or_default().push(key);
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let mut out = BTreeMap::new();
    for (pat, keys) in by {
        let sample: Vec<&String> = keys.iter().step_by((keys.len() / 500).max(1)).collect();
        let mut bytes = 0u64;
        for key in &sample {
            let b: Option<u64> = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(key.as_str())
                .arg("SAMPLES")
                .arg(1000)
                .query_async(conn)
                .await?;
            bytes += b.unwrap_or(0);
        }
        let total = bytes * keys.len() as u64 / sample.len().max(1) as u64;
        out.insert(pat, (keys.len() as u64, total));
    }
    Ok(out)
}

fn print_breakdown(title: &str, rows: &BTreeMap<String, (u64, u64)>, cards: u64) {
    println!("\n{title}\n");
    println!("| key pattern | keys | MEMORY USAGE (bytes) | bytes per card |");
    println!("| --- | ---: | ---: | ---: |");
    let mut sorted: Vec<_> = rows.iter().collect();
    sorted.sort_by_key(|(_, (_, bytes))| std::cmp::Reverse(*bytes));
    let mut sum = 0;
    for (pat, (n, bytes)) in sorted {
        sum += bytes;
        if *bytes * 100 < cards {
            continue; // under 0.01 B per card
        }
        println!(
            "| `{pat}` | {n} | {bytes} | {:.2} |",
            *bytes as f64 / cards as f64
        );
    }
    println!(
        "| all keys of the prefix (rows under 0.01 B per card not shown) | | {sum} | {:.1} |",
        sum as f64 / cards as f64
    );
}

fn config(db_url: &str, redis_url: &str, prefix: &str, gateway: &str) -> anyhow::Result<Config> {
    let mut c = Config::default();
    c.database.url = db_url.to_owned().into();
    c.database.max_connections = 20;
    c.redis.url = redis_url.to_owned().into();
    c.redis.key_prefix = prefix.to_owned();
    c.gateway.base_url = gateway.into();
    c.polling.total_limit = Limit::new(256).expect("a limit");
    c.polling.carddata.limit = Limit::new(128).expect("a limit");
    c.polling.card_status.limit = Limit::new(128).expect("a limit");
    c.polling.carddata.interval_secs = 3600;
    c.polling.card_status.interval_secs = 3600;
    // Scheduled reconciles stay out of the way (the bench sweeps once itself).
    c.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    c.telemetry.listen = "127.0.0.1:0".to_owned();
    c.validate()?;
    Ok(c)
}

async fn wait_for(
    what: &str,
    limit: Duration,
    mut done: impl AsyncFnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if done().await? {
            return Ok(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    anyhow::bail!("{what}: not reached within {limit:?}")
}

/// Counts one unchanged poll at `at` for each of `cards`: the state its acknowledgement writes
/// (`PollState::after` with `Step::Unchanged`, exactly what a poll's successor holds) and the
/// fleet's hourly counter (added up in this process, written by the running worker's flush).
async fn count_at(
    conn: &ConnectionManager,
    prefix: &str,
    task: Task,
    cards: &[String],
    at: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<()> {
    let state_key = lease::due_queue(prefix, task).keys().state.clone();
    let mut conn = conn.clone();
    for chunk in cards.chunks(2000) {
        let states: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&state_key)
            .arg(chunk)
            .query_async(&mut conn)
            .await?;
        let mut pipe = redis::pipe();
        for (card, state) in chunk.iter().zip(states) {
            let Some(state) = state else { continue };
            let next = PollState::parse(&state).after(Step::Unchanged, 0, at);
            pipe.cmd("HSET")
                .arg(&state_key)
                .arg(card)
                .arg(next.to_raw())
                .ignore();
            cardworker::polling::unchanged::count_fleet(prefix, task, at);
        }
        pipe.query_async::<()>(&mut conn).await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: u64 = support::env_or("BENCH_CARDS", "100000")
        .parse()
        .context("BENCH_CARDS")?;
    let hour_sample: usize = support::env_or("BENCH_HOUR_SAMPLE", "2000")
        .parse()
        .context("BENCH_HOUR_SAMPLE")?;
    let (redis, mut conn) = support::private_redis().await?;
    let admin = support::admin_url();
    let id = ulid::Ulid::new().to_string().to_lowercase();
    let (db, db_url) = support::create_database(&admin, &format!("cw_bench_mem_{id}")).await?;
    let result = run(n, hour_sample, &redis, &mut conn, &db_url).await;
    support::drop_database(&admin, &db).await;
    drop(redis);
    result
}

async fn run(
    n: u64,
    hour_sample: usize,
    redis: &support::PrivateRedis,
    conn: &mut ConnectionManager,
    db_url: &str,
) -> anyhow::Result<()> {
    let prefix = "cwmem";
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
    sim.set_latency(0, 0);
    let config = config(db_url, &redis.url(), prefix, &sim_handle.base_url())?;
    let ctx: Arc<AppContext> = AppContext::connect(config).await?;
    cardworker::storage::migrate(&ctx.pool).await?;
    let running = cardworker::app::start(ctx.clone()).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let join = tokio::spawn(running.wait(async move {
        let _ = stopped.await;
    }));
    // The empty deployment: workers registered, no card yet. The cards go into PostgreSQL only
    // now: a worker's start puts every card it finds there into the due queues.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let empty = info_field(conn, "memory", "used_memory").await?;
    let cards: Vec<String> = (1..=n).map(|i| format!("m-{i:07}")).collect();
    for chunk in cards.chunks(50_000) {
        sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
            .bind(chunk)
            .execute(&ctx.pool)
            .await?;
    }
    sqlx::query("ANALYZE cards").execute(&ctx.pool).await?;

    let started = Instant::now();
    for task in Task::ALL {
        reconcile::sweep(&ctx, task).await?;
    }
    let swept = started.elapsed();
    // A card's waiting poll is its entry in its task's due queue, below LEASED.
    let due_sets: Vec<String> = Task::ALL
        .iter()
        .map(|t| lease::due_queue(prefix, *t).keys().due.clone())
        .collect();
    let calls = |sim: &Simulator| {
        let stats = sim.stats();
        ["carddata", "card_status"]
            .iter()
            .map(|c| stats.calls_total.get(*c).copied().unwrap_or(0))
            .sum::<u64>()
    };
    wait_for("the first round", Duration::from_secs(1800), async || {
        Ok(calls(&sim) >= 2 * n)
    })
    .await?;
    // From the sweep's start: the first polls are due within a minute of their chain's start, so
    // the round runs alongside the sweep.
    let round = started.elapsed();
    // Every successor written (every card waits in its due queue, due in about an hour).
    let settle = wait_for(
        "every successor waiting",
        Duration::from_secs(300),
        async || {
            let mut waiting = 0u64;
            for k in &due_sets {
                waiting += redis::cmd("ZCOUNT")
                    .arg(k)
                    .arg("-inf")
                    .arg(format!("({LEASED}"))
                    .query_async::<u64>(&mut conn.clone())
                    .await?;
            }
            Ok(waiting == 2 * n)
        },
    )
    .await?;
    let first = info_field(conn, "memory", "used_memory").await?;
    let first_rows = breakdown(conn, prefix).await?;

    // 48 hours of hour boundaries, the clock pushed ahead.
    let now = chrono::Utc::now();
    let hours_started = Instant::now();
    for h in 1..=48i64 {
        let at = now + chrono::Duration::hours(h);
        for task in Task::ALL {
            let sample: Vec<String> = if h == 48 {
                cards.clone()
            } else {
                cards
                    .iter()
                    .skip((h as usize * 997) % cards.len().max(1))
                    .take(hour_sample)
                    .cloned()
                    .collect()
            };
            count_at(&ctx.redis, prefix, task, &sample, at).await?;
        }
    }
    // The fleet-wide counters are added up in process and written every few seconds: write them
    // now.
    cardworker::polling::unchanged::flush(&mut ctx.redis.clone(), prefix).await?;
    let hours_took = hours_started.elapsed();
    let steady = info_field(conn, "memory", "used_memory").await?;
    let steady_rows = breakdown(conn, prefix).await?;
    let version: String = {
        let info: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
        info.lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .unwrap_or("?")
            .trim()
            .to_owned()
    };

    // The yardstick, on the same Redis after the worker's figures were read: what plain
    // apalis-redis keeps per finished no-op job (its finished jobs' records).
    let raw = raw_apalis(&ctx.redis, intake::HIGH_WATER_MARK).await?;

    let per = |used: u64| used.saturating_sub(empty) as f64 / n as f64;
    println!("bench-redis-memory: {n} cards, both tasks at 3600 s, Redis {version} (private)\n");
    println!("| measure | value |");
    println!("| --- | ---: |");
    println!(
        "| reconcile sweep of both tasks | {:.1} s |",
        swept.as_secs_f64()
    );
    println!(
        "| first round ({} polls) done, from the sweep's start | {:.1} s; every successor waiting and apalis trimmed {:.1} s later |",
        2 * n,
        round.as_secs_f64(),
        settle.as_secs_f64()
    );
    println!("| used_memory, empty deployment (workers up, no card) | {empty} B |");
    println!("| used_memory after the first round | {first} B |");
    println!("| **per card after the first round (both tasks), minus the empty deployment** | **{:.0} B** |", per(first));
    println!("| 48 simulated hours ({hour_sample} cards per task and hour, every card at hour 48) | {:.1} s |", hours_took.as_secs_f64());
    println!("| used_memory at steady state (48 h of hourly counters) | {steady} B |");
    println!(
        "| **per card at steady state (both tasks), minus the empty deployment** | **{:.0} B** |",
        per(steady)
    );
    println!(
        "| growth from the first round to steady state, per card | {:.1} B |",
        (steady as f64 - first as f64) / n as f64
    );
    println!(
        "| raw apalis-redis, same Redis, same run: memory per finished no-op job ({} jobs) | {:.0} B |",
        intake::HIGH_WATER_MARK,
        raw.kept_bytes
    );
    println!(
        "| per card ÷ per raw apalis-redis job: first round / steady state | {:.2} / {:.2} |",
        per(first) / raw.kept_bytes,
        per(steady) / raw.kept_bytes
    );
    let keys_sum = |rows: &BTreeMap<String, (u64, u64)>| {
        rows.values().map(|(_, b)| b).sum::<u64>() as f64 / n as f64
    };
    println!(
        "| MEMORY USAGE of every key of the prefix ÷ cards: first round / steady state | {:.0} B / {:.0} B |",
        keys_sum(&first_rows),
        keys_sum(&steady_rows)
    );
    println!(
        "| used_memory ÷ cards (everything, the empty deployment included): first round / steady state | {:.0} B / {:.0} B |",
        first as f64 / n as f64,
        steady as f64 / n as f64
    );
    print_breakdown(
        "After the first round, per key pattern (MEMORY USAGE, sampled):",
        &first_rows,
        n,
    );
    print_breakdown(
        "At steady state, per key pattern (MEMORY USAGE, sampled):",
        &steady_rows,
        n,
    );

    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(30), join).await;
    Ok(())
}
