//! Facts: audit events about polling rather than about a poll. A card's manual facts (the operator
//! actions on it: `operator.*` events with who and why) and the latest fleet-wide polling facts
//! (circuit openings and closings, budget and maintenance actions).

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::commands::operator::OUTCOME_SQL;
use crate::config::Task;

/// How many fleet-wide facts are shown.
pub const FLEET_FACTS: i64 = 10;

/// One audit event that is a fact about polling rather than about a poll.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FactView {
    pub at: DateTime<Utc>,
    pub id: i64,
    /// `operator.unpark`, `gateway.circuit_opened`, …
    pub event_type: String,
    /// `operator:<user>` for an operator action, else `cardworker`.
    pub actor: String,
    /// `--reason`, when the operator gave one.
    pub reason: Option<String>,
    pub summary: String,
    /// An operator action's outcome: `applied`, `failed`, or `unknown` (requested, with no
    /// outcome on record: check whether it took effect); `None` for other events
    /// (`super::operator::OUTCOME_SQL`).
    pub outcome: Option<String>,
    /// The resource it is linked to here (the card, a task, `maintenance`).
    pub resource_type: String,
    pub resource_id: String,
}

/// What an operator action's outcome (`FactView::outcome`) says, for people; empty for an applied
/// one and for events that are not operator actions.
pub fn outcome_note(outcome: Option<&str>) -> &'static str {
    match outcome {
        Some("unknown") => {
            "outcome unknown: requested, and no outcome on record (the process stopped or \
             PostgreSQL failed before it was written); check whether it took effect"
        }
        Some("failed") => {
            "failed: the action returned an error (in the event's details, `outcome.error`); \
             check whether it took effect before running it again"
        }
        _ => "",
    }
}

/// The operator actions on the card (`operator.*` audit events), newest first (at most `limit`).
pub async fn manual_facts(
    pool: &sqlx::PgPool,
    card_ref: &str,
    limit: i64,
) -> sqlx::Result<Vec<FactView>> {
    facts(
        pool,
        "r.resource_type = 'card' AND r.resource_id = $1 AND e.event_type LIKE 'operator.%'",
        Some(card_ref),
        limit,
    )
    .await
}

/// Audit events as facts, newest first: those whose resource link matches `filter` (which may
/// use `$1`, bound to `card_ref`), at most `limit`.
async fn facts(
    pool: &sqlx::PgPool,
    filter: &str,
    card_ref: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<FactView>> {
    sqlx::query_as(&format!(
        "SELECT e.created_at AS at, e.id, e.event_type, e.actor, e.details->>'reason' AS reason,
                e.summary, {OUTCOME_SQL} AS outcome, r.resource_type, r.resource_id
           FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
          WHERE {filter}
          ORDER BY r.created_at DESC LIMIT $2"
    ))
    .bind(card_ref)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// The latest facts about the fleet's polling (circuit transitions, budget and maintenance
/// actions): one ordered lookup of `audit_resources_resource_idx` per fleet resource (each task,
/// and maintenance), merged. A single `resource_type IN (…) ORDER BY created_at` would let the
/// planner walk the whole `created_at` index backwards looking for the rare fleet rows.
pub async fn fleet_facts(pool: &sqlx::PgPool, limit: i64) -> sqlx::Result<Vec<FactView>> {
    let resources = Task::ALL
        .iter()
        .map(|t| ("task", t.label()))
        .chain([("maintenance", "maintenance")]);
    let parts: Vec<String> = resources
        .map(|(kind, id)| {
            format!(
                "(SELECT e.created_at AS at, e.id, e.event_type, e.actor,
                         e.details->>'reason' AS reason, e.summary, {OUTCOME_SQL} AS outcome,
                         r.resource_type, r.resource_id
                    FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
                   WHERE r.resource_type = '{kind}' AND r.resource_id = '{id}'
                   ORDER BY r.created_at DESC LIMIT $1)"
            )
        })
        .collect();
    sqlx::query_as(&format!(
        "SELECT * FROM ({}) f ORDER BY at DESC LIMIT $1",
        parts.join(" UNION ALL ")
    ))
    .bind(limit)
    .fetch_all(pool)
    .await
}
