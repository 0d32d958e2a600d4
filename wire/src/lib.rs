//! The wire types of the Gateway contract (spec sections 1 and 7): the header names, the request
//! and response bodies, the enums of card states and statuses, of payment and approval statuses,
//! and [`CallKind`], the six calls by the names metrics and config sections use.
//!
//! Both sides of the contract share them: the worker's Gateway client (`cardworker::gateway`,
//! which re-exports every name here) and the Gateway simulator (`cardworker-sim`). So this crate
//! holds only plain data: serde derives, `as_str` labels and `FromStr` for the status strings.
//!
//! # What stays in the worker
//! How a response body is *read* stays in `cardworker`'s `gateway/wire.rs`: the worker does not
//! decode Gateway answers with serde derive, because a serde error quotes the offending value
//! (possibly a card number) and a decoding failure becomes a stored reason. Those decoders mask
//! digit runs and check a card token for a PAN with the worker's one PAN masker, so they belong
//! beside it, not in a crate the simulator depends on. Nothing here carries masking: the
//! `Deserialize` derives below are for the simulator reading requests and for tests, and
//! [`UnknownStatus`] quotes its value unredacted for that reason (the worker's decoders never use
//! it in a reason).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Header carrying the per-call correlation id.
pub const CORRELATION_HEADER: &str = "X-Correlation-Id";

/// Header carrying the payment id on `POST /v1/payments`.
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// The six Gateway calls, as named in metric labels and config sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    Carddata,
    CardStatus,
    PaymentSubmit,
    PaymentQuery,
    ApprovalSubmit,
    ApprovalQuery,
}

impl CallKind {
    /// Every call kind, in a fixed order.
    pub const ALL: [CallKind; 6] = [
        CallKind::Carddata,
        CallKind::CardStatus,
        CallKind::PaymentSubmit,
        CallKind::PaymentQuery,
        CallKind::ApprovalSubmit,
        CallKind::ApprovalQuery,
    ];

    /// The label value used in metrics (`carddata`, `card_status`, `payment_submit`,
    /// `payment_query`).
    pub fn as_str(self) -> &'static str {
        match self {
            CallKind::Carddata => "carddata",
            CallKind::CardStatus => "card_status",
            CallKind::PaymentSubmit => "payment_submit",
            CallKind::PaymentQuery => "payment_query",
            CallKind::ApprovalSubmit => "approval_submit",
            CallKind::ApprovalQuery => "approval_query",
        }
    }
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer of `GET /v1/cards/{card_ref}/data`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum CardData {
    Pending,
    Ready {
        card_token: String,
        pan_last4: String,
        expiry_month: u32,
        expiry_year: u32,
    },
}

impl CardData {
    pub fn state(&self) -> &'static str {
        match self {
            CardData::Pending => "pending",
            CardData::Ready { .. } => "ready",
        }
    }
}

/// The answer of `GET /v1/cards/{card_ref}/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CardStatus {
    Inactive,
    Active,
    Frozen,
    Cancelled,
    Expired,
}

impl CardStatus {
    pub const ALL: [CardStatus; 5] = [
        CardStatus::Inactive,
        CardStatus::Active,
        CardStatus::Frozen,
        CardStatus::Cancelled,
        CardStatus::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CardStatus::Inactive => "inactive",
            CardStatus::Active => "active",
            CardStatus::Frozen => "frozen",
            CardStatus::Cancelled => "cancelled",
            CardStatus::Expired => "expired",
        }
    }

    /// A final status is never left again: the card needs no more status polling.
    pub fn is_final(self) -> bool {
        matches!(self, CardStatus::Cancelled | CardStatus::Expired)
    }
}

impl fmt::Display for CardStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status string outside the list of spec section 1.
///
/// Its message quotes the value as given (unredacted); the worker's Gateway decoders never use
/// it in a reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown status value {0:?}")]
pub struct UnknownStatus(pub String);

impl FromStr for CardStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CardStatus::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

/// The body of `POST /v1/payments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRequest {
    pub payment_id: Uuid,
    pub card_ref: String,
    pub amount_minor: i64,
    pub currency: String,
}

/// What the Gateway decided about a payment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentStatus {
    Accepted,
    Rejected,
}

impl PaymentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PaymentStatus::Accepted => "accepted",
            PaymentStatus::Rejected => "rejected",
        }
    }
}

impl fmt::Display for PaymentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PaymentStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "accepted" => Ok(PaymentStatus::Accepted),
            "rejected" => Ok(PaymentStatus::Rejected),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// The answer of `POST /v1/payments` and `GET /v1/payments/{payment_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentResult {
    pub payment_id: Uuid,
    pub status: PaymentStatus,
    pub channel_ref: String,
}

/// The answer of `GET /v1/payments/{payment_id}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentQuery {
    Found(PaymentResult),
    /// 404: the Gateway never saw that payment.
    NotFound,
}

/// The kinds of approval a channel decides (spec section 7).
pub const APPROVAL_KINDS: [&str; 3] = ["issue", "limit_change", "unfreeze"];

/// The body of `POST /v1/approvals`: `amount_minor` only for `limit_change`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalRequest {
    pub approval_id: Uuid,
    pub card_ref: String,
    /// One of [`APPROVAL_KINDS`].
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount_minor: Option<i64>,
}

/// What the Gateway answered about an approval: a decision, or `in_review` (not yet one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    Approved,
    Declined,
    InReview,
}

impl ApprovalStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Declined => "declined",
            ApprovalStatus::InReview => "in_review",
        }
    }
}

impl fmt::Display for ApprovalStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ApprovalStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "approved" => Ok(ApprovalStatus::Approved),
            "declined" => Ok(ApprovalStatus::Declined),
            "in_review" => Ok(ApprovalStatus::InReview),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// The answer of `POST /v1/approvals` and `GET /v1/approvals/{approval_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalResult {
    pub approval_id: Uuid,
    pub status: ApprovalStatus,
    pub channel_ref: String,
}

/// The answer of `GET /v1/approvals/{approval_id}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApprovalQuery {
    Found(ApprovalResult),
    /// 404: the Gateway never saw that approval.
    NotFound,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn card_status_round_trips_and_knows_final_states() {
        for st in CardStatus::ALL {
            assert_eq!(st.as_str().parse::<CardStatus>(), Ok(st));
        }
        assert!(CardStatus::Cancelled.is_final());
        assert!(CardStatus::Expired.is_final());
        assert!(!CardStatus::Frozen.is_final());
        assert_eq!(
            "weird".parse::<CardStatus>().map_err(|e| e.to_string()),
            Err("unknown status value \"weird\"".to_owned())
        );
    }

    #[test]
    fn labels_match_the_serde_names() -> Result<(), serde_json::Error> {
        for kind in CallKind::ALL {
            assert_eq!(serde_json::to_value(kind)?, json!(kind.as_str()));
        }
        for st in CardStatus::ALL {
            assert_eq!(serde_json::to_value(st)?, json!(st.as_str()));
        }
        for st in [PaymentStatus::Accepted, PaymentStatus::Rejected] {
            assert_eq!(st.as_str().parse::<PaymentStatus>(), Ok(st));
            assert_eq!(serde_json::to_value(st)?, json!(st.as_str()));
        }
        for st in [
            ApprovalStatus::Approved,
            ApprovalStatus::Declined,
            ApprovalStatus::InReview,
        ] {
            assert_eq!(st.as_str().parse::<ApprovalStatus>(), Ok(st));
            assert_eq!(serde_json::to_value(st)?, json!(st.as_str()));
        }
        Ok(())
    }
}
