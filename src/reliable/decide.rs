//! Applying a decision once, however it arrives.
//!
//! The POST's answer, a recovery query and a channel callback can race, in any order and from
//! different pods. Each locks the row first ([`super::table::lock`]) and then calls [`decide`]
//! inside its own transaction, so they are serialised by the row lock and each sees what the one
//! before it committed:
//! - the first **final** decision wins: the row is written and the outbox event announcing it is
//!   inserted in the caller's transaction (with the caller's integration log and audit records);
//! - the same decision again is a no-op ([`Decided::Repeated`]);
//! - a different decision after a final one is never applied: it becomes one `<kind>.conflict`
//!   audit event naming both ([`Decided::Conflict`]), logged at warn level;
//! - a valid answer that is not a decision yet (`in_review`) is written while the row is not
//!   final ([`Decided::Waiting`]), and never overrides a decision.

use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::kind::{Arrival, Kind, Row as _};
use super::pending::{FinalState, Finish, Pending, ReliableError};
use super::table;
use crate::storage::records::{insert_audit, AuditRecord};

/// What [`decide`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    /// A final decision, applied now; its outbox event is written.
    Applied,
    /// The waiting status (`in_review`), written now.
    Waiting,
    /// The row already says this (or the answer is older news than its decision): nothing
    /// written.
    Repeated,
    /// A different decision after a final one: not applied; one conflict audit event written.
    Conflict {
        /// The decision on record, which stays.
        recorded: String,
    },
}

/// Applies `status` (with the channel's reference) to the locked, current `row` inside the
/// caller's transaction (module docs). `log_id` and `correlation_id` link a conflict's audit
/// event to the record that brought it.
pub async fn decide<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    status: &str,
    channel_ref: Option<&str>,
    via: Arrival,
    trace: (Option<Uuid>, Option<i64>),
) -> sqlx::Result<Decided> {
    let current = row.status();
    if current == status {
        return Ok(Decided::Repeated);
    }
    if K::is_final(current) {
        if !K::is_final(status) {
            // "Still in review" after a decision is older news, not a different decision.
            return Ok(Decided::Repeated);
        }
        let id = row.id();
        tracing::warn!(
            resource = K::RESOURCE,
            %id,
            recorded = current,
            arrived = status,
            via = via.as_str(),
            "a different decision after a final one: not applied, kept as a conflict"
        );
        let summary = format!(
            "{} {id}: {status} arrived by {} after the final decision {current}; not applied",
            K::RESOURCE,
            via.as_str()
        );
        let details = json!({
            K::ID: id,
            "recorded": current,
            "arrived": status,
            "arrived_channel_ref": channel_ref,
            "via": via.as_str(),
        });
        insert_audit(
            conn,
            &AuditRecord {
                event_type: K::NAMES.conflict,
                correlation_id: trace.0,
                summary,
                details,
                resource_type: K::RESOURCE,
                resource_id: id.to_string(),
            },
            trace.1,
        )
        .await?;
        return Ok(Decided::Conflict {
            recorded: current.to_owned(),
        });
    }
    if !table::write_answer::<K>(conn, row.id(), status, channel_ref).await? {
        // Under the row lock the row cannot have become final since it was read.
        return Ok(Decided::Repeated);
    }
    if !K::is_final(status) {
        return Ok(Decided::Waiting);
    }
    K::decided_event(row, status, channel_ref, via)
        .insert(conn)
        .await?;
    // Not counted here: the transaction may still roll back (an attempt that lost to another
    // writer is applied again in a fresh one). The caller counts after its commit.
    Ok(Decided::Applied)
}

/// Closes the latest attempt's log if it is still `pending` (its worker died mid-call, or is
/// slower than whoever settles the row now). Returns the closed log id.
pub async fn close_open_attempt<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    state: FinalState,
    response_summary: String,
    recovery_summary: String,
) -> Result<Option<i64>, ReliableError> {
    let Some(log_id) = row.attempt_log_id() else {
        return Ok(None);
    };
    let Some(pending) = Pending::reopen(conn, log_id).await? else {
        return Ok(None);
    };
    let id = row.id();
    pending
        .finish_in(
            conn,
            &Finish {
                state,
                response_summary,
                http_status: None,
                error: (state != FinalState::Succeeded)
                    .then(|| "no answer was recorded by the attempt itself".to_owned()),
                recovery_summary: Some(recovery_summary.clone()),
                audit_event: K::NAMES.attempt_closed,
                audit_summary: format!(
                    "submission attempt log #{log_id} of {} {id} closed: {recovery_summary}",
                    K::RESOURCE
                ),
                audit_details: json!({ K::ID: id, "log_id": log_id }),
                // The decision that closes it announces itself.
                outbox: None,
            },
        )
        .await?;
    Ok(Some(log_id))
}
