//! A card's timeline: its changes and failures, the integration logs and audit events about it,
//! online and archived, newest first.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// One entry of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineEntry {
    pub at: DateTime<Utc>,
    /// `integration_log` or `audit_event`.
    pub kind: &'static str,
    /// Whether the row is in an `*_archive` table.
    pub archived: bool,
    pub id: i64,
    pub correlation_id: Option<Uuid>,
    /// Log: the scenario; audit: the event type.
    pub what: String,
    /// Log: the state; audit: empty.
    pub state: Option<String>,
    /// Log: response summary / error; audit: its summary.
    pub summary: Option<String>,
    pub error: Option<String>,
    pub recovery: Option<String>,
    pub http_status: Option<i32>,
    pub duration_ms: Option<i32>,
}

type LogRow = (
    i64,
    Uuid,
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i32>,
    Option<i32>,
    DateTime<Utc>,
    bool,
);

type AuditRow = (i64, Option<Uuid>, String, String, DateTime<Utc>, bool);

/// The card's timeline, newest first (at most `limit` entries).
pub async fn timeline(
    pool: &sqlx::PgPool,
    card_ref: &str,
    limit: i64,
) -> anyhow::Result<Vec<TimelineEntry>> {
    let logs = logs(pool, card_ref, limit).await?;
    let audits = audits(pool, card_ref, limit).await?;
    let mut timeline: Vec<TimelineEntry> = logs
        .into_iter()
        .map(log_entry)
        .chain(audits.into_iter().map(audit_entry))
        .collect();
    // Newest first; on equal times the audit event (written after its log) comes first.
    timeline.sort_by(|a, b| b.at.cmp(&a.at).then(b.id.cmp(&a.id)));
    timeline.truncate(limit as usize);
    Ok(timeline)
}

/// The card's integration logs, online and archived (at most `limit` of each).
async fn logs(pool: &sqlx::PgPool, card_ref: &str, limit: i64) -> anyhow::Result<Vec<LogRow>> {
    sqlx::query_as(
        "(SELECT id, correlation_id, scenario, state, response_summary, error, recovery_summary,
                 http_status, duration_ms, created_at, false AS archived
            FROM integration_logs WHERE resource_type = 'card' AND resource_id = $1
           ORDER BY created_at DESC LIMIT $2)
         UNION ALL
         (SELECT id, correlation_id, scenario, state, response_summary, error, recovery_summary,
                 http_status, duration_ms, created_at, true AS archived
            FROM integration_logs_archive WHERE resource_type = 'card' AND resource_id = $1
           ORDER BY created_at DESC LIMIT $2)",
    )
    .bind(card_ref)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading the card's integration logs")
}

/// The card's audit events, online and archived (at most `limit` of each).
async fn audits(pool: &sqlx::PgPool, card_ref: &str, limit: i64) -> anyhow::Result<Vec<AuditRow>> {
    sqlx::query_as(
        "(SELECT e.id, e.correlation_id, e.event_type, e.summary, e.created_at, false AS archived
            FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
           WHERE r.resource_type = 'card' AND r.resource_id = $1
           ORDER BY r.created_at DESC LIMIT $2)
         UNION ALL
         (SELECT e.id, e.correlation_id, e.event_type, e.summary, e.created_at, true AS archived
            FROM audit_resources_archive r JOIN audit_events_archive e ON e.id = r.audit_event_id
           WHERE r.resource_type = 'card' AND r.resource_id = $1
           ORDER BY r.created_at DESC LIMIT $2)",
    )
    .bind(card_ref)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading the card's audit events")
}

fn log_entry(row: LogRow) -> TimelineEntry {
    let (id, cid, scenario, state, resp, error, recovery, http, dur, at, archived) = row;
    TimelineEntry {
        at,
        kind: "integration_log",
        archived,
        id,
        correlation_id: Some(cid),
        what: scenario,
        state: Some(state),
        summary: resp,
        error,
        recovery,
        http_status: http,
        duration_ms: dur,
    }
}

fn audit_entry(row: AuditRow) -> TimelineEntry {
    let (id, cid, event_type, summary, at, archived) = row;
    TimelineEntry {
        at,
        kind: "audit_event",
        archived,
        id,
        correlation_id: cid,
        what: event_type,
        state: None,
        summary: Some(summary),
        error: None,
        recovery: None,
        http_status: None,
        duration_ms: None,
    }
}
