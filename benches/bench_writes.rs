//! `make bench-writes`: N unchanged card_status polls, side by side on one fresh database,
//! through the new path (the real job code, `polling::poll::run_poll`) and through an emulation of
//! the old pending-first path (pending log + audit event + resource link committed before the
//! call, the log finalised with an UPDATE after it). Reports rows written (from
//! `pg_stat_user_tables`, read after every backend of the phase exited), WAL bytes
//! (`pg_current_wal_lsn()` difference; cluster-wide, so other activity on the server adds noise)
//! and polls per second, and the ratios.
//!
//! Env: `BENCH_N` (default 2000), `BENCH_CONCURRENCY` (default 8), `CARDWORKER_BENCH_PG_ADMIN`
//! (default `postgres://root@127.0.0.1:5432/postgres`), `CARDWORKER_BENCH_REDIS` (default
//! `redis://127.0.0.1:6379/0`).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cardworker::config::{Config, Task};
use cardworker::context::AppContext;
use cardworker::gateway::Outcome;
use cardworker::polling::lease;
use cardworker::polling::poll::{run_poll, PollOutcome};
use cardworker::sim::Simulator;
use cardworker::storage::records::{self, AuditRecord};
use cardworker_jobs::{PollCardStatus, PollTicket};
use futures::StreamExt as _;
use sqlx::{Connection as _, PgConnection, PgPool};
use uuid::Uuid;

use cardworker_test_kit::bench as support;

const TABLES: &[&str] = &[
    "cards",
    "integration_logs",
    "audit_events",
    "audit_resources",
    "outbox_events",
];

use support::env_or;

/// Rows written (ins + upd + del) over the measured tables, once every other backend is gone.
async fn rows_written(stats: &mut PgConnection, db: &str) -> anyhow::Result<i64> {
    let start = Instant::now();
    loop {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(db)
        .fetch_one(&mut *stats)
        .await?;
        if others == 0 || start.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *stats)
        .await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint
           FROM pg_stat_user_tables WHERE relname = ANY($1)",
    )
    .bind(TABLES)
    .fetch_one(&mut *stats)
    .await?;
    Ok(n)
}

async fn lsn(stats: &mut PgConnection) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&mut *stats)
        .await?)
}

async fn wal_bytes(stats: &mut PgConnection, from: &str) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
            .bind(from)
            .fetch_one(&mut *stats)
            .await?,
    )
}

struct Measured {
    rows: i64,
    wal: i64,
    secs: f64,
}

/// The emulated old path for one poll: pending-first, finalised after.
async fn old_poll(pool: &PgPool, ctx: &AppContext, card_ref: &str) -> anyhow::Result<()> {
    let correlation_id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    let log_id: i64 = sqlx::query_scalar(
        "INSERT INTO integration_logs (correlation_id, resource_type, resource_id, scenario, state,
                                       request_summary, started_at)
         VALUES ($1, 'card', $2, 'card_status_poll', 'pending', $3, now()) RETURNING id",
    )
    .bind(correlation_id)
    .bind(card_ref)
    .bind(format!("GET /v1/cards/{card_ref}/status"))
    .fetch_one(&mut *tx)
    .await?;
    records::insert_audit(
        &mut tx,
        &AuditRecord {
            event_type: "poll.started",
            correlation_id: Some(correlation_id),
            summary: format!("card_status poll of {card_ref}"),
            details: serde_json::json!({}),
            resource_type: "card",
            resource_id: card_ref.to_owned(),
        },
        Some(log_id),
    )
    .await?;
    tx.commit().await?;
    let result = ctx.gateway.card_status(card_ref, correlation_id).await;
    let state = match result.outcome {
        Outcome::Valid(_) => "succeeded",
        Outcome::Failed(_) => "failed",
        Outcome::Unknown(_) => "unknown",
    };
    sqlx::query(
        "UPDATE integration_logs SET state = $2, response_summary = $3, http_status = $4,
                finished_at = now(), duration_ms = $5 WHERE id = $1",
    )
    .bind(log_id)
    .bind(state)
    .bind(&result.response_summary)
    .bind(result.http_status.map(i32::from))
    .bind(i32::try_from(result.elapsed.as_millis()).unwrap_or(i32::MAX))
    .execute(pool)
    .await?;
    Ok(())
}

async fn bench(n: usize, concurrency: usize) -> anyhow::Result<(Measured, Measured)> {
    let (admin_url, redis_url) = (support::admin_url(), support::redis_url());
    let id = ulid::Ulid::new().to_string().to_lowercase();
    let (db, db_url) = support::create_database(&admin_url, &format!("cw_bench_{id}")).await?;
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
    sim.set_latency(0, 0);

    let mut config = Config::default();
    config.database.url = db_url.clone().into();
    config.database.max_connections = u32::try_from(concurrency).unwrap_or(8) + 2;
    config.redis.url = redis_url.into();
    config.redis.key_prefix = format!("cwbench-{id}");
    config.gateway.base_url = sim_handle.base_url().into();
    config.validate()?;

    let result = async {
        let ctx = AppContext::connect(config.clone()).await?;
        cardworker::storage::migrate(&ctx.pool).await?;
        let cards: Vec<String> = (1..=n).map(|i| format!("b-{i}")).collect();
        let mut setup = PgConnection::connect(&db_url).await?;
        sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
            .bind(&cards)
            .execute(&mut setup)
            .await?;
        setup.close().await?;
        // Cards for the new path, due now and then leased for an hour, as a worker's fetch would
        // (the direct calls below are their polls).
        let mut redis = ctx.redis.clone();
        let queue = lease::due_queue(ctx.prefix(), Task::CardStatus);
        for card in &cards {
            lease::start(
                &mut redis,
                ctx.prefix(),
                Task::CardStatus,
                card,
                Duration::ZERO,
            )
            .await?;
        }
        let mut jobs = Vec::with_capacity(n);
        while jobs.len() < n {
            let leased = queue
                .fetch(&mut redis, 1000, Duration::from_secs(3600))
                .await?;
            anyhow::ensure!(!leased.is_empty(), "{} of {n} cards leased", jobs.len());
            jobs.extend(leased.into_iter().map(|l| PollCardStatus {
                card_ref: l.card_ref,
                ticket: PollTicket {
                    lease: l.lease.score(),
                    due_ms: l.due_ms,
                    state: l.state.to_raw(),
                },
            }));
        }
        ctx.pool.close().await;

        let mut stats = PgConnection::connect(&db_url).await?;
        // Baseline after the setup's counters are published.
        let base = loop {
            let rows = rows_written(&mut stats, &db).await?;
            if rows >= n as i64 {
                break rows;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };

        // New path: the real job code.
        let ctx = AppContext::connect(config.clone()).await?;
        let from = lsn(&mut stats).await?;
        let started = Instant::now();
        let outcomes: Vec<anyhow::Result<PollOutcome>> = futures::stream::iter(jobs)
            .map(|job| run_poll(job, ctx.clone()))
            .buffer_unordered(concurrency)
            .collect()
            .await;
        let secs = started.elapsed().as_secs_f64();
        let unchanged = outcomes
            .iter()
            .filter(|o| matches!(o, Ok(PollOutcome::Unchanged)))
            .count();
        anyhow::ensure!(
            unchanged == n,
            "new path: {unchanged} of {n} polls unchanged"
        );
        let wal = wal_bytes(&mut stats, &from).await?;
        ctx.pool.close().await;
        let after_new = rows_written(&mut stats, &db).await?;
        let new = Measured {
            rows: after_new - base,
            wal,
            secs,
        };

        // Old path, same cards, same Gateway.
        let ctx = AppContext::connect(config.clone()).await?;
        let pool = ctx.pool.clone();
        let from = lsn(&mut stats).await?;
        let started = Instant::now();
        let results: Vec<anyhow::Result<()>> = futures::stream::iter(cards.iter())
            .map(|card| old_poll(&pool, &ctx, card))
            .buffer_unordered(concurrency)
            .collect()
            .await;
        let secs = started.elapsed().as_secs_f64();
        for r in results {
            r?;
        }
        let wal = wal_bytes(&mut stats, &from).await?;
        pool.close().await;
        let after_old = rows_written(&mut stats, &db).await?;
        let old = Measured {
            rows: after_old - after_new,
            wal,
            secs,
        };
        stats.close().await?;
        Ok::<_, anyhow::Error>((new, old))
    }
    .await;

    // Clean up whatever happened.
    let _ = sim_handle.shutdown().await;
    if let Ok(mut conn) = cardworker::context::connect_redis(config.redis.url.expose()).await {
        support::delete_prefix(&mut conn, &config.redis.key_prefix).await;
    }
    support::drop_database(&admin_url, &db).await;
    result
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = env_or("BENCH_N", "2000").parse().context("BENCH_N")?;
    let concurrency: usize = env_or("BENCH_CONCURRENCY", "8")
        .parse()
        .context("BENCH_CONCURRENCY")?;
    let (new, old) = bench(n, concurrency).await?;
    let per = |x: i64| x as f64 / n as f64;
    let ratio = |a: f64, b: f64| {
        if a == 0.0 {
            "∞ (new = 0)".to_owned()
        } else {
            format!("{:.1}×", b / a)
        }
    };
    println!("bench-writes: {n} unchanged card_status polls per path, concurrency {concurrency}\n");
    println!("| path | rows written | rows/poll | WAL bytes | WAL bytes/poll | polls/s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for (name, m) in [
        ("new (terminal records only)", &new),
        ("old (pending-first)", &old),
    ] {
        println!(
            "| {name} | {} | {:.2} | {} | {:.0} | {:.0} |",
            m.rows,
            per(m.rows),
            m.wal,
            per(m.wal),
            n as f64 / m.secs
        );
    }
    println!(
        "| old / new | {} | | {} | | {:.2}× faster (new) |",
        ratio(new.rows as f64, old.rows as f64),
        ratio(new.wal as f64, old.wal as f64),
        old.secs / new.secs
    );
    Ok(())
}
