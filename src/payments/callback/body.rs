//! A callback's body (spec 1b): what is parsed, what is stored and queued, and which keys and
//! identifiers the contract accepts. Everything here is pure: no database, no Redis.

use std::str::FromStr as _;

use serde::Deserialize;
use uuid::Uuid;

use crate::gateway::{redact_digits, CardStatus, PaymentStatus};
use crate::storage::ident::{self, IdentError};

/// The body of a callback (spec 1b).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "type")]
pub enum CallbackBody {
    /// A card status change.
    #[serde(rename = "card.status")]
    CardStatus {
        /// The card.
        card_ref: String,
        /// The new status.
        status: String,
    },
    /// A payment result.
    #[serde(rename = "payment.result")]
    PaymentResult {
        /// The payment.
        payment_id: Uuid,
        /// `accepted` or `rejected`.
        status: String,
        /// The channel's reference.
        channel_ref: String,
    },
    /// An approval's decision (spec section 7).
    #[serde(rename = "approval.result")]
    ApprovalResult {
        /// The approval.
        approval_id: Uuid,
        /// `approved` or `declined`.
        status: String,
        /// The channel's reference.
        channel_ref: String,
    },
}

/// The fields of a callback body the contract knows (spec 1b): only these are stored.
const KNOWN_FIELDS: [&str; 6] = [
    "type",
    "card_ref",
    "status",
    "payment_id",
    "approval_id",
    "channel_ref",
];

/// A body as it is stored and queued: a JSON object reduced to its `KNOWN_FIELDS` (anything else
/// a channel sent, a card number in an extra field say, is dropped), with its identifiers
/// (`card_ref`, `payment_id`, `approval_id`, `channel_ref`) kept exactly and its free fields
/// (`type`, `status`, and any value of an unexpected JSON type) masked for card numbers
/// (`storage::fault::clean_json`); anything that is not a JSON object is replaced by a note of
/// its size. Parsing it gives what parsing the raw body gives, so the stored body is also what a
/// re-enqueued delivery is processed from, and it may be written anywhere: PostgreSQL, the
/// callback job's payload in Redis, a log line.
pub fn known_fields(body: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(o)) => {
            let kept: serde_json::Map<String, serde_json::Value> = o
                .into_iter()
                .filter(|(k, _)| KNOWN_FIELDS.contains(&k.as_str()))
                .collect();
            let kept = serde_json::Value::Object(kept);
            crate::storage::fault::clean_json(&kept).to_string()
        }
        _ => format!("(not stored: not a JSON object, {} bytes)", body.len()),
    }
}

/// Refuses a callback whose `channel` or `callback_id` the contract forbids (empty, too long,
/// a control character: `storage::ident`). Such a callback has no key to be recorded under.
pub fn check_key(channel: &str, callback_id: &str) -> Result<(), IdentError> {
    ident::check("channel", channel)?;
    ident::check("callback_id", callback_id)
}

/// Parses and validates a raw body. The error is the reason kept on the failed row.
///
/// The reason of a refused body is stored and logged, and serde quotes the values it refuses, so
/// every run of digits that could be a card number is masked first.
pub fn parse(body: &str) -> Result<CallbackBody, String> {
    let refused = |why: String| redact_digits(&format!("malformed body: {why}"));
    let parsed: CallbackBody = serde_json::from_str(body).map_err(|e| refused(e.to_string()))?;
    let identifier =
        |what, value: &str| ident::check(what, value).map_err(|e| format!("malformed body: {e}"));
    match &parsed {
        CallbackBody::CardStatus { status, card_ref } => {
            identifier("card_ref", card_ref)?;
            CardStatus::from_str(status).map_err(|e| refused(e.to_string()))?;
        }
        CallbackBody::PaymentResult {
            status,
            channel_ref,
            ..
        } => {
            identifier("channel_ref", channel_ref)?;
            PaymentStatus::from_str(status).map_err(|_| {
                refused(format!(
                    "payment status {status:?} is not accepted or rejected"
                ))
            })?;
        }
        CallbackBody::ApprovalResult {
            status,
            channel_ref,
            ..
        } => {
            identifier("channel_ref", channel_ref)?;
            if !matches!(status.as_str(), "approved" | "declined") {
                return Err(refused(format!(
                    "approval status {status:?} is not approved or declined"
                )));
            }
        }
    }
    Ok(parsed)
}

/// The resource a callback is about, read loosely so that a malformed body that still names its
/// card or payment is found by `investigate`.
pub(super) fn loose_resource(body: &str) -> Option<(&'static str, String)> {
    let value: serde_json::Value = serde_json::from_str(body).ok()?;
    [
        ("card_ref", "card"),
        ("payment_id", "payment"),
        ("approval_id", "approval"),
    ]
    .into_iter()
    .find_map(|(field, resource)| {
        value
            .get(field)
            .and_then(|v| v.as_str())
            .filter(|id| ident::check(field, id).is_ok())
            .map(|id| (resource, id.to_owned()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_body_keeps_only_the_known_fields() {
        let body = r#"{"type":"card.status","card_ref":"c-1","status":"frozen","pan":"4111111111111111","note":{"x":1}}"#;
        let stored = known_fields(body);
        assert!(
            !stored.contains("4111") && !stored.contains("note"),
            "{stored}"
        );
        assert_eq!(parse(&stored), parse(body));
        assert_eq!(
            known_fields("card 4111 1111 1111 1111"),
            "(not stored: not a JSON object, 24 bytes)"
        );
    }

    #[test]
    fn a_refused_body_names_the_problem_without_quoting_a_card_number() {
        for body in [
            r#"{"type":"card.status","card_ref":4111111111111111,"status":"frozen"}"#,
            r#"{"type":"card.status","card_ref":"c-1","status":"4111 1111 1111 1111"}"#,
            r#"{"type":"payment.result","payment_id":"4111111111111111","status":"accepted","channel_ref":"x"}"#,
        ] {
            let reason = parse(body).expect_err(body);
            assert!(reason.starts_with("malformed body: "), "{reason}");
            assert!(!reason.contains("4111111111111111"), "{reason}");
            assert!(!reason.contains("4111 1111 1111 1111"), "{reason}");
        }
    }

    #[test]
    fn a_valid_card_status_callback_parses() {
        let body = r#"{"type":"card.status","card_ref":"c-1","status":"frozen"}"#;
        assert!(matches!(parse(body), Ok(CallbackBody::CardStatus { .. })));
    }
}
