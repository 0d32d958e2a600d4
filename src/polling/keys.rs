//! The Redis key names of polling: each task's queue, chain hash, chain due set and late set.
//! Their own module so that the chain calls ([`super::chain`]) and the unchanged-poll counts
//! ([`super::unchanged`]), which both read a chain's entry, name its keys in one place without
//! importing each other.

use cardworker_jobs::{keys, Job, PollCardData, PollCardStatus};

use crate::config::Task;

/// The queue of a polling task (its label).
pub fn queue_of(task: Task) -> &'static str {
    match task {
        Task::Carddata => PollCardData::QUEUE,
        Task::CardStatus => PollCardStatus::QUEUE,
    }
}

/// The chain hash of one task.
pub fn chain_key(prefix: &str, task: Task) -> String {
    keys::chain(prefix, queue_of(task))
}

/// The chain due set of one task: its polling intake and reconcile's index (member card_ref;
/// score the next poll's due ms while it waits, [`super::chain::FED`] + that once its job exists).
pub fn due_key(prefix: &str, task: Task) -> String {
    keys::chain_due(prefix, queue_of(task))
}

/// The late set of one task: card_ref -> the due ms (Redis clock) of a poll that was deferred,
/// written at its first deferral ([`super::chain::defer`]). A deferral re-scores the due set to
/// the deferred time, so this is where a poll starved of tokens keeps the time it was due;
/// [`super::chain::lateness`] reads it and removes the entries of chains that polled since.
pub fn late_key(prefix: &str, task: Task) -> String {
    format!("{}:late", chain_key(prefix, task))
}
