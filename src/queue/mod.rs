//! Queues: the bounded intake in front of apalis, and the Redis names of a queue.
//!
//! # Layout
//! - [`intake`]: the feeder (intake -> apalis under a high-water mark) and the trimmer.
//! - [`dead`]: the dead set of a queue: list, requeue (through the intake), discard.
//! - [`announce`]: the subscription that tells the feeder of entries due earlier than it knew.
//! - [`wake`]: the feeder's local wake-up of a queue's workers when it moved jobs in.
//! - [`batch`]: one process's concurrent calls of a script (polls' and jobs' acknowledgements),
//!   sent several to a script call.
//! - [`backend`]: the apalis backend every worker runs: apalis-redis's storage with a fetch and
//!   an acknowledgement of cardworker's own (no per-job meta hash read, done jobs deleted at once).
//! - this module: [`QueueName`].
//!
//! Running what a queue holds is `crate::runner`; the list of queues is `crate::workers`.
//!
//! A job's life: a producer (`cardworker_jobs::Producer`, the CLI, a cron tick or a handler
//! scheduling its successor) writes an entry into the intake; the feeder moves it into apalis
//! when it is due and the apalis backlog allows; a worker fetches it ([`backend`]: without
//! reading its meta hash), runs it and always acknowledges it: a done job's payload and meta hash
//! are deleted there and then, a dead one (a payload that cannot be decoded, a job that failed)
//! goes to the dead set with its reason; the trimmer removes dead jobs past their retention and
//! what an older release's acknowledgements left in the done set. Re-runs (next poll, back-off
//! after a failure, deferral) go back through the intake, never through apalis-redis's hard-coded
//! 25 retries.
//!
//!
//! The polling tasks are not queues here: each card waits for its next poll in its task's due
//! queue (`crate::polling::due_queue`), which the polling workers fetch from themselves.

pub mod announce;
pub mod backend;
pub mod batch;
pub mod dead;
pub mod intake;
pub mod wake;

use cardworker_jobs::keys;

/// The Redis names of one queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueName {
    /// Short name, as in metric labels (`carddata`, `payment`, …).
    pub short: String,
    /// The apalis queue (`{prefix}:q:{short}`); apalis's keys hang under it.
    pub apalis: String,
    /// The intake sorted set (entries with a payload of their own).
    pub intake: String,
    /// The intake payload hash.
    pub intake_payload: String,
    /// The deployment's due hint (shared by every queue): intake key -> earliest due ms.
    pub due_hint: String,
}

impl QueueName {
    /// Names of queue `short` in the deployment with key prefix `prefix`.
    pub fn new(prefix: &str, short: &str) -> Self {
        Self {
            short: short.to_owned(),
            apalis: keys::queue(prefix, short),
            intake: keys::intake(prefix, short),
            intake_payload: keys::intake_payload(prefix, short),
            due_hint: keys::intake_due_hint(prefix),
        }
    }
}
