//! The Gateway: the company service in front of the card channels (spec section 1).
//!
//! The worker talks to it through [`GatewayClient`], which turns every call into a typed
//! [`CallResult`] whose [`Outcome`] is `Valid`, `Failed` or `Unknown` exactly as the spec
//! classifies calls. Card calls (reads) treat timeouts and non-2xx as `Failed`; a payment
//! submit that may have reached the Gateway (timeout, dropped connection, 5xx, unreadable 2xx)
//! is `Unknown`, never `Failed`. Every call sends `X-Correlation-Id` and
//! `Accept: application/json`, and records `cardworker_gateway_request_duration_seconds{call}`.
//!
//! The simulator that speaks the same contract lives in [`crate::sim`]; it depends only on the
//! wire types re-exported here.
//!
//! # Layout
//! - `client.rs`: [`GatewayClient`], the wire types ([`CardData`], [`CardStatus`],
//!   [`PaymentRequest`], [`PaymentResult`], [`PaymentQuery`]), the classification
//!   ([`Outcome`], [`Failure`], [`CallResult`]) and the log-safe summaries (no PAN or CVV ever
//!   reaches a summary).

pub mod client;

pub use client::{
    CallKind, CallResult, CardData, CardStatus, Failure, GatewayClient, Outcome, PaymentQuery,
    PaymentRequest, PaymentResult, PaymentStatus, UnknownStatus, CORRELATION_HEADER,
    IDEMPOTENCY_HEADER, REQUEST_DURATION_METRIC,
};
