//! `make bench-due-queue`: what the polling due queue (`polling::due_queue`) costs Redis per
//! poll, alone: its fetch under a lease and its acknowledgement, with nothing of the budget, the
//! Gateway or PostgreSQL around them. The floor the one-queue design starts from.
//!
//! On a private redis-server (so that `INFO` counts only this run): `BENCH_CARDS` cards (default
//! 30,000) in one task shard, all due; then `BENCH_WORKERS` (default 8) concurrent loops, each
//! fetching up to `BENCH_BATCH` (default 32) cards under a 30 s lease and acknowledging them all
//! in one call, each due again at once, for `BENCH_WINDOW_SECS` (default 10). It prints Redis
//! commands and CPU per poll, both beside plain apalis-redis running no-op jobs on the same Redis
//! in the same run (the yardstick of `make bench-redis`: the median of three runs of 2,000 jobs),
//! and the due queue's memory per card (its due entry and its state).
//! Prints markdown.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cardworker::config::Task;
use cardworker::polling::due_queue::{DueQueue, ShardKeys, Step, Successor};
use cardworker_test_kit::bench::{env_or, private_redis};
use cardworker_test_kit::redis_stats::{info, raw_apalis_median, redis_sample};

fn env_num(name: &str, default: usize) -> anyhow::Result<usize> {
    env_or(name, &default.to_string())
        .parse()
        .with_context(|| format!("{name} must be a whole number"))
}

async fn used_memory(conn: &mut redis::aio::ConnectionManager) -> anyhow::Result<f64> {
    info(conn, "memory")
        .await?
        .get("used_memory")
        .and_then(|v| v.parse().ok())
        .context("INFO memory has no used_memory")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let cards = env_num("BENCH_CARDS", 30_000)?;
    let workers = env_num("BENCH_WORKERS", 8)?;
    let batch = env_num("BENCH_BATCH", 32)?;
    let window = Duration::from_secs(u64::try_from(env_num("BENCH_WINDOW_SECS", 10)?)?);
    let (_redis, mut conn) = private_redis().await?;

    let raw = raw_apalis_median(&conn).await?;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;

    let queue = DueQueue::new(ShardKeys::new("bench", Task::Carddata, 0));
    let empty = used_memory(&mut conn).await?;
    // Each card as a poll leaves it: its due entry and its state after one unchanged poll.
    let state = "1|t0gmqo|st0gmqo|0";
    for chunk in (0..cards).collect::<Vec<_>>().chunks(1_000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            let card = format!("c-{i:06}");
            pipe.cmd("ZADD")
                .arg(&queue.keys().due)
                .arg(0)
                .arg(&card)
                .ignore();
            pipe.cmd("HSET")
                .arg(&queue.keys().state)
                .arg(&card)
                .arg(state)
                .ignore();
        }
        let _: () = pipe.query_async(&mut conn).await?;
    }
    let per_card = (used_memory(&mut conn).await? - empty) / cards as f64;

    let before = redis_sample(&mut conn).await?;
    let start = Instant::now();
    let until = start + window;
    let mut loops = Vec::new();
    for _ in 0..workers {
        let (queue, mut conn) = (queue.clone(), conn.clone());
        loops.push(tokio::spawn(async move {
            let mut polls = 0u64;
            while Instant::now() < until {
                let leased = queue
                    .fetch(&mut conn, batch, Duration::from_secs(30))
                    .await?;
                let now = chrono::Utc::now();
                let acks: Vec<_> = leased
                    .iter()
                    .map(|l| Successor {
                        card_ref: &l.card_ref,
                        lease: l.lease,
                        next_in: Duration::ZERO,
                        next: l.state.after(Step::Unchanged, 0, now),
                    })
                    .collect();
                if !acks.is_empty() {
                    queue.ack_many(&mut conn, &acks).await?;
                }
                polls += acks.len() as u64;
            }
            anyhow::Ok(polls)
        }));
    }
    let mut polls = 0u64;
    for l in loops {
        polls += l.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    let after = redis_sample(&mut conn).await?;
    anyhow::ensure!(polls > 0, "no polls in the window");
    let polls_f = polls as f64;
    let cpu_us = (after.cpu_secs - before.cpu_secs) * 1e6 / polls_f;

    println!("| measure ({cards} cards in one shard, {workers} loops, batches of {batch}, window {secs:.0} s) | value |");
    println!("| --- | --- |");
    println!(
        "| fetch + acknowledgement cycles/s | {:.0} |",
        polls_f / secs
    );
    println!(
        "| raw apalis-redis no-op jobs/s, same Redis, same run | {:.0} |",
        raw.rate
    );
    println!(
        "| Redis commands per poll (commandstats, inner commands counted) | {:.2} (raw apalis-redis: {:.1}) |",
        (after.total() - before.total()) as f64 / polls_f,
        raw.cmds
    );
    println!(
        "| Redis CPU per poll | {cpu_us:.1} µs (raw apalis-redis: {:.1} µs; ratio {:.2}) |",
        raw.cpu_us,
        cpu_us / raw.cpu_us.max(1e-9)
    );
    println!("| the due queue's Redis memory per card (due entry and state) | {per_card:.0} B |");
    let by_name: Vec<String> = after
        .calls
        .iter()
        .filter_map(|(name, n)| {
            let d = n - before.calls.get(name).copied().unwrap_or(0);
            (d > 0).then(|| format!("{name} {:.2}", d as f64 / polls_f))
        })
        .collect();
    println!();
    println!("commands per poll by name: {}", by_name.join(", "));
    Ok(())
}
