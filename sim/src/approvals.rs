//! The simulator's approval book (spec section 7): what it saw of each approval id, and the pure
//! decisions on it.
//!
//! A new approval is answered `in_review` with probability `approval_in_review_rate`, else
//! decided at once (`declined` with probability `approval_decline_rate`, else `approved`). One in
//! review is decided `approval_review_ms` after its POST (declined with the same probability),
//! which a later `GET` (the worker's recovery query) then answers: that is how `make run` shows an
//! approval move from `in_review` to a decision. Answers are idempotent: an approval on record is
//! answered as recorded, whatever the dice say now.
//!
//! Nothing here sleeps, locks or speaks HTTP (the routes are `approval_routes.rs`); randomness
//! comes in as an `Rng`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cardworker_wire::{ApprovalRequest, ApprovalResult, ApprovalStatus};
use serde::Serialize;
use uuid::Uuid;

/// What the simulator saw of one approval id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ApprovalRecord {
    /// The `Idempotency-Key` of each `POST /v1/approvals` for this id, in order (`""` when
    /// absent).
    pub idempotency_keys: Vec<String>,
    /// What `GET` answers; `None` means 404.
    pub stored: Option<ApprovalResult>,
    /// For one in review: the decision it gets, and when.
    #[serde(skip)]
    pub(crate) pending_decision: Option<(ApprovalStatus, Instant)>,
}

impl ApprovalRecord {
    /// The record as of now: an in-review approval whose time has come is decided.
    fn settle_due(&mut self, now: Instant) {
        if let (Some(stored), Some((decision, at))) = (&mut self.stored, self.pending_decision) {
            if now >= at {
                stored.status = decision;
                self.pending_decision = None;
            }
        }
    }
}

/// Every approval the simulator saw.
pub(crate) type Approvals = HashMap<Uuid, ApprovalRecord>;

/// The dice of a new approval, from the config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ApprovalDice {
    pub in_review_rate: f64,
    pub decline_rate: f64,
    pub review_ms: u64,
}

/// Acts on one POST (already counted with its key) and answers it (module docs).
pub(crate) fn submit(
    approvals: &mut Approvals,
    req: &ApprovalRequest,
    dice: ApprovalDice,
    rng: &mut impl rand::Rng,
) -> ApprovalResult {
    let now = Instant::now();
    let rec = approvals.entry(req.approval_id).or_default();
    rec.settle_due(now);
    if let Some(stored) = &rec.stored {
        return stored.clone();
    }
    let decision = if rng.random_bool(dice.decline_rate) {
        ApprovalStatus::Declined
    } else {
        ApprovalStatus::Approved
    };
    let status = if rng.random_bool(dice.in_review_rate) {
        rec.pending_decision = Some((decision, now + Duration::from_millis(dice.review_ms)));
        ApprovalStatus::InReview
    } else {
        decision
    };
    let result = ApprovalResult {
        approval_id: req.approval_id,
        status,
        channel_ref: format!("ch_{}", req.approval_id.simple()),
    };
    rec.stored = Some(result.clone());
    result
}

/// What `GET` answers now; `None` is 404.
pub(crate) fn query(approvals: &mut Approvals, id: Uuid) -> Option<ApprovalResult> {
    let rec = approvals.get_mut(&id)?;
    rec.settle_due(Instant::now());
    rec.stored.clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: Uuid) -> ApprovalRequest {
        ApprovalRequest {
            approval_id: id,
            card_ref: "c-1".to_owned(),
            kind: "issue".to_owned(),
            amount_minor: None,
        }
    }

    #[test]
    fn an_approval_in_review_is_decided_after_the_review_time_and_answered_the_same_ever_after() {
        let mut approvals = Approvals::new();
        let id = Uuid::new_v4();
        let dice = ApprovalDice {
            in_review_rate: 1.0,
            decline_rate: 1.0,
            review_ms: 0,
        };
        let first = submit(&mut approvals, &req(id), dice, &mut rand::rng());
        assert_eq!(first.status, ApprovalStatus::InReview);
        assert_eq!(
            query(&mut approvals, id).map(|r| r.status),
            Some(ApprovalStatus::Declined)
        );
        let never = ApprovalDice {
            in_review_rate: 0.0,
            decline_rate: 0.0,
            review_ms: 0,
        };
        let again = submit(&mut approvals, &req(id), never, &mut rand::rng());
        assert_eq!(again.status, ApprovalStatus::Declined, "idempotent");
        assert_eq!(query(&mut approvals, Uuid::new_v4()), None);
    }
}
