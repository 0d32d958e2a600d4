//! What each subcommand does. `main` only parses, calls [`execute`] and maps the error to an exit
//! status.

use std::sync::Arc;

use anyhow::Context as _;
use cardworker_jobs::{Producer, RunArchive, RunRetention};

use crate::app::{self, AppContext};
use crate::cli::{Cli, Command, EnqueueCommand, Format, MaintenanceCommand};
use crate::config::{Config, ConfigError};
use crate::telemetry;

/// Why a command failed, as the exit status needs it.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// Invalid configuration: exit 2.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Invalid usage found after parsing: exit 2.
    #[error(transparent)]
    Usage(#[from] crate::cli::UsageError),
    /// Anything else: exit 1.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl CommandError {
    /// The process exit status for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CommandError::Config(_) | CommandError::Usage(_) => 2,
            CommandError::Other(e) if e.downcast_ref::<crate::cli::UsageError>().is_some() => 2,
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
            telemetry::init_logging(config.telemetry.log_format);
            run_simulator(args).await?;
            Ok(())
        }
        Command::Run => {
            telemetry::init_logging(config.telemetry.log_format);
            app::run(config, shutdown_signal()).await?;
            Ok(())
        }
        Command::Migrate => {
            let pool = crate::storage::connect(&config.database).await?;
            crate::storage::migrate(&pool).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Budget(cmd) => crate::budget::cli::execute(&config, cmd).await,
        Command::Maintenance(cmd) => {
            let mut redis = app::connect_redis(&config.redis.url).await?;
            let paused = matches!(cmd, MaintenanceCommand::Pause);
            crate::maintenance::set_paused(&mut redis, &config.redis.key_prefix, paused).await?;
            println!(
                "maintenance {}",
                if paused {
                    "paused: a running run stops at its next batch boundary; later runs are no-ops until `cardworker maintenance resume`"
                } else {
                    "resumed"
                }
            );
            Ok(())
        }
        Command::Enqueue(EnqueueCommand::Archive) => {
            let redis = app::connect_redis(&config.redis.url).await?;
            let id = Producer::new(redis, config.redis.key_prefix.clone())
                .enqueue(&RunArchive::default())
                .await
                .context("enqueueing the archive run")?;
            println!("archive run enqueued ({id}){}", disabled_note(&config));
            Ok(())
        }
        Command::Enqueue(EnqueueCommand::Retention) => {
            let redis = app::connect_redis(&config.redis.url).await?;
            let id = Producer::new(redis, config.redis.key_prefix.clone())
                .enqueue(&RunRetention::default())
                .await
                .context("enqueueing the retention run")?;
            println!("retention run enqueued ({id}){}", disabled_note(&config));
            Ok(())
        }
        Command::Enqueue(cmd) => {
            let ctx = AppContext::connect(config).await?;
            enqueue(ctx, cmd).await
        }
        Command::Reconcile { format } => {
            let ctx = AppContext::connect(config).await?;
            crate::polling::cli::reconcile(&ctx, format).await
        }
        Command::Investigate { card_ref, format } => {
            let ctx = AppContext::connect(config).await?;
            crate::polling::cli::investigate(&ctx, &card_ref, format).await
        }
    }
}

async fn enqueue(ctx: Arc<AppContext>, cmd: EnqueueCommand) -> Result<(), CommandError> {
    match cmd {
        EnqueueCommand::Carddata { card_ref } => {
            crate::polling::cli::enqueue(&ctx, crate::config::Task::Carddata, &card_ref).await
        }
        EnqueueCommand::CardStatus { card_ref } => {
            crate::polling::cli::enqueue(&ctx, crate::config::Task::CardStatus, &card_ref).await
        }
        EnqueueCommand::Payment { payment_id } => {
            crate::payments::cli::enqueue_payment(&ctx, payment_id).await
        }
        EnqueueCommand::Callback {
            channel,
            callback_id,
            body_file,
        } => crate::payments::cli::enqueue_callback(&ctx, &channel, &callback_id, &body_file).await,
        EnqueueCommand::Archive | EnqueueCommand::Retention => {
            unreachable!("handled without a database connection")
        }
    }
}

async fn run_simulator(args: crate::cli::SimArgs) -> anyhow::Result<()> {
    use crate::sim::{SimConfig, Simulator};
    let config = SimConfig {
        latency_ms: args.latency_ms,
        latency_jitter_ms: args.latency_jitter_ms,
        error_rate: args.error_rate,
        garbage_rate: args.garbage_rate,
        change_rate: args.change_rate,
        ..SimConfig::default()
    };
    config
        .validate()
        .map_err(|e| crate::cli::UsageError(format!("{e:#}")))?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding the gateway simulator to {}", args.listen))?;
    println!(
        "gateway simulator listening on http://{}",
        listener.local_addr()?
    );
    Simulator::new(config)
        .serve(listener, shutdown_signal())
        .await
}

fn disabled_note(config: &Config) -> &'static str {
    if config.maintenance.enabled {
        ""
    } else {
        "; maintenance.enabled is false, so it will be acknowledged as a no-op"
    }
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
