//! The frame every maintenance run shares: pause brake, the cross-pod lock on a dedicated
//! connection, `statement_timeout` on every statement, batch boundaries, metrics and the one log
//! line per run.
//!
//! Order of a run (enabled):
//! 1. the Redis brake: paused -> `skipped_paused`, before any database work;
//! 2. a dedicated PostgreSQL connection (not from the pool, so that dropping it always ends the
//!    session and releases the lock, even when the run is aborted or times out) with
//!    `statement_timeout` set for the session, and `pg_try_advisory_lock(LOCK_KEY)`: taken by
//!    another pod -> `skipped_busy`;
//! 3. the job body: one day at most, each batch its own transaction under
//!    `SET LOCAL statement_timeout`, the brake read again before every batch;
//! 4. unlock, close, count and log.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::NaiveDate;
use sqlx::postgres::PgConnection;
use sqlx::Connection as _;

use super::session::{
    count_due_days, oldest_due, JobKind, RunReport, Session, APPLICATION_NAME, LOCK_KEY,
    PROBE_APPLICATION_NAME, RESULTS,
};
use super::switch;
use super::{archive, day, retention};
use crate::context::AppContext;
use crate::telemetry::metrics as m;

/// Hard limit on one archive or retention run. One day in bounded batches; a run cut off here is
/// safe, because a rerun finishes the day without duplicates.
pub const RUN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);

/// What a queued archive or retention job does: a no-op acknowledgement while maintenance is
/// off (not a single query on the log, audit or archive tables), else one run.
pub async fn run_queued(
    ctx: &AppContext,
    job: JobKind,
    scheduled_for: Option<i64>,
) -> anyhow::Result<()> {
    if !switch::enabled(&ctx.config.maintenance) {
        tracing::info!(
            job = job.label(),
            scheduled_for = %crate::telemetry::rfc3339_opt(scheduled_for),
            "maintenance run skipped: maintenance disabled"
        );
        super::count_run(job.label(), "skipped_disabled");
        return Ok(());
    }
    run_job(ctx, job).await.map(|_| ())
}

pub async fn run_job(ctx: &AppContext, job: JobKind) -> anyhow::Result<RunReport> {
    let started = Instant::now();
    let mut report = RunReport::new(job);
    let outcome = run_locked(ctx, &mut report).await;
    report.duration = started.elapsed();
    let label = job.label();
    metrics::histogram!(m::MAINTENANCE_RUN_DURATION, "job" => label)
        .record(report.duration.as_secs_f64());
    let cleanup_enabled = ctx.config.maintenance.cleanup_enabled;
    if let Err(e) = outcome {
        report.result = "failed";
        count(&report);
        tracing::error!(
            job = label,
            enabled = true,
            cleanup_enabled,
            result = report.result,
            day = %day_field(report.day),
            rows = %rows_field(&report),
            duration_ms = report.duration.as_millis() as u64,
            error = %format!("{e:#}"),
            "maintenance run failed; rows of finished batches stay moved, a later run finishes the day"
        );
        return Err(e);
    }
    count(&report);
    if report.result == "processed" {
        if let Some(d) = report.day {
            super::last_day::record(ctx, job, d, report.day_finished).await;
        }
    }
    tracing::info!(
        job = label,
        enabled = true,
        cleanup_enabled,
        result = report.result,
        day = %day_field(report.day),
        day_finished = report.day_finished,
        stopped_by_pause = report.stopped_by_pause,
        rows = %rows_field(&report),
        days_pending = report.days_pending,
        duration_ms = report.duration.as_millis() as u64,
        "maintenance run"
    );
    if report.stopped_by_pause {
        tracing::warn!(
            job = label,
            day = %day_field(report.day),
            "maintenance paused: run stopped at a batch boundary, day not finished; a run after \
             `cardworker maintenance resume` finishes it"
        );
    }
    Ok(report)
}

/// The run's Shanghai day for a log field: `2026-11-30`, or `none` when no day was due (never
/// `Some(…)`).
fn day_field(day: Option<NaiveDate>) -> String {
    day.map_or_else(|| "none".to_owned(), |d| d.to_string())
}

/// `integration_logs:archived=10 audit_events:archived=2`, for the one log line per run.
fn rows_field(report: &RunReport) -> String {
    let parts: Vec<String> = report
        .rows
        .iter()
        .map(|r| format!("{}:{}={}", r.table, r.action, r.rows))
        .collect();
    parts.join(" ")
}

fn count(report: &RunReport) {
    let job = report.job.label();
    super::count_run(job, report.result);
    for r in &report.rows {
        metrics::counter!(m::MAINTENANCE_ROWS, "job" => job, "table" => r.table, "action" => r.action)
            .increment(r.rows);
    }
    if report.result == "processed" {
        if let Some(d) = report.day {
            metrics::gauge!(m::MAINTENANCE_LAST_DAY, "job" => job).set(day::yyyymmdd(d) as f64);
        }
    }
    if let Some(days) = report.days_pending {
        metrics::gauge!(m::MAINTENANCE_DAYS_PENDING, "job" => job).set(days as f64);
    }
}

/// Opens the dedicated session of a run or a probe (not pooled: closing it ends the session).
async fn connect(ctx: &AppContext, application_name: &str) -> anyhow::Result<PgConnection> {
    let options = (*ctx.pool.connect_options())
        .clone()
        .application_name(application_name)
        .options([(
            "statement_timeout",
            ctx.config.maintenance.statement_timeout_ms.to_string(),
        )]);
    tokio::time::timeout(
        Duration::from_secs(10),
        PgConnection::connect_with(&options),
    )
    .await
    .context("connecting the maintenance session timed out")?
    .context("connecting the maintenance session")
}

async fn run_locked(ctx: &AppContext, report: &mut RunReport) -> anyhow::Result<()> {
    // A run asked for directly (`run_job`) runs whatever the switch says; the brake holds it.
    if switch::is_paused(&mut ctx.redis.clone(), ctx.prefix()).await? {
        report.result = "skipped_paused";
        return Ok(());
    }
    let mut conn = connect(ctx, APPLICATION_NAME).await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(LOCK_KEY)
        .fetch_one(&mut conn)
        .await
        .context("pg_try_advisory_lock")?;
    if !locked {
        report.result = "skipped_busy";
        let _ = conn.close().await;
        return Ok(());
    }
    let mut session = Session { ctx, conn };
    let outcome = match report.job {
        JobKind::Archive => archive::run_day(&mut session, report).await,
        JobKind::Retention => retention::run_day(&mut session, report).await,
    };
    if outcome.is_ok() && report.stopped_by_pause && report.total_rows() == 0 {
        // The brake came between the lock and the first batch: nothing was done.
        report.result = "skipped_paused";
    }
    // Closing the session releases the lock whatever happened; the explicit unlock is for
    // readability in pg_locks traces and costs nothing.
    let mut conn = session.conn;
    let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(LOCK_KEY)
        .execute(&mut conn)
        .await;
    let _ = conn.close().await;
    outcome
}

/// Registers every maintenance series the dashboards and alert rules read, so that a scrape
/// shows them from start-up, and sets the switch gauge. Touches no table.
pub fn register_metrics(enabled: bool) {
    metrics::gauge!(m::MAINTENANCE_ENABLED).set(if enabled { 1.0 } else { 0.0 });
    for job in [JobKind::Archive, JobKind::Retention] {
        let label = job.label();
        for result in RESULTS {
            metrics::counter!(m::MAINTENANCE_RUNS, "job" => label, "result" => result).increment(0);
        }
        // 0 = nothing processed by this process yet (dashboards aggregate with max).
        metrics::gauge!(m::MAINTENANCE_LAST_DAY, "job" => label).increment(0.0);
        // Measured only while maintenance is on (after each run and at start-up); 0 until then.
        metrics::gauge!(m::MAINTENANCE_DAYS_PENDING, "job" => label).increment(0.0);
        let _ = metrics::histogram!(m::MAINTENANCE_RUN_DURATION, "job" => label);
        let pairs: &[(&str, &str)] = match job {
            JobKind::Archive => &archive::TABLE_ACTIONS,
            JobKind::Retention => &retention::TABLE_ACTIONS,
        };
        for (table, action) in pairs {
            metrics::counter!(m::MAINTENANCE_ROWS, "job" => label, "table" => *table, "action" => *action)
                .increment(0);
        }
    }
}

/// A job's backlog as its next run would see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Backlog {
    /// The oldest due Shanghai day: what the next run handles (`None`: nothing is due).
    pub next_day: Option<NaiveDate>,
    /// Due days waiting, capped at [`super::session::DAYS_PENDING_CAP`].
    pub days_pending: i64,
    /// Days before this Shanghai day are due (`today - archive_after_days` or
    /// `today - retention_days`).
    pub due_before: NaiveDate,
}

/// Measures one job's backlog: the same bounded, read-only index probes a run uses
/// ([`oldest_due`], [`count_due_days`]), on a dedicated session under the maintenance
/// `statement_timeout`. It takes no lock and works whether maintenance is on or off.
pub async fn backlog(ctx: &AppContext, job: JobKind) -> anyhow::Result<Backlog> {
    let (tables, cut) = match job {
        JobKind::Archive => archive::due(&ctx.config),
        JobKind::Retention => retention::due(&ctx.config),
    };
    let conn = connect(ctx, PROBE_APPLICATION_NAME).await?;
    let mut session = Session { ctx, conn };
    let measured = async {
        let oldest = oldest_due(&mut session, tables, cut).await?;
        let days = count_due_days(&mut session, tables, cut).await?;
        anyhow::Ok((oldest, days))
    }
    .await;
    let _ = session.conn.close().await;
    let (oldest, days_pending) = measured?;
    Ok(Backlog {
        next_day: oldest.map(day::day_of),
        days_pending,
        due_before: day::day_of(cut),
    })
}

/// Measures `days_pending` of both jobs at start-up (maintenance on only): a bounded read-only
/// probe; it takes no lock, and a failure is only logged.
pub async fn measure_days_pending(ctx: &AppContext) {
    for job in [JobKind::Archive, JobKind::Retention] {
        match backlog(ctx, job).await {
            Ok(b) => {
                metrics::gauge!(m::MAINTENANCE_DAYS_PENDING, "job" => job.label())
                    .set(b.days_pending as f64);
                tracing::info!(
                    job = job.label(),
                    days_pending = b.days_pending,
                    "maintenance backlog measured at start-up"
                );
            }
            Err(e) => {
                tracing::warn!(job = job.label(), error = %format!("{e:#}"), "could not measure the maintenance backlog at start-up")
            }
        }
    }
}
