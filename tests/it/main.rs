//! Integration tests: one binary, shared harness. Real PostgreSQL and Redis; each test gets its
//! own database and key prefix. Only the Gateway is simulated (by cardworker's own simulator).

mod harness;

mod budget;
mod circuit;
mod config_cli;
mod console;
mod endpoint;
mod gateway;
mod intake;
mod maintenance;
mod migrations;
mod payments;
mod polling;
mod webdriver;
