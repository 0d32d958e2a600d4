//! The Gateway: the company service in front of the card channels (spec section 1).
//!
//! The worker talks to it through [`GatewayClient`], which turns every call into a typed
//! [`CallResult`] whose [`Outcome`] is `Valid`, `Failed` or `Unknown` exactly as the spec
//! classifies calls. Card calls (reads) treat timeouts and non-2xx as `Failed`; a payment
//! submit that may have reached the Gateway (timeout, dropped connection, 5xx, unreadable 2xx)
//! is `Unknown`, never `Failed`. Every call sends `X-Correlation-Id` and
//! `Accept: application/json`, and records `cardworker_gateway_request_duration_seconds{call}`.
//!
//! [`Simulator`] is an in-process axum server speaking the same contract from an in-memory card
//! set (`cardworker gateway-sim`), with a control API to inject latency, outages, bad bodies,
//! card changes and payment behaviours, and in-flight accounting that load tests use to prove
//! that concurrency limits held.
//!
//! # Layout
//! - `client.rs`: [`GatewayClient`], the wire types ([`CardData`], [`CardStatus`],
//!   [`PaymentRequest`], [`PaymentResult`], [`PaymentQuery`]), the classification
//!   ([`Outcome`], [`Failure`], [`CallResult`]) and the log-safe summaries (no PAN or CVV ever
//!   reaches a summary).
//! - `sim.rs`: [`Simulator`] (state, control methods, axum router, `serve`/`spawn_on`),
//!   [`SimConfig`] and its runtime patch, per-card and per-payment behaviours, [`SimStats`].

pub mod client;
pub mod sim;

pub use client::{
    CallKind, CallResult, CardData, CardStatus, Failure, GatewayClient, Outcome, PaymentQuery,
    PaymentRequest, PaymentResult, PaymentStatus, UnknownStatus, CORRELATION_HEADER,
    IDEMPOTENCY_HEADER, REQUEST_DURATION_METRIC,
};
pub use sim::{
    CardBehaviour, GarbageKind, PaymentBehaviour, PaymentRecord, RequestRecord, SimCard,
    SimCardPatch, SimConfig, SimConfigPatch, SimHandle, SimStats, Simulator,
};
