//! What an idle pod's feeder sends to Redis (issue 16), counted by a private redis-server's
//! `INFO commandstats` (the shared Redis would count other clients too). Counted per feed tick,
//! never timed; the announcements' subscription is real (`queue::announce`).

use std::collections::BTreeMap;
use std::time::Duration;

use cardworker::config::Task;
use cardworker::context;
use cardworker::polling::chain;
use cardworker::queue::announce::Announcements;
use cardworker::queue::intake::{FeedState, Feeder, QUIET_READ_EVERY_TICKS, SWEEP_EVERY_TICKS};
use cardworker_jobs::{Job, Producer, SubmitPayment};
use redis::aio::ConnectionManager;

use crate::private::PrivateRedis;

/// Calls per command since the last `CONFIG RESETSTAT` (the test's own INFO and CONFIG left out),
/// and the bytes Redis read from its clients.
pub(crate) async fn counted(conn: &mut ConnectionManager) -> (BTreeMap<String, u64>, u64) {
    let text: String = redis::cmd("INFO")
        .arg("all")
        .query_async(conn)
        .await
        .expect("info");
    let mut calls = BTreeMap::new();
    let mut input = 0;
    for line in text.lines() {
        if let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        {
            // Redis 7 counts subcommands as `config|resetstat`.
            if name == "info" || name.starts_with("config") {
                continue;
            }
            let n = rest
                .split("calls=")
                .nth(1)
                .and_then(|r| r.split(',').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            calls.insert(name.to_owned(), n);
        } else if let Some(v) = line.strip_prefix("total_net_input_bytes:") {
            input = v.trim().parse().unwrap_or(0);
        }
    }
    (calls, input)
}

/// Zeroes Redis's command statistics.
pub(crate) async fn reset(conn: &mut ConnectionManager) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .expect("resetstat");
}

/// The feeder of every queue of deployment `prefix`, at the product's tick.
fn feeder(conn: &ConnectionManager, prefix: &str, announcements: Option<Announcements>) -> Feeder {
    Feeder {
        conn: conn.clone(),
        queues: cardworker::workers::queue_names(prefix),
        interval: Duration::from_millis(200),
        trim_every: Duration::from_secs(5),
        redis: Default::default(),
        announcements,
    }
}

/// Subscribes `announcements` to the deployment's channel on `redis` and waits until it listens.
async fn subscribed(redis: &PrivateRedis, prefix: &str) -> Announcements {
    let announcements = Announcements::default();
    let client = redis::Client::open(redis.url()).expect("client");
    tokio::spawn(announcements.clone().run(
        client,
        cardworker_jobs::keys::intake_wake(prefix),
        std::future::pending(),
    ));
    wait_for(|| announcements.live()).await;
    announcements
}

/// Waits (up to 10 s) until `cond` holds, checking every few milliseconds.
async fn wait_for(cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// 200 polling chains and a payment job, all due in an hour.
async fn nothing_due_for_an_hour(
    conn: &mut ConnectionManager,
    prefix: &str,
) -> Producer<ConnectionManager> {
    for i in 0..100 {
        for task in Task::ALL {
            chain::start(
                conn,
                prefix,
                task,
                &format!("c-{i:03}"),
                Duration::from_secs(3600),
            )
            .await
            .expect("chain");
        }
    }
    let producer = Producer::new(conn.clone(), prefix);
    producer
        .enqueue_raw(
            SubmitPayment::QUEUE,
            "later",
            "{}",
            Duration::from_secs(3600),
        )
        .await
        .expect("enqueue");
    producer
}

#[tokio::test]
async fn an_idle_pod_s_feeder_reads_the_due_hint_once_a_second_and_a_job_that_becomes_due_is_fed_at_the_next_tick(
) {
    let redis = PrivateRedis::start_new(false);
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let prefix = "idle";
    let producer = nothing_due_for_an_hour(&mut conn, prefix).await;
    let announcements = subscribed(&redis, prefix).await;
    let mut feeder = feeder(&conn, prefix, Some(announcements.clone()));
    let mut state = FeedState::default();
    // The first tick feeds every queue (a sweep), the second reads the hint: nothing is due for
    // an hour.
    assert_eq!(feeder.feed_tick(&mut state).await, 0);
    assert_eq!(feeder.feed_tick(&mut state).await, 0);

    reset(&mut conn).await;
    let ticks = 9 * QUIET_READ_EVERY_TICKS;
    assert!(ticks + 2 < SWEEP_EVERY_TICKS, "no sweep among them");
    for _ in 0..ticks {
        assert_eq!(feeder.feed_tick(&mut state).await, 0);
    }
    let (calls, input) = counted(&mut conn).await;
    // One read of the due hint (all 8 queues) every QUIET_READ_EVERY_TICKS ticks; nothing else.
    assert_eq!(
        calls,
        BTreeMap::from([("zrange".to_owned(), ticks / QUIET_READ_EVERY_TICKS)]),
        "an idle tick must send nothing but the periodic due-hint read"
    );
    assert!(
        input < 9 * 120,
        "{input} bytes into Redis for {ticks} idle ticks"
    );

    // A chain started due now and a job enqueued due now announce themselves, and the very next
    // tick moves both (the last tick read the hint, so without the announcements this one would
    // send nothing).
    chain::start(&mut conn, prefix, Task::Carddata, "now", Duration::ZERO)
        .await
        .expect("chain");
    producer
        .enqueue_raw(SubmitPayment::QUEUE, "due-now", "{}", Duration::ZERO)
        .await
        .expect("enqueue");
    wait_for(|| announcements.earliest().is_some()).await;
    assert_eq!(feeder.feed_tick(&mut state).await, 2);
}

#[tokio::test]
async fn without_announcements_the_feeder_reads_the_due_hint_on_every_tick() {
    let redis = PrivateRedis::start_new(false);
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let prefix = "deaf";
    let producer = nothing_due_for_an_hour(&mut conn, prefix).await;
    let mut feeder = feeder(&conn, prefix, None);
    let mut state = FeedState::default();
    assert_eq!(feeder.feed_tick(&mut state).await, 0);
    reset(&mut conn).await;
    let ticks = 10;
    for _ in 0..ticks {
        assert_eq!(feeder.feed_tick(&mut state).await, 0);
    }
    let (calls, _) = counted(&mut conn).await;
    assert_eq!(calls, BTreeMap::from([("zrange".to_owned(), ticks)]));
    producer
        .enqueue_raw(SubmitPayment::QUEUE, "due-now", "{}", Duration::ZERO)
        .await
        .expect("enqueue");
    assert_eq!(feeder.feed_tick(&mut state).await, 1);
}

#[tokio::test]
async fn an_entry_written_without_the_due_hint_is_fed_by_the_next_sweep() {
    let redis = PrivateRedis::start_new(false);
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let prefix = "nohint";
    let mut feeder = feeder(&conn, prefix, None);
    let mut state = FeedState::default();
    assert_eq!(feeder.feed_tick(&mut state).await, 0);
    // A producer from before the hint: the entry and its payload, no hint.
    let queue = cardworker::queue::QueueName::new(prefix, SubmitPayment::QUEUE);
    let _: () = redis::pipe()
        .cmd("ZADD")
        .arg(&queue.intake)
        .arg(0)
        .arg("old")
        .ignore()
        .cmd("HSET")
        .arg(&queue.intake_payload)
        .arg("old")
        .arg("{}")
        .ignore()
        .query_async(&mut conn)
        .await
        .expect("write");
    let mut fed_at = None;
    for tick in 1..=SWEEP_EVERY_TICKS {
        if feeder.feed_tick(&mut state).await == 1 {
            fed_at = Some(tick);
            break;
        }
    }
    assert_eq!(
        fed_at,
        Some(SWEEP_EVERY_TICKS),
        "fed by the sweep tick, not before"
    );
}

#[tokio::test]
async fn after_a_redis_restart_the_announcements_come_back_and_a_sleeping_feeder_still_feeds_a_new_entry_at_the_next_tick(
) {
    let mut redis = PrivateRedis::start_new(false);
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let prefix = "restart";
    nothing_due_for_an_hour(&mut conn, prefix).await;
    let announcements = subscribed(&redis, prefix).await;
    let before = announcements.generation();
    let mut feeder = feeder(&conn, prefix, Some(announcements.clone()));
    let mut state = FeedState::default();
    assert_eq!(feeder.feed_tick(&mut state).await, 0);
    assert_eq!(feeder.feed_tick(&mut state).await, 0);

    // Redis goes away (and comes back empty): the subscription is lost, then renewed.
    redis.stop();
    wait_for(|| !announcements.live()).await;
    redis.start();
    wait_for(|| announcements.live() && announcements.generation() > before).await;

    // The entries were lost with Redis; a new one due now is announced on the new subscription
    // and fed by the next tick.
    let producer = Producer::new(conn.clone(), prefix);
    let mut enqueued = false;
    for _ in 0..50 {
        // The shared connection reconnects on its own; the first writes may still fail.
        if producer
            .enqueue_raw(SubmitPayment::QUEUE, "after", "{}", Duration::ZERO)
            .await
            .is_ok()
        {
            enqueued = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(enqueued, "the producer writes again once Redis is back");
    wait_for(|| announcements.earliest().is_some()).await;
    let mut moved = 0;
    // The first tick after the restart may read a hint the restart emptied; within two ticks the
    // entry is moved (a tick without announcements would be a full read anyway).
    for _ in 0..2 {
        moved += feeder.feed_tick(&mut state).await;
    }
    assert_eq!(moved, 1);
}
