//! What an idle pod sends to Redis (issue 16), counted by a private redis-server's
//! `INFO commandstats` (the shared Redis would count other clients too): the feeder per feed tick,
//! never timed (the announcements' subscription is real, `queue::announce`); a whole
//! `cardworker run` process per second over a window; the Redis probe and a reconcile pass per
//! call.
//!
//! Over 600 lines because each of those costs needs its own setup (a feeder and its subscription,
//! a child process on a fresh database, an `AppContext` for reconcile) and the shared counting
//! helpers ([`counted`], [`reset`]) belong next to all of them; splitting it would only spread
//! one issue's budget over several files.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cardworker::config::{Config, Task};
use cardworker::context::{self, AppContext};
use cardworker::polling::{lease, reconcile};
use cardworker::queue::announce::Announcements;
use cardworker::queue::intake::{FeedState, Feeder, QUIET_READ_EVERY_TICKS, SWEEP_EVERY_TICKS};
use cardworker_jobs::{Job, Producer, SubmitPayment};
use redis::aio::ConnectionManager;

use crate::harness::{wait_until, TestDb};
use crate::private::PrivateRedis;
use crate::process::Worker;

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

/// A private redis-server and a connection to it.
async fn private_redis() -> (PrivateRedis, ConnectionManager) {
    let redis = PrivateRedis::start_new(false);
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    (redis, conn)
}

/// One reconcile pass of carddata (from the first card, 2000 a batch) with the Redis statistics
/// reset before it: the pass, and the calls and input it cost as [`counted`] reads them.
async fn counted_pass(
    ctx: &AppContext,
    conn: &mut ConnectionManager,
) -> (reconcile::Pass, BTreeMap<String, u64>, u64) {
    reset(conn).await;
    let pass = reconcile::pass(ctx, Task::Carddata, 0, 2000)
        .await
        .expect("pass");
    let (calls, input) = counted(conn).await;
    (pass, calls, input)
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

/// 200 polled cards (which the feeder never reads: their workers fetch from the due queue) and a
/// payment job, all due in an hour.
async fn nothing_due_for_an_hour(
    conn: &mut ConnectionManager,
    prefix: &str,
) -> Producer<ConnectionManager> {
    for i in 0..100 {
        for task in Task::ALL {
            lease::start(
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
    let (redis, mut conn) = private_redis().await;
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
    // One read of the due hint (every queue) every QUIET_READ_EVERY_TICKS ticks; nothing else.
    assert_eq!(
        calls,
        BTreeMap::from([("zrange".to_owned(), ticks / QUIET_READ_EVERY_TICKS)]),
        "an idle tick must send nothing but the periodic due-hint read"
    );
    assert!(
        input < 9 * 120,
        "{input} bytes into Redis for {ticks} idle ticks"
    );

    // A job enqueued due now announces itself, and the very next tick moves it (the last tick
    // read the hint, so without the announcements this one would send nothing).
    producer
        .enqueue_raw(SubmitPayment::QUEUE, "due-now", "{}", Duration::ZERO)
        .await
        .expect("enqueue");
    wait_for(|| announcements.earliest().is_some()).await;
    assert_eq!(feeder.feed_tick(&mut state).await, 1);
}

#[tokio::test]
async fn without_announcements_the_feeder_reads_the_due_hint_on_every_tick() {
    let (_redis, mut conn) = private_redis().await;
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
    let (_redis, mut conn) = private_redis().await;
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

/// Inserts `n` cards and starts both chains of each, due in an hour (spread over a minute).
async fn cards_due_in_an_hour(
    db: &TestDb,
    conn: &mut ConnectionManager,
    prefix: &str,
    n: usize,
) -> Vec<String> {
    let cards: Vec<String> = (0..n).map(|i| format!("c-{i:04}")).collect();
    sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
        .bind(&cards)
        .execute(&db.pool)
        .await
        .expect("insert cards");
    for (i, card) in cards.iter().enumerate() {
        let delay = Duration::from_secs(3600) + Duration::from_millis(60_000 * i as u64 / n as u64);
        for task in Task::ALL {
            lease::start(conn, prefix, task, card, delay)
                .await
                .expect("chain");
        }
    }
    cards
}

/// Whether a `cardworker run` of deployment `prefix` has started up on this Redis: every queue
/// has a registered worker, the probe has written the epoch marker, and the feeder's first trim
/// pass (every queue, one `SPOP` each) is done. What it sends after that is its idle cost.
async fn started_up(conn: &mut ConnectionManager, prefix: &str) -> bool {
    let queues = cardworker::workers::queue_names(prefix);
    let mut pipe = redis::pipe();
    for q in &queues {
        pipe.zcard(format!("{}:workers", q.apalis));
    }
    pipe.exists(cardworker::runner::redis_watch::epoch_key(prefix));
    let Ok((workers, marker)) = pipe.query_async::<Vec<u64>>(conn).await.map(|mut v| {
        let marker = v.pop().unwrap_or(0);
        (v, marker)
    }) else {
        return false;
    };
    let (calls, _) = counted(conn).await;
    workers.iter().all(|n| *n >= 1)
        && marker == 1
        && calls.get("spop").copied().unwrap_or(0) >= queues.len() as u64
}

/// Writes deployment `prefix`'s epoch marker, as a pod that is not the deployment's first finds
/// it: its first probe then enqueues no full reconcile (`runner::redis_watch`).
async fn epoch_marker(conn: &mut ConnectionManager, prefix: &str) {
    let _: () = redis::cmd("SET")
        .arg(cardworker::runner::redis_watch::epoch_key(prefix))
        .arg("earlier-pod")
        .query_async(conn)
        .await
        .expect("marker");
}

/// A `cardworker run` process of deployment `prefix` on `db` and the private `redis`, with the
/// product's defaults otherwise (its schedules, feeder tick, heartbeats and probe), started up
/// ([`started_up`]). The Gateway is never called: nothing is due. The directory holds its config.
async fn idle_pod(
    db: &TestDb,
    redis: &PrivateRedis,
    conn: &mut ConnectionManager,
    prefix: &str,
    extra_config: &str,
) -> (Worker, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("cardworker.toml");
    std::fs::write(
        &file,
        format!(
            "[database]\nurl = \"{}\"\n\n[redis]\nurl = \"{}\"\nkey_prefix = \"{prefix}\"\n\n\
             [gateway]\nbase_url = \"http://127.0.0.1:9\"\n\n\
             [telemetry]\nlisten = \"127.0.0.1:0\"\nlog_format = \"json\"\n{extra_config}",
            db.url,
            redis.url()
        ),
    )
    .expect("config");
    let worker = Worker::spawn(env!("CARGO_BIN_EXE_cardworker"), &file).expect("spawn");
    wait_until(Duration::from_secs(30), "the worker has started up", || {
        let mut conn = conn.clone();
        async move { started_up(&mut conn, prefix).await }
    })
    .await;
    (worker, dir)
}

/// The pod's scheduled reconcile, once a year: by default it runs every ten minutes of the wall
/// clock, so whether a one-minute window holds a pass would depend on when the test runs, and a
/// pass over this test's cards is an inner `ZADD NX` per card and task. A pass's own cost is
/// `a_reconcile_pass_over_1200_cards_in_the_due_queue_…` above.
const NO_RECONCILE_IN_THE_WINDOW: &str = "\n[polling]\nreconcile_cron = \"0 0 0 1 1 *\"\n";

/// Over a minute: the product's most frequent schedules (payment and approval recovery) tick
/// once a minute, so a minute holds exactly one run of each, and the rate is the pod's average
/// (a 20 s window would hold none or both, 3 commands/s apart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_cardworker_run_process_sends_at_most_20_commands_and_2000_bytes_a_second_into_redis_over_a_minute(
) {
    const WINDOW: Duration = Duration::from_secs(60);
    let db = TestDb::new().await;
    let (redis, mut conn) = private_redis().await;
    let prefix = "cw";
    cards_due_in_an_hour(&db, &mut conn, prefix, 200).await;
    epoch_marker(&mut conn, prefix).await;
    let (mut worker, _dir) =
        idle_pod(&db, &redis, &mut conn, prefix, NO_RECONCILE_IN_THE_WINDOW).await;

    reset(&mut conn).await;
    let started = Instant::now();
    // The measurement window itself: a rate over time, not a wait for something to happen.
    tokio::time::sleep(WINDOW).await;
    let (calls, input) = counted(&mut conn).await;
    let secs = started.elapsed().as_secs_f64();
    assert!(
        worker.child.try_wait().expect("try_wait").is_none(),
        "the worker runs on"
    );
    let total: u64 = calls.values().sum();
    let per_sec = total as f64 / secs;
    let bytes_per_sec = input as f64 / secs;
    let mut by_name: Vec<(&String, &u64)> = calls.iter().collect();
    by_name.sort_by(|a, b| b.1.cmp(a.1));
    eprintln!("idle pod: {per_sec:.1} commands/s, {bytes_per_sec:.0} bytes/s: {by_name:?}");
    assert!(
        per_sec <= 20.0,
        "{per_sec:.1} commands/s from an idle pod ({total} in {secs:.1} s): {by_name:?}"
    );
    assert!(
        bytes_per_sec <= 2000.0,
        "{bytes_per_sec:.0} bytes/s into Redis from an idle pod: {by_name:?}"
    );
    worker.terminate();
    let _ = worker.child.wait();
}

/// The quiet queues' workers beat, and so fetch on their own, every 30 s; a job this pod's
/// feeder moves into one wakes them at once (`queue::wake`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_enqueued_into_a_quiet_queue_runs_before_the_worker_s_next_heartbeat() {
    let db = TestDb::new().await;
    let (redis, mut conn) = private_redis().await;
    let prefix = "quiet";
    epoch_marker(&mut conn, prefix).await;
    let (mut worker, _dir) = idle_pod(&db, &redis, &mut conn, prefix, "").await;
    // A card inserted without `enqueue` (no chain), then a full reconcile, which gives it one.
    sqlx::query("INSERT INTO cards (card_ref) VALUES ('unchained')")
        .execute(&db.pool)
        .await
        .expect("insert");
    // Enqueued in the first half of the reconcile worker's beat: an idle worker that is not woken
    // fetches only after its next heartbeat, at least half a beat later.
    let workers = apalis_redis::Config::default()
        .queue(cardworker_jobs::keys::queue(prefix, "reconcile"))
        .workers_set();
    let beat = cardworker::runner::spawn::QUIET_HEARTBEAT.as_secs_f64();
    let next_beat = loop {
        let beats: Vec<(String, f64)> = redis::cmd("ZRANGE")
            .arg(&workers)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut conn)
            .await
            .expect("workers");
        let last = beats.iter().map(|(_, at)| *at).fold(f64::NAN, f64::max);
        assert!(!last.is_nan(), "the reconcile worker is registered");
        if unix_now() < last + beat / 2.0 {
            break last + beat;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let enqueued = Instant::now();
    cardworker_jobs::Producer::new(conn.clone(), prefix)
        .enqueue(&cardworker_jobs::RunReconcile {
            scheduled_for: None,
            full: true,
        })
        .await
        .expect("enqueue");
    wait_until(
        cardworker::runner::spawn::QUIET_HEARTBEAT,
        "the reconcile ran",
        || {
            let mut conn = conn.clone();
            async move {
                lease::due_queue(prefix, Task::Carddata)
                    .entry(&mut conn, "unchained")
                    .await
                    .expect("entry")
                    .is_some()
            }
        },
    )
    .await;
    let ran_by = unix_now();
    assert!(
        ran_by < next_beat,
        "ran {:?} after the enqueue, at {ran_by}, not before the worker's next heartbeat at \
         {next_beat}: the quiet worker was not woken",
        enqueued.elapsed()
    );
    worker.terminate();
    let _ = worker.child.wait();
}

#[tokio::test]
async fn a_probe_that_finds_the_epoch_marker_sends_one_get_and_writes_nothing_and_the_first_probe_after_a_flush_re_creates_it(
) {
    use cardworker::runner::redis_watch::{epoch_key, Probe, RedisWatch};
    let (_redis, mut conn) = private_redis().await;
    let probe_conn = conn.clone();
    let watch_on = |answered_before| RedisWatch {
        conn: probe_conn.clone(),
        prefix: "probe".to_owned(),
        status: Default::default(),
        on_data_lost: std::sync::Arc::new(|| Box::pin(async { Ok(()) })),
        on_data_lost_here: std::sync::Arc::new(|| Box::pin(async { Ok(()) })),
        budget: None,
        epoch: None,
        answered_before,
        restore_pending: false,
    };
    let mut watch = watch_on(false);
    // The first start: the marker is made.
    assert_eq!(watch.probe().await, Probe::DataLost);
    let marker: Option<String> = redis::cmd("GET")
        .arg(epoch_key("probe"))
        .query_async(&mut conn)
        .await
        .expect("get");
    assert!(marker.is_some(), "the first probe writes the marker");

    reset(&mut conn).await;
    for _ in 0..5 {
        assert_eq!(watch.probe().await, Probe::Up);
    }
    let (calls, _) = counted(&mut conn).await;
    assert_eq!(
        calls,
        BTreeMap::from([("get".to_owned(), 5)]),
        "a probe that finds the marker reads it and writes nothing"
    );

    // Redis came back empty: the next probe (this pod's or a peer's) re-creates the marker, once.
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .expect("flush");
    let mut peer = watch_on(true);
    let mut watching_peer = watch_on(true);
    watching_peer.epoch = marker.clone();
    assert_eq!(watch.probe().await, Probe::DataLost);
    assert_eq!(peer.probe().await, Probe::Up, "only the first pod restores");
    assert_eq!(
        watching_peer.probe().await,
        Probe::LostElsewhere,
        "a pod that saw the old marker notices the loss and writes its running polls back"
    );
    assert_eq!(watching_peer.probe().await, Probe::Up, "once");
    let exists: bool = redis::cmd("EXISTS")
        .arg(epoch_key("probe"))
        .query_async(&mut conn)
        .await
        .expect("exists");
    assert!(exists, "the marker is back");
}

/// An [`AppContext`] on `db` and the private `redis`, deployment `prefix`, the default config.
async fn context_on(db: &TestDb, redis: &PrivateRedis, prefix: &str) -> std::sync::Arc<AppContext> {
    let mut config = Config::default();
    config.database.url = db.url.clone().into();
    config.redis.url = redis.url().into();
    config.redis.key_prefix = prefix.to_owned();
    AppContext::connect(config).await.expect("connect")
}

#[tokio::test]
async fn a_reconcile_pass_over_1200_cards_in_the_due_queue_is_one_script_call_and_adds_only_the_card_missing_from_it(
) {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let prefix = "rec";
    let ctx = context_on(&db, &redis, prefix).await;
    let mut conn = ctx.redis.clone();
    cards_due_in_an_hour(&db, &mut conn, prefix, 1200).await;
    // One card more, missing from the due queue (inserted without `enqueue`), last in id order.
    sqlx::query("INSERT INTO cards (card_ref) VALUES ('lost')")
        .execute(&db.pool)
        .await
        .expect("insert");

    let (pass, calls, _) = counted_pass(&ctx, &mut conn).await;
    assert_eq!((pass.examined, pass.started), (1201, 1));
    assert_eq!(calls.get("evalsha"), Some(&1), "one script call: {calls:?}");
    assert!(
        lease::due_queue(prefix, Task::Carddata)
            .entry(&mut conn, "lost")
            .await
            .expect("entry")
            .is_some(),
        "the missing card is in the due queue now"
    );

    // Every card in the due queue now: the next pass adds nothing, in the same one call.
    let (pass, calls, input) = counted_pass(&ctx, &mut conn).await;
    assert_eq!((pass.examined, pass.started), (1201, 0));
    assert_eq!(calls.get("evalsha"), Some(&1), "{calls:?}");
    assert_eq!(calls.get("hset"), None, "nothing written: {calls:?}");
    // Each card ref travels once (about 16 bytes with its framing, and its delay), not once per
    // command.
    assert!(input < 1201 * 30, "{input} bytes for 1201 cards");
}

/// This process's clock in unix seconds (the clock apalis scores heartbeats with).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
