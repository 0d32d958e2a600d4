//! PAN-safe text about Gateway calls: the request and response summaries kept in integration
//! logs and log lines, and the redaction primitives every other gateway module uses when it
//! puts a value from a body into a message.
//!
//! Spec section 1 forbids logging or storing a full card number (PAN) or CVV, and a summary or
//! a failure reason is both logged and stored. So this module is the one place that decides what
//! may leave a body:
//! - a body that parsed is summarised from its typed, validated fields ([`Summarize`]);
//! - a JSON body that did not validate shows only whitelisted fields ([`SAFE_FIELDS`]) with
//!   their values, and the *names* of the other fields;
//! - a body that is not JSON is a truncated excerpt;
//! - in all of these, and in every value quoted by a failure reason (`mask::Redacted`), a run
//!   of 12 or more digits (possibly separated by single spaces or dashes) is masked.
//!
//! The masking primitives themselves live in `mask.rs`, below both this module and the wire
//! decoders, so that neither imports the other.

use serde_json::Value;
use uuid::Uuid;

use super::mask::{json_type, redact_digits, summarize_str, truncate};
use super::wire::{
    ApprovalQuery, ApprovalRequest, ApprovalResult, CardData, CardStatus, PaymentQuery,
    PaymentRequest, PaymentResult,
};

/// Longest response or request summary kept, in bytes.
pub const SUMMARY_MAX_BYTES: usize = 512;

/// `GET /v1/cards/{card_ref}/{what}`.
pub(super) fn card_request_summary(card_ref: &str, what: &str) -> String {
    truncate(
        format!("GET /v1/cards/{}/{what}", summarize_str(card_ref)),
        SUMMARY_MAX_BYTES,
    )
}

/// `POST /v1/payments` and the request fields (none of them sensitive, all but the id redacted
/// anyway).
pub(super) fn submit_request_summary(req: &PaymentRequest) -> String {
    truncate(
        format!(
            "POST /v1/payments payment_id={} card_ref={} amount_minor={} currency={}",
            req.payment_id,
            summarize_str(&req.card_ref),
            req.amount_minor,
            summarize_str(&req.currency)
        ),
        SUMMARY_MAX_BYTES,
    )
}

/// `GET /v1/payments/{payment_id}`.
pub(super) fn query_request_summary(payment_id: Uuid) -> String {
    format!("GET /v1/payments/{payment_id}")
}

/// `POST /v1/approvals` and the request fields.
pub(super) fn approval_request_summary(req: &ApprovalRequest) -> String {
    let amount = req
        .amount_minor
        .map_or_else(String::new, |a| format!(" amount_minor={a}"));
    truncate(
        format!(
            "POST /v1/approvals approval_id={} card_ref={} kind={}{amount}",
            req.approval_id,
            summarize_str(&req.card_ref),
            summarize_str(&req.kind),
        ),
        SUMMARY_MAX_BYTES,
    )
}

/// `GET /v1/approvals/{approval_id}`.
pub(super) fn approval_query_summary(approval_id: Uuid) -> String {
    format!("GET /v1/approvals/{approval_id}")
}

/// A log-safe summary of a parsed answer.
pub(super) trait Summarize {
    fn summary(&self) -> String;
}

impl Summarize for CardData {
    fn summary(&self) -> String {
        match self {
            CardData::Pending => "state=pending".to_owned(),
            CardData::Ready {
                card_token,
                pan_last4,
                expiry_month,
                expiry_year,
            } => format!(
                "state=ready card_token={} pan_last4={pan_last4} expiry={expiry_month:02}/{expiry_year}",
                summarize_str(card_token)
            ),
        }
    }
}

impl Summarize for CardStatus {
    fn summary(&self) -> String {
        format!("status={}", self.as_str())
    }
}

impl Summarize for PaymentResult {
    fn summary(&self) -> String {
        format!(
            "payment_id={} status={} channel_ref={}",
            self.payment_id,
            self.status,
            summarize_str(&self.channel_ref)
        )
    }
}

impl Summarize for ApprovalResult {
    fn summary(&self) -> String {
        format!(
            "approval_id={} status={} channel_ref={}",
            self.approval_id,
            self.status,
            summarize_str(&self.channel_ref)
        )
    }
}

impl Summarize for ApprovalQuery {
    fn summary(&self) -> String {
        match self {
            ApprovalQuery::Found(r) => r.summary(),
            ApprovalQuery::NotFound => "not found".to_owned(),
        }
    }
}

impl Summarize for PaymentQuery {
    fn summary(&self) -> String {
        match self {
            PaymentQuery::Found(r) => r.summary(),
            PaymentQuery::NotFound => "not found".to_owned(),
        }
    }
}

/// Fields whose values may appear in a summary of a JSON body that did not validate.
const SAFE_FIELDS: &[&str] = &[
    "card_ref",
    "state",
    "status",
    "card_token",
    "pan_last4",
    "expiry_month",
    "expiry_year",
    "payment_id",
    "approval_id",
    "kind",
    "channel_ref",
    "error",
    "code",
];

/// A summary of a JSON body that did not validate: whitelisted fields with their values, the
/// names of the other fields, never their values.
pub(super) fn json_summary(v: &Value) -> String {
    let Some(o) = v.as_object() else {
        return format!("JSON {}", json_type(v));
    };
    let mut parts = Vec::new();
    let mut others = Vec::new();
    for (k, val) in o {
        if SAFE_FIELDS.contains(&k.as_str()) {
            let shown = match val {
                Value::String(s) => format!("{:?}", summarize_str(s)),
                Value::Number(n) => redact_digits(&n.to_string()),
                Value::Bool(b) => b.to_string(),
                Value::Null => "null".to_owned(),
                other => format!("<{}>", json_type(other)),
            };
            parts.push(format!("{k}={shown}"));
        } else {
            others.push(summarize_str(k));
        }
    }
    if !others.is_empty() {
        parts.push(format!("other_fields=[{}]", others.join(",")));
    }
    truncate(format!("JSON {{{}}}", parts.join(" ")), SUMMARY_MAX_BYTES)
}

/// A summary of a body that is not (or not known to be) JSON: a truncated excerpt, with long
/// digit runs (possible card numbers) masked. A body that is JSON after all is summarised by
/// [`json_summary`].
pub(super) fn body_summary(body: &[u8]) -> String {
    if body.is_empty() {
        return "empty body".to_owned();
    }
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return json_summary(&v);
    }
    let head = &body[..body.len().min(SUMMARY_MAX_BYTES * 2)];
    let text = String::from_utf8_lossy(head);
    let cleaned: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate(
        format!("{} bytes: {}", body.len(), redact_digits(&cleaned)),
        SUMMARY_MAX_BYTES,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_json_summary_never_shows_unlisted_values() {
        let v = json!({"card_ref": "c-1", "pan": "4242424242424242", "cvv": "123"});
        let s = json_summary(&v);
        assert!(s.contains("card_ref=\"c-1\""), "{s}");
        assert!(!s.contains("4242"), "{s}");
        assert!(!s.contains("123"), "{s}");
        assert!(s.contains("other_fields=[pan,cvv]") || s.contains("other_fields=[cvv,pan]"));
    }

    #[test]
    fn a_json_summary_masks_card_numbers_in_listed_fields_and_keys() {
        let v = json!({
            "card_token": "4111111111111111",
            "pan_last4": "4111111111111111",
            "expiry_year": 4111111111111111u64,
            "4111111111111111": 1,
            "status": ["4111111111111111"],
        });
        let s = json_summary(&v);
        assert!(!s.contains("4111111111111111"), "{s}");
        assert!(s.contains("card_token=\"[redacted]\""), "{s}");
        assert!(s.contains("pan_last4=\"[redacted]\""), "{s}");
        assert!(s.contains("expiry_year=[redacted]"), "{s}");
        assert!(s.contains("status=<array>"), "{s}");
        assert_eq!(json_summary(&json!([1, 2])), "JSON array");
    }

    #[test]
    fn a_body_summary_masks_and_cleans_a_non_json_body() {
        assert_eq!(body_summary(b""), "empty body");
        assert_eq!(
            body_summary(b"card 4111 1111 1111 1111\nrefused"),
            "32 bytes: card [redacted] refused"
        );
        // JSON is summarised field by field even when it came with an error status.
        assert_eq!(
            body_summary(br#"{"error":"nope","pan":"4111111111111111"}"#),
            "JSON {error=\"nope\" other_fields=[pan]}"
        );
    }

    #[test]
    fn parsed_answers_are_summarised_from_their_fields() {
        let ready = CardData::Ready {
            card_token: "tok_1".into(),
            pan_last4: "4242".into(),
            expiry_month: 3,
            expiry_year: 2030,
        };
        assert_eq!(
            ready.summary(),
            "state=ready card_token=tok_1 pan_last4=4242 expiry=03/2030"
        );
        assert_eq!(CardData::Pending.summary(), "state=pending");
        assert_eq!(CardStatus::Frozen.summary(), "status=frozen");
        assert_eq!(PaymentQuery::NotFound.summary(), "not found");
    }
}
