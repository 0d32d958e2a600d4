//! Operator actions are facts on record: every action that changes polling or money (`unpark`,
//! `enqueue` of a polling chain or an approval, `budget set|clear|pause|resume`, `maintenance
//! pause|resume`, `circuit open|close`, the dead set) writes one `operator.<action>` audit event
//! naming the action, who did it ([`Operator`]: `actor` = `operator:<name>`, and `via` = `cli` or
//! `console`) and the `--reason` when given, linked to the cards or tasks it acted on.
//! `investigate` shows a card's ones as its manual facts.
//!
//! The action and its audit event commit together, or neither happens ([`carry_out`]): the event
//! is written first, in a transaction, then the action is applied (in Redis, or in the same
//! transaction), then the transaction commits. An event that cannot be written means the action
//! is not carried out, and the command (or the console page) says so. Only a commit that fails
//! after the action was applied in Redis can leave an action without its event; that is said
//! (exit 1) and logged at error level with the whole event.

use std::future::Future;

use anyhow::Context as _;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::config::DatabaseConfig;
use crate::storage::records::{self, OperatorEvent};

/// Where an operator acted from (`details.via` of the audit event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The command line.
    Cli,
    /// The console (`cardworker console`).
    Console,
}

impl Via {
    /// The recorded value.
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Cli => "cli",
            Via::Console => "console",
        }
    }
}

/// Who carried out an action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    /// The person: the console's login name; for the CLI env `CARDWORKER_OPERATOR`, else the OS
    /// user.
    pub name: String,
    /// Where from.
    pub via: Via,
}

impl Operator {
    /// The operator of this command line: env `CARDWORKER_OPERATOR`, else the OS user (`USER`,
    /// `LOGNAME`), else `unknown`.
    pub fn cli() -> Self {
        let name = ["CARDWORKER_OPERATOR", "USER", "LOGNAME"]
            .iter()
            .filter_map(|k| std::env::var(k).ok())
            .map(|w| w.trim().to_owned())
            .find(|w| !w.is_empty())
            .unwrap_or_else(|| "unknown".to_owned());
        Self {
            name,
            via: Via::Cli,
        }
    }

    /// The operator logged in to the console under `name`.
    pub fn console(name: &str) -> Self {
        Self {
            name: name.trim().to_owned(),
            via: Via::Console,
        }
    }

    /// `audit_events.actor`: `operator:<name>`.
    pub fn actor(&self) -> String {
        format!("operator:{}", self.name)
    }
}

/// One operator action, to be recorded.
#[derive(Debug, Clone)]
pub struct Action {
    /// `unpark`, `enqueue`, `budget_set`, … (event type `operator.<action>`).
    pub action: &'static str,
    /// `card`, `task`, `queue`, `approval` or `maintenance`.
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

    /// The audit event of this action, carried out by `by`.
    pub fn event(&self, by: &Operator) -> OperatorEvent {
        let actor = by.actor();
        let mut details = match &self.details {
            Value::Object(map) => map.clone(),
            _ => serde_json::Map::new(),
        };
        details.insert("action".to_owned(), json!(self.action));
        details.insert("operator".to_owned(), json!(actor));
        details.insert("via".to_owned(), json!(by.via.as_str()));
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

/// Why an action was not carried out, or was carried out without its record.
#[derive(Debug, thiserror::Error)]
pub enum NotRecorded {
    /// The audit event could not be written: the action was not carried out.
    #[error(
        "not carried out: its operator.{action} audit event could not be written ({error:#}); \
         nothing was changed"
    )]
    NotCarriedOut {
        /// The action.
        action: &'static str,
        /// What PostgreSQL said.
        error: anyhow::Error,
    },
    /// The action itself failed: its audit event was rolled back.
    #[error("{0:#}")]
    Failed(anyhow::Error),
    /// The action was applied in Redis, but the transaction of its audit event did not commit.
    #[error(
        "the action was applied, but its operator.{action} audit event could not be committed \
         ({error:#}); the event is in this process's error log"
    )]
    Unrecorded {
        /// The action.
        action: &'static str,
        /// What PostgreSQL said.
        error: anyhow::Error,
    },
}

/// Carries out one operator action with its audit event (module docs): writes the event of
/// `action` by `by` in a transaction on `pool`, runs `apply` (which returns what it did and the
/// outcome's details, merged into the event), and commits. `apply` has not started before the
/// event is written (a future does nothing until polled), and the transaction is rolled back if
/// it fails.
pub async fn carry_out<T, F>(
    pool: &PgPool,
    action: &Action,
    by: &Operator,
    apply: F,
) -> Result<T, NotRecorded>
where
    F: Future<Output = anyhow::Result<(T, Value)>>,
{
    let not_written = |error: anyhow::Error| NotRecorded::NotCarriedOut {
        action: action.action,
        error,
    };
    let event = action.event(by);
    let mut tx = pool
        .begin()
        .await
        .context("connecting to PostgreSQL")
        .map_err(not_written)?;
    let id = records::insert_operator_event(&mut tx, &event)
        .await
        .context("writing the event")
        .map_err(not_written)?;
    let (value, outcome) = match apply.await {
        Ok(done) => done,
        Err(e) => {
            let _ = tx.rollback().await;
            return Err(NotRecorded::Failed(e));
        }
    };
    let committed = async {
        if outcome.as_object().is_some_and(|o| !o.is_empty()) {
            records::add_operator_outcome(&mut tx, id, &outcome).await?;
        }
        tx.commit().await
    }
    .await;
    if let Err(e) = committed {
        tracing::error!(
            event_type = %format!("operator.{}", action.action),
            actor = %event.actor,
            summary = %event.summary,
            details = %event.details,
            outcome = %outcome,
            error = %e,
            "an operator action was applied but its audit event could not be committed"
        );
        return Err(NotRecorded::Unrecorded {
            action: action.action,
            error: e.into(),
        });
    }
    Ok(value)
}

/// [`carry_out`], connecting to the database first (the budget, circuit and maintenance commands
/// need no database otherwise).
pub async fn carry_out_to<T, F>(
    database: &DatabaseConfig,
    action: &Action,
    by: &Operator,
    apply: F,
) -> Result<T, NotRecorded>
where
    F: Future<Output = anyhow::Result<(T, Value)>>,
{
    let pool =
        crate::storage::connect(database)
            .await
            .map_err(|error| NotRecorded::NotCarriedOut {
                action: action.action,
                error,
            })?;
    let done = carry_out(&pool, action, by, apply).await;
    pool.close().await;
    done
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
        let by = Operator::console("Ada Lovelace");
        let e = a.event(&by);
        assert_eq!(e.action, "budget_pause");
        assert_eq!(e.actor, "operator:Ada Lovelace");
        assert_eq!(e.details["via"], "console");
        assert_eq!(e.details["reason"], "gateway maintenance");
        assert_eq!(e.details["action"], "budget_pause");
        assert_eq!(e.details["tasks"][0], "carddata");
        assert!(
            e.summary.ends_with("(reason: gateway maintenance)"),
            "{}",
            e.summary
        );
        let none =
            Action::new("enqueue", "card", vec![], "x".to_owned(), None).event(&Operator::cli());
        assert_eq!(none.details["via"], "cli");
        assert_eq!(none.details["reason"], Value::Null);
        assert!(none.summary.contains("no reason given"));
    }
}
