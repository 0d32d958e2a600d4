//! Everything on record for one card, gathered section by section ([`Investigation`]).

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

use super::callbacks::{callbacks, CallbackView};
use super::chains::{chains, ChainView};
use super::facts::{fleet_facts, manual_facts, FactView, FLEET_FACTS};
use super::payments::{approvals, payments, ApprovalView, PaymentView};
use super::timeline::{timeline, TimelineEntry};
use super::unchanged::{unchanged_counts, UnchangedView, NOTE};
use crate::context::AppContext;
use crate::storage::cards::{self, Card};

/// How many timeline entries, payments and callbacks are shown.
pub const LIMIT: i64 = 50;

/// Everything `investigate` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Investigation {
    /// The card as stored.
    pub card: Card,
    /// Per task: chain live or parked.
    pub chains: Vec<ChainView>,
    /// Changes and failures, newest first (at most [`LIMIT`]).
    pub timeline: Vec<TimelineEntry>,
    /// Unchanged polls per task: this card's tally, and the fleet's hourly counts.
    pub unchanged_polls: Vec<UnchangedView>,
    /// When Redis's counts began: the deployment's epoch marker, written when Redis was found
    /// empty (its data lost, or the deployment's first start). Nothing before it is counted.
    pub counts_since: Option<DateTime<Utc>>,
    /// The card's payments, newest first.
    pub payments: Vec<PaymentView>,
    /// The card's approvals, newest first, each with its history.
    pub approvals: Vec<ApprovalView>,
    /// Callbacks about the card, its payments or its approvals, newest first.
    pub callbacks: Vec<CallbackView>,
    /// Operator actions on this card (`operator.*` audit events), newest first.
    pub manual_facts: Vec<FactView>,
    /// The latest fleet-wide polling facts (circuit transitions, operator actions on tasks and
    /// maintenance), newest first: what else was going on.
    pub fleet_facts: Vec<FactView>,
    /// Says plainly how unchanged polls are kept.
    pub note: &'static str,
}

/// What investigating a card can run into.
#[derive(Debug, thiserror::Error)]
pub enum InvestigateError {
    /// No such card.
    #[error("unknown card {0:?}: there is no row with that card_ref in cards")]
    UnknownCard(String),
    /// PostgreSQL or Redis.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// Gathers everything on record for `card_ref`.
pub async fn investigate(
    ctx: &AppContext,
    card_ref: &str,
) -> Result<Investigation, InvestigateError> {
    let pool = &ctx.pool;
    let card = cards::load(pool, card_ref)
        .await
        .context("loading the card")?
        .ok_or_else(|| InvestigateError::UnknownCard(card_ref.to_owned()))?;
    let timeline = timeline(pool, card_ref, LIMIT).await?;
    let chains = chains(ctx, &card).await?;
    let (unchanged_polls, counts_since) = unchanged_counts(ctx, card_ref, Utc::now()).await?;
    let payments = payments(pool, card_ref, LIMIT).await?;
    let approvals = approvals(pool, card_ref, LIMIT).await?;
    let callbacks = callbacks(pool, card_ref, LIMIT).await?;
    let manual_facts = manual_facts(pool, card_ref, LIMIT)
        .await
        .context("reading the card's manual facts")?;
    let fleet_facts = fleet_facts(pool, FLEET_FACTS)
        .await
        .context("reading the fleet's polling facts")?;
    Ok(Investigation {
        card,
        chains,
        timeline,
        unchanged_polls,
        counts_since,
        payments,
        approvals,
        callbacks,
        manual_facts,
        fleet_facts,
        note: NOTE,
    })
}
