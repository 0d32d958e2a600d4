//! The command line (spec section 2). Every subcommand takes `--config FILE` after its own
//! arguments; without it, env `CARDWORKER_CONFIG`, and without that the built-in defaults.
//!
//! Exit status: 0 success; 2 invalid configuration or usage (the message names the key, the
//! value and what is allowed); 1 any other failure.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::Task;

/// cardworker: the card platform's background worker.
#[derive(Debug, Parser)]
#[command(name = "cardworker", version, about)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
    /// Configuration file (TOML). Defaults to env CARDWORKER_CONFIG, then built-in defaults.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

/// Output format of the reporting commands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// For people.
    #[default]
    Text,
    /// For scripts.
    Json,
}

/// Every subcommand.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Runs every worker of this process and the HTTP endpoint (metrics, health).
    Run,
    /// Applies the embedded database migrations (idempotent).
    Migrate,
    /// Validates the configuration and prints the effective values, secrets redacted.
    CheckConfig {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Hands one job to the workers.
    #[command(subcommand)]
    Enqueue(EnqueueCommand),
    /// Runs reconcile passes now until every card that should be polled has a chain.
    Reconcile {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Archive and retention: the runtime brake shared by every pod, and their status.
    #[command(subcommand)]
    Maintenance(MaintenanceCommand),
    /// Polling budgets: show, override, pause.
    #[command(subcommand)]
    Budget(BudgetCommand),
    /// Shows what is on record for one card.
    Investigate {
        /// The card.
        #[arg(long)]
        card_ref: String,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// A Gateway simulator speaking the Gateway contract, for local runs and load tests.
    GatewaySim(SimArgs),
}

/// `cardworker enqueue …`
#[derive(Debug, Subcommand)]
pub enum EnqueueCommand {
    /// Starts or restarts one card's card-data polling chain (also a parked one).
    Carddata {
        /// The card.
        #[arg(long)]
        card_ref: String,
    },
    /// Starts or restarts one card's card_status polling chain (also a parked one).
    #[command(name = "card_status", alias = "card-status")]
    CardStatus {
        /// The card.
        #[arg(long)]
        card_ref: String,
    },
    /// Submits one payment row through the reliable path.
    Payment {
        /// `payments.payment_id`.
        #[arg(long)]
        payment_id: uuid::Uuid,
    },
    /// Hands one channel callback to the callback job, as the ingress would.
    Callback {
        /// The channel name.
        #[arg(long)]
        channel: String,
        /// The callback id, unique within the channel.
        #[arg(long)]
        callback_id: String,
        /// File holding the JSON body.
        #[arg(long)]
        body_file: PathBuf,
    },
    /// Enqueues one archive run (a no-op while maintenance is off).
    Archive,
    /// Enqueues one retention run (a no-op while maintenance is off).
    Retention,
}

/// `cardworker maintenance …`
#[derive(Debug, Subcommand)]
pub enum MaintenanceCommand {
    /// Stops a running run at its next batch boundary; later runs are no-ops until resumed.
    Pause,
    /// Lifts the pause.
    Resume,
    /// Shows the switch, the brake, and per job the last day processed and the backlog (due
    /// days, measured now by bounded index probes; also while maintenance is off).
    Status {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

/// `cardworker budget …`
#[derive(Debug, Subcommand)]
pub enum BudgetCommand {
    /// Shows total and per-task limits and the tokens in use, fleet-wide.
    Show {
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Sets a runtime per-task limit override (validated like the config).
    Set {
        /// The task.
        #[arg(long, value_enum)]
        task: Task,
        /// An integer in 1..=256, at most the total limit.
        #[arg(long, allow_hyphen_values = true)]
        limit: String,
    },
    /// Clears a runtime per-task limit override.
    Clear {
        /// The task.
        #[arg(long, value_enum)]
        task: Task,
    },
    /// Runtime brake: the task's jobs are deferred instead of run (`all` for every task).
    Pause {
        /// `carddata`, `card_status` or `all`.
        #[arg(long, value_parser = tasks_or_all)]
        task: Tasks,
    },
    /// Lifts a pause (`all` for every task).
    Resume {
        /// `carddata`, `card_status` or `all`.
        #[arg(long, value_parser = tasks_or_all)]
        task: Tasks,
    },
}

/// `cardworker gateway-sim …`
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8089")]
    pub listen: String,
    /// Added latency per call (ms).
    #[arg(long, default_value_t = 20)]
    pub latency_ms: u64,
    /// Random extra latency per call, up to this (ms).
    #[arg(long, default_value_t = 10)]
    pub latency_jitter_ms: u64,
    /// Share of card calls answered with 503 (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Share of card calls answered with garbage (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub garbage_rate: f64,
    /// Probability that a card changes when it is read (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub change_rate: f64,
    /// Before serving, load every card of the database of --config (its data and status), so
    /// that a restarted simulator answers what the worker already recorded (`make run`).
    #[arg(long)]
    pub seed_from_db: bool,
}

/// The tasks a `--task T|all` argument names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tasks(pub Vec<Task>);

/// Parses `--task`: a task as [`Task`]'s `ValueEnum` spells it (`carddata`, `card_status`, or
/// its alias `card-status`), or `all`.
fn tasks_or_all(raw: &str) -> Result<Tasks, String> {
    if raw == "all" {
        return Ok(Tasks(Task::ALL.to_vec()));
    }
    Task::from_str(raw, false)
        .map(|t| Tasks(vec![t]))
        .map_err(|_| "must be carddata, card_status or all".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_argument_accepts_both_spellings_and_all() {
        assert_eq!(
            tasks_or_all("card-status"),
            Ok(Tasks(vec![Task::CardStatus]))
        );
        assert_eq!(
            tasks_or_all("card_status"),
            Ok(Tasks(vec![Task::CardStatus]))
        );
        assert_eq!(tasks_or_all("carddata"), Ok(Tasks(vec![Task::Carddata])));
        assert_eq!(tasks_or_all("all"), Ok(Tasks(Task::ALL.to_vec())));
        assert!(tasks_or_all("payments").is_err());
    }

    #[test]
    fn enqueue_accepts_both_spellings_and_its_help_shows_only_card_status() {
        use clap::CommandFactory as _;
        for spelling in ["card_status", "card-status"] {
            let cli = Cli::try_parse_from(["cardworker", "enqueue", spelling, "--card-ref", "c-1"])
                .expect(spelling);
            assert!(
                matches!(
                    cli.command,
                    Command::Enqueue(EnqueueCommand::CardStatus { ref card_ref }) if card_ref == "c-1"
                ),
                "{spelling}: {:?}",
                cli.command
            );
        }
        let mut cmd = Cli::command();
        let enqueue = cmd
            .find_subcommand_mut("enqueue")
            .expect("enqueue")
            .render_help()
            .to_string();
        assert!(enqueue.contains("card_status"), "{enqueue}");
        assert!(!enqueue.contains("card-status"), "{enqueue}");
        let budget_set = cmd
            .find_subcommand_mut("budget")
            .and_then(|b| b.find_subcommand_mut("set"))
            .expect("budget set")
            .render_help()
            .to_string();
        assert!(budget_set.contains("card_status"), "{budget_set}");
        assert!(!budget_set.contains("card-status"), "{budget_set}");
    }

    #[test]
    fn an_unknown_task_is_a_usage_error_from_clap() {
        let e = Cli::try_parse_from(["cardworker", "budget", "set", "--task", "x", "--limit", "2"])
            .expect_err("unknown task");
        assert_eq!(e.exit_code(), 2);
        let ok = Cli::try_parse_from(["cardworker", "budget", "clear", "--task", "card_status"]);
        assert!(ok.is_ok(), "{ok:?}");
    }
}
