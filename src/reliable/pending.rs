//! The pending record before the call: pending **before** the call, finalised **with** the change.
//!
//! For every external call whose loss would lose money or a customer's state (payment
//! submission today, approval flows and any future money-moving call tomorrow):
//!
//! 1. [`begin_in`] writes a `pending` integration log row together with its audit event and
//!    resource link, inside the caller's transaction, beside the caller's own domain change (for
//!    example "payment status = pending"); the caller commits, and the [`Pending`] handle names
//!    that row.
//! 2. The caller makes the call. A crash here leaves the committed `pending` row as evidence.
//! 3. [`Pending::finish_in`] finalises **the same row** (`succeeded`, `failed` or `unknown`, the
//!    response summary, the error, the recovery summary, `finished_at`), with an audit event and
//!    the outbox event announcing the change, inside the transaction that makes the caller's
//!    domain change. If any part fails, nothing of it is written and the row stays `pending`, so
//!    recovery still finds the evidence.
//!
//! A handle lost with its process is rebuilt from the row id with [`Pending::reopen`], which is
//! how recovery closes the log of an attempt that died mid-call.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::storage::fault::{clean, clean_opt};
use crate::storage::records::{
    insert_audit, insert_audit_row, insert_outbox, AuditRecord, AuditRow, LogState,
};

/// What is about to be called, as the `pending` row and its audit event record it.
#[derive(Debug, Clone)]
pub struct PendingCall {
    /// The `X-Correlation-Id` the call will send (generated before the call).
    pub correlation_id: Uuid,
    /// `payment`, `approval`, …
    pub resource_type: &'static str,
    /// The payment id, …
    pub resource_id: String,
    /// What is attempted: `payment_submit`, …
    pub scenario: &'static str,
    /// What will be asked (never a PAN or CVV).
    pub request_summary: String,
    /// The audit event type of the attempt, e.g. `payment.submit_started`.
    pub audit_event: &'static str,
    /// Human-readable audit summary.
    pub audit_summary: String,
    /// Structured audit details.
    pub audit_details: Value,
}

/// How a reliable call ended, as the log row keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalState {
    /// A valid answer.
    Succeeded,
    /// The call certainly had no effect (refused before sending, rejected as invalid).
    Failed,
    /// The remote side may have acted; recovery must settle it.
    Unknown,
}

impl FinalState {
    /// The same state as an [`LogState`] (for a terminal log row written instead).
    pub fn log_state(self) -> LogState {
        match self {
            FinalState::Succeeded => LogState::Succeeded,
            FinalState::Failed => LogState::Failed,
            FinalState::Unknown => LogState::Unknown,
        }
    }

    /// The column value.
    pub fn as_str(self) -> &'static str {
        self.log_state().as_str()
    }
}

/// One outbox event announcing a change, written in the finalising transaction.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    /// `payment`, `card`, …
    pub aggregate_type: &'static str,
    /// Its id.
    pub aggregate_id: String,
    /// `payment.accepted`, …
    pub event_type: &'static str,
    /// The event body.
    pub payload: Value,
}

impl OutboxEvent {
    /// Writes it to `outbox_events`; returns the row id.
    pub async fn insert(&self, conn: &mut PgConnection) -> sqlx::Result<i64> {
        insert_outbox(
            conn,
            self.aggregate_type,
            &self.aggregate_id,
            self.event_type,
            &self.payload,
        )
        .await
    }
}

/// How the call ended and what the finalising transaction records besides the domain change.
#[derive(Debug, Clone)]
pub struct Finish {
    /// The row's final state.
    pub state: FinalState,
    /// What came back (never a PAN or CVV).
    pub response_summary: String,
    /// The HTTP status, when there was one.
    pub http_status: Option<u16>,
    /// Why it failed or is unknown.
    pub error: Option<String>,
    /// What happens next (retry in N s, recovery settles it, settled by recovery, …).
    pub recovery_summary: Option<String>,
    /// The audit event type, e.g. `payment.accepted`.
    pub audit_event: &'static str,
    /// Human-readable audit summary.
    pub audit_summary: String,
    /// Structured audit details.
    pub audit_details: Value,
    /// The event announcing the domain change. `None` only when the finalisation changes
    /// nothing in the domain (for example the payment was already settled by another path,
    /// which announced it): an unchanged fact is never announced twice.
    pub outbox: Option<OutboxEvent>,
}

/// A committed `pending` log row, waiting for its call's outcome. Finish it, or leave it for
/// recovery; dropping it does not finalise anything (that is the point).
#[must_use = "a pending call must be finished, or deliberately left for recovery"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The `integration_logs` row.
    pub log_id: i64,
    /// The correlation id the call sends.
    pub correlation_id: Uuid,
    /// Resource type of the row.
    pub resource_type: String,
    /// Resource id of the row.
    pub resource_id: String,
    /// Scenario of the row.
    pub scenario: String,
    /// When the pending row was written, on the database's clock.
    pub started_at: DateTime<Utc>,
}

/// Why a reliable-path step wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReliableError {
    /// PostgreSQL failed; the transaction was rolled back.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// The row was already finalised by another writer (e.g. recovery closed a slow attempt).
    #[error("integration log {0} is no longer pending (finalised by another writer)")]
    NotPending(i64),
    /// The caller's domain change failed; the transaction was rolled back.
    #[error("domain change: {0:#}")]
    Domain(anyhow::Error),
}

/// Step 1 inside the caller's transaction: inserts the pending row, its audit event and link.
/// Nothing is committed until the caller commits.
pub async fn begin_in(
    conn: &mut PgConnection,
    call: &PendingCall,
) -> Result<Pending, ReliableError> {
    // `started_at` on the database's clock, like the `finished_at` and `duration_ms` that
    // [`Pending::finish_in`] computes from it (possibly in another process, on another host).
    let (log_id, started_at): (i64, DateTime<Utc>) = sqlx::query_as(
        "INSERT INTO integration_logs
           (correlation_id, resource_type, resource_id, scenario, state, request_summary,
            started_at)
         VALUES ($1, $2, $3, $4, 'pending', $5, now())
         RETURNING id, started_at",
    )
    .bind(call.correlation_id)
    .bind(call.resource_type)
    .bind(&call.resource_id)
    .bind(call.scenario)
    .bind(clean(&call.request_summary))
    .fetch_one(&mut *conn)
    .await?;
    insert_audit(
        conn,
        &AuditRecord {
            event_type: call.audit_event,
            correlation_id: Some(call.correlation_id),
            summary: call.audit_summary.clone(),
            details: call.audit_details.clone(),
            resource_type: call.resource_type,
            resource_id: call.resource_id.clone(),
        },
        Some(log_id),
    )
    .await?;
    Ok(Pending {
        log_id,
        correlation_id: call.correlation_id,
        resource_type: call.resource_type.to_owned(),
        resource_id: call.resource_id.clone(),
        scenario: call.scenario.to_owned(),
        started_at,
    })
}

impl Pending {
    /// Step 3 inside the caller's transaction: finalises the row and writes the audit event,
    /// its link and the outbox event. The caller makes its domain change in the same
    /// transaction and commits.
    pub async fn finish_in(
        &self,
        conn: &mut PgConnection,
        finish: &Finish,
    ) -> Result<(), ReliableError> {
        // Finished and timed on the database's clock, the clock of the row's `started_at`: the
        // finisher may be another process on another host (recovery closing a dead attempt).
        let updated = sqlx::query(
            "UPDATE integration_logs
                SET state = $2, response_summary = $3, http_status = $4, error = $5,
                    recovery_summary = $6, finished_at = now(),
                    duration_ms = LEAST(GREATEST(
                        floor(extract(epoch FROM now() - started_at) * 1000), 0), 2147483647)::int4
              WHERE id = $1 AND state = 'pending'",
        )
        .bind(self.log_id)
        .bind(finish.state.as_str())
        .bind(clean(&finish.response_summary))
        .bind(finish.http_status.map(i32::from))
        .bind(clean_opt(finish.error.as_deref()))
        .bind(clean_opt(finish.recovery_summary.as_deref()))
        .execute(&mut *conn)
        .await?;
        if updated.rows_affected() != 1 {
            return Err(ReliableError::NotPending(self.log_id));
        }
        audit_for_row(
            conn,
            self,
            finish.audit_event,
            &finish.audit_summary,
            &finish.audit_details,
        )
        .await?;
        if let Some(event) = &finish.outbox {
            event.insert(conn).await?;
        }
        Ok(())
    }

    /// Rebuilds the handle of a row that is still `pending` (its process died mid-call), locking
    /// it for the caller's transaction. `None` when the row is gone or already finalised.
    pub async fn reopen(conn: &mut PgConnection, log_id: i64) -> sqlx::Result<Option<Pending>> {
        let row: Option<(Uuid, String, String, String, DateTime<Utc>)> = sqlx::query_as(
            "SELECT correlation_id, resource_type, resource_id, scenario, started_at
               FROM integration_logs
              WHERE id = $1 AND state = 'pending'
                FOR UPDATE",
        )
        .bind(log_id)
        .fetch_optional(conn)
        .await?;
        Ok(row.map(
            |(correlation_id, resource_type, resource_id, scenario, started_at)| Pending {
                log_id,
                correlation_id,
                resource_type,
                resource_id,
                scenario,
                started_at,
            },
        ))
    }
}

/// The audit event of a finalisation and its resource link. Like `records::insert_audit`, but
/// for a handle that may have been rebuilt from the row (its resource type is then a `String`).
async fn audit_for_row(
    conn: &mut PgConnection,
    pending: &Pending,
    event_type: &str,
    summary: &str,
    details: &Value,
) -> sqlx::Result<i64> {
    insert_audit_row(
        conn,
        AuditRow {
            event_type,
            correlation_id: Some(pending.correlation_id),
            integration_log_id: Some(pending.log_id),
            summary,
            details,
            resource_type: &pending.resource_type,
            resource_id: &pending.resource_id,
        },
    )
    .await
}
