//! Operator actions are facts on record: every action that changes polling or money (`unpark`,
//! `enqueue` of a polling chain or an approval, `budget set|clear|pause|resume`, `maintenance
//! pause|resume`, `circuit open|close`, the dead set) writes one `operator.<action>` audit event
//! naming the action, who did it ([`Operator`]: `actor` = `operator:<name>`, and `via` = `cli` or
//! `console`) and the `--reason` when given, linked to the cards or tasks it acted on.
//! `investigate` shows a card's ones as its manual facts.
//!
//! No action stands without its record ([`carry_out`]), in three steps:
//! 1. the event is committed with `details.outcome.status = "requested"` before anything is
//!    done; an event that cannot be written means the action is not carried out, and the command
//!    (or the console page) says so;
//! 2. the action is carried out (in Redis);
//! 3. its outcome is written on the same event: `details.outcome` becomes
//!    `{"status": "applied", …what the action found}`, or `{"status": "failed", "error": …}`.
//!
//! A process that dies, or a PostgreSQL that fails, between steps 1 and 3 leaves the event
//! `requested`: its outcome is unknown, and `investigate` and the console say so
//! ([`OUTCOME_SQL`]), so that the operator checks whether it took effect. Such a command exits 1
//! saying so, and logs the event at error level.

use std::future::Future;

use anyhow::Context as _;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::config::DatabaseConfig;
use crate::storage::records::{self, OperatorEvent};

/// Where an operator acted from (`details.via` of the audit event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// The command line.
    Cli,
    /// The console (`cardworker console`).
    Console,
}

impl Surface {
    /// The recorded value.
    pub fn as_str(self) -> &'static str {
        match self {
            Surface::Cli => "cli",
            Surface::Console => "console",
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
    pub via: Surface,
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
            via: Surface::Cli,
        }
    }

    /// The operator logged in to the console under `name`.
    pub fn console(name: &str) -> Self {
        Self {
            name: name.trim().to_owned(),
            via: Surface::Console,
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

/// What `investigate` and the console show as an operator event's outcome, as an SQL expression
/// over the audit event `e`: `applied`, `failed` or `unknown` (requested, and no outcome on
/// record: the process stopped, or PostgreSQL failed, between the action and its outcome); NULL
/// for an event that is not an operator action. An operator event without `details.outcome.status`
/// committed together with its action (`unpark`, which changes PostgreSQL first), so it is
/// `applied`. It reads JSON only with `->` and `->>`, which never fail on a value of another shape.
pub const OUTCOME_SQL: &str = "CASE WHEN e.event_type LIKE 'operator.%' THEN \
     CASE e.details->'outcome'->>'status' WHEN 'requested' THEN 'unknown' \
     WHEN 'failed' THEN 'failed' ELSE 'applied' END END";

/// How many times an action's outcome is written before it is left `requested` (unknown).
const OUTCOME_ATTEMPTS: u32 = 3;

/// Why an action was not carried out, or was carried out without its outcome on record.
#[derive(Debug, thiserror::Error)]
pub enum NotRecorded {
    /// Its request could not be recorded: the action was not carried out.
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
    /// The action itself failed; its event says so (`failed`) when PostgreSQL took that.
    #[error("{0:#}")]
    Failed(anyhow::Error),
    /// The action was carried out, but its outcome could not be written: its event stays
    /// `requested`, outcome unknown.
    #[error(
        "outcome unknown: the action was carried out, but its outcome could not be recorded \
         ({error:#}); its operator.{action} audit event #{event_id} stays requested, so \
         investigate and the console show its outcome as unknown; the outcome is in this \
         process's error log"
    )]
    OutcomeUnknown {
        /// The action.
        action: &'static str,
        /// The event that stays `requested`.
        event_id: i64,
        /// What PostgreSQL said.
        error: anyhow::Error,
    },
}

/// Carries out one operator action with its audit event (module docs): commits the event of
/// `action` by `by` as `requested` on `pool`, runs `apply` (which returns what it did and the
/// outcome's details), and writes the outcome on the event (`applied` with those details, or
/// `failed` with the error). `apply` has not started before the request is committed (a future
/// does nothing until polled).
pub async fn carry_out<T, F>(
    pool: &PgPool,
    action: &Action,
    by: &Operator,
    apply: F,
) -> Result<T, NotRecorded>
where
    F: Future<Output = anyhow::Result<(T, Value)>>,
{
    let mut event = action.event(by);
    if let Value::Object(details) = &mut event.details {
        details.insert("outcome".to_owned(), json!({"status": "requested"}));
    }
    let id = request(pool, &event)
        .await
        .map_err(|error| NotRecorded::NotCarriedOut {
            action: action.action,
            error,
        })?;
    let (done, outcome) = match apply.await {
        Ok((value, found)) => (Ok(value), applied(found)),
        Err(e) => {
            let outcome = json!({"status": "failed", "error": format!("{e:#}")});
            (Err(e), outcome)
        }
    };
    if let Err(error) = record_outcome(pool, id, &outcome).await {
        tracing::error!(
            event_id = id,
            event_type = %format!("operator.{}", action.action),
            actor = %event.actor,
            summary = %event.summary,
            details = %event.details,
            outcome = %outcome,
            error = %format!("{error:#}"),
            "an operator action's outcome could not be recorded; its audit event stays requested \
             (outcome unknown)"
        );
        return match done {
            Ok(_) => Err(NotRecorded::OutcomeUnknown {
                action: action.action,
                event_id: id,
                error,
            }),
            Err(e) => Err(NotRecorded::Failed(e.context(format!(
                "the action failed, and its operator.{} audit event #{id} stays requested \
                 (outcome unknown): recording the failure failed too ({error:#})",
                action.action
            )))),
        };
    }
    done.map_err(NotRecorded::Failed)
}

/// Step 1: the event, committed as `requested`. Returns its id.
async fn request(pool: &PgPool, event: &OperatorEvent) -> anyhow::Result<i64> {
    let mut tx = pool.begin().await.context("connecting to PostgreSQL")?;
    let id = records::insert_operator_event(&mut tx, event)
        .await
        .context("writing the event")?;
    tx.commit().await.context("committing the event")?;
    Ok(id)
}

/// `{"status": "applied", …}` with what the action found (an object's fields, else under
/// `value`).
fn applied(found: Value) -> Value {
    let mut outcome = serde_json::Map::new();
    outcome.insert("status".to_owned(), json!("applied"));
    match found {
        Value::Object(fields) => {
            for (k, v) in fields {
                if k != "status" {
                    outcome.insert(k, v);
                }
            }
        }
        Value::Null => {}
        other => {
            outcome.insert("value".to_owned(), other);
        }
    }
    Value::Object(outcome)
}

/// Step 3: the outcome on event `id`, a few attempts apart (PostgreSQL may be restarting).
async fn record_outcome(pool: &PgPool, id: i64, outcome: &Value) -> anyhow::Result<()> {
    let mut attempt = 1;
    loop {
        let written = async {
            let mut conn = pool.acquire().await.context("connecting to PostgreSQL")?;
            records::add_operator_outcome(&mut conn, id, outcome)
                .await
                .context("writing the outcome")
        }
        .await;
        match written {
            Ok(()) => return Ok(()),
            Err(e) if attempt >= OUTCOME_ATTEMPTS => return Err(e),
            Err(e) => {
                tracing::warn!(event_id = id, attempt, error = %format!("{e:#}"), "writing an operator action's outcome failed; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(250 << attempt)).await;
                attempt += 1;
            }
        }
    }
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
