//! Writers of the investigable records: integration logs, the unified audit (event + resource
//! link) and the outbox.
//!
//! Two paths write integration logs, on purpose kept apart:
//! - the **terminal** path ([`insert_terminal_log`]): one finished row, written only when a poll
//!   found a change, a failure or an unknown answer. Polling never writes a `pending` row.
//! - the **reliable** path (`crate::reliable::pending`, for money-moving calls): a `pending` row
//!   committed before the call, finalised after it.
//!
//! Every text and JSON value goes through `fault::clean` first: PostgreSQL refuses NUL, and a
//! Gateway body may carry one.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::fault::{clean, clean_json, clean_opt};

/// A finished external interaction, as the integration log keeps it.
#[derive(Debug, Clone)]
pub struct LogRecord {
    /// The `X-Correlation-Id` sent to the Gateway.
    pub correlation_id: Uuid,
    /// `card`, `payment`, `callback`.
    pub resource_type: &'static str,
    /// The card_ref, payment id, …
    pub resource_id: String,
    /// What was attempted: `carddata_poll`, `card_status_poll`, `payment_submit`, …
    pub scenario: &'static str,
    /// `succeeded`, `failed` or `unknown` (never `pending` on this path).
    pub state: LogState,
    /// What was asked.
    pub request_summary: String,
    /// What came back (never a PAN or CVV).
    pub response_summary: String,
    /// The HTTP status, when there was one.
    pub http_status: Option<u16>,
    /// Why it failed.
    pub error: Option<String>,
    /// What happens next (retry in N s, parked, …).
    pub recovery_summary: Option<String>,
    /// When the call started.
    pub started_at: DateTime<Utc>,
    /// When the answer (or its absence) was known.
    pub finished_at: DateTime<Utc>,
}

/// `integration_logs.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogState {
    /// Written before a reliable call; finalised later.
    Pending,
    /// A valid answer.
    Succeeded,
    /// A failed call.
    Failed,
    /// An answer that cannot be trusted, or none after the request was sent.
    Unknown,
}

impl LogState {
    /// The column value.
    pub fn as_str(self) -> &'static str {
        match self {
            LogState::Pending => "pending",
            LogState::Succeeded => "succeeded",
            LogState::Failed => "failed",
            LogState::Unknown => "unknown",
        }
    }
}

/// One audit event with its resource link.
#[derive(Debug, Clone)]
pub struct AuditRecord {
    /// `card.status_changed`, `poll.failed`, `poll.parked`, `payment.submitted`, …
    pub event_type: &'static str,
    /// The correlation id of the interaction it audits.
    pub correlation_id: Option<Uuid>,
    /// Human-readable.
    pub summary: String,
    /// Structured details.
    pub details: Value,
    /// The resource it is about.
    pub resource_type: &'static str,
    /// Its id.
    pub resource_id: String,
}

/// Inserts one finished integration log row. Returns its id.
pub async fn insert_terminal_log(conn: &mut PgConnection, log: &LogRecord) -> sqlx::Result<i64> {
    debug_assert!(
        log.state != LogState::Pending,
        "the terminal path never writes pending"
    );
    let duration_ms = duration_ms(log.started_at, log.finished_at);
    sqlx::query_scalar(
        "INSERT INTO integration_logs
           (correlation_id, resource_type, resource_id, scenario, state, request_summary,
            response_summary, http_status, error, recovery_summary, started_at, finished_at,
            duration_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
         RETURNING id",
    )
    .bind(log.correlation_id)
    .bind(log.resource_type)
    .bind(&log.resource_id)
    .bind(log.scenario)
    .bind(log.state.as_str())
    .bind(clean(&log.request_summary))
    .bind(clean(&log.response_summary))
    .bind(log.http_status.map(i32::from))
    .bind(clean_opt(log.error.as_deref()))
    .bind(clean_opt(log.recovery_summary.as_deref()))
    .bind(log.started_at)
    .bind(log.finished_at)
    .bind(duration_ms)
    .fetch_one(conn)
    .await
}

/// The audit writer: one event and its resource link. Called only for changes and failures.
pub async fn insert_audit(
    conn: &mut PgConnection,
    audit: &AuditRecord,
    integration_log_id: Option<i64>,
) -> sqlx::Result<i64> {
    insert_audit_row(
        conn,
        AuditRow {
            event_type: audit.event_type,
            correlation_id: audit.correlation_id,
            integration_log_id,
            summary: &audit.summary,
            details: &audit.details,
            resource_type: audit.resource_type,
            resource_id: &audit.resource_id,
        },
    )
    .await
}

/// The columns of one audit event and its resource link, borrowed.
pub(crate) struct AuditRow<'a> {
    pub(crate) event_type: &'a str,
    pub(crate) correlation_id: Option<Uuid>,
    pub(crate) integration_log_id: Option<i64>,
    pub(crate) summary: &'a str,
    pub(crate) details: &'a Value,
    pub(crate) resource_type: &'a str,
    pub(crate) resource_id: &'a str,
}

/// Writes one audit event and its resource link (the body of [`insert_audit`], shared with the
/// reliable path's `pending` record, whose rebuilt handles own their resource type).
pub(crate) async fn insert_audit_row(
    conn: &mut PgConnection,
    row: AuditRow<'_>,
) -> sqlx::Result<i64> {
    let event_id: i64 = sqlx::query_scalar(
        "INSERT INTO audit_events (event_type, correlation_id, integration_log_id, summary, details)
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(row.event_type)
    .bind(row.correlation_id)
    .bind(row.integration_log_id)
    .bind(clean(row.summary))
    .bind(clean_json(row.details).as_ref())
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query(
        "INSERT INTO audit_resources (audit_event_id, resource_type, resource_id)
         VALUES ($1, $2, $3)",
    )
    .bind(event_id)
    .bind(row.resource_type)
    .bind(row.resource_id)
    .execute(&mut *conn)
    .await?;
    Ok(event_id)
}

/// An operator's action that changed polling (spec section 6: `operator.<action>`), as its one
/// audit event records it.
#[derive(Debug, Clone)]
pub struct OperatorEvent {
    /// The action: `unpark`, `enqueue`, `budget_set`, `circuit_open`, … (event type
    /// `operator.<action>`).
    pub action: &'static str,
    /// Who: `operator:<user>` (`audit_events.actor`).
    pub actor: String,
    /// Human-readable, naming the reason when there is one.
    pub summary: String,
    /// Structured details (`reason`, the action's arguments, what it found).
    pub details: Value,
    /// `card`, `task` or `maintenance`.
    pub resource_type: &'static str,
    /// The resources it acted on (more can be linked later with [`link_resources`]).
    pub resource_ids: Vec<String>,
}

/// Writes one operator event and its resource links. Returns the event id.
pub async fn insert_operator_event(
    conn: &mut PgConnection,
    event: &OperatorEvent,
) -> sqlx::Result<i64> {
    let event_id: i64 = sqlx::query_scalar(
        "INSERT INTO audit_events (event_type, actor, summary, details)
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(format!("operator.{}", event.action))
    .bind(clean(&event.actor))
    .bind(clean(&event.summary))
    .bind(clean_json(&event.details).as_ref())
    .fetch_one(&mut *conn)
    .await?;
    link_resources(conn, event_id, event.resource_type, &event.resource_ids).await?;
    Ok(event_id)
}

/// Merges what an operator action did into its audit event (`details.outcome`), in the
/// action's transaction.
pub async fn add_operator_outcome(
    conn: &mut PgConnection,
    event_id: i64,
    outcome: &Value,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE audit_events SET details = details || jsonb_build_object('outcome', $2::jsonb)
          WHERE id = $1",
    )
    .bind(event_id)
    .bind(clean_json(outcome).as_ref())
    .execute(conn)
    .await
    .map(|_| ())
}

/// Links more resources to an audit event (one statement). Returns how many links it wrote.
pub async fn link_resources(
    conn: &mut PgConnection,
    event_id: i64,
    resource_type: &str,
    resource_ids: &[String],
) -> sqlx::Result<u64> {
    if resource_ids.is_empty() {
        return Ok(0);
    }
    let done = sqlx::query(
        "INSERT INTO audit_resources (audit_event_id, resource_type, resource_id)
         SELECT $1, $2, unnest($3::text[])",
    )
    .bind(event_id)
    .bind(resource_type)
    .bind(resource_ids)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// `integration_logs.duration_ms` of a call from `started_at` to `finished_at` (never negative,
/// saturating at the column's range).
pub(super) fn duration_ms(started_at: DateTime<Utc>, finished_at: DateTime<Utc>) -> i32 {
    (finished_at - started_at)
        .num_milliseconds()
        .clamp(0, i64::from(i32::MAX)) as i32
}

/// Inserts one outbox event, in the caller's transaction.
pub async fn insert_outbox(
    conn: &mut PgConnection,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &Value,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
         VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(aggregate_type)
    .bind(aggregate_id)
    .bind(event_type)
    .bind(clean_json(payload).as_ref())
    .fetch_one(conn)
    .await
}
