//! Polling chains, seen from the producer side: the one chain script (`chain.lua`, shared with
//! the worker) and [`merge`], which is how a producer's poll job enters the intake.
//!
//! A card has at most one live chain per polling task, and the chain's next job waits in the
//! intake under the card's entry id. A producer's poll job (usually without a chain id) must
//! therefore never be written over that entry: that would drop the chain's own job and leave the
//! chain with no job at all. [`merge`] instead brings the live chain's waiting poll forward (the
//! chain keeps its failure count), or starts a chain with the producer's job when the card has
//! none.

use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::{keys, ChainState, EnqueueError};

/// The chain script. Keys: chain hash, intake, intake payloads, chain due set (see the file's
/// header).
pub const SCRIPT: &str = include_str!("chain.lua");

/// How many arguments one call of the script's `batch` op takes (its ARGV[1..8]).
pub const BATCH_WIDTH: usize = 8;

/// The score offset of a chain whose job exists (fed into apalis, running, or waiting with a
/// payload of its own in the intake): its entry in the chain due set ([`keys::chain_due`]) is
/// `FED + due ms` instead of `due ms`, so the feeder, which reads scores below `FED` only, never
/// feeds it twice, while reconcile still finds it overdue. 2^50 ms is about 35,000 years: above
/// every due time, and `FED + due` stays an exact integer in a double. Also in `chain.lua` and
/// the worker's feed script.
pub const FED: u64 = 1 << 50;

/// A fresh chain id: 8 random Crockford base32 characters (40 bits). A chain id only has to
/// differ from the card's earlier chains' (a job of a replaced chain is stale); nothing parses it.
/// Shorter than a ULID: 18 bytes less in every chain entry and every poll payload.
pub fn fresh_chain_id() -> String {
    // The last 8 characters of a fresh ULID are 40 of its 80 random bits.
    ulid::Ulid::new().to_string()[18..].to_owned()
}

/// A chain with nothing waiting in the intake still counts as live for this long past its due
/// time (its job is being fed or run); after that a producer's poll starts a new chain. The same
/// base as reconcile's grace.
pub const MERGE_LIVE_FOR: Duration = Duration::from_secs(600);

/// What [`merge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Merged {
    /// The card had a live chain; its waiting poll is due no later than asked.
    IntoLive(String),
    /// The card had no live chain; one was started with the producer's job.
    Started(String),
}

impl Merged {
    /// The chain id the card's polls now run under.
    pub fn chain(&self) -> &str {
        match self {
            Merged::IntoLive(id) | Merged::Started(id) => id,
        }
    }
}

/// Hands one poll job (`payload`, whose flattened [`ChainState`] is `state`) of `queue` for
/// `card_ref` to the card's chain, due after `delay`. Only `card_ref` and `state` are kept (a poll
/// payload has no other fields): the chain entry holds them, and the feeder builds the job's
/// payload from it.
pub async fn merge<C: ConnectionLike>(
    conn: &mut C,
    prefix: &str,
    queue: &str,
    card_ref: &str,
    payload: serde_json::Value,
    state: &ChainState,
    delay: Duration,
) -> Result<Merged, EnqueueError> {
    // A poll payload is card_ref plus the flattened chain state, and a waiting poll keeps that
    // state in its chain entry: the payload itself is not stored (the feeder builds
    // the job's from the chain entry).
    let _ = payload;
    // An id the producer chose itself is kept.
    let id = if state.chain.is_empty() {
        fresh_chain_id()
    } else {
        state.chain.clone()
    };
    let (verdict, chain): (String, String) = redis::Script::new(SCRIPT)
        .key(keys::chain(prefix, queue))
        .key(keys::intake(prefix, queue))
        .key(keys::intake_payload(prefix, queue))
        .key(keys::chain_due(prefix, queue))
        .arg("merge")
        .arg(card_ref)
        .arg(&id)
        .arg(ms(delay))
        .arg(state.failures)
        .arg(state.deferrals)
        .arg(ms(MERGE_LIVE_FOR))
        .invoke_async(conn)
        .await?;
    Ok(if verdict == "started" {
        Merged::Started(chain)
    } else {
        Merged::IntoLive(chain)
    })
}

/// Milliseconds, saturating.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
