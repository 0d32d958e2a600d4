//! `cardworker budget show|set|clear|pause|resume`.
//!
//! Arguments are validated before Redis is contacted, so that a bad limit or task is always a
//! usage error (exit status 2) naming the key, the value and what is allowed.

use anyhow::Context as _;

use super::args::{BudgetCommand, Format};
use super::CommandError;
use crate::budget::{Budget, BudgetView};
use crate::config::{parse_limit, Config, Task};

/// A validated `budget` subcommand.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Show(Format),
    Set(Task, u32),
    Clear(Task),
    Pause(Vec<Task>),
    Resume(Vec<Task>),
}

/// Validates a runtime override exactly like the config: an integer in 1..=256, at most
/// `polling.total_limit`.
pub fn validate_override(config: &Config, task: Task, raw: &str) -> Result<u32, CommandError> {
    let key = format!("polling.{}.limit (runtime override, --limit)", task.label());
    let n = parse_limit(raw).map_err(|e| CommandError::Usage(format!("{key} = {raw:?}: {e}")))?;
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
        BudgetCommand::Set { task, limit } => {
            Action::Set(task, validate_override(config, task, &limit)?)
        }
        BudgetCommand::Clear { task } => Action::Clear(task),
        BudgetCommand::Pause { task } => Action::Pause(task.0),
        BudgetCommand::Resume { task } => Action::Resume(task.0),
    })
}

fn labels(tasks: &[Task]) -> String {
    tasks
        .iter()
        .map(|t| t.label())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs one `budget` subcommand.
pub async fn execute(config: &Config, cmd: BudgetCommand) -> Result<(), CommandError> {
    let action = validate(config, cmd)?;
    let redis = crate::context::connect_redis(config.redis.url.expose()).await?;
    let budget = Budget::new(redis, config);
    match action {
        Action::Show(format) => {
            let view = budget.show().await?;
            match format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string(&view).context("rendering the budget")?
                ),
                Format::Text => print!("{}", render(&view)),
            }
        }
        Action::Set(task, limit) => {
            budget.set_override(task, limit).await?;
            println!(
                "{task} limit overridden: {limit} (config {}); every worker applies it at its next acquire",
                budget.config_limit(task)
            );
        }
        Action::Clear(task) => {
            let had = budget.clear_override(task).await?;
            println!(
                "{task} override {}; the config limit {} applies",
                if had { "cleared" } else { "was not set" },
                budget.config_limit(task)
            );
        }
        Action::Pause(tasks) => {
            budget.pause(&tasks).await?;
            println!(
                "paused: {}; their jobs are deferred (running polls finish) until `cardworker budget resume`",
                labels(&tasks)
            );
        }
        Action::Resume(tasks) => {
            budget.resume(&tasks).await?;
            println!("resumed: {}", labels(&tasks));
        }
    }
    Ok(())
}

/// The text form of `budget show`.
pub fn render(view: &BudgetView) -> String {
    let mut out = format!(
        "{:<12} {:>6} {:>6} {:>8} {:>8}  {}\n",
        "scope", "in_use", "limit", "config", "override", "paused"
    );
    out.push_str(&format!(
        "{:<12} {:>6} {:>6} {:>8} {:>8}  {}\n",
        "total", view.total.in_use, view.total.limit, view.total.limit, "-", "-"
    ));
    for (name, t) in &view.tasks {
        let over = match (&t.override_limit, &t.invalid_override) {
            (Some(n), _) => n.to_string(),
            (None, Some(raw)) => format!("invalid {raw:?} (ignored)"),
            (None, None) => "-".to_owned(),
        };
        out.push_str(&format!(
            "{:<12} {:>6} {:>6} {:>8} {:>8}  {}\n",
            name,
            t.in_use,
            t.limit,
            t.config_limit,
            over,
            if t.paused { "yes" } else { "no" }
        ));
    }
    out
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
            validate_override(&config, Task::CardStatus, "8").ok(),
            Some(8)
        );
    }
}
