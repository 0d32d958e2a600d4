//! Operator actions are facts on record: every action that changes polling (`unpark`, `enqueue`
//! of a polling chain, `budget set|clear|pause|resume`, `maintenance pause|resume`,
//! `circuit open|close`) writes one `operator.<action>` audit event naming the action, the
//! operator (`actor` = `operator:<user>`, from env `CARDWORKER_OPERATOR`, else `USER`) and the
//! `--reason` when given, linked to the cards or tasks it acted on. `investigate` shows a card's
//! ones as its manual facts.
//!
//! The action is applied first and recorded after: a runtime brake must work while PostgreSQL is
//! down, so a record that cannot be written is reported on stderr and the command still succeeds
//! (the action took effect). `unpark` is the exception: it changes PostgreSQL itself, so its
//! record is written in the same transactions.

use anyhow::Context as _;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::config::DatabaseConfig;
use crate::storage::records::{self, OperatorEvent};

/// The operator as recorded in `audit_events.actor`.
pub fn actor() -> String {
    let who = std::env::var("CARDWORKER_OPERATOR")
        .or_else(|_| std::env::var("USER"))
        .ok()
        .filter(|w| !w.trim().is_empty())
        .unwrap_or_else(|| "unknown".to_owned());
    format!("operator:{who}")
}

/// One operator action, to be recorded.
#[derive(Debug, Clone)]
pub struct Action {
    /// `unpark`, `enqueue`, `budget_set`, … (event type `operator.<action>`).
    pub action: &'static str,
    /// `card`, `task` or `maintenance`.
    pub resource_type: &'static str,
    /// What it acted on.
    pub resource_ids: Vec<String>,
    /// What it did, for people.
    pub summary: String,
    /// The action's arguments and what it found.
    pub details: Value,
    /// `--reason`.
    pub reason: Option<String>,
}

impl Action {
    /// An action on `resource_ids` of `resource_type`, described by `summary`.
    pub fn new(
        action: &'static str,
        resource_type: &'static str,
        resource_ids: Vec<String>,
        summary: String,
        reason: Option<String>,
    ) -> Self {
        Self {
            action,
            resource_type,
            resource_ids,
            summary,
            details: json!({}),
            reason,
        }
    }

    /// With these details (merged with the reason and the operator when recorded).
    pub fn with_details(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    /// The audit event of this action.
    pub fn event(&self) -> OperatorEvent {
        let actor = actor();
        let mut details = match &self.details {
            Value::Object(map) => map.clone(),
            _ => serde_json::Map::new(),
        };
        details.insert("action".to_owned(), json!(self.action));
        details.insert("operator".to_owned(), json!(actor));
        details.insert("reason".to_owned(), json!(self.reason));
        let summary = match &self.reason {
            Some(r) => format!("{} (reason: {r})", self.summary),
            None => format!("{} (no reason given)", self.summary),
        };
        OperatorEvent {
            action: self.action,
            actor,
            summary,
            details: Value::Object(details),
            resource_type: self.resource_type,
            resource_ids: self.resource_ids.clone(),
        }
    }
}

/// Writes the action's audit event. Returns its id.
pub async fn record(pool: &PgPool, action: &Action) -> anyhow::Result<i64> {
    let mut conn = pool.acquire().await.context("connecting to PostgreSQL")?;
    records::insert_operator_event(&mut conn, &action.event())
        .await
        .with_context(|| format!("writing the operator.{} audit event", action.action))
}

/// Records an action that was already applied, on `pool`; a failure is reported on stderr.
pub async fn record_applied(pool: &PgPool, action: &Action) {
    if let Err(e) = record(pool, action).await {
        not_recorded(action, &e);
    }
}

/// Records an action that was already applied, connecting to the database first (the budget
/// and maintenance commands need no database otherwise); a failure is reported on stderr.
pub async fn record_applied_to(database: &DatabaseConfig, action: &Action) {
    match crate::storage::connect(database).await {
        Ok(pool) => {
            record_applied(&pool, action).await;
            pool.close().await;
        }
        Err(e) => not_recorded(action, &e),
    }
}

fn not_recorded(action: &Action, e: &anyhow::Error) {
    eprintln!(
        "warning: the action was applied, but its operator.{} audit event could not be \
         written: {e:#}",
        action.action
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_event_names_the_action_the_operator_and_the_reason() {
        let a = Action::new(
            "budget_pause",
            "task",
            vec!["carddata".to_owned()],
            "carddata paused".to_owned(),
            Some("gateway maintenance".to_owned()),
        )
        .with_details(json!({"tasks": ["carddata"]}));
        let e = a.event();
        assert_eq!(e.action, "budget_pause");
        assert!(e.actor.starts_with("operator:"), "{}", e.actor);
        assert_eq!(e.details["reason"], "gateway maintenance");
        assert_eq!(e.details["action"], "budget_pause");
        assert_eq!(e.details["tasks"][0], "carddata");
        assert!(
            e.summary.ends_with("(reason: gateway maintenance)"),
            "{}",
            e.summary
        );
        let none = Action::new("enqueue", "card", vec![], "x".to_owned(), None).event();
        assert_eq!(none.details["reason"], Value::Null);
        assert!(none.summary.contains("no reason given"));
    }
}
