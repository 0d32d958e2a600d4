//! The shared machinery of cardworker's integration tests (`tests/it`, `tests/faults`,
//! `tests/chaos`) and load benchmarks (`benches/`): a dev-dependency of the `cardworker` package,
//! never part of the product.
//!
//! - [`harness`]: a fresh database and Redis key prefix per test on the shared servers, removed
//!   when their guards drop, and [`harness::TestApp`], a real `cardworker run` started in-process;
//!   [`inventory`], the Redis key inventory every test prefix is checked against.
//! - [`private`]: a redis-server or PostgreSQL cluster of the test's own on a free port, which a
//!   fault test stops, restarts, pauses or wipes; [`faults`], the setup the fault tests share
//!   (their worker's configuration, an in-process worker they stop, their cards).
//! - [`cluster`]: a three-master Redis Cluster of the test's own on loopback.
//! - [`process`]: `cardworker run` as a child process; [`proxy`], a TCP proxy in front of a
//!   redis-server, cut off or routed to another server.
//! - [`scripted_gateway`]: a Gateway whose answers a test scripts per payment.
//! - [`webdriver`]: the browser of the console's test.
//! - [`plan_drive`] and [`plan_guard`]: every statement path of `src/`, driven and judged by its
//!   plans (the plan guard test and `make bench-plans`).
//! - [`bench`](mod@bench): what the benchmarks share; [`redis_stats`], Redis's counters and the
//!   raw apalis-redis yardstick of the Redis-cost benches; [`worker_stage`], the database, config,
//!   cards and chains of the benches that run a `cardworker run` process against the simulator.

// Test code: an unwrap() that fails is the test failing, at its line (the workspace's
// `clippy::unwrap_used` is for product code).
#![allow(clippy::unwrap_used)]

pub mod bench;
pub mod cluster;
pub mod faults;
pub mod harness;
pub mod inventory;
pub mod plan_drive;
pub mod plan_guard;
pub mod private;
pub mod process;
pub mod proxy;
pub mod redis_stats;
pub mod scripted_gateway;
pub mod webdriver;
pub mod worker_stage;

use std::path::PathBuf;

/// A free TCP port on 127.0.0.1 (bound once and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The workspace's root directory (where `docs/`, `deploy/` and `src/` are).
pub fn repo_root() -> PathBuf {
    let kit = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    kit.parent().map(PathBuf::from).unwrap_or(kit)
}

/// The `cardworker` binary of this build. Cargo builds it for every integration test and
/// benchmark of the `cardworker` package, into the directory above the test's own executable
/// (`target/<profile>/deps/<test>` beside `target/<profile>/cardworker`).
pub fn cardworker_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own executable");
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("cardworker"))
        .expect("the test executable sits in target/<profile>/deps");
    assert!(
        bin.exists(),
        "no cardworker binary at {} (run the tests through cargo)",
        bin.display()
    );
    bin
}
