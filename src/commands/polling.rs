//! `enqueue carddata|card_status`, `unpark`, `reconcile`, `investigate`.

use std::time::Duration;

use anyhow::Context as _;
use futures::{StreamExt as _, TryStreamExt as _};
use rand::Rng as _;
use serde::Serialize;
use serde_json::json;

use super::args::Format;
use super::investigate::{self, InvestigateError};
use super::operator::{self, Action, Operator};
use super::CommandError;
use crate::config::Task;
use crate::context::AppContext;
use crate::polling::due_queue::Restarted;
use crate::polling::{lease, reconcile};
use crate::storage::cards::{self, ParkedSelector};
use crate::storage::records;

/// Parked chains un-parked per transaction by `cardworker unpark`.
pub const UNPARK_BATCH: i64 = 1000;
/// Chains started at once (on the shared, multiplexed Redis connection) after each batch.
const START_CONCURRENCY: usize = 32;

/// Starts or restarts one card's chain: clears the parked mark in PostgreSQL, then restarts the
/// card's polling in the due queue (a fresh state, its next poll due now; one entry per card, so
/// running it twice leaves one chain), and records it as `operator.enqueue`. Unknown card: exit 1.
pub async fn enqueue(
    ctx: &AppContext,
    task: Task,
    card_ref: &str,
    reason: Option<String>,
) -> Result<(), CommandError> {
    let card = cards::load(&ctx.pool, card_ref)
        .await
        .context("loading the card")?
        .ok_or_else(|| {
            anyhow::anyhow!("unknown card {card_ref:?}: there is no row with that card_ref in cards; nothing enqueued")
        })?;
    let was_parked = card.parked_at(task).is_some();
    let recorded = Action::new(
        "enqueue",
        "card",
        vec![card_ref.to_owned()],
        format!(
            "{task} chain of card {card_ref} started by an operator{}",
            if was_parked { " (was parked)" } else { "" }
        ),
        reason,
    )
    .with_details(json!({"task": task.label(), "was_parked": was_parked}));
    let said = operator::carry_out(&ctx.pool, &recorded, &Operator::cli(), async {
        if was_parked {
            cards::unpark(&ctx.pool, card_ref, task)
                .await
                .context("clearing the parked mark")?;
        }
        let mut conn = ctx.redis.clone();
        let restarted = lease::due_queue(ctx.prefix(), task)
            .restart(&mut conn, card_ref, Duration::ZERO)
            .await?;
        let id = match restarted {
            Restarted::Started => "started",
            Restarted::Restarted => "restarted",
            Restarted::Running => "running",
        };
        let said = format!(
            "{task} chain {} for card {card_ref}{}{}",
            match restarted {
                Restarted::Started => "started",
                Restarted::Restarted => "restarted (its next poll is due now, failures cleared)",
                Restarted::Running => "restarted (a poll of the card runs now; failures cleared)",
            },
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
        Ok((said, json!({"chain": id})))
    })
    .await
    .map_err(anyhow::Error::from)?;
    println!("{said}");
    Ok(())
}

/// What `cardworker unpark` did.
#[derive(Debug, Clone, Serialize)]
pub struct Unparked {
    /// The task.
    pub task: &'static str,
    /// Chains un-parked and restarted.
    pub restarted: u64,
    /// The `operator.unpark` audit event (none when nothing was parked).
    pub audit_event_id: Option<i64>,
}

/// `cardworker unpark`: clears the parked marks `which` selects in batches of [`UNPARK_BATCH`]
/// (each batch one transaction, with the action's one `operator.unpark` audit event written in
/// the first and linked to every card it restarted), then restarts each card's polling in the
/// due queue (a fresh state), spread over min(interval, 60 s). Idempotent: a second run finds nothing parked and
/// writes nothing. A crash between a batch's commit and its chains is repaired by reconcile (the
/// cards are no longer parked, so they are in its index).
pub async fn unpark(
    ctx: &AppContext,
    task: Task,
    which: ParkedSelector,
    reason: Option<String>,
    by: &Operator,
) -> anyhow::Result<Unparked> {
    let selector = match &which {
        ParkedSelector::CardRef(r) => format!("--card-ref {r}"),
        ParkedSelector::All => "--all".to_owned(),
        ParkedSelector::ParkedBefore(ts) => format!("--parked-before {}", ts.to_rfc3339()),
    };
    let spread = ctx
        .config
        .polling
        .task(task)
        .interval()
        .min(reconcile::MAX_START_SPREAD);
    let spread_ms = u64::try_from(spread.as_millis()).unwrap_or(u64::MAX);
    let mut event_id = None;
    let mut restarted = 0u64;
    loop {
        let mut tx = ctx.pool.begin().await.context("starting an unpark batch")?;
        let refs = cards::unpark_batch(&mut tx, task, &which, UNPARK_BATCH)
            .await
            .context("clearing parked marks")?;
        if refs.is_empty() {
            tx.rollback()
                .await
                .context("ending the last unpark batch")?;
            break;
        }
        match event_id {
            None => {
                let action = Action::new(
                    "unpark",
                    "card",
                    refs.clone(),
                    format!("{task} parked chains restarted by an operator ({selector})"),
                    reason.clone(),
                )
                .with_details(json!({"task": task.label(), "selector": selector}));
                let id = records::insert_operator_event(&mut tx, &action.event(by))
                    .await
                    .context("writing the operator.unpark audit event")?;
                event_id = Some(id);
            }
            Some(id) => {
                records::link_resources(&mut tx, id, "card", &refs)
                    .await
                    .context("linking the restarted cards to the audit event")?;
            }
        }
        tx.commit().await.context("committing an unpark batch")?;
        // Owned card_refs and prefix: a future that borrows from the closure's argument is not
        // `Send` for every lifetime, which the console's handlers (axum) need.
        let prefix = ctx.prefix().to_owned();
        futures::stream::iter(refs.iter().cloned())
            .map(|card_ref: String| {
                let mut conn = ctx.redis.clone();
                let prefix = prefix.clone();
                let delay = Duration::from_millis(rand::rng().random_range(0..=spread_ms));
                async move {
                    lease::due_queue(&prefix, task)
                        .restart(&mut conn, &card_ref, delay)
                        .await
                }
            })
            .buffer_unordered(START_CONCURRENCY)
            .try_collect::<Vec<_>>()
            .await?;
        restarted += refs.len() as u64;
        if matches!(which, ParkedSelector::CardRef(_)) {
            break;
        }
    }
    Ok(Unparked {
        task: task.label(),
        restarted,
        audit_event_id: event_id,
    })
}

/// Runs `unpark` and prints how many chains it restarted.
pub async fn unpark_command(
    ctx: &AppContext,
    task: Task,
    which: ParkedSelector,
    reason: Option<String>,
    format: Format,
) -> Result<(), CommandError> {
    let done = unpark(ctx, task, which, reason, &Operator::cli()).await?;
    match format {
        Format::Json => println!(
            "{}",
            serde_json::to_string(&done).context("rendering the result")?
        ),
        Format::Text => println!(
            "{task}: {} parked chains restarted{}",
            done.restarted,
            if done.restarted == 0 {
                " (nothing was parked; nothing written)"
            } else {
                ""
            }
        ),
    }
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
