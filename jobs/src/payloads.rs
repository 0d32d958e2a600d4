//! One struct per job. Fields added later get `#[serde(default)]`, so that jobs already queued by
//! an older producer still decode.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::Job;

/// What a poll job carries from the polling due queue (`cardworker::polling::due_queue`): the
/// lease its card is held under, when the card came due, and the card's state. A producer's poll
/// job carries none of it (every field at its default): it asks for a poll of the card.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollTicket {
    /// The lease's score (`LEASED` + its deadline); 0 for a producer's request.
    #[serde(default)]
    pub lease: u64,
    /// When the card came due (unix ms, Redis clock).
    #[serde(default)]
    pub due_ms: u64,
    /// The card's state as the due queue keeps it (`unchanged|last|since|failures[.deferrals]`);
    /// empty for a fresh one.
    #[serde(default)]
    pub state: String,
}

/// Polls the Gateway for one card's data (`GET /v1/cards/{card_ref}/data`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollCardData {
    /// The card to poll.
    pub card_ref: String,
    /// Its lease and state, from the due queue.
    #[serde(default, flatten)]
    pub ticket: PollTicket,
}

/// Polls the Gateway for one card's status (`GET /v1/cards/{card_ref}/status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PollCardStatus {
    /// The card to poll.
    pub card_ref: String,
    /// Its lease and state, from the due queue.
    #[serde(default, flatten)]
    pub ticket: PollTicket,
}

impl Job for PollCardData {
    const QUEUE: &'static str = "carddata";
    const POLL: bool = true;
    // One entry per card: a producer's request merges into it.
    fn entry_id(&self) -> Option<String> {
        Some(self.card_ref.clone())
    }
}

impl Job for PollCardStatus {
    const QUEUE: &'static str = "card_status";
    const POLL: bool = true;
    fn entry_id(&self) -> Option<String> {
        Some(self.card_ref.clone())
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

/// One reconcile pass: `polling.reconcile_batch` cards from the cursor; or, with `full`, every
/// card (after Redis lost its data).
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
    fn a_producer_s_poll_payload_holds_only_the_card() {
        let job: PollCardData = serde_json::from_str(r#"{"card_ref":"c-1"}"#).unwrap();
        assert_eq!(job.card_ref, "c-1");
        assert_eq!(job.ticket, PollTicket::default());
        // A payload an older release wrote (with its chain fields) still decodes.
        let old: PollCardData =
            serde_json::from_str(r#"{"card_ref":"c-1","chain":"01J","failures":2,"turn":5}"#)
                .unwrap();
        assert_eq!(old.card_ref, "c-1");
    }

    #[test]
    fn the_ticket_round_trips_flat_in_the_payload() {
        let job = PollCardStatus {
            card_ref: "c-2".into(),
            ticket: PollTicket {
                lease: 1_125_900_000_000_000,
                due_ms: 1_764_000_000_000,
                state: "3|t0gmqo|ct0gmqa|2.1".into(),
            },
        };
        let json = serde_json::to_value(&job).unwrap();
        assert_eq!(json["state"], "3|t0gmqo|ct0gmqa|2.1");
        let back: PollCardStatus = serde_json::from_value(json).unwrap();
        assert_eq!(back, job);
    }
}
