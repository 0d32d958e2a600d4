//! Payments and channel callbacks: the reliable paths.
//!
//! Unlike polling, these paths keep every record and keep it in PostgreSQL: a payment is
//! recorded `pending` before its call (`reliable::pending`), and a callback is applied once
//! however often it is delivered (`inbound_callbacks`). The polling budget does not apply to
//! them; their queues use the bounded intake like every other queue.
//!
//! # Layout
//! - [`submit`]: `SubmitPayment`, `POST /v1/payments` through the reliable path.
//! - [`recovery`]: `RecoverPayments`, the cron job settling `pending`/`unknown` payments.
//! - [`callback`]: `ProcessCallback`, idempotent channel callbacks.
//! - [`store`]: the `payments` table.
//!
//! The commands (`enqueue payment`, `enqueue callback`) are in `crate::commands::payments`;
//! `cardworker investigate` (`crate::commands::investigate`) shows a card's payments and
//! callbacks. A callback's card change is applied by `crate::cards`, as a poll's is.

pub mod callback;
pub mod recovery;
pub mod store;
pub mod submit;
