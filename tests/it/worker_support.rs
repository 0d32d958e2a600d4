//! Helpers of the tests that run `cardworker run` processes polling both tasks against the
//! simulator: the services and the worker's config file, with the values that differ per test.

use cardworker::sim::{SimHandle, Simulator};

use crate::harness::{worker_config_file, TestDb, TestRedis};

/// The settings that differ between the polling workers' configs: the Gateway's timeout, the
/// shutdown grace, and the `[polling]` limits, timeouts and intervals (each task gets the same
/// limit and interval).
pub struct Polling<'a> {
    pub gateway_timeout_ms: u64,
    pub shutdown_grace_secs: u64,
    pub total_limit: u32,
    pub handler_timeout_secs: u64,
    pub lease_ttl_secs: u64,
    /// The `limit` of each task.
    pub task_limit: u32,
    /// The `interval_secs` of each task.
    pub interval_secs: u64,
    /// More lines of `[polling]`, each ending in a newline (empty for none).
    pub more_polling: &'a str,
}

/// What a test of polling workers runs against: a test database and key prefix, the simulator
/// (its handle keeps it serving), and the config file in its temporary directory.
pub struct PollingEnv {
    pub db: TestDb,
    pub redis: TestRedis,
    pub sim: Simulator,
    pub sim_handle: SimHandle,
    pub dir: tempfile::TempDir,
    pub config: std::path::PathBuf,
}

/// Starts the services for workers of `polling` on a pool of `connections`: a new test database
/// and prefix, the simulator answering after `latency_ms`, and the config file (retries back
/// off from 1 s to 3 s).
pub async fn polling_env(latency_ms: u64, connections: u32, polling: &Polling<'_>) -> PollingEnv {
    let db = TestDb::new().await;
    let redis = TestRedis::new().await;
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(latency_ms, 0);
    let dir = tempfile::tempdir().unwrap();
    let Polling {
        gateway_timeout_ms,
        shutdown_grace_secs,
        total_limit,
        handler_timeout_secs,
        lease_ttl_secs,
        task_limit,
        interval_secs,
        more_polling,
    } = polling;
    let config = worker_config_file(
        &dir,
        (&db, connections),
        &redis,
        &sim_handle.base_url(),
        &format!(
            "timeout_ms = {gateway_timeout_ms}\n\n\
             [worker]\nshutdown_grace_secs = {shutdown_grace_secs}\n\n\
             [polling]\ntotal_limit = {total_limit}\nhandler_timeout_secs = {handler_timeout_secs}\n\
             {more_polling}lease_ttl_secs = {lease_ttl_secs}\ndefer_delay_secs = 1\ndefer_max_delay_secs = 3\n\n\
             [polling.carddata]\nlimit = {task_limit}\ninterval_secs = {interval_secs}\n\n\
             [polling.card_status]\nlimit = {task_limit}\ninterval_secs = {interval_secs}\n"
        ),
    );
    PollingEnv {
        db,
        redis,
        sim,
        sim_handle,
        dir,
        config,
    }
}
