//! Polling jobs: card data and card status.
//!
//! # Layout
//! - [`chain`]: one live chain per card and task, in Redis (schedule only; parking is in
//!   PostgreSQL).
//! - [`cli`]: `enqueue carddata|card-status`, `reconcile`, `investigate`.

pub mod chain;
pub mod cli;
