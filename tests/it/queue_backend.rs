//! The workers' own fetch and acknowledgement (`cardworker::queue::backend`, issue 16): a done job
//! leaves nothing of itself in apalis's keys, a job without data is dropped without stopping its
//! worker, a job a peer took back is left to that peer, and a job an older release fed (with its
//! meta hash) is fetched and cleaned up like any other.

use std::time::Duration;

use apalis_core::worker::context::WorkerContext;
use cardworker::queue::backend;
use cardworker::queue::intake;
use cardworker::queue::QueueName;
use cardworker_jobs::{Job as _, RunArchive};
use redis::AsyncCommands as _;

use crate::harness::{metric_value, spawn_app, wait_until, TestRedis};

async fn finished(app: &crate::harness::TestApp) -> f64 {
    let (_, text) = app.get("/metrics").await;
    metric_value(
        &text,
        "cardworker_jobs_finished_total",
        &[("queue", RunArchive::QUEUE), ("result", "succeeded")],
    )
}

/// What apalis queue `apalis` still holds of finished jobs: payloads, done ids, meta hashes.
async fn leftovers(conn: &mut redis::aio::ConnectionManager, apalis: &str) -> Vec<String> {
    let mut found = Vec::new();
    let data: usize = conn.hlen(format!("{apalis}:data")).await.expect("hlen");
    if data > 0 {
        found.push(format!("{data} payloads in {apalis}:data"));
    }
    let done: usize = conn.scard(format!("{apalis}:done")).await.expect("scard");
    if done > 0 {
        found.push(format!("{done} ids in {apalis}:done"));
    }
    let meta: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{apalis}:meta:*"))
        .query_async(conn)
        .await
        .expect("keys");
    found.extend(meta);
    found
}

#[tokio::test]
async fn a_done_job_leaves_no_payload_meta_hash_or_done_entry_in_apalis() {
    let app = spawn_app().await;
    archive_runs(&app, 3).await;
    let apalis = QueueName::new(&app.redis.prefix, RunArchive::QUEUE).apalis;
    let conn = app.redis.conn.clone();
    // The acknowledgement follows the handler's metric by a round trip: wait until no worker
    // holds a job, then look at once (apalis's own acknowledgement would leave each done job in
    // the done set, with its meta hash and payload, for up to one trim, 5 s).
    wait_until(Duration::from_secs(10), "the acknowledgements", || async {
        in_flight(&mut conn.clone(), &apalis).await == 0
    })
    .await;
    let left = leftovers(&mut conn.clone(), &apalis).await;
    assert!(left.is_empty(), "{left:#?}");
}

/// Enqueues `n` archive runs through the producer and waits up to 20 s until `n` runs finished.
async fn archive_runs(app: &crate::harness::TestApp, n: u32) {
    for _ in 0..n {
        enqueue_archive(app.producer()).await;
    }
    let what = format!("{n} archive runs");
    wait_until(Duration::from_secs(20), &what, || async {
        finished(app).await >= f64::from(n)
    })
    .await;
}

/// A fresh prefix, a connection, and its archive queue with `n` runs enqueued through the
/// producer and fed into apalis.
async fn fed_archive_queue(n: usize) -> (TestRedis, redis::aio::ConnectionManager, QueueName) {
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let queue = QueueName::new(&redis.prefix, RunArchive::QUEUE);
    let producer = cardworker_jobs::Producer::new(conn.clone(), &redis.prefix);
    for _ in 0..n {
        enqueue_archive(&producer).await;
    }
    let fed = intake::feed_once(&mut conn, &queue).await.expect("feed");
    assert_eq!(fed.moved, n);
    (redis, conn, queue)
}

/// Enqueues one archive run through `producer`.
async fn enqueue_archive(producer: &cardworker_jobs::Producer<redis::aio::ConnectionManager>) {
    producer
        .enqueue(&RunArchive::default())
        .await
        .expect("enqueue");
}

/// Jobs in the inflight sets of queue `apalis`'s workers.
async fn in_flight(conn: &mut redis::aio::ConnectionManager, apalis: &str) -> usize {
    let sets: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{apalis}:inflight:*"))
        .query_async(conn)
        .await
        .expect("keys");
    let mut n = 0;
    for set in sets {
        let k: usize = conn.scard(&set).await.expect("scard");
        n += k;
    }
    n
}

#[tokio::test]
async fn a_job_id_without_a_payload_is_dropped_and_its_worker_runs_the_next_job() {
    let mut app = spawn_app().await;
    // An id in the active list with no data and no meta hash (a hand edit, a half-restored
    // backup): apalis-redis's own fetch fails on it, which stops the worker.
    let apalis = QueueName::new(&app.redis.prefix, RunArchive::QUEUE).apalis;
    let _: () = app
        .redis
        .conn
        .clone()
        .rpush(format!("{apalis}:active"), ulid::Ulid::new().to_string())
        .await
        .expect("rpush");
    // The real job runs.
    archive_runs(&app, 1).await;
    assert!(
        app.exited_within(Duration::from_millis(500))
            .await
            .is_none(),
        "the process is still running"
    );
    let active: usize = app
        .redis
        .conn
        .clone()
        .llen(format!("{apalis}:active"))
        .await
        .expect("llen");
    assert_eq!(
        active, 0,
        "the id without a payload was taken off the queue"
    );
}

/// A worker registered by hand in `queue`'s workers set, as apalis registers one.
async fn register(conn: &mut redis::aio::ConnectionManager, queue: &QueueName, name: &str) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let _: () = conn
        .zadd(format!("{}:workers", queue.apalis), name, now)
        .await
        .expect("zadd");
}

fn config_of(queue: &QueueName) -> apalis_redis::Config {
    apalis_redis::Config::default()
        .queue(&queue.apalis)
        .batch_size(10)
}

#[tokio::test]
async fn a_job_a_peer_took_back_is_left_to_the_peer_and_the_others_are_acknowledged() {
    let (_redis, mut conn, queue) = fed_archive_queue(2).await;

    let worker = WorkerContext::new("archive-test-1");
    register(&mut conn, &queue, worker.name()).await;
    let config = config_of(&queue);
    let tasks = backend::fetch(conn.clone(), config.clone(), worker.clone())
        .await
        .expect("fetch");
    assert_eq!(tasks.len(), 2);
    let ids: Vec<String> = tasks
        .iter()
        .map(|t| t.ctx().task_id().expect("id").to_string())
        .collect();
    assert!(
        tasks.iter().all(|t| t.ctx().attempt() == 0),
        "every job starts at attempt 0"
    );

    // A peer's orphan recovery takes the first one back into the active list.
    let inflight = config.inflight_set_for(&worker);
    let _: () = conn.srem(&inflight, &ids[0]).await.expect("srem");
    let _: () = conn
        .rpush(format!("{}:active", queue.apalis), &ids[0])
        .await
        .expect("rpush");

    let calls = backend::ack_calls(conn.clone());
    let keys = backend::ack_keys(&config, &worker);
    let mut answers = Vec::new();
    for id in &ids {
        let args = vec![
            id.clone(),
            "Done".into(),
            r#"{"Ok":null}"#.into(),
            "0".into(),
        ];
        answers.push(calls.call(keys.clone(), args).await.expect("ack"));
    }
    assert_eq!(
        answers,
        vec![redis::Value::Int(0), redis::Value::Int(1)],
        "the job taken back is not this worker's to acknowledge"
    );
    let data: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(format!("{}:data", queue.apalis))
        .arg(&ids)
        .query_async(&mut conn)
        .await
        .expect("hmget");
    assert!(data[0].is_some(), "the peer still has its payload to run");
    assert!(data[1].is_none(), "the done job's payload is gone");
    let meta: bool = conn
        .exists(format!("{}:meta:{}", queue.apalis, ids[1]))
        .await
        .expect("exists");
    assert!(!meta, "the done job's meta hash is gone");
    let meta: bool = conn
        .exists(format!("{}:meta:{}", queue.apalis, ids[0]))
        .await
        .expect("exists");
    assert!(
        meta,
        "the job taken back keeps its meta hash for an older release's fetch"
    );
}

#[tokio::test]
async fn a_killed_job_is_acknowledged_into_the_dead_set_with_its_reason() {
    let (_redis, mut conn, queue) = fed_archive_queue(1).await;
    let worker = WorkerContext::new("archive-test-2");
    register(&mut conn, &queue, worker.name()).await;
    let config = config_of(&queue);
    let tasks = backend::fetch(conn.clone(), config.clone(), worker.clone())
        .await
        .expect("fetch");
    let id = tasks[0].ctx().task_id().expect("id").to_string();
    let calls = backend::ack_calls(conn.clone());
    let answer = calls
        .call(
            backend::ack_keys(&config, &worker),
            vec![
                id.clone(),
                "Killed".into(),
                r#"{"Err":"boom"}"#.into(),
                "1".into(),
            ],
        )
        .await
        .expect("ack");
    assert_eq!(answer, redis::Value::Int(1));
    let (total, dead) = cardworker::queue::dead::list(&mut conn, &queue, 10)
        .await
        .expect("dead list");
    assert_eq!(total, 1);
    assert_eq!(dead[0].id, id);
    assert!(
        dead[0]
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("boom")),
        "the reason is kept: {:?}",
        dead[0].reason
    );
    assert!(
        dead[0].payload.is_some(),
        "the payload is kept for `dead requeue`"
    );
}

/// The feeder wakes this process's workers of a queue when it moved jobs into it. A wake-up that
/// arrives while a worker's fetch is on its way, and that fetch ran in Redis before the jobs
/// landed, makes the worker fetch again as soon as the empty answer is back: the jobs never wait
/// for the queue's next heartbeat (30 s for a quiet queue such as archive), whatever the fetch's
/// round trip took.
#[tokio::test]
async fn a_wake_up_during_a_fetch_that_came_back_empty_is_fetched_without_waiting_for_a_heartbeat()
{
    use apalis_core::backend::Backend as _;
    use cardworker::runner::RunJob as _;

    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let queue = QueueName::new(&redis.prefix, RunArchive::QUEUE);
    let worker = WorkerContext::new("archive-test-wake");
    register(&mut conn, &queue, worker.name()).await;
    let config = config_of(&queue);
    // The fetch script is cached in Redis first, so that the fetch below is one command, sent
    // on its first poll.
    let none = backend::fetch(conn.clone(), config.clone(), worker.clone())
        .await
        .expect("fetch");
    assert!(none.is_empty());
    let producer = cardworker_jobs::Producer::new(conn.clone(), &redis.prefix);
    enqueue_archive(&producer).await;

    let wake = cardworker::queue::wake::handle(&queue.apalis);
    let storage = apalis_redis::RedisStorage::<String>::new(conn.clone()).with_config(config);
    let mut backend = backend::QueueBackend::new(storage, conn.clone(), wake);
    // The worker's fetch is sent...
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(backend.poll_next(&mut cx, &worker).is_pending());
    // ...and the feed, on the same connection, runs after it in Redis: the fetch finds nothing.
    // `feed` wakes this process's workers of the queue once it moved the job.
    let fed = intake::feed(&mut conn, &queue).await.expect("feed");
    assert_eq!(fed.backlog, 1, "the job is in apalis");

    let beat = RunArchive::HEARTBEAT;
    let next = tokio::time::timeout(
        beat,
        futures::future::poll_fn(|cx| backend.poll_next(cx, &worker)),
    )
    .await
    .unwrap_or_else(|_| panic!("the job waited a whole heartbeat ({beat:?}) after its wake-up"));
    let task = next.expect("a job").expect("fetched");
    assert!(task.ctx().task_id().is_some());
}
