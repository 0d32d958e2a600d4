//! Integration tests: one binary, shared harness. Real PostgreSQL and Redis; each test gets its
//! own database and key prefix. Only the Gateway is simulated (by cardworker's own simulator).

// Test code: an unwrap() that fails is the test failing, at its line (the workspace's
// `clippy::unwrap_used` is for product code).
#![allow(clippy::unwrap_used)]

mod config_support;
mod harness;
mod pg_cluster;
mod plan_drive;
mod plan_guard;
mod process;
mod scripted_gateway;

mod approvals;
mod budget;
mod budget_pool;
mod card_reads;
mod chain_intake;
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
mod lateness;
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
mod webdriver;
