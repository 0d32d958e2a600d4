//! A pod asked to stop while it is still starting (Kubernetes sends SIGTERM whenever it likes:
//! a rolling deploy, a node drain) exits 0 at once, whatever its start was waiting for.

use std::os::unix::process::ExitStatusExt as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::faults::{self, Child};
use crate::harness::TestDb;
use crate::private::PrivateRedis;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_asked_to_stop_while_its_start_waits_for_redis_exits_0_at_once() {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = faults::config_file(dir.path(), &db.url, &redis.url(), "http://127.0.0.1:9", "");
    // Redis answers nobody for 30 s: the worker's start waits on it.
    redis.pause(Duration::from_secs(30));
    let mut worker = Child(
        Command::new(cardworker_test_kit::cardworker_bin())
            .arg("run")
            .arg("--config")
            .arg(&file)
            .env_remove("CARDWORKER_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn cardworker run"),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(worker.running(), "the start is still waiting for Redis");

    let asked = Instant::now();
    let sent = Command::new("kill")
        .args(["-TERM", &worker.0.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(sent.success());
    let status = loop {
        if let Some(status) = worker.0.try_wait().expect("wait") {
            break status;
        }
        assert!(
            asked.elapsed() < Duration::from_secs(5),
            "the worker still runs 5 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        (status.code(), status.signal()),
        (Some(0), None),
        "a clean exit, not a death by the signal: {status:?}"
    );
}
