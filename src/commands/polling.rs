//! `enqueue carddata|card_status`, `reconcile`, `investigate`.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;

use super::args::Format;
use super::investigate::{self, InvestigateError};
use super::CommandError;
use crate::config::Task;
use crate::context::AppContext;
use crate::polling::{chain, reconcile};
use crate::storage::cards;

/// Starts or restarts one card's chain: clears the parked mark in PostgreSQL, then replaces any
/// live chain with a new one due now (so running it twice leaves one chain). Unknown card: exit 1.
pub async fn enqueue(ctx: &AppContext, task: Task, card_ref: &str) -> Result<(), CommandError> {
    let card = cards::load(&ctx.pool, card_ref)
        .await
        .context("loading the card")?
        .ok_or_else(|| {
            anyhow::anyhow!("unknown card {card_ref:?}: there is no row with that card_ref in cards; nothing enqueued")
        })?;
    let was_parked = card.parked_at(task).is_some();
    if was_parked {
        cards::unpark(&ctx.pool, card_ref, task)
            .await
            .context("clearing the parked mark")?;
    }
    let mut conn = ctx.redis.clone();
    // Read before the start only to say what it replaced; the start itself is atomic.
    let replaced = chain::live_chains(&mut conn, ctx.prefix(), task, &[card_ref.to_owned()])
        .await?
        .pop()
        .flatten();
    let id = chain::start(&mut conn, ctx.prefix(), task, card_ref, Duration::ZERO).await?;
    println!(
        "{task} chain {id} started for card {card_ref}{}{}{}",
        replaced
            .map(|old| format!(" (replaced live chain {old}, which stops at its next poll)"))
            .unwrap_or_default(),
        if was_parked {
            " (was parked; parked mark cleared)"
        } else {
            ""
        },
        if card.wants_polling(task) {
            ""
        } else {
            "; note: the card needs no more polling for this task, so the chain ends at its first run"
        }
    );
    Ok(())
}

/// Runs reconcile passes until every card that should be polled has a chain; prints how many
/// chains were started per task.
pub async fn reconcile(ctx: &AppContext, format: Format) -> Result<(), CommandError> {
    let mut started = serde_json::Map::new();
    let mut lines = Vec::new();
    for task in Task::ALL {
        let (examined, n) = reconcile::sweep(ctx, task).await?;
        started.insert(task.label().to_owned(), json!(n));
        lines.push(format!(
            "{task}: {n} chains started ({examined} cards that should be polled examined; parked chains left alone)"
        ));
    }
    match format {
        Format::Json => println!("{}", json!({ "started": started })),
        Format::Text => println!("{}", lines.join("\n")),
    }
    Ok(())
}

/// Shows what is on record for one card. Unknown card: exit 1.
pub async fn investigate(
    ctx: &AppContext,
    card_ref: &str,
    format: Format,
) -> Result<(), CommandError> {
    let inv = investigate::investigate(ctx, card_ref)
        .await
        .map_err(|e| match e {
            InvestigateError::UnknownCard(_) => anyhow::anyhow!("{e}"),
            InvestigateError::Other(e) => e,
        })?;
    match format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&inv).context("rendering the investigation")?
        ),
        Format::Text => print!("{}", investigate::render_text(&inv)),
    }
    Ok(())
}
