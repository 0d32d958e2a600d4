//! Polling jobs: card data and card status.
//!
//! # Layout
//! - [`due_queue`]: one record per card and task shard (its due time and its state), which the
//!   workers fetch under a lease and acknowledge with the card's next due time and state; its
//!   script is Redis Cluster safe. Parking is in PostgreSQL.
//! - [`poll_state`]: a card's poll state (failures, deferrals, unchanged-poll tally) and how a
//!   finished poll changes it.
//! - [`backend`]: the apalis backend of both polling workers, which fetches from the due queue as
//!   many cards as the worker has free slots.
//! - [`worker`]: starting a polling worker on its task's due queue.
//! - [`lease`]: a poll's hold on its card ([`lease::PollJob`]) and its acknowledgement, batched
//!   per process.
//! - [`poll`]: the flow of one poll, shared by both tasks ([`poll::PollTask`]).
//! - [`unchanged`]: what Redis keeps of unchanged polls (a tally in the card's poll state, hourly
//!   fleet-wide counters), and how it is read back.
//! - [`carddata`]: the `PollCardData` job.
//! - [`card_status`]: the `PollCardStatus` job.
//! - `run_job`: the `RunJob` impl both poll jobs share (a macro; its doc says why).
//! - [`budget_layer`]: the tower layer around both polling workers: both budget tokens and a
//!   closed Gateway circuit or no handler, deferral through the due queue.
//! - [`circuit`]: what the fleet-wide Gateway circuit breaker means for a poll (its outcome
//!   report, probes, the one audit event per opening and per closing).
//! - [`reconcile`]: the `RunReconcile` job (adds every card that wants polling and is missing
//!   from the due queue, after a Redis loss say; reads PostgreSQL only).
//! - [`takeover`]: moves the chains of the release before into the due queue, keeping each
//!   card's due time and state (run as a worker starts).
//!
//! Applying an observed change is `crate::cards` (shared with channel callbacks); the commands
//! (`enqueue carddata|card_status`, `reconcile`, `investigate`) are in `crate::commands`.

pub mod backend;
pub mod budget_layer;
pub mod card_status;
pub mod carddata;
pub mod circuit;
pub mod due_queue;
pub mod lease;
pub mod poll;
pub mod poll_state;
pub mod reconcile;
mod run_job;
pub mod takeover;
pub mod unchanged;
pub mod worker;

use anyhow::Context as _;

use crate::budget::circuit::{CIRCUIT_OPEN_REASON, TRANSITION_LABELS};
use crate::budget::ShortReason;
use crate::config::Task;
use crate::context::AppContext;
use crate::storage::cards;
use crate::telemetry::metrics as m;

/// The `reason` label of a deferral because Redis did not answer the acquire (the other reasons
/// are [`ShortReason`]'s).
pub const BUDGET_UNAVAILABLE: &str = "budget_unavailable";

/// Registers the polling series at zero: every outcome and every deferral reason of each task,
/// each task's circuit gauge and transitions, and its lateness gauges.
pub fn register_metrics() {
    for task in Task::ALL {
        for outcome in poll::OUTCOMES {
            metrics::counter!(m::POLL_OUTCOMES, "task" => task.label(), "outcome" => outcome)
                .increment(0);
        }
        let reasons = ShortReason::ALL.map(ShortReason::label);
        for reason in reasons
            .into_iter()
            .chain([CIRCUIT_OPEN_REASON, BUDGET_UNAVAILABLE])
        {
            metrics::counter!(m::POLL_DEFERRED, "task" => task.label(), "reason" => reason)
                .increment(0);
        }
        metrics::gauge!(m::GATEWAY_CIRCUIT_OPEN, "task" => task.label()).set(0.0);
        metrics::gauge!(m::PARKED_CHAINS, "task" => task.label()).set(0.0);
        metrics::gauge!(m::POLL_OVERDUE, "task" => task.label()).set(0.0);
        metrics::gauge!(m::POLL_DUE_NOW, "task" => task.label()).set(0.0);
        metrics::gauge!(m::QUEUE_DEPTH, "queue" => task.label()).set(0.0);
        for to in TRANSITION_LABELS {
            metrics::counter!(m::GATEWAY_CIRCUIT_TRANSITIONS, "task" => task.label(), "to" => to)
                .increment(0);
        }
    }
}

/// Reads how late each task's polling runs (one script call per task, the due queue's head) and
/// publishes `cardworker_poll_due_now{task}`, `cardworker_poll_overdue_seconds{task}` and the
/// task's `cardworker_queue_depth{queue}`. Part of
/// the fleet-wide gauges' background refresh (`telemetry::fleet`).
pub async fn publish_lateness(ctx: &AppContext) -> anyhow::Result<()> {
    let mut conn = ctx.redis.clone();
    for task in Task::ALL {
        let head = lease::due_queue(ctx.prefix(), task).head(&mut conn).await?;
        let overdue = head
            .earliest_due_ms
            .map_or(0, |due| head.now_ms.saturating_sub(due));
        metrics::gauge!(m::POLL_DUE_NOW, "task" => task.label()).set(head.due_now as f64);
        // A polling task's queue is its due queue: its jobs waiting are its cards due now.
        metrics::gauge!(m::QUEUE_DEPTH, "queue" => task.label()).set(head.due_now as f64);
        metrics::gauge!(m::POLL_OVERDUE, "task" => task.label()).set(overdue as f64 / 1000.0);
    }
    Ok(())
}

/// Counts the parked chains per task and publishes `cardworker_parked_chains{task}`: two counts
/// on the partial indexes of parked cards (index-only, proportional to the parked cards, not to
/// the table). Part of the fleet-wide gauges' background refresh (`telemetry::fleet`).
pub async fn publish_parked_chains(ctx: &AppContext) -> anyhow::Result<()> {
    let (carddata, card_status) = cards::count_parked(&ctx.pool)
        .await
        .context("counting the parked chains")?;
    for (task, n) in [(Task::Carddata, carddata), (Task::CardStatus, card_status)] {
        metrics::gauge!(m::PARKED_CHAINS, "task" => task.label()).set(n as f64);
    }
    Ok(())
}
