//! The Gateway simulator behind `cardworker gateway-sim`: a real axum server that speaks the
//! Gateway contract (spec sections 1 and 7: cards, payments, approvals) from an in-memory card
//! set, for local runs, demos, load tests, the benches and the integration tests.
//!
//! A crate of its own (`cardworker-sim`): it depends only on the Gateway's wire types
//! (`cardworker-wire`: `CallKind`, `CardData`, `CardStatus`, the payment and approval bodies and
//! the header names), never on the worker, so it cannot reach its polling, storage or queue code.
//! The worker re-exports it as `cardworker::sim`.
//!
//! Behaviour is steered at run time through Rust methods on [`Simulator`] or through the HTTP
//! control API under `/sim/…`:
//!
//! | route | what |
//! | --- | --- |
//! | `GET /healthz` | 200 |
//! | `GET /sim/stats` | [`SimStats`]: in flight now, peaks, totals per call kind |
//! | `POST /sim/stats/reset-peaks` | peaks := current in-flight |
//! | `GET /sim/config`, `POST /sim/config` | read / patch ([`SimConfigPatch`]) the global knobs |
//! | `GET /sim/cards/{card_ref}`, `POST /sim/cards/{card_ref}` | read / patch ([`SimCardPatch`]) one card |
//! | `GET /sim/payments/{payment_id}` | [`PaymentRecord`]: submissions, idempotency keys, stored result |
//! | `POST /sim/payments/{payment_id}` | `{"behaviour": …}` ([`PaymentBehaviour`]) for that payment |
//! | `GET /sim/requests` | the last requests seen ([`RequestRecord`]), oldest first |
//!
//! The money-moving `POST`s (`/v1/payments`, `/v1/approvals`) have three knobs of their own,
//! switched at run time through `POST /sim/config` like the others: `post_act_delay_ms` (the
//! request is held before the Gateway acts on it, so a `GET` meanwhile answers 404),
//! `post_answer_delay_ms` (it acts, then holds the answer: set it above the client's timeout and
//! the Gateway acted while the caller saw a timeout), and `conflict_concurrent_posts` (a `POST`
//! whose `Idempotency-Key` is still being processed is answered `409 Conflict` without acting).
//! For example `curl -d '{"post_answer_delay_ms": 8000, "conflict_concurrent_posts": true}'
//! 127.0.0.1:8089/sim/config`.
//!
//! # Layout
//! Bottom-up; a file imports only files above it in this list, so no two import each other.
//! - `config.rs`: [`SimConfig`] and its patch ([`SimConfigPatch`], rates validated to 0..=1),
//!   the per-card [`CardBehaviour`], the per-payment [`PaymentBehaviour`], [`GarbageKind`].
//! - `approvals.rs`: the approval book ([`ApprovalRecord`]) and its pure decisions: `in_review`
//!   at `approval_in_review_rate`, decided `approval_review_ms` later (declined at
//!   `approval_decline_rate`), idempotent.
//! - `state.rs`: the in-memory state (cards [`SimCard`], payments [`PaymentRecord`], the
//!   approval book, the request log [`RequestRecord`]) and its pure decisions: a card changing as
//!   it is read, a payment submission counted, a payment decided once and answered the same ever
//!   after.
//! - `answer.rs`: what one call answers, without HTTP: the latency / outage / bad-body dice and
//!   the card and bad payment bodies.
//! - `stats.rs`: in-flight accounting and peaks ([`SimStats`]), and, once started, each card's
//!   first read and read count per poll kind ([`CardReads`]).
//! - `simulator.rs`: [`Simulator`], the shared state under its locks, and the control methods.
//! - `reply.rs`: the HTTP responses the handlers share (an answer rendered, `409`, `400`).
//! - `approval_routes.rs`: `POST /v1/approvals` and `GET /v1/approvals/{id}`, over the book.
//! - `routes.rs`: the axum router ([`Simulator::router`]), the card, payment and `/sim`
//!   handlers, thin shells over `state.rs` and `answer.rs`.
//! - `server.rs`: [`Simulator::serve`], [`Simulator::spawn_on`] / [`Simulator::spawn_with`] and
//!   the [`SimHandle`] that stops a spawned server.
//!
//! `tests/routes.rs` drives the routes over a real socket through this public API.

mod answer;
mod approval_routes;
mod approvals;
mod config;
mod reply;
mod routes;
mod server;
mod simulator;
mod state;
mod stats;

pub use approvals::ApprovalRecord;
pub use config::{CardBehaviour, GarbageKind, PaymentBehaviour, SimConfig, SimConfigPatch};
pub use server::SimHandle;
pub use simulator::Simulator;
pub use state::{PaymentRecord, RequestRecord, SimCard, SimCardPatch, REQUEST_LOG_CAPACITY};
pub use stats::{CardReads, SimStats};
