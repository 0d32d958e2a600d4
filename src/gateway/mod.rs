//! The Gateway: the company service in front of the card channels (spec section 1).
//!
//! The worker talks to it through [`GatewayClient`], which turns every call into a typed
//! [`CallResult`] whose [`Outcome`] is `Valid`, `Failed` or `Unknown` exactly as the spec
//! classifies calls. Card calls (reads) treat timeouts and non-2xx as `Failed`; a payment
//! submit that may have reached the Gateway (timeout, dropped connection, 5xx, unreadable 2xx)
//! is `Unknown`, never `Failed`. Every call sends `X-Correlation-Id` and
//! `Accept: application/json`, and records `cardworker_gateway_request_duration_seconds{call}`
//! (the name is [`crate::telemetry::metrics::GATEWAY_REQUEST_DURATION`]).
//!
//! The wire types are the `cardworker-wire` crate, re-exported here. The simulator that speaks
//! the same contract is the `cardworker-sim` crate ([`crate::sim`]); it depends only on them.
//!
//! # Layout
//! The client is split by the question each part answers, so that the rules the spec fixes can
//! be read, and tested, apart from the HTTP plumbing:
//! - `wire.rs` — *what is on the wire?* The header names, the request and response bodies
//!   ([`CardData`], [`CardStatus`], [`PaymentRequest`], [`PaymentResult`], [`PaymentQuery`]) and
//!   [`CallKind`], from `cardworker-wire`, and the hand-written decoders of response bodies (the
//!   module says why they are not serde derive: serde errors quote values, which may be card
//!   numbers, and why they stay here).
//! - `outcome.rs` — *what did the call come to?* [`Outcome`] (`Valid` / `Failed` / `Unknown`)
//!   with a [`Failure`] reason, and [`CallResult`], the outcome with what an integration log row
//!   needs.
//! - `transport.rs` — *what came back?* What the transport produced for one call (a status and
//!   body bytes, a lost body, no answer, a request never sent) and how it is read off `reqwest`:
//!   the body up to its cap, a transport error reduced to its kind and a PAN-safe reason.
//! - `classify.rs` — *what did the call mean?* The pure function per call kind from what the
//!   transport produced to an [`Outcome`]. No I/O, unit-tested rule by rule.
//! - `mask.rs` — the masking primitives (digit runs that could be a card number, truncation,
//!   `Redacted` values for reasons), below both the decoders and the summaries.
//! - `redact.rs` — *what may be written down?* The request and response summaries of
//!   integration logs and log lines, and digit redaction: no PAN or CVV ever reaches a summary
//!   or a reason.
//! - `client.rs` — *how is it sent?* [`GatewayClient`]: `reqwest`, URLs, headers, the timeout,
//!   the duration histogram, one log line per call; a card read sent on a task of its own
//!   ([`SentRead`], [`AtGateway`]).
//! - `reads.rs` — *how does a card read go?* The card reads' own transport, hyper's pooled
//!   client without reqwest's per-request layers (a read is every poll's call), and when the
//!   client leaves a read to reqwest (a proxy, credentials in the base URL).
//!
//! Every public name is re-exported here; use `crate::gateway::X`, not the module paths.

mod classify;
pub mod client;
mod mask;
mod outcome;
mod reads;
mod redact;
mod transport;
mod wire;

pub use client::{AtGateway, GatewayClient, SentRead};
pub use mask::redact_digits;
pub use outcome::{CallResult, Failure, Outcome};
pub use redact::SUMMARY_MAX_BYTES;
pub use wire::{
    ApprovalQuery, ApprovalRequest, ApprovalResult, ApprovalStatus, CallKind, CardData, CardStatus,
    PaymentQuery, PaymentRequest, PaymentResult, PaymentStatus, UnknownStatus, APPROVAL_KINDS,
    CORRELATION_HEADER, IDEMPOTENCY_HEADER,
};

/// Registers the request-duration histogram of every call kind, so that a scrape lists it before
/// the first call.
pub fn register_metrics() {
    for call in CallKind::ALL {
        // Registering the handle is enough for the exporter to list the histogram.
        let _ = metrics::histogram!(
            crate::telemetry::metrics::GATEWAY_REQUEST_DURATION,
            "call" => call.as_str()
        );
    }
}
