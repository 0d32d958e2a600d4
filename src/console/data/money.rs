//! The money page: payments and approvals that need attention, and failed callbacks.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::bounded::LIST_LIMIT;
use crate::context::AppContext;
use crate::gateway::redact_digits;

/// A payment that needs attention.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StuckPayment {
    /// The payment.
    pub payment_id: uuid::Uuid,
    /// Its card.
    pub card_ref: String,
    /// Minor units.
    pub amount_minor: i64,
    /// ISO 4217.
    pub currency: String,
    /// `unknown`, or `requested`/`pending` past `payments.recovery_after_secs`.
    pub status: String,
    /// Submissions sent.
    pub submissions: i32,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// A callback that failed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FailedCallback {
    /// The channel.
    pub channel: String,
    /// Its id within the channel.
    pub callback_id: String,
    /// Why it failed (masked).
    pub reason: Option<String>,
    /// What it is about.
    pub resource_type: Option<String>,
    /// Which one.
    pub resource_id: Option<String>,
    /// The card, when the callback is about a card or a payment of one.
    pub card_ref: Option<String>,
    /// Deliveries received.
    pub deliveries: i32,
    /// Last delivery.
    pub last_received_at: DateTime<Utc>,
}

/// An approval that needs attention.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StuckApproval {
    /// The approval.
    pub approval_id: uuid::Uuid,
    /// Its card.
    pub card_ref: String,
    /// `issue`, `limit_change`, `unfreeze`.
    pub kind: String,
    /// `requested`/`pending`/`unknown` past `approvals.recovery_after_secs`, or `in_review` past
    /// `approvals.review_query_secs`.
    pub status: String,
    /// Submissions sent.
    pub submissions: i32,
    /// Last change (or last query while in review).
    pub updated_at: DateTime<Utc>,
}

/// The money page.
#[derive(Debug, Clone, Serialize)]
pub struct Money {
    /// `payments.recovery_after_secs`: past it a pending payment is overdue.
    pub threshold_secs: u64,
    /// Payments `unknown`, or still `requested`/`pending` past the threshold, oldest first.
    pub payments: Vec<StuckPayment>,
    /// Approvals undecided past `approvals.recovery_after_secs` or in review past
    /// `approvals.review_query_secs`, oldest first.
    pub approvals: Vec<StuckApproval>,
    /// Failed callbacks, newest first.
    pub callbacks: Vec<FailedCallback>,
}

/// A uuid as text that PostgreSQL's `uuid` input always accepts (32 hex digits, with or without
/// the four dashes, either case): the only stored text a page casts to `uuid`. A callback's
/// `resource_id` is stored as the channel sent it, so it may hold anything; the cast comes after
/// this match (`CASE` evaluates its result only for the branch that matched), so no stored text
/// can make a page's query fail.
pub const UUID_TEXT: &str =
    "^[0-9A-Fa-f]{8}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{12}$";

/// Reads the money page.
pub async fn money(ctx: &AppContext) -> anyhow::Result<Money> {
    let threshold_secs = ctx.config.payments.recovery_after_secs;
    let payments: Vec<StuckPayment> = sqlx::query_as(
        "SELECT payment_id, card_ref, amount_minor, currency, status, submissions, updated_at
           FROM payments
          WHERE status = 'unknown'
             OR (status IN ('requested', 'pending')
                 AND updated_at < now() - $1 * interval '1 second')
          ORDER BY updated_at LIMIT $2",
    )
    .bind(threshold_secs as f64)
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading payments that need attention")?;
    // Two range scans, of approvals_unsettled_idx and approvals_in_review_idx.
    let approvals: Vec<StuckApproval> = sqlx::query_as(
        "SELECT approval_id, card_ref, kind, status, submissions, updated_at
           FROM approvals
          WHERE (status IN ('requested', 'pending', 'unknown')
                 AND updated_at < now() - $1 * interval '1 second')
             OR (status = 'in_review' AND updated_at < now() - $2 * interval '1 second')
          ORDER BY updated_at LIMIT $3",
    )
    .bind(ctx.config.approvals.recovery_after_secs as f64)
    .bind(ctx.config.approvals.review_query_secs as f64)
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading approvals that need attention")?;
    let mut callbacks: Vec<FailedCallback> = sqlx::query_as(&format!(
        "SELECT cb.channel, cb.callback_id, cb.reason, cb.resource_type, cb.resource_id,
                CASE WHEN cb.resource_type = 'card' THEN cb.resource_id ELSE p.card_ref END
                  AS card_ref,
                cb.deliveries, cb.last_received_at
           FROM inbound_callbacks cb
           LEFT JOIN payments p
             ON p.payment_id = CASE WHEN cb.resource_type = 'payment'
                                     AND cb.resource_id ~ '{UUID_TEXT}'
                                    THEN cb.resource_id::uuid END
          WHERE cb.state = 'failed'
          ORDER BY cb.last_received_at DESC LIMIT $1"
    ))
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading failed callbacks")?;
    for c in &mut callbacks {
        c.reason = c.reason.as_deref().map(redact_digits);
    }
    Ok(Money {
        threshold_secs,
        payments,
        approvals,
        callbacks,
    })
}
