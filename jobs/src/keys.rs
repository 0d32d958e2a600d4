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

/// The hash tag of shard `shard` of a polling queue's due queue, with the prefix before it: every
/// key of the shard carries it, so that one script reaches them all on a Redis Cluster.
fn poll_shard(prefix: &str, queue: &str, shard: u16) -> String {
    format!("{prefix}:{{poll:{queue}:{shard}}}")
}

/// A due-queue shard's due set (member: card_ref; score: the due time of the card's next poll,
/// unix ms on the Redis clock, or `LEASED` (2^50) + the deadline of the lease a poll holds it
/// under).
pub fn poll_due(prefix: &str, queue: &str, shard: u16) -> String {
    format!("{}:due", poll_shard(prefix, queue, shard))
}

/// A due-queue shard's last lease score (every new lease scores above it).
pub fn poll_last_lease(prefix: &str, queue: &str, shard: u16) -> String {
    format!("{}:last_lease", poll_shard(prefix, queue, shard))
}

/// A due-queue shard's poll state (card_ref -> `unchanged|last|since|failures[.deferrals]`).
pub fn poll_state(prefix: &str, queue: &str, shard: u16) -> String {
    format!("{}:state", poll_shard(prefix, queue, shard))
}

/// The chain hash of a polling queue, as the release before the due queue kept it (card_ref ->
/// `chain_id|unchanged|last|since|state[|marker]`): read once, by moving chains over.
pub fn chain(prefix: &str, queue: &str) -> String {
    format!("{prefix}:chain:{queue}")
}

/// The chain due set of a polling queue, as the release before the due queue kept it (member:
/// card_ref; score: the due ms of the chain's next poll, or 2^50 + that once its job existed):
/// read once, by moving chains over.
pub fn chain_due(prefix: &str, queue: &str) -> String {
    format!("{prefix}:chain:{queue}:due")
}
