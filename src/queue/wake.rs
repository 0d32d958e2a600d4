//! Local wake-ups of a queue's workers in this process.
//!
//! An idle apalis-redis worker asks Redis for work on its own only after each heartbeat (every
//! beat of its queue, `RunJob::HEARTBEAT`: 5 s, or 30 s for the quiet queues). Jobs reach apalis
//! through the intake feeder alone, so the feeder,
//! when it moves jobs into a queue, wakes this process's workers of that queue at once: a job
//! that becomes due is fetched within one feeder tick, while an idle pod does not send a fetch
//! per worker five times a second. A worker whose fetch was on its way when the wake-up came
//! fetches again as soon as that fetch comes back empty (`queue::backend::QueueBackend`), so a
//! wake-up is never used up by a fetch that ran before the jobs landed. A job another pod's feeder moved
//! is fetched by that pod's workers at once, and by this pod's within a beat of its queue.
//!
//! Keyed by the apalis queue name, which carries the deployment's key prefix, so that several
//! deployments in one process (the integration tests) do not wake each other.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use tokio::sync::Notify;

static WAKERS: LazyLock<Mutex<HashMap<String, Arc<Notify>>>> = LazyLock::new(Default::default);

/// The wake-up of the workers of apalis queue `queue` (created on first use).
pub fn handle(queue: &str) -> Arc<Notify> {
    let mut map = WAKERS.lock().unwrap_or_else(|e| e.into_inner());
    map.entry(queue.to_owned()).or_default().clone()
}

/// Wakes every worker of apalis queue `queue` in this process that waits for work.
pub fn notify(queue: &str) {
    let notify = {
        let map = WAKERS.lock().unwrap_or_else(|e| e.into_inner());
        map.get(queue).cloned()
    };
    if let Some(n) = notify {
        n.notify_waiters();
    }
}
