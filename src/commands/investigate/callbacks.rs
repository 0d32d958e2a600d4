//! The callbacks about a card, one of its payments or one of its approvals (their bodies are not
//! shown).

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

/// The callbacks about a card (`$1`) or one of its payments, newest first (at most `$2`).
///
/// Both halves are lookups of `inbound_callbacks_resource_idx` (resource_type, resource_id), OR-ed
/// into one bitmap scan: the card's own rows, and its payments' rows, whose ids are collected
/// first by `ARRAY(SELECT …)` so that `resource_id = ANY (…)` is an index condition. Written as
/// `resource_id IN (SELECT …)`, the payment half cannot use the index: the planner then reads
/// every callback (a parallel seq scan of the whole table to return a few rows;
/// docs/BENCHMARKS.md "bench-plans").
pub const CALLBACKS_SQL: &str =
    "SELECT channel, callback_id, state, reason, resource_type, resource_id, deliveries,
        first_received_at, last_received_at, applied_at
   FROM inbound_callbacks
  WHERE (resource_type = 'card' AND resource_id = $1)
     OR (resource_type = 'payment'
         AND resource_id = ANY (ARRAY(SELECT payment_id::text FROM payments WHERE card_ref = $1)))
     OR (resource_type = 'approval'
         AND resource_id = ANY (ARRAY(SELECT approval_id::text FROM approvals WHERE card_ref = $1)))
  ORDER BY last_received_at DESC LIMIT $2";

/// One inbound callback (the body is not shown).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct CallbackView {
    pub channel: String,
    pub callback_id: String,
    pub state: String,
    pub reason: Option<String>,
    pub resource_type: Option<String>,
    pub resource_id: Option<String>,
    pub deliveries: i32,
    pub first_received_at: DateTime<Utc>,
    pub last_received_at: DateTime<Utc>,
    pub applied_at: Option<DateTime<Utc>>,
}

/// The callbacks about the card, its payments or its approvals, newest first (at most `limit`).
pub async fn callbacks(
    pool: &sqlx::PgPool,
    card_ref: &str,
    limit: i64,
) -> anyhow::Result<Vec<CallbackView>> {
    sqlx::query_as(CALLBACKS_SQL)
        .bind(card_ref)
        .bind(limit)
        .fetch_all(pool)
        .await
        .context("reading the card's callbacks")
}
