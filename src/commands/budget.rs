//! `cardworker budget show|set|clear|pause|resume` and `cardworker circuit open|close`.
//!
//! Arguments are validated before Redis is contacted, so that a bad limit or task is always a
//! usage error (exit status 2) naming the key, the value and what is allowed. Every action that
//! changes polling is recorded as an `operator.<action>` audit event (see [`super::operator`]).

use anyhow::Context as _;
use serde_json::{json, Value};

use super::args::{BudgetCommand, CircuitCommand, Format};
use super::operator::{self, Action as Recorded, Operator};
use super::CommandError;
use crate::budget::{Budget, BudgetView, CircuitState, CircuitView};
use crate::config::{Config, Task};
use crate::limit::Limit;

/// A validated `budget` subcommand (with its `--reason`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Show(Format),
    Set(Task, Limit, Option<String>),
    Clear(Task, Option<String>),
    Pause(Vec<Task>, Option<String>),
    Resume(Vec<Task>, Option<String>),
}

/// Validates a runtime override exactly like the config: a [`Limit`], at most
/// `polling.total_limit`.
pub fn validate_override(config: &Config, task: Task, raw: &str) -> Result<Limit, CommandError> {
    let key = format!("polling.{}.limit (runtime override, --limit)", task.label());
    let n: Limit = raw
        .parse()
        .map_err(|e| CommandError::Usage(format!("{key} = {raw:?}: {e}")))?;
    let total = config.polling.total_limit;
    if n > total {
        return Err(CommandError::Usage(format!(
            "{key} = {raw:?}: must be at most polling.total_limit = {total}"
        )));
    }
    Ok(n)
}

fn validate(config: &Config, cmd: BudgetCommand) -> Result<Action, CommandError> {
    Ok(match cmd {
        BudgetCommand::Show { format } => Action::Show(format),
        BudgetCommand::Set {
            task,
            limit,
            reason,
        } => Action::Set(task, validate_override(config, task, &limit)?, reason),
        BudgetCommand::Clear { task, reason } => Action::Clear(task, reason),
        BudgetCommand::Pause { task, reason } => Action::Pause(task.0, reason),
        BudgetCommand::Resume { task, reason } => Action::Resume(task.0, reason),
    })
}

fn labels(tasks: &[Task]) -> String {
    tasks
        .iter()
        .map(|t| t.label())
        .collect::<Vec<_>>()
        .join(", ")
}

fn task_ids(tasks: &[Task]) -> Vec<String> {
    tasks.iter().map(|t| t.label().to_owned()).collect()
}

/// A change to the polling budget, validated (the console's budget actions take these too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BudgetChange {
    /// A runtime per-task limit override.
    Set(Task, Limit),
    /// Clears the override.
    Clear(Task),
    /// The runtime brake on.
    Pause(Vec<Task>),
    /// The runtime brake off.
    Resume(Vec<Task>),
}

/// Runs one `budget` subcommand.
pub async fn execute(config: &Config, cmd: BudgetCommand) -> Result<(), CommandError> {
    let action = validate(config, cmd)?;
    let redis = crate::context::connect_redis(config.redis.url.expose()).await?;
    let budget = Budget::new(redis, config);
    let (change, reason) = match action {
        Action::Show(format) => {
            let view = budget.show().await?;
            match format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string(&view).context("rendering the budget")?
                ),
                Format::Text => print!("{}", render(&view)),
            }
            return Ok(());
        }
        Action::Set(task, limit, reason) => (BudgetChange::Set(task, limit), reason),
        Action::Clear(task, reason) => (BudgetChange::Clear(task), reason),
        Action::Pause(tasks, reason) => (BudgetChange::Pause(tasks), reason),
        Action::Resume(tasks, reason) => (BudgetChange::Resume(tasks), reason),
    };
    println!(
        "{}",
        change_budget(config, &budget, change, reason, &Operator::cli()).await?
    );
    Ok(())
}

/// Applies one budget change fleet-wide with its audit event
/// (`operator.budget_set|clear|pause|resume`, [`operator::carry_out_to`]: not applied when the
/// event cannot be written); returns what it did, for people. Shared by the CLI and the console.
pub async fn change_budget(
    config: &Config,
    budget: &Budget,
    change: BudgetChange,
    reason: Option<String>,
    by: &Operator,
) -> anyhow::Result<String> {
    let recorded = recorded(budget, &change, reason);
    let done = operator::carry_out_to(&config.database, &recorded, by, apply(budget, change)).await;
    Ok(done?)
}

/// The audit event of `change` (`operator.budget_set|clear|pause|resume`).
fn recorded(budget: &Budget, change: &BudgetChange, reason: Option<String>) -> Recorded {
    match change {
        BudgetChange::Set(task, limit) => Recorded::new(
            "budget_set",
            "task",
            task_ids(&[*task]),
            format!("{task} budget limit overridden to {limit}"),
            reason,
        )
        .with_details(json!({"task": task.label(), "limit": limit, "config_limit": budget.config_limit(*task)})),
        BudgetChange::Clear(task) => Recorded::new(
            "budget_clear",
            "task",
            task_ids(&[*task]),
            format!("{task} budget override cleared"),
            reason,
        )
        .with_details(json!({"task": task.label()})),
        BudgetChange::Pause(tasks) => Recorded::new(
            "budget_pause",
            "task",
            task_ids(tasks),
            format!("polling paused: {}", labels(tasks)),
            reason,
        )
        .with_details(json!({"tasks": task_ids(tasks)})),
        BudgetChange::Resume(tasks) => Recorded::new(
            "budget_resume",
            "task",
            task_ids(tasks),
            format!("polling resumed: {}", labels(tasks)),
            reason,
        )
        .with_details(json!({"tasks": task_ids(tasks)})),
    }
}

/// Carries `change` out: what it did, for people, and the details of its outcome.
async fn apply(budget: &Budget, change: BudgetChange) -> anyhow::Result<(String, Value)> {
    match change {
        BudgetChange::Set(task, limit) => {
            budget.set_override(task, limit).await?;
            let said = format!(
                "{task} limit overridden: {limit} (config {}); every worker applies it at its next acquire",
                budget.config_limit(task)
            );
            Ok((said, json!({})))
        }
        BudgetChange::Clear(task) => {
            let had = budget.clear_override(task).await?;
            let said = format!(
                "{task} override {}; the config limit {} applies",
                if had { "cleared" } else { "was not set" },
                budget.config_limit(task)
            );
            Ok((said, json!({"had_override": had})))
        }
        BudgetChange::Pause(tasks) => {
            budget.pause(&tasks).await?;
            let said = format!(
                "paused: {}; their jobs are deferred (running polls finish) until `cardworker budget resume`",
                labels(&tasks)
            );
            Ok((said, json!({})))
        }
        BudgetChange::Resume(tasks) => {
            budget.resume(&tasks).await?;
            Ok((format!("resumed: {}", labels(&tasks)), json!({})))
        }
    }
}

/// `cardworker circuit open|close --task T [--reason TEXT]`: forces the task's Gateway circuit,
/// fleet-wide, and records it (`operator.circuit_open` / `operator.circuit_close`). Forcing a
/// circuit that changes its state also writes the transition's own event
/// (`gateway.circuit_opened` / `gateway.circuit_closed`), as an opening or closing by itself
/// would.
pub async fn circuit(config: &Config, cmd: CircuitCommand) -> Result<(), CommandError> {
    let (task, open, reason) = match cmd {
        CircuitCommand::Open { task, reason } => (task, true, reason),
        CircuitCommand::Close { task, reason } => (task, false, reason),
    };
    let redis = crate::context::connect_redis(config.redis.url.expose()).await?;
    let budget = Budget::new(redis, config);
    println!(
        "{}",
        force_circuit(config, &budget, task, open, reason, &Operator::cli()).await?
    );
    Ok(())
}

/// Forces `task`'s circuit open or closed with its audit event (see [`circuit`];
/// [`operator::carry_out_to`]: not forced when the event cannot be written); returns what it
/// did, for people. Shared by the CLI and the console.
pub async fn force_circuit(
    config: &Config,
    budget: &Budget,
    task: Task,
    open: bool,
    reason: Option<String>,
    by: &Operator,
) -> anyhow::Result<String> {
    let recorded = Recorded::new(
        if open {
            "circuit_open"
        } else {
            "circuit_close"
        },
        "task",
        task_ids(&[task]),
        format!(
            "{task} Gateway circuit forced {}",
            if open { "open" } else { "closed" }
        ),
        reason,
    )
    .with_details(json!({"task": task.label()}));
    let found = operator::carry_out_to(&config.database, &recorded, by, async {
        let found = budget.force_circuit(task, open).await?;
        let outcome = json!({
            "before": found.before.label(),
            "was_forced": found.was_forced,
            "outage_ms": found.outage_ms,
        });
        Ok((found, outcome))
    })
    .await?;
    let changed = (found.before == CircuitState::Closed) == open;
    let said = if open {
        format!(
            "{task} Gateway circuit forced open (was {}): its polls are deferred without a \
             Gateway call, with no probes, until `cardworker circuit close --task {}`",
            found.before.label(),
            task.cli_name()
        )
    } else {
        format!(
            "{task} Gateway circuit forced closed (was {}{}): its polls call the Gateway again",
            found.before.label(),
            if found.was_forced {
                ", forced open"
            } else {
                ""
            }
        )
    };
    if changed {
        let written = async {
            let pool = crate::storage::connect(&config.database).await?;
            let done = crate::polling::circuit::on_forced(&pool, task, open, found.outage_ms).await;
            pool.close().await;
            done
        }
        .await;
        if let Err(e) = written {
            eprintln!("warning: the circuit was forced, but its transition event could not be written: {e:#}");
        }
    }
    Ok(said)
}

/// The text form of `budget show`.
pub fn render(view: &BudgetView) -> String {
    let mut out = format!(
        "{:<12} {:>6} {:>6} {:>6} {:>8} {:>8}  {:<6}  {}\n",
        "scope", "in_use", "kept", "limit", "config", "override", "paused", "circuit"
    );
    out.push_str(&format!(
        "{:<12} {:>6} {:>6} {:>6} {:>8} {:>8}  {:<6}  {}\n",
        "total",
        view.total.in_use,
        view.total.kept,
        view.total.limit,
        view.total.limit,
        "-",
        "-",
        "-"
    ));
    for (name, t) in &view.tasks {
        let over = match (&t.override_limit, &t.invalid_override) {
            (Some(n), _) => n.to_string(),
            (None, Some(raw)) => format!("invalid {raw:?} (ignored)"),
            (None, None) => "-".to_owned(),
        };
        out.push_str(&format!(
            "{:<12} {:>6} {:>6} {:>6} {:>8} {:>8}  {:<6}  {}\n",
            name,
            t.in_use,
            t.kept,
            t.limit,
            t.config_limit,
            over,
            if t.paused { "yes" } else { "no" },
            render_circuit(&t.circuit)
        ));
    }
    out
}

/// One circuit in `budget show`'s text form.
fn render_circuit(c: &CircuitView) -> String {
    let window = format!(
        "window {} calls, {} failed",
        c.window.calls, c.window.failures
    );
    match c.state {
        CircuitState::Closed => format!("closed ({window})"),
        state => {
            let mut s = state.label().to_owned();
            if c.forced {
                s.push_str(" (forced by an operator)");
            }
            if let Some(since) = c.since {
                s.push_str(&format!(" since {}", since.format("%Y-%m-%dT%H:%M:%SZ")));
            }
            if let Some(at) = c.probes_from {
                s.push_str(&format!(", probes from {}", at.format("%H:%M:%SZ")));
            }
            if let Some(cd) = c.cooldown_secs {
                s.push_str(&format!(", cool-down {cd} s"));
            }
            if c.reopens > 0 {
                s.push_str(&format!(", {} failed probe rounds", c.reopens));
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_is_validated_like_the_config_and_names_the_key() {
        let config = Config::default();
        for bad in ["0", "-1", "3.5", "abc", "inf", "100000", "1e9", ""] {
            let e = validate_override(&config, Task::Carddata, bad).expect_err(bad);
            assert_eq!(e.exit_code(), 2, "{e}");
            assert!(e.to_string().contains("polling.carddata.limit"), "{e}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        let e = validate_override(&config, Task::CardStatus, "9").expect_err("above total");
        assert!(
            e.to_string().contains("at most polling.total_limit = 8"),
            "{e}"
        );
        assert_eq!(
            validate_override(&config, Task::CardStatus, "8")
                .ok()
                .map(Limit::get),
            Some(8)
        );
    }
}
