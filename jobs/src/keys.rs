//! Redis key names shared by producers and the worker. Every key lives under the deployment's
//! `redis.key_prefix`.

/// The apalis queue name (apalis hangs its own keys under it: `…:active`, `…:data`, …).
pub fn queue(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{queue}")
}

/// The intake sorted set of a queue (member: entry id, score: due unix ms on the Redis clock).
pub fn intake(prefix: &str, queue: &str) -> String {
    format!("{prefix}:intake:{queue}")
}

/// The intake payload hash of a queue (entry id -> JSON payload). A polling chain's waiting poll
/// has none (its state is in the chain entry, [`chain_due`]); only entries with a payload of their
/// own are here.
pub fn intake_payload(prefix: &str, queue: &str) -> String {
    format!("{prefix}:intake:{queue}:payload")
}

/// The due hint of the deployment's intakes (member: an intake key, score: unix ms on the Redis
/// clock, never later than that intake's earliest entry). Every intake writer lowers it
/// (`ZADD LT`); the feeder sets it exactly after each feed. The feeder reads this one key on its
/// ticks instead of every intake, so an idle pod costs Redis almost nothing.
pub fn intake_due_hint(prefix: &str) -> String {
    format!("{prefix}:intakes:due")
}

/// The channel on which intake writers announce an entry due earlier than the due hint held
/// for its intake (message: the due time, unix ms on the Redis clock). Published only when the
/// hint was lowered; every worker process subscribes, so its feeder can sleep while nothing is
/// due and still feed such an entry within one tick. A pub/sub channel, not a key.
pub fn intake_wake(prefix: &str) -> String {
    format!("{prefix}:intakes:wake")
}

/// A one-off claim, for example one cron tick.
pub fn claim(prefix: &str, claim: &str) -> String {
    format!("{prefix}:claim:{claim}")
}

/// The chain hash of a polling queue (card_ref -> `chain_id|unchanged|last|since|state`:
/// the chain, its unchanged-poll tally and its next job's state, see `chain.lua`): one live chain
/// per card.
pub fn chain(prefix: &str, queue: &str) -> String {
    format!("{prefix}:chain:{queue}")
}

/// The chain due set of a polling queue (member: card_ref; score: the due time of the chain's next
/// poll, unix ms on the Redis clock, while it waits to be fed, and [`crate::chain::FED`] + that
/// time once its job exists): the polling intake and the index reconcile reads, in one sorted set
/// (no payload hash entry and no second sorted set per waiting poll). The feeder feeds the scores
/// below `FED`; reconcile reads both ranges past a grace.
pub fn chain_due(prefix: &str, queue: &str) -> String {
    format!("{prefix}:chain:{queue}:due")
}
