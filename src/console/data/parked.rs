//! The parked page: the parked chains of a task, each with its last failed poll.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::bounded::LIST_LIMIT;
use crate::config::Task;
use crate::context::AppContext;
use crate::gateway::redact_digits;

/// One parked chain.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ParkedView {
    /// The card.
    pub card_ref: String,
    /// When it was parked.
    pub parked_at: DateTime<Utc>,
    /// When its last failed poll was recorded.
    pub failed_at: Option<DateTime<Utc>>,
    /// The last failed poll's error (masked).
    pub error: Option<String>,
    /// The last failed poll's HTTP status.
    pub http_status: Option<i32>,
}

/// The parked chains of `task` (newest parked first, at most [`LIST_LIMIT`]) and their count.
pub async fn parked(ctx: &AppContext, task: Task) -> anyhow::Result<(i64, Vec<ParkedView>)> {
    let (column, scenario) = match task {
        Task::Carddata => ("carddata_parked_at", "carddata_poll"),
        Task::CardStatus => ("card_status_parked_at", "card_status_poll"),
    };
    let total: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM cards WHERE {column} IS NOT NULL"
    ))
    .fetch_one(&ctx.pool)
    .await
    .context("counting parked chains")?;
    let mut rows: Vec<ParkedView> = sqlx::query_as(&format!(
        "SELECT c.card_ref, c.{column} AS parked_at, l.created_at AS failed_at, l.error,
                l.http_status
           FROM cards c
           LEFT JOIN LATERAL (
                SELECT created_at, error, http_status FROM integration_logs
                 WHERE resource_type = 'card' AND resource_id = c.card_ref
                   AND scenario = $1 AND state IN ('failed', 'unknown')
                 ORDER BY created_at DESC LIMIT 1) l ON true
          WHERE c.{column} IS NOT NULL
          ORDER BY c.{column} DESC LIMIT $2"
    ))
    .bind(scenario)
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading parked chains")?;
    for r in &mut rows {
        r.error = r.error.as_deref().map(redact_digits);
    }
    Ok((total, rows))
}
