//! The polling budget: the lease script against real Redis, and the `budget` CLI.

use std::time::Duration;

use cardworker::budget::{self, Acquired, Budget, ShortReason};
use cardworker::config::{Config, Task};
use redis::aio::ConnectionManager;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

use crate::harness::{redis_url, TestRedis};

const SHORT_TOTAL: Acquired = Acquired::Short {
    reason: ShortReason::Total,
};
const SHORT_TASK: Acquired = Acquired::Short {
    reason: ShortReason::Task,
};

fn config(redis: &TestRedis, total: u32, carddata: u32, card_status: u32) -> Config {
    let mut c = Config::default();
    c.redis.url = redis_url();
    c.redis.key_prefix = redis.prefix.clone();
    c.polling.total_limit = total;
    c.polling.carddata.limit = carddata;
    c.polling.card_status.limit = card_status;
    c
}

async fn members(conn: &mut ConnectionManager, key: &str) -> Vec<String> {
    let mut m: Vec<String> = redis::cmd("ZRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .expect("zrange");
    m.sort();
    m
}

async fn redis_now_ms(conn: &mut ConnectionManager) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("time");
    s * 1000 + us / 1000
}

#[tokio::test]
async fn both_tokens_are_taken_or_neither_when_either_budget_is_full() {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let total = budget::total_key(&r.prefix);
    let cd = budget::task_key(&r.prefix, Task::Carddata);
    let cs = budget::task_key(&r.prefix, Task::CardStatus);

    // Total full (2 of 2), carddata budget has room (1 of 2): nothing is added anywhere.
    let b = Budget::new(r.conn.clone(), &config(&r, 2, 2, 2));
    assert_eq!(b.acquire(Task::Carddata, "a").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.acquire(Task::CardStatus, "b").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.acquire(Task::Carddata, "c").await.unwrap(), SHORT_TOTAL);
    assert_eq!(members(&mut conn, &total).await, ["a", "b"]);
    assert_eq!(members(&mut conn, &cd).await, ["a"]);
    assert_eq!(members(&mut conn, &cs).await, ["b"]);

    // Task full (1 of 1), total has room (2 of 4): still nothing is added anywhere.
    let b = Budget::new(r.conn.clone(), &config(&r, 4, 1, 1));
    assert_eq!(b.acquire(Task::Carddata, "d").await.unwrap(), SHORT_TASK);
    assert_eq!(members(&mut conn, &total).await, ["a", "b"]);
    assert_eq!(members(&mut conn, &cd).await, ["a"]);

    // Both full: reported as `total`.
    let b = Budget::new(r.conn.clone(), &config(&r, 2, 1, 1));
    assert_eq!(b.acquire(Task::Carddata, "e").await.unwrap(), SHORT_TOTAL);

    // Room in both: the same lease lands in both sets.
    let b = Budget::new(r.conn.clone(), &config(&r, 3, 2, 2));
    assert_eq!(b.acquire(Task::Carddata, "f").await.unwrap(), Acquired::Acquired);
    assert_eq!(members(&mut conn, &total).await, ["a", "b", "f"]);
    assert_eq!(members(&mut conn, &cd).await, ["a", "f"]);
    assert_eq!(members(&mut conn, &cs).await, ["b"]);
}

#[tokio::test]
async fn expired_leases_are_repaired_in_both_sets_by_the_same_call() {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let total = budget::total_key(&r.prefix);
    let cd = budget::task_key(&r.prefix, Task::Carddata);
    // A crashed worker's leases: expired long ago (score = expiry ms), in both sets.
    for key in [&total, &cd] {
        let _: i64 = redis::cmd("ZADD")
            .arg(key)
            .arg(1)
            .arg("dead-1")
            .arg(2)
            .arg("dead-2")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let b = Budget::new(r.conn.clone(), &config(&r, 2, 2, 2));
    assert_eq!(b.acquire(Task::Carddata, "live").await.unwrap(), Acquired::Acquired);
    assert_eq!(members(&mut conn, &total).await, ["live"]);
    assert_eq!(members(&mut conn, &cd).await, ["live"]);
    let view = b.show().await.unwrap();
    assert_eq!(view.total.in_use, 1);
    assert_eq!(view.tasks["carddata"].in_use, 1);
}

#[tokio::test]
async fn a_double_release_is_harmless() {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let b = Budget::new(r.conn.clone(), &config(&r, 4, 2, 2));
    assert_eq!(b.acquire(Task::Carddata, "x").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.acquire(Task::CardStatus, "y").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.held_count(), 2);
    assert_eq!(b.release(&["x".to_owned()]).await.unwrap(), 1);
    assert_eq!(b.release(&["x".to_owned()]).await.unwrap(), 0);
    assert_eq!(b.release(&["never-taken".to_owned()]).await.unwrap(), 0);
    assert_eq!(b.held_count(), 1);
    assert_eq!(members(&mut conn, &budget::total_key(&r.prefix)).await, ["y"]);
    assert!(members(&mut conn, &budget::task_key(&r.prefix, Task::Carddata))
        .await
        .is_empty());
    assert_eq!(
        members(&mut conn, &budget::task_key(&r.prefix, Task::CardStatus)).await,
        ["y"]
    );
    // Shutdown: everything still held, in one call.
    assert_eq!(b.release_held().await.unwrap(), 1);
    assert_eq!(b.held_count(), 0);
    assert_eq!(b.show().await.unwrap().total.in_use, 0);
}

#[tokio::test]
async fn an_invalid_override_in_redis_falls_back_to_the_config_limit() {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let b = Budget::new(r.conn.clone(), &config(&r, 8, 2, 2));
    for garbage in ["0", "-3", "abc", "1e9", "2.5", "999999999999999999999"] {
        let _: i64 = redis::cmd("HSET")
            .arg(budget::overrides_key(&r.prefix))
            .arg("carddata")
            .arg(garbage)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(b.acquire(Task::Carddata, "l1").await.unwrap(), Acquired::Acquired, "{garbage}");
        assert_eq!(b.acquire(Task::Carddata, "l2").await.unwrap(), Acquired::Acquired, "{garbage}");
        // Config says 2: never more (and never "unlimited"), never less.
        assert_eq!(b.acquire(Task::Carddata, "l3").await.unwrap(), SHORT_TASK, "{garbage}");
        let view = b.show().await.unwrap();
        let t = &view.tasks["carddata"];
        assert_eq!((t.limit, t.override_limit), (2, None), "{garbage}");
        assert_eq!(t.invalid_override.as_deref(), Some(garbage));
        b.release(&["l1".to_owned(), "l2".to_owned()]).await.unwrap();
    }
    // A valid override applies atomically at the next acquire, clamped to the total.
    b.set_override(Task::Carddata, 1).await.unwrap();
    assert_eq!(b.acquire(Task::Carddata, "m1").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.acquire(Task::Carddata, "m2").await.unwrap(), SHORT_TASK);
    let small_total = Budget::new(r.conn.clone(), &config(&r, 2, 2, 2));
    b.set_override(Task::CardStatus, 8).await.unwrap();
    assert_eq!(small_total.show().await.unwrap().tasks["card_status"].limit, 2);
    // A pause defers before anything else.
    b.pause(&[Task::Carddata]).await.unwrap();
    b.clear_override(Task::Carddata).await.unwrap();
    assert_eq!(
        b.acquire(Task::Carddata, "m3").await.unwrap(),
        Acquired::Short {
            reason: ShortReason::Paused
        }
    );
    b.resume(&[Task::Carddata]).await.unwrap();
    assert_eq!(b.acquire(Task::Carddata, "m3").await.unwrap(), Acquired::Acquired);
}

/// Reads Redis's MONITOR stream on a raw connection until `until` appears in a line.
async fn monitor_lines(until: &str, run: impl std::future::Future<Output = ()>) -> Vec<String> {
    let url = url::Url::parse(&redis_url()).expect("redis url");
    let addr = format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(6379)
    );
    let stream = tokio::net::TcpStream::connect(addr).await.expect("monitor connection");
    let (read, mut write) = stream.into_split();
    write.write_all(b"MONITOR\r\n").await.unwrap();
    let mut lines = BufReader::new(read).lines();
    assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("+OK"));
    run.await;
    let mut seen = Vec::new();
    let collect = async {
        while let Ok(Some(line)) = lines.next_line().await {
            let done = line.contains(until);
            seen.push(line);
            if done {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), collect).await.expect("monitor saw the call");
    seen
}

#[tokio::test]
async fn a_skewed_worker_clock_changes_nothing_because_leases_run_on_redis_time() {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let mut c = config(&r, 1, 1, 1);
    c.polling.lease_ttl_secs = 1;
    let b = Budget::new(r.conn.clone(), &c);
    let lease = format!("skew-{}", ulid::Ulid::new());

    // 1. The acquire call carries no timestamp of the worker's clock: every argument it sends
    //    is shown by MONITOR, and none is a time (only op, task, lease, limits and the TTL).
    let b2 = b.clone();
    let l2 = lease.clone();
    let lines = monitor_lines(&lease, async move {
        assert_eq!(b2.acquire(Task::Carddata, &l2).await.unwrap(), Acquired::Acquired);
    })
    .await;
    let call = lines
        .iter()
        .find(|l| l.contains(&lease) && (l.contains("EVALSHA") || l.contains("EVAL")))
        .expect("the acquire call");
    let worker_now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let args: Vec<&str> = call.split('"').skip(1).step_by(2).collect();
    for arg in &args {
        if let Ok(n) = arg.parse::<u64>() {
            // Anything near "now" in seconds or ms would be a worker timestamp.
            assert!(
                n < worker_now_s / 2,
                "argument {n} looks like a timestamp: {call}"
            );
        }
    }
    assert!(args.contains(&"1000"), "the TTL (ms) is the only time passed: {call}");

    // 2. The lease's expiry is Redis's TIME + TTL, whatever this process's clock says.
    let redis_now = redis_now_ms(&mut conn).await;
    let score: f64 = redis::cmd("ZSCORE")
        .arg(budget::total_key(&r.prefix))
        .arg(&lease)
        .query_async(&mut conn)
        .await
        .unwrap();
    let expiry = score as i64;
    assert!(
        expiry > redis_now && expiry <= redis_now + 1_000,
        "expiry {expiry} vs redis now {redis_now}"
    );

    // 3. It expires by Redis time: once Redis's clock passes it, the next acquire repairs it.
    assert_eq!(b.acquire(Task::Carddata, "other").await.unwrap(), SHORT_TOTAL);
    loop {
        if redis_now_ms(&mut conn).await > expiry {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(b.acquire(Task::Carddata, "other").await.unwrap(), Acquired::Acquired);
    assert_eq!(
        members(&mut conn, &budget::total_key(&r.prefix)).await,
        ["other"]
    );
}

// ---- CLI ----

fn write_config(dir: &tempfile::TempDir, prefix: &str, extra: &str) -> std::path::PathBuf {
    let path = dir.path().join("cardworker.toml");
    std::fs::write(
        &path,
        format!(
            "[redis]\nurl = \"{}\"\nkey_prefix = \"{prefix}\"\n\n[polling]\ntotal_limit = 8\n{extra}\n[polling.carddata]\nlimit = 4\n\n[polling.card_status]\nlimit = 3\n",
            redis_url()
        ),
    )
    .unwrap();
    path
}

fn cardworker(args: &[&str], config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run cardworker")
}

#[tokio::test]
async fn budget_set_refuses_an_invalid_limit_with_exit_status_2_naming_the_key() {
    let r = TestRedis::new().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(&dir, &r.prefix, "");
    for bad in ["0", "-1", "3.5", "abc", "inf", "100000", "9"] {
        let out = cardworker(&["budget", "set", "--task", "carddata", "--limit", bad], &cfg);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("polling.carddata.limit"), "{bad}: {err}");
        assert!(err.contains(&format!("\"{bad}\"")), "{bad}: {err}");
        assert!(
            err.contains("1..=256") || err.contains("at most polling.total_limit = 8"),
            "{bad}: {err}"
        );
    }
    let out = cardworker(&["budget", "set", "--task", "payments", "--limit", "2"], &cfg);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"payments\""));
    let out = cardworker(&["budget", "pause", "--task", "nope"], &cfg);
    assert_eq!(out.status.code(), Some(2));
    // Nothing was written.
    assert!(r.keys().await.is_empty(), "{:?}", r.keys().await);
}

#[tokio::test]
async fn budget_show_prints_the_spec_json_shape_with_overrides_pauses_and_leases() {
    let r = TestRedis::new().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = write_config(&dir, &r.prefix, "");
    let ok = |args: &[&str]| {
        let out = cardworker(args, &cfg_path);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(&["budget", "set", "--task", "card-status", "--limit", "2"]);
    let b = Budget::new(r.conn.clone(), &config(&r, 8, 4, 3));
    assert_eq!(b.acquire(Task::Carddata, "p1").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.acquire(Task::CardStatus, "p2").await.unwrap(), Acquired::Acquired);
    assert_eq!(b.acquire(Task::CardStatus, "p3").await.unwrap(), Acquired::Acquired);
    // A pause stops new tokens; the ones held keep counting until released.
    ok(&["budget", "pause", "--task", "carddata"]);

    let json: serde_json::Value =
        serde_json::from_str(&ok(&["budget", "show", "--format", "json"])).expect("json");
    assert_eq!(
        json,
        serde_json::json!({
            "total": {"limit": 8, "in_use": 3},
            "tasks": {
                "carddata": {"limit": 4, "config_limit": 4, "override": null, "paused": true, "in_use": 1},
                "card_status": {"limit": 2, "config_limit": 3, "override": 2, "paused": false, "in_use": 2}
            }
        })
    );
    let text = ok(&["budget", "show"]);
    assert!(text.contains("card_status"), "{text}");

    ok(&["budget", "resume", "--task", "all"]);
    ok(&["budget", "clear", "--task", "card_status"]);
    b.release_held().await.unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["budget", "show", "--format", "json"])).expect("json");
    assert_eq!(json["tasks"]["carddata"]["paused"], false);
    assert_eq!(json["tasks"]["card_status"]["override"], serde_json::Value::Null);
    assert_eq!(json["tasks"]["card_status"]["limit"], 3);
    assert_eq!(json["total"]["in_use"], 0);
}
