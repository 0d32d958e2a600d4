//! What a maintenance run works with: its [`JobKind`], its [`RunReport`], the dedicated
//! [`Session`] (one connection, `statement_timeout`, the brake between batches), and the
//! index-probe queries that find the day a run handles.
//!
//! Archive and retention build their day on these; `run` drives them. Keeping these below both
//! job bodies is what lets `run` dispatch to archive and retention without either importing
//! `run` back.

use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, NaiveDate, Utc};
use sqlx::postgres::PgConnection;
use sqlx::{Connection as _, Postgres, Transaction};

use super::day;
use super::switch::is_paused;
use crate::context::AppContext;

/// The advisory lock key shared by archive and retention: one maintenance run at a time per
/// database, whichever job and pod (ASCII "cwmaint" as an integer).
pub const LOCK_KEY: i64 = 0x0063_776d_6169_6e74;

/// `application_name` of the maintenance session, so that a DBA finds it in `pg_stat_activity`.
pub const APPLICATION_NAME: &str = "cardworker-maintenance";

/// `application_name` of a read-only backlog probe (start-up, `cardworker maintenance status`):
/// not the name of a run, so that `pg_stat_activity` never shows a probe as a run in progress.
pub const PROBE_APPLICATION_NAME: &str = "cardworker-maintenance-probe";

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
    pub(super) fn new(job: JobKind) -> Self {
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

    pub(super) fn total_rows(&self) -> u64 {
        self.rows.iter().map(|r| r.rows).sum()
    }
}

/// The dedicated session of one run, holding the advisory lock.
pub struct Session<'a> {
    /// The process context (config, Redis for the brake).
    pub ctx: &'a AppContext,
    /// The dedicated connection.
    pub(super) conn: PgConnection,
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
