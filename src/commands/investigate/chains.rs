//! A card's chains: per task, whether its chain is live, parked, finished or missing, and when its
//! next poll is due.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::Task;
use crate::context::AppContext;
use crate::polling::chain;
use crate::storage::cards::Card;

/// One task's chain.
#[derive(Debug, Clone, Serialize)]
pub struct ChainView {
    /// `carddata` or `card_status`.
    pub task: &'static str,
    /// `live`, `parked`, `finished` (nothing left to poll) or `none` (reconcile will start one).
    pub state: &'static str,
    /// The live chain id, if any.
    pub chain_id: Option<String>,
    /// When it was parked, if it is.
    pub parked_at: Option<DateTime<Utc>>,
    /// When the chain's next poll is due (Redis clock), read from the chain due set; `None`
    /// without a chain in Redis.
    pub next_poll_due_at: Option<DateTime<Utc>>,
    /// Whether that poll's job already exists (fed into apalis or running); false while it waits.
    pub next_poll_fed: bool,
}

/// The card's chain of each task, read from Redis.
pub async fn chains(ctx: &AppContext, card: &Card) -> anyhow::Result<Vec<ChainView>> {
    let card_ref = card.card_ref.as_str();
    let mut conn = ctx.redis.clone();
    let mut chains = Vec::new();
    for task in Task::ALL {
        let live = chain::live_chains(&mut conn, ctx.prefix(), task, &[card_ref.to_owned()])
            .await?
            .into_iter()
            .next()
            .flatten();
        let parked_at = card.parked_at(task);
        let state = if parked_at.is_some() {
            "parked"
        } else if live.is_some() {
            "live"
        } else if !card.wants_polling(task) {
            "finished"
        } else {
            "none"
        };
        let due = chain::next_due(&mut conn, ctx.prefix(), task, card_ref).await?;
        chains.push(ChainView {
            task: task.label(),
            state,
            chain_id: live,
            parked_at,
            next_poll_due_at: due.map(|(at, _)| at),
            next_poll_fed: due.is_some_and(|(_, fed)| fed),
        });
    }
    Ok(chains)
}
