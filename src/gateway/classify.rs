//! Classification of one Gateway call (spec section 1): from what the transport produced — a
//! status and body bytes, a status and a lost body, no answer at all, or a request never sent —
//! to the typed [`Outcome`] of that call kind: `Valid`, `Failed` or `Unknown`.
//!
//! This is the pure core of the client: no I/O, no clock, no `reqwest` types. The transport
//! ([`super::transport`]) reduces a transport error to a [`TransportError`] (its kind and an
//! already PAN-safe reason) and hands the rest over as bytes, so every rule below is unit-tested
//! without a socket.
//!
//! [`TransportError`]: super::transport::TransportError
//!
//! The rules, per call kind:
//! - card calls and payment queries are reads, safe to repeat: a request not sent, any
//!   transport error (timeout included) and any non-2xx are `Failed`;
//! - `POST /v1/payments` and `POST /v1/approvals` act on the Gateway's side: only a connection
//!   that was never opened, or a 4xx other than 409, is `Failed`; a timeout, a connection
//!   dropped after sending, a lost body, a 5xx or a 409 (the Gateway is still processing the
//!   same `Idempotency-Key`) are `Unknown`, because the Gateway may have acted;
//! - a 404 on a payment or approval query is the valid answer `NotFound`;
//! - a 2xx is `Valid` when its body decodes (see [`super::wire`]), else `Unknown`.
//!
//! Reasons and response summaries come from [`super::wire::BodyError`] and [`super::redact`]
//! only, so no body text that could hold a card number reaches them.
//!
//! The table of tests below is the spec of this file: one row per status and body shape, for
//! every call kind, approvals included.

use serde_json::Value;
use uuid::Uuid;

use super::mask::truncate;
use super::outcome::{Failure, Outcome};
use super::redact::{body_summary, json_summary, Summarize, SUMMARY_MAX_BYTES};
use super::transport::{HttpOutcome, TransportErrorKind, MAX_BODY_BYTES};
use super::wire::{
    self, ApprovalQuery, ApprovalResult, BodyError, CardData, CardStatus, PaymentQuery,
    PaymentResult,
};

/// An oversized 2xx is unknown (what the Gateway said cannot be read whole); an oversized error
/// is classified like any other answer, on its cut body.
fn settle_oversized<T>(outcome: HttpOutcome) -> Result<HttpOutcome, Classified<T>> {
    match outcome {
        HttpOutcome::Oversized { status, .. } if (200..300).contains(&status) => {
            Err(Classified::unknown(
                Some(status),
                format!("body longer than {} KiB (not read)", MAX_BODY_BYTES / 1024),
                String::new(),
            ))
        }
        HttpOutcome::Oversized { status, body } => Ok(HttpOutcome::Answer { status, body }),
        other => Ok(other),
    }
}

/// A classified call before timing and the request summary are attached.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Classified<T> {
    pub outcome: Outcome<T>,
    pub http_status: Option<u16>,
    pub response_summary: String,
}

impl<T> Classified<T> {
    fn failed(http_status: Option<u16>, reason: String, response_summary: String) -> Self {
        Self {
            outcome: Outcome::Failed(Failure::new(reason)),
            http_status,
            response_summary,
        }
    }

    fn unknown(http_status: Option<u16>, reason: String, response_summary: String) -> Self {
        Self {
            outcome: Outcome::Unknown(Failure::new(reason)),
            http_status,
            response_summary,
        }
    }
}

/// `GET /v1/cards/{card_ref}/data`.
pub(crate) fn card_data(outcome: HttpOutcome, card_ref: &str) -> Classified<CardData> {
    read(outcome, |v| wire::card_data(v, card_ref))
}

/// `GET /v1/cards/{card_ref}/status`.
pub(crate) fn card_status(outcome: HttpOutcome, card_ref: &str) -> Classified<CardStatus> {
    read(outcome, |v| wire::card_status(v, card_ref))
}

/// `POST /v1/payments`: never `Failed` when the Gateway may have acted.
pub(crate) fn payment_submit(outcome: HttpOutcome, payment_id: Uuid) -> Classified<PaymentResult> {
    acting_call(outcome, |v| wire::payment_result(v, payment_id))
}

/// `POST /v1/approvals`: the same rules as a payment submission.
pub(crate) fn approval_submit(
    outcome: HttpOutcome,
    approval_id: Uuid,
) -> Classified<ApprovalResult> {
    acting_call(outcome, |v| wire::approval_result(v, approval_id))
}

/// `GET /v1/payments/{payment_id}`: a read, with 404 as the valid answer `NotFound`.
pub(crate) fn payment_query(outcome: HttpOutcome, payment_id: Uuid) -> Classified<PaymentQuery> {
    lookup(outcome, PaymentQuery::NotFound, |v| {
        wire::payment_result(v, payment_id).map(PaymentQuery::Found)
    })
}

/// `GET /v1/approvals/{approval_id}`: a read, with 404 as the valid answer `NotFound`.
pub(crate) fn approval_query(outcome: HttpOutcome, approval_id: Uuid) -> Classified<ApprovalQuery> {
    lookup(outcome, ApprovalQuery::NotFound, |v| {
        wire::approval_result(v, approval_id).map(ApprovalQuery::Found)
    })
}

/// A call that makes the Gateway act (a payment, an approval): `Failed` only when it cannot
/// have acted (never sent, never connected, a 4xx refusal); `Unknown` for a timeout, a dropped
/// connection, a lost body, a 5xx or a 2xx that does not decode.
fn acting_call<T: Summarize>(
    outcome: HttpOutcome,
    decode: impl FnOnce(&Value) -> Result<T, BodyError>,
) -> Classified<T> {
    let outcome = match settle_oversized(outcome) {
        Ok(outcome) => outcome,
        Err(unknown) => return unknown,
    };
    match outcome {
        HttpOutcome::NotSent(reason) => Classified::failed(None, reason, String::new()),
        HttpOutcome::NoAnswer(e) => match e.kind {
            TransportErrorKind::Connect => Classified::failed(None, e.reason, String::new()),
            // A timeout may have fired after the request left: never assume it did not act.
            TransportErrorKind::Timeout | TransportErrorKind::Other => {
                Classified::unknown(None, e.reason, String::new())
            }
        },
        HttpOutcome::BodyLost { status, error } => Classified::unknown(
            Some(status),
            format!("HTTP {status}, then {}", error.reason),
            String::new(),
        ),
        HttpOutcome::Answer { status, body } => match status {
            200..=299 => decode_2xx(status, &body, decode),
            // The Gateway is still processing a request with the same Idempotency-Key: it may
            // act on it, so this answer decides nothing (spec section 9).
            409 => Classified::unknown(
                Some(status),
                "HTTP 409: the Gateway is still processing this Idempotency-Key".to_owned(),
                body_summary(&body),
            ),
            400..=499 => {
                Classified::failed(Some(status), format!("HTTP {status}"), body_summary(&body))
            }
            _ => Classified::unknown(Some(status), format!("HTTP {status}"), body_summary(&body)),
        },
        HttpOutcome::Oversized { .. } => unreachable_oversized(),
    }
}

/// [`settle_oversized`] ran first: no oversized answer is left to classify. Classified as
/// unknown all the same, never a panic.
fn unreachable_oversized<T>() -> Classified<T> {
    Classified::unknown(None, "body too long".to_owned(), String::new())
}

/// A query of a reliable call's record: a read, where 404 is the valid answer `not_found`.
fn lookup<T: Summarize>(
    outcome: HttpOutcome,
    not_found: T,
    decode: impl FnOnce(&Value) -> Result<T, BodyError>,
) -> Classified<T> {
    let outcome = match settle_oversized(outcome) {
        Ok(outcome) => outcome,
        Err(unknown) => return unknown,
    };
    match outcome {
        HttpOutcome::Answer { status: 404, body } => Classified {
            outcome: Outcome::Valid(not_found),
            http_status: Some(404),
            response_summary: if body.is_empty() {
                "not found".to_owned()
            } else {
                body_summary(&body)
            },
        },
        other => read(other, decode),
    }
}

/// A read: anything but a decodable 2xx is `Failed`, except a 2xx that does not decode, which
/// is `Unknown`.
fn read<T: Summarize>(
    outcome: HttpOutcome,
    decode: impl FnOnce(&Value) -> Result<T, BodyError>,
) -> Classified<T> {
    let outcome = match settle_oversized(outcome) {
        Ok(outcome) => outcome,
        Err(unknown) => return unknown,
    };
    match outcome {
        HttpOutcome::NotSent(reason) => Classified::failed(None, reason, String::new()),
        HttpOutcome::NoAnswer(e) => Classified::failed(None, e.reason, String::new()),
        HttpOutcome::BodyLost { status, error } => Classified::failed(
            Some(status),
            format!("HTTP {status}, then {}", error.reason),
            String::new(),
        ),
        HttpOutcome::Answer { status, body } if !(200..300).contains(&status) => {
            Classified::failed(Some(status), format!("HTTP {status}"), body_summary(&body))
        }
        HttpOutcome::Answer { status, body } => decode_2xx(status, &body, decode),
        HttpOutcome::Oversized { .. } => unreachable_oversized(),
    }
}

fn decode_2xx<T: Summarize>(
    status: u16,
    body: &[u8],
    decode: impl FnOnce(&Value) -> Result<T, BodyError>,
) -> Classified<T> {
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        // The serde error is dropped on purpose: it may quote the body.
        Err(_) => {
            return Classified::unknown(
                Some(status),
                "body is not JSON".to_owned(),
                body_summary(body),
            )
        }
    };
    match decode(&value) {
        Ok(parsed) => Classified {
            response_summary: truncate(parsed.summary(), SUMMARY_MAX_BYTES),
            outcome: Outcome::Valid(parsed),
            http_status: Some(status),
        },
        Err(e) => Classified::unknown(Some(status), e.to_string(), json_summary(&value)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::transport::TransportError;
    use serde_json::json;

    const PAN: &str = "4111111111111111";

    fn answer(status: u16, body: impl Into<Vec<u8>>) -> HttpOutcome {
        HttpOutcome::Answer {
            status,
            body: body.into(),
        }
    }

    fn json_answer(status: u16, v: serde_json::Value) -> HttpOutcome {
        answer(status, v.to_string())
    }

    fn no_answer(kind: TransportErrorKind, reason: &str) -> HttpOutcome {
        HttpOutcome::NoAnswer(TransportError {
            kind,
            reason: reason.to_owned(),
        })
    }

    fn refused() -> HttpOutcome {
        no_answer(TransportErrorKind::Connect, "connection refused")
    }

    fn timed_out() -> HttpOutcome {
        no_answer(TransportErrorKind::Timeout, "timeout after 200 ms")
    }

    fn dropped() -> HttpOutcome {
        no_answer(TransportErrorKind::Other, "connection reset")
    }

    fn not_sent() -> HttpOutcome {
        HttpOutcome::NotSent("bad url".to_owned())
    }

    fn body_lost(status: u16) -> HttpOutcome {
        HttpOutcome::BodyLost {
            status,
            error: TransportError {
                kind: TransportErrorKind::Other,
                reason: "connection reset".to_owned(),
            },
        }
    }

    /// `(kind, reason, http_status)` of a classification.
    fn shape<T>(c: &Classified<T>) -> (&'static str, Option<&str>, Option<u16>) {
        (
            c.outcome.kind(),
            c.outcome.failure().map(|f| f.reason.as_str()),
            c.http_status,
        )
    }

    fn payment(id: Uuid) -> serde_json::Value {
        json!({"payment_id": id.to_string(), "status": "accepted", "channel_ref": "ch_1"})
    }

    #[test]
    fn reads_fail_on_every_transport_error_and_non_2xx() {
        let reset = "HTTP 200, then connection reset";
        let cases = [
            (not_sent(), (None, "bad url")),
            (refused(), (None, "connection refused")),
            (timed_out(), (None, "timeout after 200 ms")),
            (dropped(), (None, "connection reset")),
            (body_lost(200), (Some(200), reset)),
            (answer(503, "busy"), (Some(503), "HTTP 503")),
            (answer(404, ""), (Some(404), "HTTP 404")),
            (answer(302, ""), (Some(302), "HTTP 302")),
        ];
        for (outcome, (status, reason)) in cases {
            let want = ("failed", Some(reason), status);
            assert_eq!(shape(&card_data(outcome.clone(), "c-1")), want);
            assert_eq!(shape(&card_status(outcome.clone(), "c-1")), want);
            if status != Some(404) {
                assert_eq!(shape(&payment_query(outcome, Uuid::nil())), want);
            }
        }
    }

    #[test]
    fn a_non_2xx_keeps_a_redacted_summary_of_its_body() {
        let c = card_data(answer(500, format!("oops {PAN}")), "c-1");
        assert_eq!(c.response_summary, "21 bytes: oops [redacted]");
        // Transport errors have no body to summarise.
        let c = card_data(body_lost(200), "c-1");
        assert_eq!(c.response_summary, "");
    }

    #[test]
    fn a_payment_submit_is_failed_only_when_it_cannot_have_acted() {
        let id = Uuid::new_v4();
        let (failed, unknown) = ("failed", "unknown");
        let lost_200 = "HTTP 200, then connection reset";
        let lost_503 = "HTTP 503, then connection reset";
        let not_json = "body is not JSON";
        let cases = [
            (not_sent(), failed, None, "bad url"),
            (refused(), failed, None, "connection refused"),
            (timed_out(), unknown, None, "timeout after 200 ms"),
            (dropped(), unknown, None, "connection reset"),
            (body_lost(200), unknown, Some(200), lost_200),
            (body_lost(503), unknown, Some(503), lost_503),
            (answer(422, "no"), failed, Some(422), "HTTP 422"),
            (answer(404, ""), failed, Some(404), "HTTP 404"),
            (
                answer(409, ""),
                unknown,
                Some(409),
                "HTTP 409: the Gateway is still processing this Idempotency-Key",
            ),
            (answer(500, ""), unknown, Some(500), "HTTP 500"),
            (answer(503, ""), unknown, Some(503), "HTTP 503"),
            (answer(302, ""), unknown, Some(302), "HTTP 302"),
            (answer(200, "<html>"), unknown, Some(200), not_json),
        ];
        for (outcome, kind, status, reason) in cases {
            assert_eq!(
                shape(&payment_submit(outcome, id)),
                (kind, Some(reason), status),
                "{kind} {reason}"
            );
        }
    }

    #[test]
    fn valid_answers_carry_their_summary() {
        let c = card_data(
            json_answer(200, json!({"card_ref": "c-1", "state": "pending"})),
            "c-1",
        );
        assert_eq!(c.outcome, Outcome::Valid(CardData::Pending));
        assert_eq!(c.response_summary, "state=pending");

        let c = card_status(
            json_answer(200, json!({"card_ref": "c-1", "status": "active"})),
            "c-1",
        );
        assert_eq!(c.outcome, Outcome::Valid(CardStatus::Active));
        assert_eq!(c.response_summary, "status=active");

        let id = Uuid::new_v4();
        let found = PaymentResult {
            payment_id: id,
            status: wire::PaymentStatus::Accepted,
            channel_ref: "ch_1".into(),
        };
        let c = payment_submit(json_answer(201, payment(id)), id);
        assert_eq!(c.outcome, Outcome::Valid(found.clone()));
        assert_eq!(c.http_status, Some(201));
        assert_eq!(
            c.response_summary,
            format!("payment_id={id} status=accepted channel_ref=ch_1")
        );
        let c = payment_query(json_answer(200, payment(id)), id);
        assert_eq!(c.outcome, Outcome::Valid(PaymentQuery::Found(found)));
    }

    #[test]
    fn a_payment_query_404_is_the_valid_answer_not_found() {
        let c = payment_query(answer(404, ""), Uuid::nil());
        assert_eq!(c.outcome, Outcome::Valid(PaymentQuery::NotFound));
        assert_eq!(c.http_status, Some(404));
        assert_eq!(c.response_summary, "not found");
        let c = payment_query(answer(404, r#"{"error":"unknown payment"}"#), Uuid::nil());
        assert!(c.outcome.is_valid());
        assert_eq!(c.response_summary, "JSON {error=\"unknown payment\"}");
    }

    #[test]
    fn an_unreadable_2xx_is_unknown_for_every_call() {
        let id = Uuid::new_v4();
        let bodies = [
            (answer(200, "upstream hiccup"), "body is not JSON"),
            (answer(200, ""), "body is not JSON"),
            (
                json_answer(200, json!("ok")),
                "body is a JSON string, not an object",
            ),
        ];
        for (outcome, reason) in bodies {
            let want = ("unknown", Some(reason), Some(200));
            assert_eq!(shape(&card_data(outcome.clone(), "c-1")), want);
            assert_eq!(shape(&card_status(outcome.clone(), "c-1")), want);
            assert_eq!(shape(&payment_submit(outcome.clone(), id)), want);
            assert_eq!(shape(&payment_query(outcome, id)), want);
        }
        // Another card or payment, or a value outside the lists.
        let c = card_data(
            json_answer(200, json!({"card_ref": "c-2", "state": "pending"})),
            "c-1",
        );
        assert_eq!(
            shape(&c),
            (
                "unknown",
                Some("card_ref mismatch: asked c-1, got c-2"),
                Some(200)
            )
        );
        let c = card_status(
            json_answer(200, json!({"card_ref": "c-1", "status": "weird"})),
            "c-1",
        );
        assert_eq!(
            shape(&c),
            ("unknown", Some("unknown status value \"weird\""), Some(200))
        );
        assert_eq!(
            c.response_summary,
            "JSON {card_ref=\"c-1\" status=\"weird\"}"
        );
        let c = payment_query(json_answer(200, payment(Uuid::nil())), id);
        assert_eq!(
            shape(&c),
            (
                "unknown",
                Some(format!("payment_id mismatch: asked {id}, got {}", Uuid::nil()).as_str()),
                Some(200)
            )
        );
    }

    /// A 16-digit card number in any field of any answer, at any status, never reaches the
    /// outcome's reason or the response summary.
    #[test]
    fn a_card_number_in_any_field_never_reaches_a_reason_or_summary() {
        let id = Uuid::new_v4();
        let card_fields = [
            "card_ref",
            "state",
            "status",
            "card_token",
            "pan_last4",
            "expiry_month",
            "expiry_year",
            "pan",
            "error",
            PAN,
        ];
        let payment_fields = ["payment_id", "status", "channel_ref", "pan", "code", PAN];
        let pan_spaced = "4111 1111 1111 1111";
        let mut checked = 0;
        for status in [200, 201, 404, 422, 500, 503] {
            for pan in [PAN, pan_spaced] {
                for value in [json!(pan), json!(4111111111111111u64), json!([pan])] {
                    for field in card_fields {
                        let mut card = json!({"card_ref": "c-1", "state": "ready",
                            "status": "active", "card_token": "tok_1", "pan_last4": "4242",
                            "expiry_month": 12, "expiry_year": 2030});
                        card[field] = value.clone();
                        let body = answer(status, card.to_string());
                        let results = [
                            card_data(body.clone(), "c-1").texts(),
                            card_status(body, "c-1").texts(),
                        ];
                        for text in results {
                            assert_safe(&text, pan);
                            checked += 1;
                        }
                    }
                    for field in payment_fields {
                        let mut p = payment(id);
                        p[field] = value.clone();
                        let body = answer(status, p.to_string());
                        let results = [
                            payment_submit(body.clone(), id).texts(),
                            payment_query(body, id).texts(),
                        ];
                        for text in results {
                            assert_safe(&text, pan);
                            checked += 1;
                        }
                    }
                }
                // A body that is not JSON, and a truncated JSON body.
                for raw in [
                    format!("card {pan} declined"),
                    format!("{{\"pan\":\"{pan}\""),
                ] {
                    let body = answer(status, raw);
                    for text in [
                        card_data(body.clone(), "c-1").texts(),
                        card_status(body.clone(), "c-1").texts(),
                        payment_submit(body.clone(), id).texts(),
                        payment_query(body, id).texts(),
                    ] {
                        assert_safe(&text, pan);
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 500, "{checked}");
    }

    fn assert_safe(text: &str, pan: &str) {
        assert!(!text.contains(pan), "{pan} in {text}");
        assert!(!text.contains("41111111"), "digits of {pan} in {text}");
    }

    impl<T> Classified<T> {
        /// The reason and the response summary, the two texts that are logged and stored.
        fn texts(&self) -> String {
            format!(
                "{} | {}",
                self.outcome
                    .failure()
                    .map(|f| f.reason.as_str())
                    .unwrap_or(""),
                self.response_summary
            )
        }
    }
}
