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
use chrono::{DateTime, NaiveDate, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{Connection as _, Postgres, Transaction};

use super::{archive, day, is_paused, retention};
use crate::context::AppContext;
use crate::telemetry::metrics as m;

/// The advisory lock key shared by archive and retention: one maintenance run at a time per
/// database, whichever job and pod (ASCII "cwmaint" as an integer).
pub const LOCK_KEY: i64 = 0x0063_776d_6169_6e74;

/// `application_name` of the maintenance session, so that a DBA finds it in `pg_stat_activity`.
pub const APPLICATION_NAME: &str = "cardworker-maintenance";

/// How many due days `days_pending` counts at most (one index probe per table and day).
pub const DAYS_PENDING_CAP: i64 = 1000;

/// The two maintenance jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// `RunArchive`.
    Archive,
    /// `RunRetention`.
    Retention,
}

impl JobKind {
    /// The `job` label.
    pub const fn label(self) -> &'static str {
        match self {
            JobKind::Archive => "archive",
            JobKind::Retention => "retention",
        }
    }

    /// The worker kind of its cron schedule.
    pub const fn cron_kind(self) -> &'static str {
        match self {
            JobKind::Archive => "archive-cron",
            JobKind::Retention => "retention-cron",
        }
    }
}

/// Every `result` label of `cardworker_maintenance_runs_total`.
pub const RESULTS: [&str; 6] = [
    "skipped_disabled",
    "skipped_paused",
    "skipped_busy",
    "processed",
    "nothing_due",
    "failed",
];

/// Rows one run handled in one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRows {
    /// The table touched (`integration_logs`, `audit_events_archive`, …).
    pub table: &'static str,
    /// `archived`, `deleted` or `expired_kept`.
    pub action: &'static str,
    /// How many rows.
    pub rows: u64,
}

/// What one run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    /// Which job.
    pub job: JobKind,
    /// The `result` label.
    pub result: &'static str,
    /// The Shanghai day handled, if any.
    pub day: Option<NaiveDate>,
    /// Whether that day was finished (false when the brake stopped the run between batches).
    pub day_finished: bool,
    /// Whether the brake stopped the run at a batch boundary.
    pub stopped_by_pause: bool,
    /// Rows per table and action.
    pub rows: Vec<TableRows>,
    /// Due days still waiting after this run (capped at [`DAYS_PENDING_CAP`]), when measured.
    pub days_pending: Option<i64>,
    /// Wall time of the run.
    pub duration: Duration,
}

impl RunReport {
    fn new(job: JobKind) -> Self {
        Self {
            job,
            result: "processed",
            day: None,
            day_finished: false,
            stopped_by_pause: false,
            rows: Vec::new(),
            days_pending: None,
            duration: Duration::ZERO,
        }
    }

    /// Adds `rows` to the count of `table`/`action`.
    pub fn add(&mut self, table: &'static str, action: &'static str, rows: u64) {
        match self
            .rows
            .iter_mut()
            .find(|r| r.table == table && r.action == action)
        {
            Some(r) => r.rows += rows,
            None => self.rows.push(TableRows {
                table,
                action,
                rows,
            }),
        }
    }

    /// Rows counted for `table` (any action).
    pub fn rows_of(&self, table: &str) -> u64 {
        self.rows
            .iter()
            .filter(|r| r.table == table)
            .map(|r| r.rows)
            .sum()
    }

    fn total_rows(&self) -> u64 {
        self.rows.iter().map(|r| r.rows).sum()
    }
}

/// The dedicated session of one run, holding the advisory lock.
pub struct Session<'a> {
    /// The process context (config, Redis for the brake).
    pub ctx: &'a AppContext,
    /// The dedicated connection.
    conn: PgConnection,
}

impl Session<'_> {
    /// Begins one batch transaction with `SET LOCAL statement_timeout`.
    pub async fn begin(&mut self) -> anyhow::Result<Transaction<'_, Postgres>> {
        let mut tx = self
            .conn
            .begin()
            .await
            .context("beginning a maintenance transaction")?;
        sqlx::query("SELECT set_config('statement_timeout', $1, true)")
            .bind(self.ctx.config.maintenance.statement_timeout_ms.to_string())
            .execute(&mut *tx)
            .await
            .context("SET LOCAL statement_timeout")?;
        Ok(tx)
    }

    /// Whether the brake is set now (read before every batch).
    pub async fn paused(&self) -> anyhow::Result<bool> {
        is_paused(&mut self.ctx.redis.clone(), self.ctx.prefix()).await
    }

    /// `maintenance.batch_size` as a SQL `LIMIT`.
    pub fn batch_size(&self) -> i64 {
        i64::from(self.ctx.config.maintenance.batch_size)
    }
}

/// The oldest `created_at` below `cutoff` over several (table, extra filter) pairs, each an index
/// probe on `created_at`.
/// The day a run handles: the oldest due day among `tables` before `cut`, recorded in `report`,
/// as its bounds with the end clipped to `cut` (so a not-yet-due instant stays out even at the
/// day's edge). `None`, with `report.result = "nothing_due"`, when no day is due.
pub async fn next_due_day(
    session: &mut Session<'_>,
    tables: &[(&str, &str)],
    cut: DateTime<Utc>,
    report: &mut RunReport,
) -> anyhow::Result<Option<(DateTime<Utc>, DateTime<Utc>)>> {
    let Some(oldest) = oldest_due(session, tables, cut).await? else {
        report.result = "nothing_due";
        report.days_pending = Some(0);
        return Ok(None);
    };
    let d = day::day_of(oldest);
    report.day = Some(d);
    let (start, end) = day::bounds(d);
    Ok(Some((start, end.min(cut))))
}

pub async fn oldest_due(
    session: &mut Session<'_>,
    tables: &[(&str, &str)],
    cutoff: DateTime<Utc>,
) -> anyhow::Result<Option<DateTime<Utc>>> {
    let probes: Vec<String> = tables
        .iter()
        .map(|(t, filter)| {
            format!("(SELECT min(created_at) FROM {t} WHERE {filter} created_at < $1)")
        })
        .collect();
    let sql = format!("SELECT LEAST({})", probes.join(", "));
    let mut tx = session.begin().await?;
    let oldest: Option<DateTime<Utc>> = sqlx::query_scalar(&sql)
        .bind(cutoff)
        .fetch_one(&mut *tx)
        .await
        .context("finding the oldest due day")?;
    tx.commit().await?;
    Ok(oldest)
}

/// Counts distinct due Shanghai days below `cutoff` over the same probes as [`oldest_due`], by a
/// loose index scan: one `min(created_at)` probe per table and day, at most
/// [`DAYS_PENDING_CAP`] days. Cost grows with the number of days, not rows.
pub async fn count_due_days(
    session: &mut Session<'_>,
    tables: &[(&str, &str)],
    cutoff: DateTime<Utc>,
) -> anyhow::Result<i64> {
    let probe = |from: &str| -> String {
        let probes: Vec<String> = tables
            .iter()
            .map(|(t, filter)| {
                format!(
                    "(SELECT min(created_at) FROM {t} \
                     WHERE {filter} created_at >= {from} AND created_at < $1)"
                )
            })
            .collect();
        format!("LEAST({})", probes.join(", "))
    };
    let next_day = "((date_trunc('day', d.found AT TIME ZONE 'Asia/Shanghai') + interval '1 day') \
                    AT TIME ZONE 'Asia/Shanghai')";
    let sql = format!(
        "WITH RECURSIVE d(found, n) AS (
             SELECT {first}, 1
           UNION ALL
             SELECT {next}, d.n + 1 FROM d WHERE d.found IS NOT NULL AND d.n < $2
         )
         SELECT count(found) FROM d",
        first = probe("'-infinity'::timestamptz"),
        next = probe(next_day),
    );
    let mut tx = session.begin().await?;
    let days: i64 = sqlx::query_scalar(&sql)
        .bind(cutoff)
        .bind(DAYS_PENDING_CAP)
        .fetch_one(&mut *tx)
        .await
        .context("counting due days")?;
    tx.commit().await?;
    Ok(days)
}

/// The explicit column list of `table` (in order, quoted), so that `INSERT INTO …_archive (cols)
/// SELECT cols` fails loudly if a later migration adds a column online but not in the archive,
/// instead of shifting values by position.
pub async fn columns(session: &mut Session<'_>, table: &str) -> anyhow::Result<String> {
    let mut tx = session.begin().await?;
    let cols: Option<String> = sqlx::query_scalar(
        "SELECT string_agg(quote_ident(column_name), ', ' ORDER BY ordinal_position)
         FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = $1",
    )
    .bind(table)
    .fetch_one(&mut *tx)
    .await
    .with_context(|| format!("reading the columns of {table}"))?;
    tx.commit().await?;
    cols.with_context(|| format!("table {table} not found"))
}

/// Runs one maintenance job (maintenance enabled): brake, lock, one day, metrics and log.
/// Returns the report; an error is counted as `result="failed"` and returned.
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
    if !ctx.config.maintenance.enabled {
        tracing::info!(
            job = job.label(),
            ?scheduled_for,
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
            day = ?report.day,
            rows = %rows_field(&report),
            duration_ms = report.duration.as_millis() as u64,
            error = %format!("{e:#}"),
            "maintenance run failed; rows of finished batches stay moved, a later run finishes the day"
        );
        return Err(e);
    }
    count(&report);
    tracing::info!(
        job = label,
        enabled = true,
        cleanup_enabled,
        result = report.result,
        day = ?report.day,
        day_finished = report.day_finished,
        stopped_by_pause = report.stopped_by_pause,
        rows = %rows_field(&report),
        days_pending = ?report.days_pending,
        duration_ms = report.duration.as_millis() as u64,
        "maintenance run"
    );
    if report.stopped_by_pause {
        tracing::warn!(
            job = label,
            day = ?report.day,
            "maintenance paused: run stopped at a batch boundary, day not finished; a run after \
             `cardworker maintenance resume` finishes it"
        );
    }
    Ok(report)
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

/// Opens the dedicated session of a run (not pooled: closing it ends the session).
async fn connect(ctx: &AppContext) -> anyhow::Result<PgConnection> {
    let options = (*ctx.pool.connect_options())
        .clone()
        .application_name(APPLICATION_NAME)
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
    if is_paused(&mut ctx.redis.clone(), ctx.prefix()).await? {
        report.result = "skipped_paused";
        return Ok(());
    }
    let mut conn = connect(ctx).await?;
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

/// The days `job` still has to process (at most [`DAYS_PENDING_CAP`]), on a connection of its own
/// with the maintenance statement timeout: a bounded read-only probe that takes no lock (the
/// start-up measurement and the console use it).
pub async fn days_pending(ctx: &AppContext, job: JobKind) -> anyhow::Result<i64> {
    let conn = connect(ctx).await?;
    let mut session = Session { ctx, conn };
    let days = match job {
        JobKind::Archive => archive::days_pending(&mut session).await,
        JobKind::Retention => retention::days_pending(&mut session).await,
    };
    let _ = session.conn.close().await;
    days
}

/// Measures `days_pending` of both jobs at start-up (maintenance on only): a bounded read-only
/// probe; it takes no lock, and a failure is only logged.
pub async fn measure_days_pending(ctx: &AppContext) {
    for job in [JobKind::Archive, JobKind::Retention] {
        match days_pending(ctx, job).await {
            Ok(days) => {
                metrics::gauge!(m::MAINTENANCE_DAYS_PENDING, "job" => job.label()).set(days as f64);
                tracing::info!(
                    job = job.label(),
                    days_pending = days,
                    "maintenance backlog measured at start-up"
                );
            }
            Err(e) => {
                tracing::warn!(job = job.label(), error = %format!("{e:#}"), "could not measure the maintenance backlog at start-up")
            }
        }
    }
}
