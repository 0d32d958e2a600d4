//! The `payments` table: reads, settlement, and closing a submission attempt's open log.
//!
//! Every writer of a payment (the submission attempt, recovery, a `payment.result` callback)
//! locks the payment row first and the integration log second, so that they serialise without
//! deadlocks.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sqlx::{FromRow, PgConnection, PgExecutor};
use uuid::Uuid;

use crate::gateway::PaymentStatus;
use crate::storage::reliable::{FinalState, Finish, OutboxEvent, Pending, ReliableError};

/// One payment, as stored.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, Serialize)]
pub struct Payment {
    /// Also the Gateway's `Idempotency-Key`, always.
    pub payment_id: Uuid,
    /// The card paid with.
    pub card_ref: String,
    /// Amount in minor units.
    pub amount_minor: i64,
    /// ISO currency.
    pub currency: String,
    /// `requested`, `pending`, `accepted`, `rejected` or `unknown`.
    pub status: String,
    /// The channel's reference once settled.
    pub channel_ref: Option<String>,
    /// Submissions sent to the Gateway.
    pub submissions: i32,
    /// The `pending` log of the latest submission attempt (closed once the attempt ends).
    pub attempt_log_id: Option<i64>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed (recovery picks unsettled payments by it).
    pub updated_at: DateTime<Utc>,
}

impl Payment {
    /// Accepted or rejected: the Gateway decided, and the payment is never submitted again.
    pub fn is_settled(&self) -> bool {
        is_settled(&self.status)
    }
}

/// Whether a status value is final.
pub fn is_settled(status: &str) -> bool {
    matches!(status, "accepted" | "rejected")
}

const COLUMNS: &str = "payment_id, card_ref, amount_minor, currency, status, channel_ref, \
                       submissions, attempt_log_id, created_at, updated_at";

/// Loads one payment (`None` when unknown).
pub async fn load<'e>(
    exec: impl PgExecutor<'e>,
    payment_id: Uuid,
) -> sqlx::Result<Option<Payment>> {
    sqlx::query_as::<_, Payment>(&format!(
        "SELECT {COLUMNS} FROM payments WHERE payment_id = $1"
    ))
    .bind(payment_id)
    .fetch_optional(exec)
    .await
}

/// Loads and locks one payment for the caller's transaction.
pub async fn lock(conn: &mut PgConnection, payment_id: Uuid) -> sqlx::Result<Option<Payment>> {
    sqlx::query_as::<_, Payment>(&format!(
        "SELECT {COLUMNS} FROM payments WHERE payment_id = $1 FOR UPDATE"
    ))
    .bind(payment_id)
    .fetch_optional(conn)
    .await
}

/// Settles the payment with the Gateway's decision unless it is settled already. Returns
/// whether this call changed it. A settled payment is never overwritten: the Gateway answers
/// idempotently, so a second decision can only repeat the first (or reveal a conflict, which
/// the caller records).
pub async fn settle(
    conn: &mut PgConnection,
    payment_id: Uuid,
    status: PaymentStatus,
    channel_ref: &str,
) -> sqlx::Result<bool> {
    let done = sqlx::query(
        "UPDATE payments SET status = $2, channel_ref = $3, updated_at = now()
          WHERE payment_id = $1 AND status NOT IN ('accepted', 'rejected')",
    )
    .bind(payment_id)
    .bind(status.as_str())
    .bind(channel_ref)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Sets a non-final status, but only while `attempt_log_id` is still the latest attempt and the
/// payment is still `pending`: an older attempt's failure never overrides a newer attempt or a
/// settlement. Returns whether it changed the payment.
pub async fn mark_attempt_outcome(
    conn: &mut PgConnection,
    payment_id: Uuid,
    attempt_log_id: i64,
    status: &'static str,
) -> sqlx::Result<bool> {
    debug_assert!(matches!(status, "requested" | "unknown"));
    let done = sqlx::query(
        "UPDATE payments SET status = $3, updated_at = now()
          WHERE payment_id = $1 AND attempt_log_id = $2 AND status = 'pending'",
    )
    .bind(payment_id)
    .bind(attempt_log_id)
    .bind(status)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Moves an unsettled payment to the back of recovery's line (its `updated_at` orders the
/// `payments_unsettled_idx` scan), so that one payment the Gateway cannot answer for does not
/// starve the others of a bounded batch.
pub async fn touch(conn: &mut PgConnection, payment_id: Uuid) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE payments SET updated_at = now()
          WHERE payment_id = $1 AND status IN ('requested', 'pending', 'unknown')",
    )
    .bind(payment_id)
    .execute(conn)
    .await
    .map(|_| ())
}

/// The Gateway never saw the payment (recovery's query answered 404): nothing is open any more, so
/// it is `requested` again (and at the back of recovery's line) for its resubmission.
pub async fn reopen_for_resubmission(
    conn: &mut PgConnection,
    payment_id: Uuid,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE payments SET status = 'requested', updated_at = now()
          WHERE payment_id = $1 AND status IN ('requested', 'pending', 'unknown')",
    )
    .bind(payment_id)
    .execute(conn)
    .await
    .map(|_| ())
}

/// `enqueue payment`'s commit before the enqueue: a `requested` payment is touched, so that
/// recovery, which resubmits `requested` payments untouched for `payments.recovery_after_secs`,
/// counts from now (the job just enqueued is the one expected). Returns the payment's status.
pub async fn touch_requested<'e>(
    exec: impl PgExecutor<'e>,
    payment_id: Uuid,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "UPDATE payments SET updated_at = CASE WHEN status = 'requested' THEN now() ELSE updated_at END
          WHERE payment_id = $1
      RETURNING status",
    )
    .bind(payment_id)
    .fetch_optional(exec)
    .await
}

/// Closes the latest attempt's log if it is still `pending` (its worker died mid-call, or is
/// slower than whoever settles the payment now). Returns the closed log id.
pub async fn close_open_attempt(
    conn: &mut PgConnection,
    payment: &Payment,
    state: FinalState,
    response_summary: String,
    recovery_summary: String,
) -> Result<Option<i64>, ReliableError> {
    let Some(log_id) = payment.attempt_log_id else {
        return Ok(None);
    };
    let Some(pending) = Pending::reopen(conn, log_id).await? else {
        return Ok(None);
    };
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
                audit_event: "payment.attempt_closed",
                audit_summary: format!(
                    "submission attempt log #{log_id} of payment {} closed: {recovery_summary}",
                    payment.payment_id
                ),
                audit_details: json!({ "payment_id": payment.payment_id, "log_id": log_id }),
                // The settlement that closes it announces itself.
                outbox: None,
            },
        )
        .await?;
    Ok(Some(log_id))
}

/// The outbox event of a settlement.
pub fn settled_event(
    payment: &Payment,
    status: PaymentStatus,
    channel_ref: &str,
    source: &str,
) -> OutboxEvent {
    OutboxEvent {
        aggregate_type: "payment",
        aggregate_id: payment.payment_id.to_string(),
        event_type: match status {
            PaymentStatus::Accepted => "payment.accepted",
            PaymentStatus::Rejected => "payment.rejected",
        },
        payload: json!({
            "payment_id": payment.payment_id,
            "card_ref": payment.card_ref,
            "amount_minor": payment.amount_minor,
            "currency": payment.currency,
            "status": status.as_str(),
            "channel_ref": channel_ref,
            "source": source,
        }),
    }
}
