//! A card's payments and approvals, each approval with its history of audit events.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::commands::operator::OUTCOME_SQL;

/// Audit events kept per approval in `investigate` (its history), at most.
pub const APPROVAL_HISTORY: usize = 20;

/// One payment.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct PaymentView {
    pub payment_id: Uuid,
    pub amount_minor: i64,
    pub currency: String,
    pub status: String,
    pub channel_ref: Option<String>,
    pub submissions: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One approval and its history.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ApprovalView {
    pub approval_id: Uuid,
    pub kind: String,
    pub amount_minor: Option<i64>,
    pub status: String,
    pub channel_ref: Option<String>,
    pub submissions: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Its audit events (submission, answers, recovery, callbacks, conflicts), oldest first.
    #[sqlx(skip)]
    pub history: Vec<ApprovalEvent>,
}

/// One event of an approval's history.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ApprovalEvent {
    #[serde(skip)]
    pub resource_id: String,
    pub at: DateTime<Utc>,
    pub event_type: String,
    pub summary: String,
    /// An operator action's outcome (`enqueue_approval`), as [`FactView::outcome`](super::facts::FactView::outcome).
    pub outcome: Option<String>,
}

/// The card's payments, newest first (at most `limit`).
pub async fn payments(
    pool: &sqlx::PgPool,
    card_ref: &str,
    limit: i64,
) -> anyhow::Result<Vec<PaymentView>> {
    sqlx::query_as(
        "SELECT payment_id, amount_minor, currency, status, channel_ref, submissions, created_at,
                updated_at
           FROM payments WHERE card_ref = $1 ORDER BY created_at DESC LIMIT $2",
    )
    .bind(card_ref)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading the card's payments")
}

/// The card's approvals, newest first (at most `limit`), each with its latest
/// [`APPROVAL_HISTORY`] audit events, oldest first.
pub async fn approvals(
    pool: &sqlx::PgPool,
    card_ref: &str,
    limit: i64,
) -> anyhow::Result<Vec<ApprovalView>> {
    let mut approvals: Vec<ApprovalView> = sqlx::query_as(
        "SELECT approval_id, kind, amount_minor, status, channel_ref, submissions, created_at,
                updated_at
           FROM approvals WHERE card_ref = $1 ORDER BY created_at DESC LIMIT $2",
    )
    .bind(card_ref)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading the card's approvals")?;
    if !approvals.is_empty() {
        add_history(pool, &mut approvals).await?;
    }
    Ok(approvals)
}

/// Adds each approval's latest [`APPROVAL_HISTORY`] audit events to its history, oldest first.
async fn add_history(pool: &sqlx::PgPool, approvals: &mut [ApprovalView]) -> anyhow::Result<()> {
    // One lookup of audit_resources_resource_idx per approval (both leading columns pinned),
    // each bounded to the approval's latest APPROVAL_HISTORY events.
    let ids: Vec<String> = approvals
        .iter()
        .map(|a| a.approval_id.to_string())
        .collect();
    let events: Vec<ApprovalEvent> = sqlx::query_as(&format!(
        "SELECT h.resource_id, h.at, h.event_type, h.summary, h.outcome
           FROM unnest($1::text[]) AS ids(id)
           CROSS JOIN LATERAL (
                SELECT r.resource_id, e.created_at AS at, e.event_type, e.summary,
                       {OUTCOME_SQL} AS outcome
                  FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
                 WHERE r.resource_type = 'approval' AND r.resource_id = ids.id
                 ORDER BY r.created_at DESC LIMIT $2) h
          ORDER BY h.at DESC"
    ))
    .bind(&ids)
    .bind(APPROVAL_HISTORY as i64)
    .fetch_all(pool)
    .await
    .context("reading the history of the card's approvals")?;
    for event in events.into_iter().rev() {
        if let Some(a) = approvals
            .iter_mut()
            .find(|a| a.approval_id.to_string() == event.resource_id)
        {
            a.history.push(event);
        }
    }
    Ok(())
}
