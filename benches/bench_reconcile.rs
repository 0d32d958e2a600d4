//! `make bench-reconcile`: how long reconcile takes to find and restart dead chains among many
//! live ones, through the chain due set (`reconcile::restart_overdue`), against the cursor walk it
//! used to rely on (`reconcile::run_once`, `polling.reconcile_batch` cards per run).
//!
//! Sets up `BENCH_CARDS` cards (default 100000) in a fresh database, each with a live card-status
//! chain in Redis (due in an hour), then for each count in `BENCH_DEAD` (default `0,100,1000,10000`)
//! makes that many chains dead (fed a day ago, their job gone) and times one `restart_overdue`. Also times
//! one cursor batch and says how many scheduled runs a full cursor cycle takes.
//!
//! Env: `CARDWORKER_BENCH_PG_ADMIN` (default `postgres://root@127.0.0.1:5432/postgres`),
//! `CARDWORKER_BENCH_REDIS` (default `redis://127.0.0.1:6379/0`).

use std::time::Instant;

use anyhow::Context as _;
use cardworker::config::{Config, Task};
use cardworker::context::AppContext;
use cardworker::polling::{chain, reconcile};

use cardworker_test_kit::bench as support;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Writes the chain hash and the chain due set of `cards` directly (the layout `chain.lua` keeps),
/// in pipelines: due at `due_ms` and waiting to be fed, or, with `fed`, fed for that due time (a
/// job that exists, or vanished if `due_ms` is long past).
async fn set_chains(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
    cards: &[String],
    due_ms: u64,
    fed: bool,
) -> anyhow::Result<()> {
    let score = if fed { chain::FED + due_ms } else { due_ms };
    for chunk in cards.chunks(2000) {
        let mut pipe = redis::pipe();
        for card in chunk {
            pipe.hset(
                chain::chain_key(prefix, Task::CardStatus),
                card,
                "benchchn|0|0|s0|0",
            )
            .ignore()
            .zadd(chain::due_key(prefix, Task::CardStatus), card, score)
            .ignore();
        }
        pipe.query_async::<()>(conn).await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = env_or("BENCH_CARDS", "100000")
        .parse()
        .context("BENCH_CARDS")?;
    let dead_counts: Vec<usize> = env_or("BENCH_DEAD", "0,100,1000,10000")
        .split(',')
        .map(|s| s.trim().parse().context("BENCH_DEAD"))
        .collect::<anyhow::Result<_>>()?;
    let admin_url = support::admin_url();
    let id = ulid::Ulid::new().to_string().to_lowercase();
    let (db, db_url) = support::create_database(&admin_url, &format!("cw_bench_{id}")).await?;
    let mut config = Config::default();
    config.database.url = db_url.into();
    config.redis.url = env_or("CARDWORKER_BENCH_REDIS", "redis://127.0.0.1:6379/0").into();
    config.redis.key_prefix = format!("cwbench-{id}");
    config.validate()?;
    let prefix = config.redis.key_prefix.clone();

    let result = async {
        let ctx = AppContext::connect(config.clone()).await?;
        cardworker::storage::migrate(&ctx.pool).await?;
        let cards: Vec<String> = (1..=n).map(|i| format!("b-{i:06}")).collect();
        sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
            .bind(&cards)
            .execute(&ctx.pool)
            .await?;
        sqlx::query("ANALYZE cards").execute(&ctx.pool).await?;
        let mut conn = ctx.redis.clone();
        let now = chain::redis_now_ms(&mut conn).await?;
        set_chains(&mut conn, &prefix, &cards, now + 3_600_000, false).await?;

        println!(
            "bench-reconcile: {n} cards with a live card_status chain; one restart_overdue per dead count\n"
        );
        println!("| dead chains | found | restarted | restart_overdue (ms) | ms per dead chain |");
        println!("| ---: | ---: | ---: | ---: | ---: |");
        for &dead in &dead_counts {
            let victims: Vec<String> = cards.iter().step_by((n / dead.max(1)).max(1)).take(dead).cloned().collect();
            // Their jobs were fed a day ago and vanished.
            set_chains(&mut conn, &prefix, &victims, now - 86_400_000, true).await?;
            let started = Instant::now();
            let done = reconcile::restart_overdue(&ctx, Task::CardStatus).await?;
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            let per = if dead == 0 { 0.0 } else { ms / dead as f64 };
            println!(
                "| {dead} | {} | {} | {ms:.1} | {per:.3} |",
                done.found, done.restarted
            );
            // Back to live for the next round.
            set_chains(&mut conn, &prefix, &victims, now + 3_600_000, false).await?;
        }
        let started = Instant::now();
        let pass = reconcile::run_once(&ctx, Task::CardStatus).await?;
        let ms = started.elapsed().as_secs_f64() * 1000.0;
        let batch = ctx.config.polling.reconcile_batch as usize;
        println!(
            "\ncursor walk: one run examined {} cards in {ms:.1} ms; a full cycle over {n} cards takes {} scheduled runs ({} min at one run per 10 min)",
            pass.examined,
            n.div_ceil(batch),
            n.div_ceil(batch) * 10
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;

    if let Ok(mut conn) = cardworker::context::connect_redis(config.redis.url.expose()).await {
        support::delete_prefix(&mut conn, &prefix).await;
    }
    support::drop_database(&admin_url, &db).await;
    result
}
