//! `RunRetention`: handles one due Shanghai day of the archive.
//!
//! The day: the oldest Shanghai day D (by `created_at`) in any archive table that is older than
//! `retention_days` (`D + retention_days < today`, the same rule as archive). With
//! `cleanup_enabled = true` that day's archived rows are deleted in batches of `batch_size` (links,
//! events, logs); with `cleanup_enabled = false` nothing is deleted and the day's rows are counted
//! as `expired_kept`, so the next run reports the same day again. The cleanup switch decides only
//! deletion, never whether runs happen.

use anyhow::Context as _;
use cardworker_jobs::RunRetention;
use chrono::{DateTime, Utc};

use super::day;
use super::session::{self, JobKind, RunReport, Session};
use super::MaintenanceJob;
use crate::config::Config;

/// The archive tables, in deletion order (links before their events).
const TABLES: [&str; 3] = [
    "audit_resources_archive",
    "audit_events_archive",
    "integration_logs_archive",
];

/// Where due days are looked for: every archive table, by its `created_at` index.
const DUE_TABLES: [(&str, &str); 3] = [
    ("audit_resources_archive", ""),
    ("audit_events_archive", ""),
    ("integration_logs_archive", ""),
];

/// Every (table, action) a retention run counts.
pub const TABLE_ACTIONS: [(&str, &str); 6] = [
    ("integration_logs_archive", "deleted"),
    ("audit_events_archive", "deleted"),
    ("audit_resources_archive", "deleted"),
    ("integration_logs_archive", "expired_kept"),
    ("audit_events_archive", "expired_kept"),
    ("audit_resources_archive", "expired_kept"),
];

impl MaintenanceJob for RunRetention {
    const JOB: JobKind = JobKind::Retention;

    fn scheduled_for(&self) -> Option<i64> {
        self.scheduled_for
    }

    fn for_tick(timestamp: i64) -> Self {
        RunRetention {
            scheduled_for: Some(timestamp),
        }
    }
}

/// Where retention looks for due days, and the first instant that is not due today.
pub(super) fn due(config: &Config) -> (&'static [(&'static str, &'static str)], DateTime<Utc>) {
    (
        &DUE_TABLES,
        day::cutoff(day::today(), config.maintenance.retention_days),
    )
}

/// One retention run's body.
pub(super) async fn run_day(
    session: &mut Session<'_>,
    report: &mut RunReport,
) -> anyhow::Result<()> {
    let (tables, cut) = due(&session.ctx.config);
    let Some((start, end)) = session::next_due_day(session, tables, cut, report).await? else {
        return Ok(());
    };

    if !session.ctx.config.maintenance.cleanup_enabled {
        // Count only: one bounded index range scan per table.
        let mut tx = session.begin().await?;
        for table in TABLES {
            let kept: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {table} WHERE created_at >= $1 AND created_at < $2"
            ))
            .bind(start)
            .bind(end)
            .fetch_one(&mut *tx)
            .await
            .with_context(|| format!("counting expired rows of {table}"))?;
            report.add(table, "expired_kept", kept as u64);
        }
        tx.commit().await?;
        // The day stays: it is reported again by the next run (and counted in days_pending).
        report.day_finished = true;
        report.days_pending = Some(session::count_due_days(session, tables, cut).await?);
        return Ok(());
    }

    for table in TABLES {
        let mut cursor = start;
        loop {
            if session.paused().await? {
                report.stopped_by_pause = true;
                return Ok(());
            }
            let (deleted, last) = delete_batch(session, table, cursor, end).await?;
            report.add(table, "deleted", deleted);
            match last {
                Some(last) if deleted >= session.batch_size() as u64 => cursor = last,
                _ => break,
            }
        }
    }
    report.day_finished = true;
    report.days_pending = Some(session::count_due_days(session, tables, cut).await?);
    Ok(())
}

async fn delete_batch(
    session: &mut Session<'_>,
    table: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> anyhow::Result<(u64, Option<DateTime<Utc>>)> {
    let limit = session.batch_size();
    let sql = format!(
        "WITH batch AS (
             SELECT id FROM {table} WHERE created_at >= $1 AND created_at < $2
             ORDER BY created_at LIMIT $3
         ), deleted AS (
             DELETE FROM {table} t USING batch WHERE t.id = batch.id RETURNING t.created_at
         )
         SELECT count(*), max(created_at) FROM deleted"
    );
    let mut tx = session.begin().await?;
    let (deleted, last): (i64, Option<DateTime<Utc>>) = sqlx::query_as(&sql)
        .bind(from)
        .bind(to)
        .bind(limit)
        .fetch_one(&mut *tx)
        .await
        .with_context(|| format!("deleting a batch of {table}"))?;
    tx.commit()
        .await
        .with_context(|| format!("committing a {table} batch"))?;
    Ok((deleted as u64, last))
}
