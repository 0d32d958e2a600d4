//! The polling budget: the lease script against real Redis, and the `budget` CLI.

use std::time::Duration;

use cardworker::budget::{self, Acquired, Budget, CallReport, ShortReason};
use cardworker::config::{Config, Task};
use cardworker::limit::Limit;
use redis::aio::ConnectionManager;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

use crate::harness::{assert_success, redis_url, TestDb, TestRedis};

const SHORT_TOTAL: Acquired = Acquired::Short {
    reason: ShortReason::Total,
};
const SHORT_TASK: Acquired = Acquired::Short {
    reason: ShortReason::Task,
};

pub(crate) fn config(redis: &TestRedis, total: u32, carddata: u32, card_status: u32) -> Config {
    let mut c = Config::default();
    c.redis.url = redis_url().into();
    c.redis.key_prefix = redis.prefix.clone();
    c.polling.total_limit = Limit::new(total).expect("a limit");
    c.polling.carddata.limit = Limit::new(carddata).expect("a limit");
    c.polling.card_status.limit = Limit::new(card_status).expect("a limit");
    c
}

/// Asserts that `b` grants `task` a token for `lease`.
pub(crate) async fn granted(b: &Budget, task: Task, lease: &str) {
    let got = b.acquire(task, lease).await.unwrap();
    assert_eq!(got, Acquired::Acquired, "{task} {lease}");
}

/// A fresh key prefix, a connection, and a budget on them of `total` tokens, `carddata` and
/// `card_status` per task.
pub(crate) async fn fresh_budget(
    total: u32,
    carddata: u32,
    card_status: u32,
) -> (TestRedis, ConnectionManager, Budget) {
    let (r, conn, c) = fresh_config(total, carddata, card_status).await;
    let b = Budget::new(r.conn.clone(), &c);
    (r, conn, b)
}

/// A fresh key prefix, a connection, and the [`config`] on them of `total` tokens, `carddata` and
/// `card_status` per task.
pub(crate) async fn fresh_config(
    total: u32,
    carddata: u32,
    card_status: u32,
) -> (TestRedis, ConnectionManager, Config) {
    let r = TestRedis::new().await;
    let c = config(&r, total, carddata, card_status);
    let conn = r.conn.clone();
    (r, conn, c)
}

/// The lease sets of `r`'s prefix: the total's, carddata's and card_status's.
fn lease_sets(r: &TestRedis) -> (String, String, String) {
    let task = |t| budget::task_key(&r.prefix, t);
    let total = budget::total_key(&r.prefix);
    (total, task(Task::Carddata), task(Task::CardStatus))
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
    let (total, cd, cs) = lease_sets(&r);

    // Total full (2 of 2), carddata budget has room (1 of 2): nothing is added anywhere.
    let b = Budget::new(r.conn.clone(), &config(&r, 2, 2, 2));
    granted(&b, Task::Carddata, "a").await;
    granted(&b, Task::CardStatus, "b").await;
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
    granted(&b, Task::Carddata, "f").await;
    assert_eq!(members(&mut conn, &total).await, ["a", "b", "f"]);
    assert_eq!(members(&mut conn, &cd).await, ["a", "f"]);
    assert_eq!(members(&mut conn, &cs).await, ["b"]);
}

#[tokio::test]
async fn expired_leases_are_repaired_in_both_sets_by_the_same_call() {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let (total, cd, _) = lease_sets(&r);
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
    granted(&b, Task::Carddata, "live").await;
    assert_eq!(members(&mut conn, &total).await, ["live"]);
    assert_eq!(members(&mut conn, &cd).await, ["live"]);
    let view = b.show().await.unwrap();
    assert_eq!(view.total.in_use, 1);
    assert_eq!(view.tasks["carddata"].in_use, 1);
    // They ended by expiry, not by a release: counted once, in each scope they were in.
    assert_eq!(view.total.leases_expired, 2);
    assert_eq!(view.tasks["carddata"].leases_expired, 2);
    assert_eq!(view.tasks["card_status"].leases_expired, 0);
}

#[tokio::test]
async fn a_double_release_is_harmless() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    granted(&b, Task::Carddata, "x").await;
    granted(&b, Task::CardStatus, "y").await;
    assert_eq!(b.held_count(), 2);
    assert_eq!(b.release(&["x".to_owned()]).await.unwrap(), 1);
    assert_eq!(b.release(&["x".to_owned()]).await.unwrap(), 0);
    assert_eq!(b.release(&["never-taken".to_owned()]).await.unwrap(), 0);
    assert_eq!(b.held_count(), 1);
    assert_eq!(
        members(&mut conn, &budget::total_key(&r.prefix)).await,
        ["y"]
    );
    assert!(
        members(&mut conn, &budget::task_key(&r.prefix, Task::Carddata))
            .await
            .is_empty()
    );
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
async fn a_finished_poll_s_release_rides_on_the_next_acquire_so_each_admitted_job_costs_one_round_trip(
) {
    let r = TestRedis::new().await;
    let mut conn = r.conn.clone();
    let total = budget::total_key(&r.prefix);
    // One total token: the next acquire is granted only because it releases the finished lease
    // first, in the same call.
    let b = Budget::new(r.conn.clone(), &config(&r, 1, 1, 1));
    let mut leases = Vec::new();
    for (i, task) in [
        Task::Carddata,
        Task::Carddata,
        Task::CardStatus,
        Task::Carddata,
    ]
    .into_iter()
    .enumerate()
    {
        let lease = format!("l-{i}");
        granted(&b, task, &lease).await;
        assert_eq!(
            members(&mut conn, &total).await,
            std::slice::from_ref(&lease)
        );
        b.finish_carried(task, lease.clone(), CallReport::Ok, 0, "card");
        leases.push(lease);
    }
    assert_eq!(b.round_trips(), 4, "one call per admitted job");
    // Nothing acquires any more: the last finish is flushed on its own, within a few ms.
    let start = std::time::Instant::now();
    while b.show().await.unwrap().total.in_use > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the carried finish was never sent"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(b.held_count(), 0);
    assert_eq!(b.carried_count(), 0);
}

async fn score(conn: &mut ConnectionManager, key: &str, member: &str) -> Option<i64> {
    let s: Option<f64> = redis::cmd("ZSCORE")
        .arg(key)
        .arg(member)
        .query_async(conn)
        .await
        .expect("zscore");
    s.map(|s| s as i64)
}

#[tokio::test]
async fn a_slot_that_turns_over_keeps_its_lease_id_re_scored_in_place_with_a_fresh_expiry() {
    let (r, mut conn, b) = fresh_budget(1, 1, 1).await;
    let (total, cd, cs) = lease_sets(&r);
    // One total token: each acquire is granted only because it takes the finished poll's slot.
    assert_eq!(
        b.acquire_slot(Task::Carddata, "l-0").await.unwrap(),
        (Acquired::Acquired, "l-0".to_owned())
    );
    let first = score(&mut conn, &total, "l-0").await.expect("held");
    tokio::time::sleep(Duration::from_millis(5)).await;
    b.finish_carried(Task::Carddata, "l-0".to_owned(), CallReport::Ok, 0, "c");
    // Same task: the finished poll's lease id passes to the next poll, re-scored in both sets.
    assert_eq!(
        b.acquire_slot(Task::Carddata, "l-1").await.unwrap(),
        (Acquired::Acquired, "l-0".to_owned())
    );
    assert_eq!(members(&mut conn, &total).await, ["l-0"]);
    assert_eq!(members(&mut conn, &cd).await, ["l-0"]);
    let now = redis_now_ms(&mut conn).await;
    let second = score(&mut conn, &total, "l-0").await.expect("held");
    assert!(
        second > first,
        "the expiry is refreshed: {first} -> {second}"
    );
    assert!(second <= now + 60_000, "Redis now + the lease TTL at most");
    assert_eq!(score(&mut conn, &cd, "l-0").await, Some(second));
    // The other task: the total set keeps the member, the task sets swap it.
    b.finish_carried(Task::Carddata, "l-0".to_owned(), CallReport::Ok, 0, "c");
    assert_eq!(
        b.acquire_slot(Task::CardStatus, "l-2").await.unwrap(),
        (Acquired::Acquired, "l-0".to_owned())
    );
    assert_eq!(members(&mut conn, &total).await, ["l-0"]);
    assert!(members(&mut conn, &cd).await.is_empty());
    assert_eq!(members(&mut conn, &cs).await, ["l-0"]);
    assert_eq!(b.round_trips(), 3, "one call per admitted job");
    assert_eq!(b.held_count(), 1);
    assert_eq!(b.carried_count(), 0);
    // `acquire` never takes a lease over: the poll holds the id it asked with.
    b.finish_carried(Task::CardStatus, "l-0".to_owned(), CallReport::Ok, 0, "c");
    granted(&b, Task::Carddata, "l-3").await;
    assert_eq!(members(&mut conn, &total).await, ["l-3"]);
    assert_eq!(b.release_held().await.unwrap(), 1);
    assert_eq!(b.show().await.unwrap().total.in_use, 0);
}

#[tokio::test]
async fn an_acquire_carries_its_own_task_s_finishes_first_and_the_rest_are_flushed_within_ms() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    for (task, lease) in [(Task::Carddata, "d"), (Task::CardStatus, "s")] {
        assert_eq!(
            b.acquire_slot(task, lease).await.unwrap(),
            (Acquired::Acquired, lease.to_owned())
        );
    }
    b.finish_carried(Task::CardStatus, "s".to_owned(), CallReport::Ok, 0, "c");
    b.finish_carried(Task::Carddata, "d".to_owned(), CallReport::Ok, 0, "c");
    // A carddata acquire takes the carddata finish over and leaves the card_status one...
    assert_eq!(
        b.acquire_slot(Task::Carddata, "d2").await.unwrap(),
        (Acquired::Acquired, "d".to_owned())
    );
    assert_eq!(b.carried_count(), 1);
    // ...which the flush releases on its own within a few ms.
    let start = std::time::Instant::now();
    while b.carried_count() > 0
        || !members(&mut conn, &budget::task_key(&r.prefix, Task::CardStatus))
            .await
            .is_empty()
    {
        assert!(start.elapsed() < Duration::from_secs(10), "never flushed");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(
        members(&mut conn, &budget::total_key(&r.prefix)).await,
        ["d"]
    );
}

#[tokio::test]
async fn a_slot_taken_over_still_obeys_a_lowered_limit_a_pause_and_an_open_circuit() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    let (total, cd, _) = lease_sets(&r);
    for lease in ["a", "b"] {
        assert_eq!(
            b.acquire_slot(Task::Carddata, lease).await.unwrap(),
            (Acquired::Acquired, lease.to_owned())
        );
    }
    // Limit lowered to 1 while 2 run: the slot that turns over is not kept, it is given back.
    b.set_override(Task::Carddata, Limit::new(1).expect("a limit"))
        .await
        .unwrap();
    b.finish_carried(Task::Carddata, "a".to_owned(), CallReport::Ok, 0, "c");
    assert_eq!(
        b.acquire_slot(Task::Carddata, "c").await.unwrap(),
        (SHORT_TASK, String::new())
    );
    assert_eq!(members(&mut conn, &total).await, ["b"]);
    assert_eq!(members(&mut conn, &cd).await, ["b"]);
    // At the lowered limit now: the next turnover keeps its slot.
    b.finish_carried(Task::Carddata, "b".to_owned(), CallReport::Ok, 0, "c");
    assert_eq!(
        b.acquire_slot(Task::Carddata, "d").await.unwrap(),
        (Acquired::Acquired, "b".to_owned())
    );
    assert_eq!(members(&mut conn, &cd).await, ["b"]);
    // Paused: the carried lease is released, nothing is taken.
    b.pause(&[Task::Carddata]).await.unwrap();
    b.finish_carried(Task::Carddata, "b".to_owned(), CallReport::Ok, 0, "c");
    assert_eq!(
        b.acquire_slot(Task::Carddata, "e").await.unwrap(),
        (
            Acquired::Short {
                reason: ShortReason::Paused
            },
            String::new()
        )
    );
    assert!(members(&mut conn, &total).await.is_empty());
    assert!(members(&mut conn, &cd).await.is_empty());
    b.resume(&[Task::Carddata]).await.unwrap();
    // Circuit forced open: likewise.
    assert_eq!(
        b.acquire_slot(Task::Carddata, "f").await.unwrap(),
        (Acquired::Acquired, "f".to_owned())
    );
    b.force_circuit(Task::Carddata, true).await.unwrap();
    b.finish_carried(Task::Carddata, "f".to_owned(), CallReport::Ok, 0, "c");
    assert!(matches!(
        b.acquire_slot(Task::Carddata, "g").await.unwrap(),
        (Acquired::CircuitOpen { .. }, ref s) if s.is_empty()
    ));
    assert!(members(&mut conn, &total).await.is_empty());
    assert!(members(&mut conn, &cd).await.is_empty());
    assert_eq!(b.held_count(), 0);
}

#[tokio::test]
async fn a_carried_finish_counts_its_failure_in_the_circuit_and_shutdown_sends_what_is_carried() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    granted(&b, Task::Carddata, "f").await;
    granted(&b, Task::Carddata, "g").await;
    b.finish_carried(
        Task::Carddata,
        "f".to_owned(),
        CallReport::Failed,
        0,
        "card-f",
    );
    // Shutdown: the carried finish is sent (its failure counted), then what is still held goes:
    // both tokens are back.
    assert_eq!(b.release_held().await.unwrap(), 2);
    assert_eq!(b.show().await.unwrap().total.in_use, 0);
    let window: Vec<String> = redis::cmd("LRANGE")
        .arg(budget::circuit::window_key(&r.prefix, Task::Carddata))
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(window.len(), 1, "{window:?}");
    assert!(
        window[0].starts_with('f') && window[0].ends_with(":card-f"),
        "{window:?}"
    );
}

#[tokio::test]
async fn an_invalid_override_in_redis_falls_back_to_the_config_limit() {
    let (r, mut conn, b) = fresh_budget(8, 2, 2).await;
    for garbage in ["0", "-3", "abc", "1e9", "2.5", "999999999999999999999"] {
        let _: i64 = redis::cmd("HSET")
            .arg(budget::overrides_key(&r.prefix))
            .arg("carddata")
            .arg(garbage)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(
            b.acquire(Task::Carddata, "l1").await.unwrap(),
            Acquired::Acquired,
            "{garbage}"
        );
        assert_eq!(
            b.acquire(Task::Carddata, "l2").await.unwrap(),
            Acquired::Acquired,
            "{garbage}"
        );
        // Config says 2: never more (and never "unlimited"), never less.
        assert_eq!(
            b.acquire(Task::Carddata, "l3").await.unwrap(),
            SHORT_TASK,
            "{garbage}"
        );
        let view = b.show().await.unwrap();
        let t = &view.tasks["carddata"];
        assert_eq!(
            (t.limit.get(), t.override_limit.map(Limit::get)),
            (2, None),
            "{garbage}"
        );
        assert_eq!(t.invalid_override.as_deref(), Some(garbage));
        b.release(&["l1".to_owned(), "l2".to_owned()])
            .await
            .unwrap();
    }
    // A valid override applies atomically at the next acquire, clamped to the total.
    b.set_override(Task::Carddata, Limit::new(1).expect("a limit"))
        .await
        .unwrap();
    granted(&b, Task::Carddata, "m1").await;
    assert_eq!(b.acquire(Task::Carddata, "m2").await.unwrap(), SHORT_TASK);
    let small_total = Budget::new(r.conn.clone(), &config(&r, 2, 2, 2));
    b.set_override(Task::CardStatus, Limit::new(8).expect("a limit"))
        .await
        .unwrap();
    assert_eq!(
        small_total.show().await.unwrap().tasks["card_status"].limit,
        2
    );
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
    granted(&b, Task::Carddata, "m3").await;
}

/// Reads Redis's MONITOR stream on a raw connection until `until` appears in a line.
async fn monitor_lines(until: &str, run: impl std::future::Future<Output = ()>) -> Vec<String> {
    let url = url::Url::parse(&redis_url()).expect("redis url");
    let addr = format!(
        "{}:{}",
        url.host_str().unwrap_or("127.0.0.1"),
        url.port().unwrap_or(6379)
    );
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("monitor connection");
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
    tokio::time::timeout(Duration::from_secs(5), collect)
        .await
        .expect("monitor saw the call");
    seen
}

#[tokio::test]
async fn a_skewed_worker_clock_changes_nothing_because_leases_run_on_redis_time() {
    let (r, mut conn, mut c) = fresh_config(1, 1, 1).await;
    c.polling.lease_ttl_secs = 1;
    let b = Budget::new(r.conn.clone(), &c);
    let lease = format!("skew-{}", ulid::Ulid::new());

    // 1. The acquire call carries no timestamp of the worker's clock: every argument it sends
    //    is shown by MONITOR, and none is a time (only op, task, lease, limits and the TTL).
    let b2 = b.clone();
    let l2 = lease.clone();
    let lines = monitor_lines(&lease, async move {
        assert_eq!(
            b2.acquire(Task::Carddata, &l2).await.unwrap(),
            Acquired::Acquired
        );
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
    assert!(
        args.contains(&"1000"),
        "the TTL (ms) is the only time passed: {call}"
    );

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
    assert_eq!(
        b.acquire(Task::Carddata, "other").await.unwrap(),
        SHORT_TOTAL
    );
    loop {
        if redis_now_ms(&mut conn).await > expiry {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    granted(&b, Task::Carddata, "other").await;
    assert_eq!(
        members(&mut conn, &budget::total_key(&r.prefix)).await,
        ["other"]
    );
}

// ---- CLI ----

/// A config file on the test prefix (and, for the commands that record operator events, the
/// test database: never the shared default one).
fn write_config(
    dir: &tempfile::TempDir,
    prefix: &str,
    db: Option<&TestDb>,
    extra: &str,
) -> std::path::PathBuf {
    let path = dir.path().join("cardworker.toml");
    let database = db.map_or(String::new(), |db| {
        format!("[database]\nurl = \"{}\"\n\n", db.url)
    });
    std::fs::write(
        &path,
        format!(
            "{database}[redis]\nurl = \"{}\"\nkey_prefix = \"{prefix}\"\n\n[polling]\ntotal_limit = 8\n{extra}\n[polling.carddata]\nlimit = 4\n\n[polling.card_status]\nlimit = 3\n",
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
    let cfg = write_config(&dir, &r.prefix, None, "");
    for bad in ["0", "-1", "3.5", "abc", "inf", "100000", "9"] {
        let out = cardworker(
            &["budget", "set", "--task", "carddata", "--limit", bad],
            &cfg,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("polling.carddata.limit"), "{bad}: {err}");
        assert!(err.contains(&format!("\"{bad}\"")), "{bad}: {err}");
        assert!(
            err.contains("1..=256") || err.contains("at most polling.total_limit = 8"),
            "{bad}: {err}"
        );
    }
    let out = cardworker(
        &["budget", "set", "--task", "payments", "--limit", "2"],
        &cfg,
    );
    // clap refuses an unknown task, naming the value and what is allowed.
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'payments'"), "{err}");
    assert!(
        err.contains("carddata") && err.contains("card_status") && !err.contains("card-status"),
        "{err}"
    );
    let out = cardworker(&["budget", "pause", "--task", "nope"], &cfg);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'nope'") && err.contains("or all"), "{err}");
    // Nothing was written (the epoch marker is the harness's).
    let written: Vec<String> = r
        .keys()
        .await
        .into_iter()
        .filter(|k| !k.ends_with(":redis_epoch"))
        .collect();
    assert!(written.is_empty(), "{written:?}");
}

#[tokio::test]
async fn budget_show_prints_the_spec_json_shape_with_overrides_pauses_and_leases() {
    let r = TestRedis::new().await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = write_config(&dir, &r.prefix, Some(&db), "");
    let ok = |args: &[&str]| {
        let out = cardworker(args, &cfg_path);
        assert_success(&out, &format!("{args:?}"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    ok(&[
        "budget",
        "set",
        "--task",
        "card-status",
        "--limit",
        "2",
        "--reason",
        "gateway asked us to slow down",
    ]);
    let b = Budget::new(r.conn.clone(), &config(&r, 8, 4, 3));
    granted(&b, Task::Carddata, "p1").await;
    granted(&b, Task::CardStatus, "p2").await;
    granted(&b, Task::CardStatus, "p3").await;
    // A pause stops new tokens; the ones held keep counting until released.
    ok(&["budget", "pause", "--task", "carddata"]);

    let mut json: serde_json::Value =
        serde_json::from_str(&ok(&["budget", "show", "--format", "json"])).expect("json");
    // Each task also lists its circuit (spec section 6); the rest is the spec's shape.
    for task in ["carddata", "card_status"] {
        let circuit = json["tasks"][task]
            .as_object_mut()
            .and_then(|t| t.remove("circuit"))
            .expect("a circuit per task");
        assert_eq!(circuit["state"], "closed", "{circuit}");
        assert_eq!(circuit["forced"], false, "{circuit}");
    }
    assert_eq!(
        json,
        serde_json::json!({
            "total": {"limit": 8, "in_use": 3, "kept": 0, "leases_expired": 0},
            "tasks": {
                "carddata": {"limit": 4, "config_limit": 4, "override": null, "paused": true, "in_use": 1, "kept": 0, "leases_expired": 0},
                "card_status": {"limit": 2, "config_limit": 3, "override": 2, "paused": false, "in_use": 2, "kept": 0, "leases_expired": 0}
            }
        })
    );
    let text = ok(&["budget", "show"]);
    assert!(text.contains("card_status"), "{text}");
    assert!(text.contains("closed (window 0 calls, 0 failed)"), "{text}");

    ok(&["budget", "resume", "--task", "all", "--reason", "done"]);
    ok(&["budget", "clear", "--task", "card_status"]);
    // Each action that changed polling wrote one operator event, with the reason when given.
    let events: Vec<(String, Option<String>, String, String)> = sqlx::query_as(
        "SELECT e.event_type, e.details->>'reason', e.actor, string_agg(r.resource_id, ',' ORDER BY r.resource_id)
           FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          GROUP BY e.id ORDER BY e.id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let kinds: Vec<(&str, Option<&str>, &str)> = events
        .iter()
        .map(|(t, r, _, res)| (t.as_str(), r.as_deref(), res.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            (
                "operator.budget_set",
                Some("gateway asked us to slow down"),
                "card_status"
            ),
            ("operator.budget_pause", None, "carddata"),
            (
                "operator.budget_resume",
                Some("done"),
                "card_status,carddata"
            ),
            ("operator.budget_clear", None, "card_status"),
        ]
    );
    assert!(
        events.iter().all(|e| e.2.starts_with("operator:")),
        "{events:?}"
    );
    b.release_held().await.unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["budget", "show", "--format", "json"])).expect("json");
    assert_eq!(json["tasks"]["carddata"]["paused"], false);
    assert_eq!(
        json["tasks"]["card_status"]["override"],
        serde_json::Value::Null
    );
    assert_eq!(json["tasks"]["card_status"]["limit"], 3);
    assert_eq!(json["total"]["in_use"], 0);
}

// ---- several `cardworker run` processes sharing one Redis ----

mod fleet {
    use std::time::{Duration, Instant};

    use cardworker::config::Task;
    use cardworker::polling::lease;
    use cardworker::sim::{SimHandle, Simulator};

    use crate::harness::{metric_value, spawn_worker, wait_until, TestDb, TestRedis, Worker};
    use crate::worker_support::{polling_env, Polling, PollingEnv};

    pub struct Fleet {
        pub workers: Vec<Worker>,
        pub sim: Simulator,
        pub _sim_handle: SimHandle,
        pub redis: TestRedis,
        pub db: TestDb,
        pub _dir: tempfile::TempDir,
    }

    /// `n` processes: total_limit 4, task limits 3 and 3, lease 8 s, handler 3 s, gateway 1 s;
    /// `cards` cards per task with a pending chain each (interval 1 h: each card polled once).
    pub async fn start(n: usize, cards: usize, latency_ms: u64) -> Fleet {
        let PollingEnv {
            db,
            redis,
            sim,
            sim_handle,
            dir,
            config: path,
        } = polling_env(
            latency_ms,
            4,
            &Polling {
                gateway_timeout_ms: 1000,
                shutdown_grace_secs: 10,
                total_limit: 4,
                handler_timeout_secs: 3,
                lease_ttl_secs: 8,
                task_limit: 3,
                interval_secs: 3600,
                more_polling: "",
            },
        )
        .await;
        for i in 0..cards {
            for r in [format!("d-{i:04}"), format!("s-{i:04}")] {
                sqlx::query("INSERT INTO cards (card_ref) VALUES ($1)")
                    .bind(&r)
                    .execute(&db.pool)
                    .await
                    .unwrap();
            }
        }
        let mut workers = Vec::new();
        for _ in 0..n {
            workers.push(spawn_worker(&path));
        }
        let mut conn = redis.conn.clone();
        for i in 0..cards {
            lease::start(
                &mut conn,
                &redis.prefix,
                Task::Carddata,
                &format!("d-{i:04}"),
                Duration::ZERO,
            )
            .await
            .unwrap();
            lease::start(
                &mut conn,
                &redis.prefix,
                Task::CardStatus,
                &format!("s-{i:04}"),
                Duration::ZERO,
            )
            .await
            .unwrap();
        }
        Fleet {
            workers,
            sim,
            _sim_handle: sim_handle,
            redis,
            db,
            _dir: dir,
        }
    }

    pub async fn leases_of(fleet: &Fleet, pid: u32) -> usize {
        let mut conn = fleet.redis.conn.clone();
        let ids: Vec<String> = redis::cmd("ZRANGE")
            .arg(cardworker::budget::total_key(&fleet.redis.prefix))
            .arg(0)
            .arg(-1)
            .query_async(&mut conn)
            .await
            .unwrap();
        ids.iter()
            .filter(|id| id.contains(&format!("-{pid}-")))
            .count()
    }

    /// The expiry (unix ms, Redis clock) of each lease process `pid` holds.
    pub async fn lease_expiries(fleet: &Fleet, pid: u32) -> Vec<i64> {
        let mut conn = fleet.redis.conn.clone();
        let leases: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(cardworker::budget::total_key(&fleet.redis.prefix))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await
            .unwrap();
        leases
            .into_iter()
            .filter(|(id, _)| id.contains(&format!("-{pid}-")))
            .map(|(_, at)| at as i64)
            .collect()
    }

    /// Redis's clock in unix ms (the clock leases expire by).
    pub async fn redis_now_ms(fleet: &Fleet) -> i64 {
        let mut conn = fleet.redis.conn.clone();
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        secs * 1000 + micros / 1000
    }

    pub async fn deferrals(workers: &[Worker]) -> f64 {
        let mut sum = 0.0;
        for w in workers {
            sum += metric_value(&w.metrics().await, "cardworker_poll_deferred_total", &[]);
        }
        sum
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_processes_never_exceed_the_shared_budgets_and_every_job_completes() {
        const CARDS: usize = 150;
        let fleet = start(3, CARDS, 200).await;
        let started = Instant::now();
        // Every card seen by the Gateway, not merely as many calls as cards: a card polled a
        // second time (its next poll) can come before another card's first, whose job was
        // deferred a few times while three processes compete for four tokens.
        let all_cards: Vec<String> = (0..CARDS)
            .flat_map(|i| [format!("d-{i:04}"), format!("s-{i:04}")])
            .collect();
        wait_until(
            Duration::from_secs(90),
            "every card polled once per task",
            || async {
                fleet.sim.stats().in_flight == 0
                    && all_cards.iter().all(|c| fleet.sim.card(c).is_some())
            },
        )
        .await;
        let elapsed = started.elapsed();
        let stats = fleet.sim.stats();
        assert!(stats.peak_in_flight <= 4, "{stats:?}");
        assert!(
            stats.peak_per_call.get("carddata").copied().unwrap_or(0) <= 3,
            "{stats:?}"
        );
        assert!(
            stats.peak_per_call.get("card_status").copied().unwrap_or(0) <= 3,
            "{stats:?}"
        );
        assert_eq!(
            stats.peak_in_flight, 4,
            "the fleet used its whole budget: {stats:?}"
        );
        let missing: Vec<String> = (0..CARDS)
            .flat_map(|i| [format!("d-{i:04}"), format!("s-{i:04}")])
            .filter(|c| fleet.sim.card(c).is_none())
            .collect();
        assert!(missing.is_empty(), "never polled: {missing:?}; {stats:?}");
        let deferred = deferrals(&fleet.workers).await;
        assert!(
            deferred > 0.0,
            "three processes with 6 slots each against 4 tokens defer"
        );
        eprintln!(
            "{} jobs in {elapsed:?}; {deferred} deferrals; {stats:?}",
            2 * CARDS
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_kill_9_its_leases_count_until_they_expire_and_then_the_others_run_at_the_full_limit(
    ) {
        let mut fleet = start(3, 150, 800).await;
        // Wait until the fleet runs at the full limit and find a process holding tokens.
        let deadline = Instant::now() + Duration::from_secs(30);
        let victim = loop {
            assert!(
                Instant::now() < deadline,
                "no process held tokens at the full limit"
            );
            let mut found = None;
            if fleet.sim.stats().in_flight >= 4 {
                for (i, w) in fleet.workers.iter().enumerate() {
                    if leases_of(&fleet, w.pid()).await > 0 {
                        found = Some(i);
                        break;
                    }
                }
            }
            if let Some(i) = found {
                break i;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let mut dead = fleet.workers.remove(victim);
        let dead_pid = dead.pid();
        dead.child.kill().expect("kill -9");
        let _ = dead.child.wait();
        let killed = Instant::now();
        // Its leases as the kill left them, and when each expires (unix ms, Redis clock).
        let expiries = lease_expiries(&fleet, dead_pid).await;
        let held = expiries.len();
        assert!(held > 0);
        let first_expiry = expiries.iter().copied().min().expect("held");
        // Its leases count until they expire (checked on Redis's clock, whatever this machine's
        // speed); then the survivors take the whole budget again.
        wait_until(
            Duration::from_secs(60),
            "the survivors at the full limit again",
            || async {
                let now = redis_now_ms(&fleet).await;
                let left = leases_of(&fleet, dead_pid).await;
                if now < first_expiry {
                    assert_eq!(
                        left, held,
                        "a lease of the killed process vanished before it expired"
                    );
                }
                left == 0 && fleet.sim.stats().in_flight == 4
            },
        )
        .await;
        eprintln!(
            "full limit again {:?} after kill -9 (held {held})",
            killed.elapsed()
        );
        assert!(fleet.sim.stats().peak_in_flight <= 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sigterm_exits_0_and_releases_the_process_leases_at_once() {
        let mut fleet = start(1, 40, 800).await;
        wait_until(Duration::from_secs(30), "tokens held", || async {
            fleet.sim.stats().in_flight >= 3
        })
        .await;
        let pid = fleet.workers[0].pid();
        assert!(leases_of(&fleet, pid).await > 0);
        let term = Instant::now();
        fleet.workers[0].terminate();
        let status = fleet.workers[0].child.wait().expect("wait");
        assert_eq!(status.code(), Some(0), "exit status after SIGTERM");
        // Released, not expired: an expired lease stays in the set until an acquire sweeps it,
        // and no other process runs (read before `show`, which may sweep).
        assert_eq!(leases_of(&fleet, pid).await, 0, "released at exit");
        let budget = cardworker::budget::Budget::new(fleet.redis.conn.clone(), &{
            let mut c = cardworker::config::Config::default();
            c.redis.key_prefix = fleet.redis.prefix.clone();
            c
        });
        let view = budget.show().await.unwrap();
        assert_eq!(view.total.in_use, 0, "{view:?}");
        eprintln!("exited and released {:?} after SIGTERM", term.elapsed());
        let _ = &fleet.db;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_that_starts_while_another_records_the_deployment_s_first_start_reads_that_start()
{
    // Two pods of a new deployment start together: the second one's record waits on the first
    // one's uncommitted row, and must then read it, not fail for having raced it.
    let db = TestDb::new().await;
    let r = TestRedis::new().await;
    let mut first = db.pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO budget_deployment (id) VALUES (TRUE)")
        .execute(&mut *first)
        .await
        .expect("the first pod's record");
    let budget = Budget::new(r.conn.clone(), &config(&r, 2, 2, 2));
    let pool = db.pool.clone();
    let second = tokio::spawn(async move { budget.record_start(&pool).await });
    crate::harness::wait_until(
        Duration::from_secs(10),
        "the second pod's record waits on the first one's row",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock'",
            )
            .fetch_one(&db.pool)
            .await
            .expect("pg_stat_activity")
                > 0
        },
    )
    .await;
    first.commit().await.expect("commit");
    second
        .await
        .expect("joined")
        .expect("the second pod reads the deployment's first start");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM budget_deployment")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(rows, 1);
}
