//! Integration tests: one binary, shared harness. Real PostgreSQL and Redis; each test gets its
//! own database and key prefix. Only the Gateway is simulated (by cardworker's own simulator).

mod harness;

mod budget;
mod gateway;
mod polling;
