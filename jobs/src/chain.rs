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

/// The chain script. Keys: chain hash, intake, intake payloads, due index (see the file's header).
pub const SCRIPT: &str = include_str!("chain.lua");

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
/// `card_ref` to the card's chain, due after `delay`.
pub async fn merge<C: ConnectionLike>(
    conn: &mut C,
    prefix: &str,
    queue: &str,
    card_ref: &str,
    payload: serde_json::Value,
    state: &ChainState,
    delay: Duration,
) -> Result<Merged, EnqueueError> {
    // The fresh chain's id goes into the payload's flattened `chain` field; an id the producer
    // chose itself is kept.
    let id = if state.chain.is_empty() {
        ulid::Ulid::new().to_string()
    } else {
        state.chain.clone()
    };
    let mut payload = payload;
    if let Some(fields) = payload.as_object_mut() {
        fields.insert("chain".to_owned(), serde_json::Value::String(id.clone()));
    }
    let (verdict, chain): (String, String) = redis::Script::new(SCRIPT)
        .key(keys::chain(prefix, queue))
        .key(keys::intake(prefix, queue))
        .key(keys::intake_payload(prefix, queue))
        .key(keys::chain_due(prefix, queue))
        .arg("merge")
        .arg(card_ref)
        .arg(&id)
        .arg(ms(delay))
        .arg(serde_json::to_string(&payload)?)
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
