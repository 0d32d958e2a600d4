//! `make bench-intake`: N no-op jobs due at once through the bounded intake into apalis-redis.
//!
//! Reports the enqueue rate into the intake, the drain rate (intake -> feeder -> apalis -> worker
//! -> trimmed), the peak apalis backlog against the high-water mark, and the Redis keys left
//! under the prefix afterwards. Runs against the local PostgreSQL (a throw-away database) and Redis
//! (a throw-away key prefix), and deletes both.
//!
//! Usage: `cargo bench --bench bench_intake -- [N]` (default 50,000; `make bench-intake`).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cardworker::app;
use cardworker::config::Config;
use cardworker::context::AppContext;
use cardworker::queue::intake::HIGH_WATER_MARK;
use cardworker_jobs::{Job, RunArchive, RunRetention};
use redis::AsyncCommands as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `cargo bench` appends `--bench` to the arguments: N is the first one that is not a flag.
    let n: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .map(|s| s.parse())
        .transpose()
        .context("N must be a number")?
        .unwrap_or(50_000);
    let prefix = format!(
        "bench-intake-{}",
        ulid::Ulid::new().to_string().to_lowercase()
    );
    // A throw-away database: the worker runs every job (reconcile and polling included), so it
    // must not see the cards of the local development database.
    let admin_url = "postgres://root@127.0.0.1:5432/postgres";
    let db = prefix.replace('-', "_");
    let admin = sqlx::PgPool::connect(admin_url)
        .await
        .context("connecting as admin")?;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await
        .context("creating the bench database")?;
    let mut config = Config::default();
    config.database.url = format!("postgres://root@127.0.0.1:5432/{db}").into();
    config.redis.key_prefix = prefix.clone();
    config.telemetry.listen = "127.0.0.1:0".into();
    let ctx = AppContext::connect(config).await?;
    cardworker::storage::migrate(&ctx.pool).await?;

    // 1. Enqueue everything first, all due at once (the worker is not running yet).
    let started = Instant::now();
    for i in 0..n {
        if i % 2 == 0 {
            ctx.producer.enqueue(&RunArchive::default()).await?;
        } else {
            ctx.producer.enqueue(&RunRetention::default()).await?;
        }
    }
    let enqueue = started.elapsed();

    // 2. Start the worker and sample the apalis backlog until everything drained.
    let running = app::start(ctx.clone()).await?;
    let mut conn = ctx.redis.clone();
    let queues = [RunArchive::QUEUE, RunRetention::QUEUE];
    let drain_start = Instant::now();
    let mut peak = 0usize;
    loop {
        let mut total = 0usize;
        for q in queues {
            // The high-water mark is per queue.
            let backlog = conn
                .llen::<_, usize>(format!("{prefix}:q:{q}:active"))
                .await?
                + conn
                    .zcard::<_, usize>(format!("{prefix}:q:{q}:scheduled"))
                    .await?;
            peak = peak.max(backlog);
            total += backlog
                + conn
                    .zcard::<_, usize>(format!("{prefix}:intake:{q}"))
                    .await?;
        }
        if total == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Let the last in-flight jobs finish and the trimmer run.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let drain = drain_start.elapsed();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let wait = tokio::spawn(running.wait(async move {
        let _ = stopped.await;
    }));
    let _ = stop.send(());
    wait.await.context("worker task")??;

    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await?;
    println!("| jobs due at once | enqueue (jobs/s) | drain incl. trim (jobs/s) | peak apalis backlog per queue (high-water {HIGH_WATER_MARK}) | keys left |");
    println!("| --- | --- | --- | --- | --- |");
    println!(
        "| {n} | {:.0} | {:.0} | {peak} | {} |",
        n as f64 / enqueue.as_secs_f64(),
        n as f64 / drain.as_secs_f64(),
        keys.len()
    );
    if !keys.is_empty() {
        let _: () = conn.del(&keys).await?;
    }
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&admin)
        .await
        .context("dropping the bench database")?;
    Ok(())
}
