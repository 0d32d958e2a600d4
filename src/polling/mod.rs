//! Polling jobs: card data and card status.
//!
//! # Layout
//! - [`chain`]: one live chain per card and task, in Redis (schedule only; parking is in
//!   PostgreSQL).
//! - [`poll`]: the flow of one poll, shared by both tasks ([`poll::PollTask`]).
//! - [`carddata`]: the `PollCardData` job.
//! - [`card_status`]: the `PollCardStatus` job.
//! - [`budget_layer`]: the tower layer around both polling workers: both budget tokens or no
//!   handler, deferral through the chain.
//! - [`reconcile`]: the `RunReconcile` job (restores chains after a Redis loss; reads only).
//!
//! Applying an observed change is `crate::cards` (shared with channel callbacks); the commands
//! (`enqueue carddata|card_status`, `reconcile`, `investigate`) are in `crate::commands`.

pub mod budget_layer;
pub mod card_status;
pub mod carddata;
pub mod chain;
pub mod poll;
pub mod reconcile;

use crate::budget::ShortReason;
use crate::config::Task;
use crate::telemetry::metrics as m;

/// The `reason` label of a deferral because Redis did not answer the acquire (the other reasons
/// are [`ShortReason`]'s).
pub const BUDGET_UNAVAILABLE: &str = "budget_unavailable";

/// Registers the polling series at zero: every outcome and every deferral reason of each task.
pub fn register_metrics() {
    for task in Task::ALL {
        for outcome in poll::OUTCOMES {
            metrics::counter!(m::POLL_OUTCOMES, "task" => task.label(), "outcome" => outcome)
                .increment(0);
        }
        let reasons = ShortReason::ALL.map(ShortReason::label);
        for reason in reasons.into_iter().chain([BUDGET_UNAVAILABLE]) {
            metrics::counter!(m::POLL_DEFERRED, "task" => task.label(), "reason" => reason)
                .increment(0);
        }
    }
}
