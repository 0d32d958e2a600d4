//! What each subcommand does. `main` only parses, calls [`execute`] and maps the error to an exit
//! status.
//!
//! Commands sit on top of everything else: they may use any job module, and no module below
//! imports them. The operator actions here are the ones a console would call too.
//!
//! # Layout
//! - [`args`]: the clap definitions (spec section 2).
//! - this module: [`execute`], [`CommandError`] and the exit status, `check-config`, `migrate`,
//!   `run`, `maintenance`, `gateway-sim`.
//! - [`budget`]: `budget show|set|clear|pause|resume`, `circuit open|close`.
//! - [`polling`]: `enqueue carddata|card_status`, `unpark`, `reconcile`, `investigate`.
//! - [`dead`]: `dead-set list|requeue|discard`.
//! - [`operator`]: the `operator.<action>` audit event every action that changes polling writes.
//! - [`investigate`]: what is on record for one card (also shows payments and callbacks).
//! - [`payments`]: `enqueue payment`, `enqueue callback`.
//! - [`approvals`]: `enqueue approval`.
//! - [`maintenance`]: `maintenance status`.
//! - [`sim`]: `gateway-sim` (and its seeding from the database).

pub mod approvals;
pub mod args;
pub mod budget;
pub mod dead;
pub mod investigate;
pub mod maintenance;
pub mod operator;
pub mod payments;
pub mod polling;
pub mod sim;

use anyhow::Context as _;
use cardworker_jobs::{Producer, RunArchive, RunRetention};

pub use args::Cli;
use args::{Command, EnqueueCommand, Format, MaintenanceCommand};

use crate::config::{Config, ConfigError, Task};
use crate::context::{connect_redis, AppContext};
use crate::storage::cards::ParkedSelector;
use crate::{app, telemetry};

/// Why a command failed, as the exit status needs it.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// Invalid configuration: exit 2.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Invalid usage found after parsing (an invalid limit, a bad simulator knob): exit 2.
    #[error("{0}")]
    Usage(String),
    /// Anything else: exit 1.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl CommandError {
    /// The process exit status for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CommandError::Config(_) | CommandError::Usage(_) => 2,
            CommandError::Other(_) => 1,
        }
    }
}

/// Runs one parsed command line.
pub async fn execute(cli: Cli) -> Result<(), CommandError> {
    let config = Config::load(cli.config.as_deref())?;
    match cli.command {
        Command::CheckConfig { format } => {
            let redacted = config.redacted();
            let out = match format {
                Format::Json => serde_json::to_string_pretty(&redacted)
                    .context("rendering the configuration")?,
                Format::Text => redacted
                    .to_toml_string()
                    .context("rendering the configuration")?,
            };
            println!("{out}");
            Ok(())
        }
        Command::GatewaySim(args) => {
            telemetry::init_logging(config.telemetry.log_format, telemetry::Process::GatewaySim);
            sim::run(&config, args).await
        }
        Command::Run => {
            telemetry::init_logging(config.telemetry.log_format, telemetry::Process::Worker);
            app::run(config, shutdown_signal()).await?;
            Ok(())
        }
        Command::Migrate => {
            let pool = crate::storage::connect(&config.database).await?;
            crate::storage::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Budget(cmd) => budget::execute(&config, cmd).await,
        Command::Circuit(cmd) => budget::circuit(&config, cmd).await,
        Command::Unpark(args) => {
            let which = match (args.card_ref, args.all, args.parked_before) {
                (Some(r), _, _) => ParkedSelector::CardRef(r),
                (None, true, _) => ParkedSelector::All,
                (None, false, Some(ts)) => ParkedSelector::ParkedBefore(ts),
                (None, false, None) => {
                    return Err(CommandError::Usage(
                        "unpark needs one of --card-ref, --all, --parked-before".to_owned(),
                    ))
                }
            };
            let ctx = AppContext::connect(config).await?;
            polling::unpark_command(&ctx, args.task, which, args.reason, args.format).await
        }
        Command::Maintenance(cmd) => {
            let (paused, reason) = match cmd {
                MaintenanceCommand::Pause { reason } => (true, reason),
                MaintenanceCommand::Resume { reason } => (false, reason),
                MaintenanceCommand::Status { format } => {
                    let ctx = AppContext::connect(config).await?;
                    return maintenance::status(&ctx, format).await;
                }
            };
            println!(
                "{}",
                maintenance_switch(&config, paused, reason, &operator::Operator::cli()).await?
            );
            Ok(())
        }
        Command::DeadSet(cmd) => dead::execute(&config, cmd).await,
        Command::Console(_) => Err(CommandError::Usage(
            "`cardworker console` is served by the console module (main dispatches it)".to_owned(),
        )),
        Command::Enqueue(cmd) => enqueue(config, cmd).await,
        Command::Reconcile { format } => {
            let ctx = AppContext::connect(config).await?;
            polling::reconcile(&ctx, format).await
        }
        Command::Investigate { card_ref, format } => {
            let ctx = AppContext::connect(config).await?;
            polling::investigate(&ctx, &card_ref, format).await
        }
    }
}

/// `cardworker maintenance pause|resume`: sets or lifts the maintenance brake fleet-wide with its
/// audit event (`operator.maintenance_pause|resume`; not applied when the event cannot be
/// written); returns what it did, for people. Shared by the CLI and the console.
pub async fn maintenance_switch(
    config: &Config,
    paused: bool,
    reason: Option<String>,
    by: &operator::Operator,
) -> anyhow::Result<String> {
    let recorded = operator::Action::new(
        if paused {
            "maintenance_pause"
        } else {
            "maintenance_resume"
        },
        "maintenance",
        vec!["maintenance".to_owned()],
        format!(
            "maintenance {} by an operator",
            if paused { "paused" } else { "resumed" }
        ),
        reason,
    );
    operator::carry_out_to(&config.database, &recorded, by, async {
        let mut redis = connect_redis(config.redis.url.expose()).await?;
        crate::maintenance::switch::set_paused(&mut redis, &config.redis.key_prefix, paused).await?;
        let said = format!(
            "maintenance {}{}",
            if paused {
                "paused: a running run stops at its next batch boundary; later runs are no-ops until `cardworker maintenance resume`"
            } else {
                "resumed"
            },
            crate::maintenance::switch::brake_note(&config.maintenance)
        );
        Ok((said, serde_json::json!({})))
    })
    .await
    .map_err(Into::into)
}

/// `cardworker enqueue …`. Maintenance runs need only Redis; the others need the whole context.
async fn enqueue(config: Config, cmd: EnqueueCommand) -> Result<(), CommandError> {
    match cmd {
        EnqueueCommand::Archive => {
            enqueue_maintenance(&config, &RunArchive::default(), "archive").await
        }
        EnqueueCommand::Retention => {
            enqueue_maintenance(&config, &RunRetention::default(), "retention").await
        }
        EnqueueCommand::Carddata { card_ref, reason } => {
            let ctx = AppContext::connect(config).await?;
            polling::enqueue(&ctx, Task::Carddata, &card_ref, reason).await
        }
        EnqueueCommand::CardStatus { card_ref, reason } => {
            let ctx = AppContext::connect(config).await?;
            polling::enqueue(&ctx, Task::CardStatus, &card_ref, reason).await
        }
        EnqueueCommand::Payment { payment_id } => {
            let ctx = AppContext::connect(config).await?;
            payments::enqueue_payment(&ctx, payment_id).await
        }
        EnqueueCommand::Approval {
            approval_id,
            reason,
        } => {
            let ctx = AppContext::connect(config).await?;
            approvals::enqueue_approval(&ctx, approval_id, reason).await
        }
        EnqueueCommand::Callback {
            channel,
            callback_id,
            body_file,
        } => {
            let ctx = AppContext::connect(config).await?;
            payments::enqueue_callback(&ctx, &channel, &callback_id, &body_file).await
        }
    }
}

/// Enqueues one maintenance run (`what` names it in the output).
async fn enqueue_maintenance<J: cardworker_jobs::Job>(
    config: &Config,
    job: &J,
    what: &str,
) -> Result<(), CommandError> {
    let redis = connect_redis(config.redis.url.expose()).await?;
    let id = Producer::new(redis, config.redis.key_prefix.clone())
        .enqueue(job)
        .await
        .with_context(|| format!("enqueueing the {what} run"))?;
    println!(
        "{what} run enqueued ({id}){}",
        crate::maintenance::switch::enqueue_note(&config.maintenance)
    );
    Ok(())
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            () = term => tracing::info!("SIGTERM received"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
        }
    }
}
