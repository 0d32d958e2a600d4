//! `enqueue carddata|card-status`, `reconcile`, `investigate`.

use crate::app::AppContext;
use crate::cli::Format;
use crate::commands::CommandError;
use crate::config::Task;

/// Starts or restarts one card's chain.
pub async fn enqueue(_ctx: &AppContext, _task: Task, _card_ref: &str) -> Result<(), CommandError> {
    Err(anyhow::anyhow!("polling is not built yet").into())
}

/// Runs reconcile passes until every card that should be polled has a chain.
pub async fn reconcile(_ctx: &AppContext, _format: Format) -> Result<(), CommandError> {
    Err(anyhow::anyhow!("polling is not built yet").into())
}

/// Shows what is on record for one card.
pub async fn investigate(
    _ctx: &AppContext,
    _card_ref: &str,
    _format: Format,
) -> Result<(), CommandError> {
    Err(anyhow::anyhow!("polling is not built yet").into())
}
