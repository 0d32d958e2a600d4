//! The polling due queue, seen from the producer side: its script (`due_queue.lua`, shared with
//! the worker, which fetches and acknowledges through it) and [`merge`], which is how a
//! producer's poll job reaches a card.
//!
//! A card has one entry per polling task in its task shard's due set, with its state beside it. A
//! producer's poll job is a request for a poll of the card: [`merge`] brings a waiting card's next
//! poll forward (it keeps its failures and tally), leaves a card being polled to that poll, and
//! adds a card that has no entry.

use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::{keys, EnqueueError};

/// The due queue's script. Keys: the shard's due set, last lease score and state hash (see the
/// file's header).
pub const SCRIPT: &str = include_str!("due_queue.lua");

/// Arguments per acknowledgement in a batched call of the script (its `batch` op): card, lease,
/// next due in ms, state.
pub const ACK_WIDTH: usize = 4;

/// The shard every card is in: the due queue has one shard per task.
pub const SHARD: u16 = 0;

/// What [`merge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The card had no entry: it was added, its first poll due when asked.
    Started,
    /// The card had one: a waiting card is due no later than asked, a leased one is being polled.
    IntoLive,
}

/// Asks for a poll of `card_ref` by `queue` (a polling task's queue) after `delay` (Redis clock).
pub async fn merge<C: ConnectionLike>(
    conn: &mut C,
    prefix: &str,
    queue: &str,
    card_ref: &str,
    delay: Duration,
) -> Result<Merged, EnqueueError> {
    let verdict: String = redis::Script::new(SCRIPT)
        .key(keys::poll_due(prefix, queue, SHARD))
        .key(keys::poll_last_lease(prefix, queue, SHARD))
        .key(keys::poll_state(prefix, queue, SHARD))
        .arg("merge")
        .arg(card_ref)
        .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
        .invoke_async(conn)
        .await?;
    Ok(if verdict == "started" {
        Merged::Started
    } else {
        Merged::IntoLive
    })
}
