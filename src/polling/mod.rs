//! Polling jobs: card data and card status.
//!
//! # Layout
//! - [`chain`]: one live chain per card and task, in Redis (schedule only; parking is in
//!   PostgreSQL).
//! - [`poll`]: the flow of one poll, shared by both tasks ([`poll::PollTask`]).
//! - [`carddata`]: the `PollCardData` job.
//! - [`card_status`]: the `PollCardStatus` job.
//! - [`apply`]: applying a card change (card update + audit + outbox) in the caller's
//!   transaction; reused by channel callbacks ([`apply::apply_status`]).
//! - [`reconcile`]: the `RunReconcile` job (restores chains after a Redis loss; reads only).
//! - [`investigate`]: what is on record for one card.
//! - [`cli`]: `enqueue carddata|card-status`, `reconcile`, `investigate`.

pub mod apply;
pub mod card_status;
pub mod carddata;
pub mod chain;
pub mod cli;
pub mod investigate;
pub mod poll;
pub mod reconcile;

pub use apply::{apply_card_data, apply_status, Applied, ChangeSource};
