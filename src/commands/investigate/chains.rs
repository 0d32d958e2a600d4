//! A card's polling: per task, whether the card is polled (it has an entry in the task's due
//! queue), parked, finished or missing, and when its next poll is due.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::Task;
use crate::context::AppContext;
use crate::polling::due_queue::Standing;
use crate::polling::lease;
use crate::storage::cards::Card;

/// One task's polling of the card (its "chain", as operators call it).
#[derive(Debug, Clone, Serialize)]
pub struct ChainView {
    /// `carddata` or `card_status`.
    pub task: &'static str,
    /// `live` (the due queue holds the card), `parked`, `finished` (nothing left to poll) or
    /// `none` (reconcile adds it).
    pub state: &'static str,
    /// When it was parked, if it is.
    pub parked_at: Option<DateTime<Utc>>,
    /// When the card's next poll is due (Redis clock); while a poll holds it, when that poll's
    /// lease ends. `None` when the due queue does not hold the card.
    pub next_poll_due_at: Option<DateTime<Utc>>,
    /// Whether a poll holds the card now (it may be at the Gateway).
    pub polling_now: bool,
    /// Consecutive failures before the card's next poll.
    pub failures: u32,
    /// Budget deferrals recorded in the card's state (only a chain moved over from the release
    /// before carries any; a worker's own deferrals are counted in its process).
    pub deferrals: u32,
}

fn at_ms(ms: u64) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp_millis(i64::try_from(ms).ok()?)
}

/// The card's polling of each task, read from Redis.
pub async fn chains(ctx: &AppContext, card: &Card) -> anyhow::Result<Vec<ChainView>> {
    let card_ref = card.card_ref.as_str();
    let mut conn = ctx.redis.clone();
    let mut chains = Vec::new();
    for task in Task::ALL {
        let entry = lease::due_queue(ctx.prefix(), task)
            .entry(&mut conn, card_ref)
            .await?;
        let parked_at = card.parked_at(task);
        let state = if parked_at.is_some() {
            "parked"
        } else if entry.is_some() {
            "live"
        } else if !card.wants_polling(task) {
            "finished"
        } else {
            "none"
        };
        let (next_poll_due_at, polling_now) = match entry.as_ref().map(|(s, _)| *s) {
            Some(Standing::Waiting { due_ms }) => (at_ms(due_ms), false),
            Some(Standing::Leased { deadline_ms }) => (at_ms(deadline_ms), true),
            None => (None, false),
        };
        let (failures, deferrals) = entry
            .as_ref()
            .map_or((0, 0), |(_, s)| (s.failures, s.deferrals));
        chains.push(ChainView {
            task: task.label(),
            state,
            parked_at,
            next_poll_due_at,
            polling_now,
            failures,
            deferrals,
        });
    }
    Ok(chains)
}
