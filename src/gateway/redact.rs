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
//! - in all of these, and in every value quoted by a failure reason ([`Redacted`]), a run of 12
//!   or more digits (possibly separated by single spaces or dashes) is masked.

use std::fmt;

use serde_json::Value;
use uuid::Uuid;

use super::wire::{CardData, CardStatus, PaymentQuery, PaymentRequest, PaymentResult};

/// Longest response or request summary kept, in bytes.
pub const SUMMARY_MAX_BYTES: usize = 512;

/// Longest single value quoted in a summary or a reason, in bytes.
const VALUE_MAX_BYTES: usize = 64;

/// A value from a body, redacted and truncated, fit to be quoted in a failure reason. The only
/// way to build one is [`Redacted::value`], so an error type that holds body values only as
/// `Redacted` cannot carry a card number.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Redacted(String);

impl Redacted {
    pub(crate) fn value(s: &str) -> Self {
        Self(summarize_str(s))
    }
}

impl fmt::Display for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Quotes like a `String` does, so `{:?}` renders `"value"`.
impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

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

/// A short, redacted rendering of one string value.
pub(super) fn summarize_str(s: &str) -> String {
    truncate(redact_digits(s), VALUE_MAX_BYTES)
}

/// Masks every run of 12 or more digits (allowing single spaces or dashes between them), which
/// could be a card number.
pub fn redact_digits(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit() {
            // Extend over digits and single separators between digits.
            let mut j = i;
            let mut digits = 0;
            let mut end = i;
            while j < chars.len() {
                if chars[j].is_ascii_digit() {
                    digits += 1;
                    j += 1;
                    end = j;
                } else if (chars[j] == ' ' || chars[j] == '-')
                    && j + 1 < chars.len()
                    && chars[j + 1].is_ascii_digit()
                {
                    j += 1;
                } else {
                    break;
                }
            }
            if digits >= 12 {
                out.push_str("[redacted]");
            } else {
                out.extend(&chars[i..end]);
            }
            i = end;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

/// Cuts `s` to at most `max` bytes on a char boundary, marking the cut with `...`.
pub(super) fn truncate(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut cut = max.saturating_sub(3);
    while cut > 0 && !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push_str("...");
    s
}

/// The JSON type of a value, for messages that must not quote the value itself.
pub(super) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn long_digit_runs_are_redacted() {
        assert_eq!(
            redact_digits("pan 4242 4242 4242 4242 ok"),
            "pan [redacted] ok"
        );
        assert_eq!(redact_digits("4242424242424242"), "[redacted]");
        assert_eq!(redact_digits("4242-4242-4242-4242"), "[redacted]");
        assert_eq!(redact_digits("tok_4242424242424242x"), "tok_[redacted]x");
        assert_eq!(
            redact_digits("last4 4242, year 2030"),
            "last4 4242, year 2030"
        );
        // Eleven digits are left alone, twelve are not.
        assert_eq!(redact_digits("12345678901"), "12345678901");
        assert_eq!(redact_digits("123456789012"), "[redacted]");
    }

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
    fn summaries_are_truncated_on_a_char_boundary() {
        let s = truncate("é".repeat(600), SUMMARY_MAX_BYTES);
        assert!(s.len() <= SUMMARY_MAX_BYTES);
        assert!(s.ends_with("..."));
        assert_eq!(truncate("short".to_owned(), SUMMARY_MAX_BYTES), "short");
    }

    #[test]
    fn a_redacted_value_quotes_like_a_string() {
        let r = Redacted::value("pan 4111111111111111");
        assert_eq!(format!("{r:?}"), "\"pan [redacted]\"");
        assert_eq!(r.to_string(), "pan [redacted]");
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
