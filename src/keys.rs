//! Every Redis key name cardworker builds, in one module. Each key lives under the deployment's
//! `redis.key_prefix`; the test kit's key inventory (`test-kit/src/inventory.rs`) lists each one's
//! pattern, owner and lifetime, and `tests/it/key_inventory.rs` checks that every key named here
//! has its pattern there.
//!
//! The names a producer needs without the worker (the queues, intakes, claims and polling chains)
//! are `cardworker-jobs`'s [`cardworker_jobs::keys`], re-exported here; the Lua scripts build the
//! keys of the same names from the ones they are given. Under a queue's name apalis hangs its own
//! keys (`…:active`, `…:data`, `…:meta:<id>`, …), which `crate::queue` names where it reads them.
//! The owners re-export what their callers name beside them: `budget` its leases, overrides,
//! pauses and fence, `budget::circuit` its state, `polling::chain` a task's chain keys,
//! `polling::unchanged` the hourly counters, `polling::reconcile` its cursor,
//! `runner::redis_watch` the epoch marker, `maintenance` its brake and last days.

use cardworker_jobs::{Job, PollCardData, PollCardStatus};

use crate::config::Task;

pub use cardworker_jobs::keys::{
    chain, chain_due, claim, intake, intake_due_hint, intake_payload, intake_wake, queue,
};

/// The queue of a polling task (its label).
pub fn queue_of(task: Task) -> &'static str {
    match task {
        Task::Carddata => PollCardData::QUEUE,
        Task::CardStatus => PollCardStatus::QUEUE,
    }
}

// The chains of the release before the due queue: read and removed once, by moving over
// (`polling::takeover`).

/// The chain hash of one task.
pub fn chain_key(prefix: &str, task: Task) -> String {
    chain(prefix, queue_of(task))
}

/// The chain due set of one task (member card_ref; score the next poll's due ms, or
/// `polling::takeover::FED` + that once its job existed).
pub fn due_key(prefix: &str, task: Task) -> String {
    chain_due(prefix, queue_of(task))
}

/// The late set of one task (card_ref -> the due ms of a deferred poll): removed by moving over.
pub fn late_key(prefix: &str, task: Task) -> String {
    format!("{}:late", chain_key(prefix, task))
}

// The polling due queue (src/polling/due_queue.rs): every key of one task shard carries the hash
// tag `{poll:<task>:<shard>}`, so that one script reaches them all on a Redis Cluster.

/// A due-queue shard's due set: card_ref -> due ms, or `LEASED` + a lease's deadline.
pub fn poll_due_key(prefix: &str, task: Task, shard: u16) -> String {
    cardworker_jobs::keys::poll_due(prefix, queue_of(task), shard)
}

/// A due-queue shard's last lease score (every new lease scores above it).
pub fn poll_last_lease_key(prefix: &str, task: Task, shard: u16) -> String {
    cardworker_jobs::keys::poll_last_lease(prefix, queue_of(task), shard)
}

/// A due-queue shard's poll state: card_ref -> `unchanged|last|since|failures[.deferrals]`.
pub fn poll_state_key(prefix: &str, task: Task, shard: u16) -> String {
    cardworker_jobs::keys::poll_state(prefix, queue_of(task), shard)
}

/// A task's reconcile cursor (the last card id examined).
pub fn cursor_key(prefix: &str, task: Task) -> String {
    format!("{prefix}:reconcile:cursor:{}", task.label())
}

/// The fleet-wide counter of unchanged polls of one task and UTC hour (`YYYYMMDDHH`).
pub fn hour_key(prefix: &str, task: Task, hour: &str) -> String {
    format!("{prefix}:unchanged_total:{}:{hour}", task.label())
}

/// The fleet-wide counter of one task's recorded polls of `outcome` (`persisted_change`,
/// `persisted_failure`) in one UTC hour: kept like the unchanged ones, so that the console's
/// chart shows every poll of the last hours by outcome without reading a table.
pub fn outcome_hour_key(prefix: &str, task: Task, outcome: &str, hour: &str) -> String {
    format!("{prefix}:outcome_total:{}:{outcome}:{hour}", task.label())
}

// The polling budget and the Gateway circuit, under one hash tag (`{budget}`) so that one script
// reaches them all.

/// The total lease set.
pub fn total_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:total")
}

/// The lease set of one task.
pub fn task_key(prefix: &str, task: Task) -> String {
    format!("{prefix}:{{budget}}:task:{}", task.label())
}

/// The override hash (task label -> limit).
pub fn overrides_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:overrides")
}

/// The set of paused task labels.
pub fn paused_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:paused")
}

/// The processes refused a token lately (process id -> until ms), so that the others stop keeping
/// idle slots (`budget::pool`).
pub fn waiters_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:waiters")
}

/// Leases that ended by expiry instead of a release, per scope (fleet-wide counters).
pub fn expired_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:expired")
}

/// The idle slots each process kept at its last renewal (process id -> expiry and slot ids per
/// task), so that `show` can tell kept slots from running polls (`budget::pool`).
pub fn kept_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:kept")
}

/// The fence after a Redis data loss: the run_id of the redis-server that holds the budget's data
/// and the moment (unix ms, Redis clock) before which no poll is admitted
/// (`budget::Budget::fence_length`).
pub fn fence_key(prefix: &str) -> String {
    format!("{prefix}:{{budget}}:fence")
}

/// The circuit hash of one task.
pub fn circuit_key(prefix: &str, task: Task) -> String {
    format!("{prefix}:{{budget}}:circuit:{}", task.label())
}

/// The outcome window (a list, newest first) of one task's circuit.
pub fn window_key(prefix: &str, task: Task) -> String {
    format!("{prefix}:{{budget}}:circuit:{}:window", task.label())
}

// Maintenance and the Redis probe.

/// The maintenance brake: while it exists, no archive or retention batch starts.
pub fn maintenance_paused_key(prefix: &str) -> String {
    format!("{prefix}:maintenance:paused")
}

/// The last processed day of a maintenance job, by its label (`archive`, `retention`).
pub fn last_day_key(prefix: &str, job: &str) -> String {
    format!("{prefix}:maintenance:last_day:{job}")
}

/// The marker key whose absence means Redis lost the deployment's data.
pub fn epoch_key(prefix: &str) -> String {
    format!("{prefix}:redis_epoch")
}
