//! The command line (spec section 2). Every subcommand takes `--config FILE` after its own
//! arguments; without it, env `CARDWORKER_CONFIG`, and without that the built-in defaults.
//!
//! Exit status: 0 success; 2 invalid configuration or usage (the message names the key, the
//! value and what is allowed); 1 any other failure.

use std::path::PathBuf;

use chrono::{DateTime, Utc};
use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};

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
    /// Forces a task's Gateway circuit breaker open or closed, fleet-wide.
    #[command(subcommand)]
    Circuit(CircuitCommand),
    /// Restarts parked polling chains (bulk, batched, idempotent).
    Unpark(UnparkArgs),
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
    /// The dead set of a queue (jobs that ended dead): list, requeue through the intake, discard.
    #[command(subcommand)]
    DeadSet(DeadSetCommand),
    /// Serves the operator's web console: a process of its own, never part of `run`.
    Console(ConsoleArgs),
}

/// `cardworker console [--listen ADDR]`
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    /// Address to listen on; defaults to `console.listen` (127.0.0.1:9465).
    #[arg(long)]
    pub listen: Option<String>,
}

/// `cardworker dead-set …`
#[derive(Debug, Subcommand)]
pub enum DeadSetCommand {
    /// Shows a queue's dead jobs (newest first), payloads with card numbers masked.
    List {
        /// The queue (`carddata`, `card_status`, `payment`, `callback`, …).
        #[arg(long)]
        queue: String,
        /// At most this many entries.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Output format.
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Hands dead jobs back to the workers through the intake, due now.
    Requeue(DeadSetTarget),
    /// Removes dead jobs for good.
    Discard(DeadSetTarget),
}

/// Which dead jobs of which queue (`--id ID`, repeatable, or `--all`).
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["id", "all"])))]
pub struct DeadSetTarget {
    /// The queue.
    #[arg(long)]
    pub queue: String,
    /// One dead job (its apalis task id); repeatable.
    #[arg(long)]
    pub id: Vec<String>,
    /// Every dead job of the queue.
    #[arg(long)]
    pub all: bool,
    /// Why, for the audit event.
    #[arg(long)]
    pub reason: Option<String>,
}

/// `cardworker enqueue …`
#[derive(Debug, Subcommand)]
pub enum EnqueueCommand {
    /// Starts or restarts one card's card-data polling chain (also a parked one).
    Carddata {
        /// The card.
        #[arg(long)]
        card_ref: String,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Starts or restarts one card's card_status polling chain (also a parked one).
    #[command(name = "card_status", alias = "card-status")]
    CardStatus {
        /// The card.
        #[arg(long)]
        card_ref: String,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Submits one payment row through the reliable path.
    Payment {
        /// `payments.payment_id`.
        #[arg(long)]
        payment_id: uuid::Uuid,
    },
    /// Submits one approval row through the reliable path (one already submitted is not
    /// submitted again; a bad row or an unknown card is refused).
    Approval {
        /// `approvals.approval_id`.
        #[arg(long)]
        approval_id: uuid::Uuid,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
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
    Pause {
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lifts the pause.
    Resume {
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
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
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Clears a runtime per-task limit override.
    Clear {
        /// The task.
        #[arg(long, value_enum)]
        task: Task,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Runtime brake: the task's jobs are deferred instead of run (`all` for every task).
    Pause {
        /// `carddata`, `card_status` or `all`.
        #[arg(long, value_parser = tasks_or_all)]
        task: Tasks,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Lifts a pause (`all` for every task).
    Resume {
        /// `carddata`, `card_status` or `all`.
        #[arg(long, value_parser = tasks_or_all)]
        task: Tasks,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
}

/// `cardworker circuit …`
#[derive(Debug, Subcommand)]
pub enum CircuitCommand {
    /// Forces the task's circuit open: its polls are deferred without a Gateway call, with no
    /// probes, until `circuit close`.
    Open {
        /// The task.
        #[arg(long, value_enum)]
        task: Task,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Forces the task's circuit closed (its window cleared): polls call the Gateway again.
    Close {
        /// The task.
        #[arg(long, value_enum)]
        task: Task,
        /// Why, for the audit event.
        #[arg(long)]
        reason: Option<String>,
    },
}

/// `cardworker unpark --task T (--card-ref R | --all | --parked-before TS)`
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("which").required(true).args(["card_ref", "all", "parked_before"])))]
pub struct UnparkArgs {
    /// The task whose parked chains restart.
    #[arg(long, value_enum)]
    pub task: Task,
    /// One card.
    #[arg(long)]
    pub card_ref: Option<String>,
    /// Every parked chain of the task.
    #[arg(long)]
    pub all: bool,
    /// The chains parked before this instant (RFC 3339, e.g. 2026-12-01T08:00:00Z).
    #[arg(long, value_parser = timestamp)]
    pub parked_before: Option<DateTime<Utc>>,
    /// Why, for the audit event.
    #[arg(long)]
    pub reason: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Parses an RFC 3339 timestamp (`--parked-before`).
fn timestamp(raw: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            format!("{raw:?} is not an RFC 3339 timestamp such as 2026-12-01T08:00:00Z ({e})")
        })
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
    /// Share of new approvals answered `in_review` (0..1); they are decided
    /// --approval-review-ms later.
    #[arg(long, default_value_t = 0.0)]
    pub approval_in_review_rate: f64,
    /// Share of approvals declined, at once or after their review (0..1).
    #[arg(long, default_value_t = 0.0)]
    pub approval_decline_rate: f64,
    /// How long an approval stays in review (ms).
    #[arg(long, default_value_t = 60_000)]
    pub approval_review_ms: u64,
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
                    Command::Enqueue(EnqueueCommand::CardStatus { ref card_ref, .. }) if card_ref == "c-1"
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
    fn unpark_takes_exactly_one_selector() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(
                ["cardworker", "unpark", "--task", "carddata"]
                    .iter()
                    .chain(args),
            )
        };
        for ok in [
            &["--all"][..],
            &["--card-ref", "c-1"],
            &[
                "--parked-before",
                "2026-12-01T08:00:00+08:00",
                "--reason",
                "x",
            ],
        ] {
            assert!(parse(ok).is_ok(), "{ok:?}");
        }
        for bad in [
            &[][..],
            &["--all", "--card-ref", "c-1"],
            &["--parked-before", "yesterday"],
        ] {
            let e = parse(bad).expect_err("refused");
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
    }

    #[test]
    fn every_operator_action_accepts_a_reason() {
        for args in [
            &["budget", "set", "--task", "carddata", "--limit", "2"][..],
            &["budget", "clear", "--task", "carddata"],
            &["budget", "pause", "--task", "all"],
            &["budget", "resume", "--task", "card-status"],
            &["maintenance", "pause"],
            &["maintenance", "resume"],
            &["enqueue", "carddata", "--card-ref", "c-1"],
            &["enqueue", "card-status", "--card-ref", "c-1"],
            &["circuit", "open", "--task", "carddata"],
            &["circuit", "close", "--task", "card_status"],
            &["unpark", "--task", "carddata", "--all"],
            &["dead-set", "requeue", "--queue", "payment", "--all"],
            &["dead-set", "discard", "--queue", "payment", "--id", "01J"],
        ] {
            let line = ["cardworker"]
                .iter()
                .chain(args)
                .chain(&["--reason", "incident 42"]);
            assert!(Cli::try_parse_from(line).is_ok(), "{args:?}");
        }
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
