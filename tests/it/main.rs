//! Integration tests: one binary, shared harness (the `cardworker-test-kit` crate). Real
//! PostgreSQL and Redis; each test gets its own database and key prefix. Only the Gateway is
//! simulated (by cardworker's own simulator).
//!
//! Run them with nextest (`make test`), a process per test: many tests wait on and assert the
//! process's Prometheus counters (`cardworker_poll_outcomes_total`, ...), and a process has one
//! recorder, so under plain `cargo test` the tests that run beside each other count each other's
//! polls, and their assertions fail.

// Test code: an unwrap() that fails is the test failing, at its line (the workspace's
// `clippy::unwrap_used` is for product code).
#![allow(clippy::unwrap_used)]

// The shared machinery (test-kit/), under the names the tests use: `crate::harness`, ….
use cardworker_test_kit::{harness, plan_drive, plan_guard, scripted_gateway, webdriver};

mod config_support;
mod money_support;
mod worker_support;

mod approvals;
mod bench_scripts;
mod budget;
mod budget_pool;
mod card_reads;
mod circuit;
mod config_cli;
mod config_layers;
mod config_rules;
mod config_types;
mod console;
mod demo;
mod endpoint;
mod gateway;
mod identifiers;
mod intake;
mod key_inventory;
mod maintenance;
mod messages;
mod migrations;
mod money_once;
mod no_pan;
mod operator_actions;
mod outage;
mod pan_oracle;
mod payments;
mod plans;
mod polling;
mod queue_backend;
mod self_healing;
mod sim_seed;
mod slow;
mod unchanged;
