//! `RunArchive`: moves one ended Shanghai day of finished records into the archive tables.
//!
//! The day: the oldest Shanghai day D with a finished integration log or an audit event that is
//! due (`D + archive_after_days < today`). Its rows `[D 00:00+08:00, D+1 00:00+08:00)` move in
//! batches of `batch_size`, each batch one transaction that deletes online and inserts into the
//! archive in one statement (`ON CONFLICT (id) DO NOTHING`), so a crash loses nothing, a rerun
//! finishes the same day and no row exists twice.
//!
//! Audit links follow their events: each batch moves the resource links of its events first
//! (whatever their own `created_at`; the foreign key demands it), then the events. Pending
//! integration logs stay online (payment recovery needs them); they are archived with their day
//! once finished, by a later run. Batches walk the day by `created_at` (keyset), along the
//! `created_at` indexes, so a batch never re-reads the part of the day already moved.

use anyhow::Context as _;
use cardworker_jobs::RunArchive;
use chrono::{DateTime, Utc};

use super::day;
use super::session::{self, JobKind, RunReport, Session};
use super::MaintenanceJob;
use crate::config::Config;

/// Where due days are looked for: (table, filter), each with a `created_at` index.
const DUE_TABLES: [(&str, &str); 2] = [
    ("integration_logs", "state <> 'pending' AND"),
    ("audit_events", ""),
];

/// Every (table, action) an archive run counts.
pub const TABLE_ACTIONS: [(&str, &str); 3] = [
    ("integration_logs", "archived"),
    ("audit_events", "archived"),
    ("audit_resources", "archived"),
];

impl MaintenanceJob for RunArchive {
    const JOB: JobKind = JobKind::Archive;

    fn scheduled_for(&self) -> Option<i64> {
        self.scheduled_for
    }

    fn for_tick(timestamp: i64) -> Self {
        RunArchive {
            scheduled_for: Some(timestamp),
        }
    }
}

/// Where archive looks for due days, and the first instant that is not due today.
pub(super) fn due(config: &Config) -> (&'static [(&'static str, &'static str)], DateTime<Utc>) {
    (
        &DUE_TABLES,
        day::cutoff(day::today(), config.maintenance.archive_after_days),
    )
}

/// One archive run's body: finds the day and moves it, batch by batch.
pub(super) async fn run_day(
    session: &mut Session<'_>,
    report: &mut RunReport,
) -> anyhow::Result<()> {
    let (tables, cut) = due(&session.ctx.config);
    let Some((start, end)) = session::next_due_day(session, tables, cut, report).await? else {
        return Ok(());
    };

    let log_cols = session::columns(session, "integration_logs").await?;
    let event_cols = session::columns(session, "audit_events").await?;
    let link_cols = session::columns(session, "audit_resources").await?;

    // Integration logs (finished only), then audit events with their links.
    let mut cursor = start;
    loop {
        if session.paused().await? {
            report.stopped_by_pause = true;
            return Ok(());
        }
        let batch = move_logs(session, &log_cols, cursor, end).await?;
        report.add("integration_logs", "archived", batch.inserted);
        warn_conflicts("integration_logs", batch.moved, batch.inserted);
        match batch.last {
            Some(last) if batch.moved >= session.batch_size() as u64 => cursor = last,
            _ => break,
        }
    }
    let mut cursor = start;
    loop {
        if session.paused().await? {
            report.stopped_by_pause = true;
            return Ok(());
        }
        let batch = move_events(session, &event_cols, &link_cols, cursor, end).await?;
        report.add("audit_resources", "archived", batch.links_inserted);
        report.add("audit_events", "archived", batch.events.inserted);
        warn_conflicts("audit_resources", batch.links_moved, batch.links_inserted);
        warn_conflicts("audit_events", batch.events.moved, batch.events.inserted);
        match batch.events.last {
            Some(last) if batch.events.moved >= session.batch_size() as u64 => cursor = last,
            _ => break,
        }
    }
    report.day_finished = true;
    report.days_pending = Some(session::count_due_days(session, tables, cut).await?);
    Ok(())
}

/// Rows whose id already was in the archive: the archive copy is kept and the online copy is
/// gone. Only possible after someone copied rows by hand; worth a warning, never a failure.
fn warn_conflicts(table: &'static str, moved: u64, inserted: u64) {
    if moved > inserted {
        tracing::warn!(
            table,
            rows = moved - inserted,
            "rows already present in the archive; kept the archive copy"
        );
    }
}

/// What one batch statement moved.
struct Moved {
    /// Deleted online.
    moved: u64,
    /// Inserted into the archive.
    inserted: u64,
    /// The latest `created_at` moved: where the next batch starts.
    last: Option<DateTime<Utc>>,
}

async fn move_logs(
    session: &mut Session<'_>,
    cols: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> anyhow::Result<Moved> {
    let limit = session.batch_size();
    let sql = format!(
        "WITH batch AS (
             SELECT id FROM integration_logs
             WHERE state <> 'pending' AND created_at >= $1 AND created_at < $2
             ORDER BY created_at LIMIT $3
         ), moved AS (
             DELETE FROM integration_logs l USING batch
             WHERE l.id = batch.id AND l.state <> 'pending'
             RETURNING l.*
         ), inserted AS (
             INSERT INTO integration_logs_archive ({cols}, archived_at)
             SELECT {cols}, now() FROM moved
             ON CONFLICT (id) DO NOTHING
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM inserted),
                (SELECT max(created_at) FROM moved)"
    );
    let mut tx = session.begin().await?;
    let (moved, inserted, last): (i64, i64, Option<DateTime<Utc>>) = sqlx::query_as(&sql)
        .bind(from)
        .bind(to)
        .bind(limit)
        .fetch_one(&mut *tx)
        .await
        .context("moving a batch of integration_logs")?;
    tx.commit()
        .await
        .context("committing an integration_logs batch")?;
    Ok(Moved {
        moved: moved as u64,
        inserted: inserted as u64,
        last,
    })
}

/// What one audit batch moved.
struct MovedEvents {
    events: Moved,
    links_moved: u64,
    links_inserted: u64,
}

async fn move_events(
    session: &mut Session<'_>,
    event_cols: &str,
    link_cols: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> anyhow::Result<MovedEvents> {
    let limit = session.batch_size();
    let mut tx = session.begin().await?;
    // Lock the batch's events first, so that no link is added to them between moving the links
    // and moving the events.
    let rows: Vec<(i64, DateTime<Utc>)> = sqlx::query_as(
        "SELECT id, created_at FROM audit_events
         WHERE created_at >= $1 AND created_at < $2
         ORDER BY created_at LIMIT $3
         FOR UPDATE",
    )
    .bind(from)
    .bind(to)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await
    .context("selecting a batch of audit_events")?;
    let ids: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
    let last = rows.iter().map(|(_, at)| *at).max();
    if ids.is_empty() {
        tx.commit().await?;
        return Ok(MovedEvents {
            events: Moved {
                moved: 0,
                inserted: 0,
                last: None,
            },
            links_moved: 0,
            links_inserted: 0,
        });
    }
    let (links_moved, links_inserted) = move_by_ids(
        &mut tx,
        "audit_resources",
        "audit_event_id",
        link_cols,
        &ids,
    )
    .await
    .context("moving the resource links of an audit batch")?;
    let (moved, inserted) = move_by_ids(&mut tx, "audit_events", "id", event_cols, &ids)
        .await
        .context("moving a batch of audit_events")?;
    tx.commit().await.context("committing an audit batch")?;
    Ok(MovedEvents {
        events: Moved {
            moved: moved as u64,
            inserted: inserted as u64,
            last,
        },
        links_moved: links_moved as u64,
        links_inserted: links_inserted as u64,
    })
}

/// Moves the rows of `table` whose `key` is one of `ids` into `{table}_archive`, in one
/// statement; returns (deleted online, inserted into the archive).
async fn move_by_ids(
    tx: &mut sqlx::PgConnection,
    table: &str,
    key: &str,
    cols: &str,
    ids: &[i64],
) -> sqlx::Result<(i64, i64)> {
    sqlx::query_as(&format!(
        "WITH moved AS (
             DELETE FROM {table} WHERE {key} = ANY($1) RETURNING *
         ), inserted AS (
             INSERT INTO {table}_archive ({cols}, archived_at)
             SELECT {cols}, now() FROM moved
             ON CONFLICT (id) DO NOTHING
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM inserted)"
    ))
    .bind(ids)
    .fetch_one(tx)
    .await
}
