//! `make bench-reconcile`: how long reconcile takes to find the cards missing from the polling
//! due queue among many that are in it: one cursor run (`reconcile::run_once`,
//! `polling.reconcile_batch` cards) and a full sweep (`reconcile::sweep`, what a Redis data loss
//! triggers), each adding one script call per batch however many cards are missing.
//!
//! Sets up `BENCH_CARDS` cards (default 100000) in a fresh database, each in the card-status due
//! queue (due in an hour), then for each count in `BENCH_DEAD` (default `0,100,1000,10000`)
//! removes that many from the due queue (as a Redis loss would) and times one full sweep. Also
//! times one cursor batch and says how many scheduled runs a full cursor cycle takes.
//!
//! Env: `CARDWORKER_BENCH_PG_ADMIN` (default `postgres://root@127.0.0.1:5432/postgres`),
//! `CARDWORKER_BENCH_REDIS` (default `redis://127.0.0.1:6379/0`).

use std::time::Instant;

use anyhow::Context as _;
use cardworker::config::{Config, Task};
use cardworker::context::AppContext;
use cardworker::polling::{lease, reconcile};

use cardworker_test_kit::bench as support;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
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
        let queue = lease::due_queue(&prefix, Task::CardStatus);
        let hour = std::time::Duration::from_secs(3600);
        for chunk in cards.chunks(2000) {
            let batch: Vec<(&str, std::time::Duration)> =
                chunk.iter().map(|c| (c.as_str(), hour)).collect();
            queue.add_many(&mut conn, &batch).await?;
        }

        println!(
            "bench-reconcile: {n} cards in the card_status due queue; one full sweep per missing count\n"
        );
        println!("| cards missing | examined | added | sweep (ms) |");
        println!("| ---: | ---: | ---: | ---: |");
        for &dead in &dead_counts {
            let victims: Vec<String> = cards
                .iter()
                .step_by((n / dead.max(1)).max(1))
                .take(dead)
                .cloned()
                .collect();
            // Lost with Redis's data.
            for card in &victims {
                queue.remove(&mut conn, card).await?;
            }
            let started = Instant::now();
            let (examined, added) = reconcile::sweep(&ctx, Task::CardStatus).await?;
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            println!("| {dead} | {examined} | {added} | {ms:.1} |");
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
