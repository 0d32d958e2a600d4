//! How a Gateway response body is read into the contract's wire types. The types themselves
//! (header names, request and response bodies, the status enums, [`CallKind`]) live in the
//! `cardworker-wire` crate, shared with the simulator, and are re-exported here and from
//! [`crate::gateway`].
//!
//! # Why response bodies are read by hand
//! The types derive `Serialize`/`Deserialize` (the client sends [`PaymentRequest`] with it and
//! the simulator writes every answer with it), but the worker does **not** read Gateway answers
//! with `serde` derive. A `serde_json` error quotes the offending value — `invalid type: string
//! "4111111111111111", expected u32`, ``unknown variant `4111…` `` — and a failure reason is
//! logged and stored in integration logs, where spec section 1 forbids a card number. So the
//! decoders below walk a [`serde_json::Value`] field by field and fail with a [`BodyError`],
//! which by construction holds only field names, JSON type names, numbers bounded far below
//! card-number length, and body values wrapped in [`Redacted`] (digit runs masked). The same
//! walk checks what derive could not: that the answer names the card or payment that was asked
//! about, and that `pan_last4` and the expiry are plausible. The reason texts are an interface
//! of sorts (operators read them in `investigate`), so they are fixed here, one per variant.
//!
//! The decoders stay in the worker, not in `cardworker-wire`, because they use the masker
//! ([`super::mask`]) and the PAN check of [`crate::telemetry::pan`]; the tests that pin each
//! decoder's refusals (a PAN never in a reason) stand beside them.

use std::str::FromStr;

use serde_json::{Map, Value};
use uuid::Uuid;

use super::mask::{json_type, redact_digits, Redacted};

pub use cardworker_wire::{
    ApprovalQuery, ApprovalRequest, ApprovalResult, ApprovalStatus, CallKind, CardData, CardStatus,
    PaymentQuery, PaymentRequest, PaymentResult, PaymentStatus, UnknownStatus, APPROVAL_KINDS,
    CORRELATION_HEADER, IDEMPOTENCY_HEADER,
};

/// Why a JSON answer is not the body the contract promises. The `Display` text becomes the
/// [`Failure::reason`](super::Failure) of an `Unknown` outcome.
///
/// No variant holds raw body text: see the module doc.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BodyError {
    #[error("body is a JSON {0}, not an object")]
    NotAnObject(&'static str),
    #[error("missing field {0}")]
    MissingField(&'static str),
    #[error("field {field} is a {found}, not a string")]
    NotAString {
        field: &'static str,
        found: &'static str,
    },
    #[error("field {field} is a {found}, not an integer")]
    NotAnInteger {
        field: &'static str,
        found: &'static str,
    },
    /// `value` is the number as written, with long digit runs masked.
    #[error("field {field} is not a small non-negative integer: {value}")]
    NotASmallInteger { field: &'static str, value: String },
    #[error("field {0} is empty")]
    Empty(&'static str),
    /// A token that holds a card number is not a token: never stored, the answer is unknown.
    #[error("field {0} looks like a card number (PAN); not stored")]
    LooksLikePan(&'static str),
    #[error("field pan_last4 is not exactly 4 digits")]
    BadLast4,
    #[error("field expiry_month out of 1..=12: {0}")]
    BadExpiryMonth(u32),
    #[error("field expiry_year out of 2000..=9999: {0}")]
    BadExpiryYear(u32),
    #[error("card_ref mismatch: asked {asked}, got {got}")]
    CardRefMismatch { asked: Redacted, got: Redacted },
    #[error("field {0} is not a UUID: {1:?}")]
    NotAUuid(&'static str, Redacted),
    #[error("{field} mismatch: asked {asked}, got {got}")]
    IdMismatch {
        field: &'static str,
        asked: Uuid,
        got: Uuid,
    },
    #[error("unknown state value {0:?}")]
    UnknownState(Redacted),
    #[error("unknown status value {0:?}")]
    UnknownStatus(Redacted),
}

/// Reads the answer of `GET /v1/cards/{card_ref}/data` asked about `card_ref`.
pub(crate) fn card_data(v: &Value, card_ref: &str) -> Result<CardData, BodyError> {
    let o = object(v)?;
    check_card_ref(o, card_ref)?;
    match field_str(o, "state")? {
        "pending" => Ok(CardData::Pending),
        "ready" => {
            let card_token = field_str(o, "card_token")?;
            if card_token.is_empty() {
                return Err(BodyError::Empty("card_token"));
            }
            if crate::telemetry::pan::contains_pan(card_token) {
                return Err(BodyError::LooksLikePan("card_token"));
            }
            let pan_last4 = field_str(o, "pan_last4")?;
            if pan_last4.len() != 4 || !pan_last4.bytes().all(|b| b.is_ascii_digit()) {
                return Err(BodyError::BadLast4);
            }
            let expiry_month = field_u32(o, "expiry_month")?;
            if !(1..=12).contains(&expiry_month) {
                return Err(BodyError::BadExpiryMonth(expiry_month));
            }
            let expiry_year = field_u32(o, "expiry_year")?;
            if !(2000..=9999).contains(&expiry_year) {
                return Err(BodyError::BadExpiryYear(expiry_year));
            }
            Ok(CardData::Ready {
                card_token: card_token.to_owned(),
                pan_last4: pan_last4.to_owned(),
                expiry_month,
                expiry_year,
            })
        }
        other => Err(BodyError::UnknownState(Redacted::value(other))),
    }
}

/// Reads the answer of `GET /v1/cards/{card_ref}/status` asked about `card_ref`.
pub(crate) fn card_status(v: &Value, card_ref: &str) -> Result<CardStatus, BodyError> {
    let o = object(v)?;
    check_card_ref(o, card_ref)?;
    let status = field_str(o, "status")?;
    status
        .parse::<CardStatus>()
        .map_err(|_| BodyError::UnknownStatus(Redacted::value(status)))
}

/// Reads the answer of `POST /v1/payments` or `GET /v1/payments/{payment_id}` asked about
/// `payment_id`.
pub(crate) fn payment_result(v: &Value, payment_id: Uuid) -> Result<PaymentResult, BodyError> {
    let (status, channel_ref) = decision_body(v, "payment_id", payment_id)?;
    Ok(PaymentResult {
        payment_id,
        status,
        channel_ref,
    })
}

/// Reads the answer of `POST /v1/approvals` or `GET /v1/approvals/{approval_id}` asked about
/// `approval_id`.
pub(crate) fn approval_result(v: &Value, approval_id: Uuid) -> Result<ApprovalResult, BodyError> {
    let (status, channel_ref) = decision_body(v, "approval_id", approval_id)?;
    Ok(ApprovalResult {
        approval_id,
        status,
        channel_ref,
    })
}

/// The shape both reliable calls answer with: `{<id_field>: <uuid>, "status": S,
/// "channel_ref": "…"}`, naming the id that was asked about, with S one of `Status`'s values.
fn decision_body<S: FromStr>(
    v: &Value,
    id_field: &'static str,
    asked: Uuid,
) -> Result<(S, String), BodyError> {
    let o = object(v)?;
    let got = field_str(o, id_field)?;
    let got =
        Uuid::parse_str(got).map_err(|_| BodyError::NotAUuid(id_field, Redacted::value(got)))?;
    if got != asked {
        return Err(BodyError::IdMismatch {
            field: id_field,
            asked,
            got,
        });
    }
    let status = field_str(o, "status")?;
    let status = status
        .parse::<S>()
        .map_err(|_| BodyError::UnknownStatus(Redacted::value(status)))?;
    let channel_ref = field_str(o, "channel_ref")?;
    Ok((status, channel_ref.to_owned()))
}

fn object(v: &Value) -> Result<&Map<String, Value>, BodyError> {
    v.as_object()
        .ok_or_else(|| BodyError::NotAnObject(json_type(v)))
}

fn field_str<'a>(o: &'a Map<String, Value>, field: &'static str) -> Result<&'a str, BodyError> {
    match o.get(field) {
        None => Err(BodyError::MissingField(field)),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(BodyError::NotAString {
            field,
            found: json_type(other),
        }),
    }
}

fn field_u32(o: &Map<String, Value>, field: &'static str) -> Result<u32, BodyError> {
    match o.get(field) {
        None => Err(BodyError::MissingField(field)),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| BodyError::NotASmallInteger {
                field,
                value: redact_digits(&n.to_string()),
            }),
        Some(other) => Err(BodyError::NotAnInteger {
            field,
            found: json_type(other),
        }),
    }
}

fn check_card_ref(o: &Map<String, Value>, asked: &str) -> Result<(), BodyError> {
    let got = field_str(o, "card_ref")?;
    if got != asked {
        return Err(BodyError::CardRefMismatch {
            asked: Redacted::value(asked),
            got: Redacted::value(got),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fmt;

    use super::*;
    use serde_json::json;

    fn ready(overrides: Value) -> Value {
        let mut v = json!({"card_ref": "c-1", "state": "ready", "card_token": "tok_1",
                           "pan_last4": "4242", "expiry_month": 12, "expiry_year": 2030});
        if let (Some(o), Some(extra)) = (v.as_object_mut(), overrides.as_object()) {
            for (k, val) in extra {
                o.insert(k.clone(), val.clone());
            }
        }
        v
    }

    fn reason<T: fmt::Debug>(r: Result<T, BodyError>) -> String {
        match r {
            Ok(v) => panic!("expected an error, got {v:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_spec_bodies_decode() {
        assert_eq!(
            card_data(&json!({"card_ref": "c-1", "state": "pending"}), "c-1"),
            Ok(CardData::Pending)
        );
        assert_eq!(
            card_data(&ready(json!({})), "c-1"),
            Ok(CardData::Ready {
                card_token: "tok_1".into(),
                pan_last4: "4242".into(),
                expiry_month: 12,
                expiry_year: 2030,
            })
        );
        assert_eq!(
            card_status(&json!({"card_ref": "c-1", "status": "frozen"}), "c-1"),
            Ok(CardStatus::Frozen)
        );
        let id = Uuid::new_v4();
        assert_eq!(
            payment_result(
                &json!({"payment_id": id.to_string(), "status": "rejected", "channel_ref": "ch"}),
                id
            ),
            Ok(PaymentResult {
                payment_id: id,
                status: PaymentStatus::Rejected,
                channel_ref: "ch".into(),
            })
        );
    }

    #[test]
    fn every_decoding_failure_has_its_fixed_reason() {
        let cases: Vec<(Result<CardData, BodyError>, &str)> = vec![
            (
                card_data(&json!([]), "c-1"),
                "body is a JSON array, not an object",
            ),
            (
                card_data(&json!({"state": "pending"}), "c-1"),
                "missing field card_ref",
            ),
            (
                card_data(&json!({"card_ref": 7, "state": "pending"}), "c-1"),
                "field card_ref is a number, not a string",
            ),
            (
                card_data(&json!({"card_ref": "c-2", "state": "pending"}), "c-1"),
                "card_ref mismatch: asked c-1, got c-2",
            ),
            (
                card_data(&json!({"card_ref": "c-1", "state": "weird"}), "c-1"),
                "unknown state value \"weird\"",
            ),
            (
                card_data(&ready(json!({"card_token": ""})), "c-1"),
                "field card_token is empty",
            ),
            (
                card_data(
                    &ready(json!({"card_token": "tok_4111.1111.1111.1111"})),
                    "c-1",
                ),
                "field card_token looks like a card number (PAN); not stored",
            ),
            (
                card_data(&ready(json!({"pan_last4": "424"})), "c-1"),
                "field pan_last4 is not exactly 4 digits",
            ),
            (
                card_data(&ready(json!({"expiry_month": "12"})), "c-1"),
                "field expiry_month is a string, not an integer",
            ),
            (
                card_data(&ready(json!({"expiry_month": -1})), "c-1"),
                "field expiry_month is not a small non-negative integer: -1",
            ),
            (
                card_data(&ready(json!({"expiry_month": 13})), "c-1"),
                "field expiry_month out of 1..=12: 13",
            ),
            (
                card_data(&ready(json!({"expiry_year": 1999})), "c-1"),
                "field expiry_year out of 2000..=9999: 1999",
            ),
        ];
        for (got, want) in cases {
            assert_eq!(reason(got), want);
        }
        assert_eq!(
            reason(card_status(&json!({"card_ref": "c-1"}), "c-1")),
            "missing field status"
        );
        let id = Uuid::nil();
        let other = Uuid::max();
        assert_eq!(
            reason(payment_result(&json!({"payment_id": "x"}), id)),
            "field payment_id is not a UUID: \"x\""
        );
        assert_eq!(
            reason(payment_result(
                &json!({"payment_id": other.to_string()}),
                id
            )),
            format!("payment_id mismatch: asked {id}, got {other}")
        );
        assert_eq!(
            reason(payment_result(
                &json!({"payment_id": id.to_string(), "status": "pending"}),
                id
            )),
            "unknown status value \"pending\""
        );
        assert_eq!(
            reason(payment_result(
                &json!({"payment_id": id.to_string(), "status": "accepted"}),
                id
            )),
            "missing field channel_ref"
        );
    }

    #[test]
    fn a_full_pan_in_the_last4_field_is_rejected_without_quoting_it() {
        let v = ready(json!({"pan_last4": "4242424242424242"}));
        assert_eq!(card_data(&v, "c-1"), Err(BodyError::BadLast4));
    }

    #[test]
    fn a_card_number_is_masked_wherever_a_reason_quotes_a_value() {
        const PAN: &str = "4111111111111111";
        let id = Uuid::nil();
        let reasons = [
            reason(card_data(
                &json!({"card_ref": PAN, "state": "pending"}),
                "c-1",
            )),
            reason(card_data(&json!({"card_ref": "c-1", "state": PAN}), "c-1")),
            reason(card_data(
                &ready(json!({"expiry_month": 4111111111111111u64})),
                "c-1",
            )),
            reason(card_data(
                &ready(json!({"expiry_year": 4111111111111111.0})),
                "c-1",
            )),
            reason(card_status(
                &json!({"card_ref": "c-1", "status": PAN}),
                "c-1",
            )),
            reason(card_status(&json!({"card_ref": "c-1"}), PAN)),
            reason(payment_result(&json!({"payment_id": PAN}), id)),
            reason(payment_result(
                &json!({"payment_id": id.to_string(), "status": PAN}),
                id,
            )),
        ];
        for r in reasons {
            assert!(!r.contains(PAN), "{r}");
            assert!(r.contains("[redacted]"), "{r}");
        }
    }
}
