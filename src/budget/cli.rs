//! `cardworker budget …`

use redis::aio::ConnectionManager;

use crate::cli::BudgetCommand;
use crate::commands::CommandError;
use crate::config::Config;

/// Runs one `budget` subcommand.
pub async fn execute(
    _config: &Config,
    _redis: ConnectionManager,
    _cmd: BudgetCommand,
) -> Result<(), CommandError> {
    Err(anyhow::anyhow!("the budget is not built yet").into())
}
