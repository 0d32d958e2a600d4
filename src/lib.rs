//! cardworker: the background worker of the card platform.
//!
//! It polls the Gateway for card data and card status and records in PostgreSQL only what is
//! worth investigating (changes, failures, unknown answers); it shares polling budgets across
//! every pod through Redis; it runs payments, approvals and channel callbacks on strict reliable paths; and
//! it runs archive and retention only when operators switch them on.
//!
//! # Layout
//! Two crates of the workspace sit below every module: `cardworker-wire` (the Gateway contract's
//! wire types, re-exported from [`gateway`]) and `cardworker-sim` (the Gateway simulator behind
//! `cardworker gateway-sim`, the tests and the benchmarks, re-exported as [`sim`]).
//!
//! Modules are listed bottom-up; a module imports only from modules above it in this list (the
//! layering test in `tests/layering.rs` enforces it; docs/DESIGN.md explains the layers).
//! - [`limit`], [`secret`]: the values the configuration holds that are not about loading it: a
//!   polling limit, checked where it is made, and the URLs and tokens that redact themselves.
//! - [`config`]: typed layered configuration, validated once.
//! - [`telemetry`], [`keys`], [`pod`], [`clock`], [`backoff`], [`linger`], [`shutdown`]: logs
//!   and metric names, every Redis key name, who this process is, its wall clock as the money path
//!   reads it, the one back-off rule, batches that wait a little for latecomers, the one shutdown
//!   signal and task tracker.
//! - [`storage`], [`gateway`], [`queue`], [`budget`]: PostgreSQL, the Gateway client, the bounded
//!   intake, admission of a poll (the polling budget's leases and the Gateway circuit breaker).
//! - [`cards`]: the card domain (applying an observed change), shared by polling and callbacks.
//! - [`context`]: [`context::AppContext`], what every job shares.
//! - [`runner`]: how a job runs on apalis (the job trait, the one service, spawning, supervision).
//! - [`reliable`]: the one reliable path of every call that makes the Gateway act (payments,
//!   approvals): the pending record before the call, submit, finalise, recover and decide once,
//!   over the description of each kind.
//! - [`polling`], [`payments`], [`approvals`], [`maintenance`]: the jobs; none imports another.
//! - [`workers`]: the one list of every worker and schedule.
//! - [`app`]: `cardworker run`.
//! - [`commands`]: the command line; `main.rs` only maps errors to exit codes.
//! - [`console`]: the operator's console (`cardworker console`), a front end over `commands`.

pub mod app;
pub mod approvals;
pub mod backoff;
pub mod budget;
pub mod cards;
pub mod clock;
pub mod commands;
pub mod config;
pub mod console;
pub mod context;
pub mod gateway;
pub mod keys;
pub mod limit;
pub mod linger;
pub mod maintenance;
pub mod payments;
pub mod pod;
pub mod polling;
pub mod queue;
pub mod reliable;
pub mod runner;
pub mod secret;
pub mod shutdown;
pub mod storage;
pub mod telemetry;
pub mod workers;

/// The Gateway simulator, a crate of its own (`cardworker-sim`, over the wire types only),
/// re-exported so that the tests and benchmarks reach it as `cardworker::sim`.
pub use cardworker_sim as sim;
