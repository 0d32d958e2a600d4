//! One struct per job. Fields added later get `#[serde(default)]`, so that jobs already queued by
//! an older producer still decode.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Job;

/// Where a polling job stands in its card's chain. Travels with the job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainState {
    /// The chain this job belongs to. A job whose chain is no longer the card's live chain is
    /// stale and is acknowledged without calling the Gateway. Empty for a job from a producer
    /// that did not start a chain: the worker adopts it if the card has no live chain.
    #[serde(default)]
    pub chain: String,
    /// Consecutive failed or unknown polls so far; the chain is parked at the configured maximum.
    #[serde(default)]
    pub failures: u32,
    /// Consecutive deferrals for lack of budget tokens (drives the deferral back-off).
    #[serde(default)]
    pub deferrals: u32,
    /// The job's turn in its chain: the due time (unix ms, Redis clock) the feeder fed it for, 0
    /// when unknown (a producer's payload, an older release's). A job acts on its chain only while
    /// the chain still waits on this turn, so a second delivery of a job whose turn is over is
    /// stale (`chain.lua`, Turns). Passed to a chain write, it is the writing job's own turn.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub turn: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Polls the Gateway for one card's data (`GET /v1/cards/{card_ref}/data`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollCardData {
    /// The card to poll.
    pub card_ref: String,
    /// Chain bookkeeping.
    #[serde(default, flatten)]
    pub state: ChainState,
}

/// Polls the Gateway for one card's status (`GET /v1/cards/{card_ref}/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollCardStatus {
    /// The card to poll.
    pub card_ref: String,
    /// Chain bookkeeping.
    #[serde(default, flatten)]
    pub state: ChainState,
}

impl Job for PollCardData {
    const QUEUE: &'static str = "carddata";
    // One waiting entry per card: a new poll replaces the waiting one.
    fn entry_id(&self) -> Option<String> {
        Some(self.card_ref.clone())
    }
    fn chain(&self) -> Option<&ChainState> {
        Some(&self.state)
    }
}

impl Job for PollCardStatus {
    const QUEUE: &'static str = "card_status";
    fn entry_id(&self) -> Option<String> {
        Some(self.card_ref.clone())
    }
    fn chain(&self) -> Option<&ChainState> {
        Some(&self.state)
    }
}

/// Submits one row of `payments` to the Gateway through the reliable (pending-first) path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitPayment {
    /// `payments.payment_id`; also the Gateway's `Idempotency-Key`.
    pub payment_id: Uuid,
    /// Re-runs after a transient failure (database or Redis unavailable), for back-off.
    #[serde(default)]
    pub retries: u32,
}

impl Job for SubmitPayment {
    const QUEUE: &'static str = "payment";
    fn entry_id(&self) -> Option<String> {
        Some(self.payment_id.to_string())
    }
}

/// One channel callback as the ingress received it. The body is kept raw so that a malformed
/// body is still recorded with its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessCallback {
    /// The channel that sent it.
    pub channel: String,
    /// Unique within the channel.
    pub callback_id: String,
    /// The JSON body as received.
    pub body: String,
    /// Re-runs after a transient failure, for back-off.
    #[serde(default)]
    pub retries: u32,
    /// Whoever enqueued it committed the delivery to cardworker's `inbound_callbacks` first
    /// (`cardworker enqueue callback`, or the sweep of `received` callbacks): the job does not
    /// count it again. A producer that only enqueues leaves it `false`.
    #[serde(default)]
    pub recorded: bool,
}

impl Job for ProcessCallback {
    const QUEUE: &'static str = "callback";
}

/// One archive run (one Shanghai day at most).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunArchive {
    /// The cron tick (unix seconds) that asked for it; `None` when enqueued by hand.
    #[serde(default)]
    pub scheduled_for: Option<i64>,
}

impl Job for RunArchive {
    const QUEUE: &'static str = "archive";
}

/// One retention run (one Shanghai day at most).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRetention {
    /// The cron tick (unix seconds) that asked for it; `None` when enqueued by hand.
    #[serde(default)]
    pub scheduled_for: Option<i64>,
}

impl Job for RunRetention {
    const QUEUE: &'static str = "retention";
}

/// One reconcile pass: the overdue chains, then `polling.reconcile_batch` cards from the cursor;
/// or, with `full`, every card (after Redis lost its data).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunReconcile {
    /// The cron tick (unix seconds) that asked for it.
    #[serde(default)]
    pub scheduled_for: Option<i64>,
    /// Sweep every card that should be polled, not one batch (Redis came back empty).
    #[serde(default)]
    pub full: bool,
}

impl Job for RunReconcile {
    const QUEUE: &'static str = "reconcile";
}

/// One payment recovery pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoverPayments {
    /// The cron tick (unix seconds) that asked for it.
    #[serde(default)]
    pub scheduled_for: Option<i64>,
}

impl Job for RecoverPayments {
    const QUEUE: &'static str = "payment_recovery";
}

/// Submits one row of `approvals` to the Gateway through the reliable (pending-first) path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitApproval {
    /// `approvals.approval_id`; also the Gateway's `Idempotency-Key`.
    pub approval_id: Uuid,
    /// Re-runs after a transient failure, for back-off.
    #[serde(default)]
    pub retries: u32,
}

impl Job for SubmitApproval {
    const QUEUE: &'static str = "approval";
    fn entry_id(&self) -> Option<String> {
        Some(self.approval_id.to_string())
    }
}

/// One approval recovery pass.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoverApprovals {
    /// The cron tick (unix seconds) that asked for it.
    #[serde(default)]
    pub scheduled_for: Option<i64>,
}

impl Job for RecoverApprovals {
    const QUEUE: &'static str = "approval_recovery";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_payload_from_an_older_producer_still_decodes() {
        let job: PollCardData = serde_json::from_str(r#"{"card_ref":"c-1"}"#).unwrap();
        assert_eq!(job.card_ref, "c-1");
        assert_eq!(job.state, ChainState::default());
    }

    #[test]
    fn chain_state_round_trips_flat_in_the_payload() {
        let job = PollCardStatus {
            card_ref: "c-2".into(),
            state: ChainState {
                chain: "01J".into(),
                failures: 3,
                deferrals: 1,
                turn: 1_764_000_000_000,
            },
        };
        let json = serde_json::to_value(&job).unwrap();
        assert_eq!(json["failures"], 3);
        let back: PollCardStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, job);
    }
}
