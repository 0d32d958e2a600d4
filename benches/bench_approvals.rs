//! `make bench-approvals`: approvals per second through the reliable path, at 1,000 rows.
//!
//! 1. **Submission**: `BENCH_APPROVALS` (default 1000) `requested` approvals, submitted by
//!    `approvals::submit::submit` (pending commit, `POST /v1/approvals` to the in-process
//!    simulator with no added latency, the answer finalised and decided once) with
//!    `approvals.concurrency` (default 4) at a time, as one worker process runs them.
//! 2. **Recovery**: as many approvals answered `in_review` (the simulator decides them at once),
//!    aged past `approvals.review_query_secs`, then decided by recovery runs
//!    (`approvals::recovery::recover`, batches of `RECOVERY_BATCH`, one query after another) until
//!    none is left.
//!
//! The figures are the cost of our side (PostgreSQL transactions, the HTTP round trip on
//! loopback); a real Gateway's latency adds to each call. Env: `CARDWORKER_BENCH_PG_ADMIN`
//! (default `postgres://root@127.0.0.1:5432/postgres`), `CARDWORKER_BENCH_REDIS` (default
//! `redis://127.0.0.1:6379/0`); a fresh database and key prefix, dropped afterwards.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use cardworker::approvals::{recovery, submit};
use cardworker::config::Config;
use cardworker::context::AppContext;
use cardworker::sim::{SimConfigPatch, Simulator};
use cardworker_jobs::SubmitApproval;
use uuid::Uuid;

use cardworker_test_kit::bench as support;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

async fn insert(ctx: &AppContext, n: usize) -> anyhow::Result<Vec<Uuid>> {
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    sqlx::query(
        "INSERT INTO approvals (approval_id, card_ref, kind, amount_minor)
         SELECT unnest($1::uuid[]), 'b-1', 'limit_change', 100000",
    )
    .bind(&ids)
    .execute(&ctx.pool)
    .await?;
    Ok(ids)
}

async fn submit_all(ctx: &Arc<AppContext>, ids: &[Uuid], concurrency: usize) -> anyhow::Result<()> {
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let mut tasks = Vec::with_capacity(ids.len());
    for &id in ids {
        let permit = sem.clone().acquire_owned().await?;
        let ctx = ctx.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            submit::submit(
                &ctx,
                &SubmitApproval {
                    approval_id: id,
                    retries: 0,
                },
            )
            .await
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

async fn count(ctx: &AppContext, status: &str) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM approvals WHERE status = $1")
            .bind(status)
            .fetch_one(&ctx.pool)
            .await?,
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = env_or("BENCH_APPROVALS", "1000")
        .parse()
        .context("BENCH_APPROVALS")?;
    let admin_url = support::admin_url();
    let id = ulid::Ulid::new().to_string().to_lowercase();
    let (db, db_url) = support::create_database(&admin_url, &format!("cw_bench_{id}")).await?;
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
    sim.set_latency(0, 0);
    let mut config = Config::default();
    config.database.url = db_url.into();
    config.redis.url = env_or("CARDWORKER_BENCH_REDIS", "redis://127.0.0.1:6379/0").into();
    config.redis.key_prefix = format!("cwbench-{id}");
    config.gateway.base_url = sim_handle.base_url().into();
    config.validate()?;
    let prefix = config.redis.key_prefix.clone();
    let concurrency = config.approvals.concurrency as usize;

    let result = async {
        let ctx = Arc::new(AppContext::connect(config.clone()).await?);
        cardworker::storage::migrate(&ctx.pool).await?;
        sqlx::query("INSERT INTO cards (card_ref) VALUES ('b-1')")
            .execute(&ctx.pool)
            .await?;
        println!("bench-approvals: {n} approvals per phase, in-process simulator (no added latency)\n");
        println!("| phase | approvals | wall (s) | approvals/s | result |");
        println!("| --- | ---: | ---: | ---: | --- |");

        let ids = insert(&ctx, n).await?;
        let started = Instant::now();
        submit_all(&ctx, &ids, concurrency).await?;
        let secs = started.elapsed().as_secs_f64();
        println!(
            "| submission ({concurrency} at a time) | {n} | {secs:.2} | {:.0} | {} approved |",
            n as f64 / secs,
            count(&ctx, "approved").await?
        );

        sim.update_config(&SimConfigPatch {
            approval_in_review_rate: Some(1.0),
            approval_review_ms: Some(0),
            ..SimConfigPatch::default()
        })?;
        let ids = insert(&ctx, n).await?;
        submit_all(&ctx, &ids, concurrency).await?;
        sqlx::query(
            "UPDATE approvals SET updated_at = now() - interval '1 day' WHERE status = 'in_review'",
        )
        .execute(&ctx.pool)
        .await?;
        sqlx::query("ANALYZE approvals").execute(&ctx.pool).await?;
        let thresholds = recovery::thresholds(&ctx.config);
        let started = Instant::now();
        let mut runs = 0;
        let mut settled = 0;
        loop {
            let report = recovery::recover(&ctx, thresholds, recovery::RECOVERY_BATCH).await?;
            if report.examined == 0 {
                break;
            }
            runs += 1;
            settled += report.settled;
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "| recovery (in_review -> decided, {runs} runs of {}) | {n} | {secs:.2} | {:.0} | {settled} settled |",
            recovery::RECOVERY_BATCH,
            n as f64 / secs,
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
