//! cardworker: the background worker of the card platform.
//!
//! It polls the Gateway for card data and card status and records in PostgreSQL only what is
//! worth investigating (changes, failures, unknown answers); it shares polling budgets across
//! every pod through Redis; it runs payments and channel callbacks on strict reliable paths; and
//! it runs archive and retention only when operators switch them on.
//!
//! # Layout
//! - [`config`]: typed layered configuration, validated once.
//! - [`cli`], [`commands`]: the command line; `main.rs` only maps errors to exit codes.
//! - [`app`]: `cardworker run` — context, supervisor, start and graceful shutdown.
//! - [`queue`]: bounded intake, trimming, the generic job handler, the registration list.
//! - [`storage`]: PostgreSQL pool, migrations, record writers.
//! - [`gateway`]: the Gateway client and the wire types of the Gateway contract.
//! - [`sim`]: the Gateway simulator (`cardworker gateway-sim`, the integration tests, benches).
//! - [`budget`]: the cross-worker polling budget (Lua leases + tower layer).
//! - [`polling`]: card-data and card-status polling chains, reconcile, investigate.
//! - [`payments`]: payment submission, recovery and channel callbacks.
//! - [`maintenance`]: archive and retention.
//! - [`telemetry`]: logs, metric names, the HTTP endpoint.

pub mod app;
pub mod budget;
pub mod cli;
pub mod commands;
pub mod config;
pub mod gateway;
pub mod maintenance;
pub mod payments;
pub mod polling;
pub mod queue;
pub mod sim;
pub mod storage;
pub mod telemetry;
