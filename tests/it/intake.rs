//! The bounded intake and the trimmer: a backlog far above apalis-redis's ~8,000 due-jobs cliff
//! runs to the end without a worker stopping, finished jobs leave nothing behind, a payload that
//! does not decode is recorded as dead without stopping its worker, and a worker that dies takes
//! the process down with it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cardworker::queue::intake::{self, HIGH_WATER_MARK};
use cardworker_jobs::{Job, RunArchive, RunRetention};
use redis::AsyncCommands as _;

use crate::harness::{metric_value, spawn_app, wait_until};

/// Enqueues `n` no-op runs (maintenance is off, so each is acknowledged without a query) split
/// over the archive and retention queues, all due at once.
async fn enqueue_noops(app: &crate::harness::TestApp, n: usize) {
    let producer = app.producer();
    for i in 0..n {
        if i % 2 == 0 {
            producer
                .enqueue(&RunArchive::default())
                .await
                .expect("enqueue");
        } else {
            producer
                .enqueue(&RunRetention::default())
                .await
                .expect("enqueue");
        }
    }
}

async fn finished(app: &crate::harness::TestApp) -> f64 {
    let (_, text) = app.get("/metrics").await;
    metric_value(
        &text,
        "cardworker_jobs_finished_total",
        &[("result", "succeeded")],
    )
}

fn backlog_key(app: &crate::harness::TestApp, queue: &str, part: &str) -> String {
    format!("{}:q:{queue}:{part}", app.redis.prefix)
}

#[tokio::test]
async fn twenty_thousand_due_jobs_all_run_and_no_worker_stops() {
    let mut app = spawn_app().await;
    let total = 20_000;
    // All due at once, before the feeder can move any: written straight into the intake.
    enqueue_noops(&app, total).await;

    // Sample the apalis backlog of both queues while they drain: it must stay under the
    // high-water mark, far below the cliff.
    let peak = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let mut conn = app.redis.conn.clone();
        let keys: Vec<(String, String)> = [RunArchive::QUEUE, RunRetention::QUEUE]
            .iter()
            .map(|q| {
                (
                    backlog_key(&app, q, "active"),
                    backlog_key(&app, q, "scheduled"),
                )
            })
            .collect();
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                for (active, scheduled) in &keys {
                    let a: usize = conn.llen(active).await.unwrap_or(0);
                    let s: usize = conn.zcard(scheduled).await.unwrap_or(0);
                    peak.fetch_max(a + s, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    wait_until(
        Duration::from_secs(240),
        "all 20,000 jobs finished",
        || async { finished(&app).await >= total as f64 },
    )
    .await;
    sampler.abort();

    let (status, body) = app.get("/healthz").await;
    assert_eq!(status, 200, "every worker still runs: {body}");
    assert!(
        peak.load(Ordering::Relaxed) <= HIGH_WATER_MARK,
        "apalis backlog peaked at {} > {HIGH_WATER_MARK}",
        peak.load(Ordering::Relaxed)
    );
    let (_, text) = app.get("/metrics").await;
    assert_eq!(
        metric_value(
            &text,
            "cardworker_jobs_finished_total",
            &[("result", "dead")]
        ),
        0.0
    );
    app.stop().await.expect("clean stop");
}

/// How many payloads the archive queue's data hash holds (apalis's per-job hash).
async fn archive_payloads(app: &crate::harness::TestApp) -> usize {
    let mut conn = app.redis.conn.clone();
    conn.hlen(backlog_key(app, RunArchive::QUEUE, "data"))
        .await
        .expect("hlen")
}

/// Keys under the test prefix once every finished job has been trimmed.
async fn settled_key_count(app: &crate::harness::TestApp) -> usize {
    let mut conn = app.redis.conn.clone();
    let done_keys = [
        backlog_key(app, RunArchive::QUEUE, "done"),
        backlog_key(app, RunRetention::QUEUE, "done"),
    ];
    // A pod trims a queue on the pass after it fed it, and every queue on a full pass (every
    // 12 passes of 5 s): jobs acked after the last pass that followed a feed (a loaded machine)
    // are trimmed by the next full pass, up to a minute later.
    wait_until(Duration::from_secs(90), "done sets trimmed", || {
        let mut conn = conn.clone();
        let done_keys = done_keys.clone();
        async move {
            let mut total = 0usize;
            for k in &done_keys {
                total += conn.scard::<_, usize>(k).await.unwrap_or(usize::MAX);
            }
            total == 0
        }
    })
    .await;
    let _: () = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .expect("ping");
    app.redis.keys().await.len()
}

#[tokio::test]
async fn redis_keys_after_ten_thousand_finished_jobs_stay_within_a_constant_of_one_thousand() {
    let mut app = spawn_app().await;
    enqueue_noops(&app, 1_000).await;
    wait_until(Duration::from_secs(60), "1,000 jobs finished", || async {
        finished(&app).await >= 1_000.0
    })
    .await;
    let after_1k = settled_key_count(&app).await;

    enqueue_noops(&app, 9_000).await;
    wait_until(Duration::from_secs(180), "10,000 jobs finished", || async {
        finished(&app).await >= 10_000.0
    })
    .await;
    let after_10k = settled_key_count(&app).await;

    assert!(
        after_10k <= after_1k + 5,
        "keys grew from {after_1k} to {after_10k}: {:?}",
        app.redis.keys().await
    );
    // And apalis's per-job hashes are gone, not merely few.
    assert_eq!(archive_payloads(&app).await, 0);
    app.stop().await.expect("clean stop");
}

#[tokio::test]
async fn a_payload_that_does_not_decode_is_dead_and_the_worker_goes_on() {
    let mut app = spawn_app().await;
    let producer = app.producer();
    producer
        .enqueue_raw(
            RunArchive::QUEUE,
            "garbage-1",
            "this is not json",
            Duration::ZERO,
        )
        .await
        .expect("enqueue garbage");
    producer
        .enqueue_raw(
            RunArchive::QUEUE,
            "garbage-2",
            r#"{"scheduled_for":"yesterday"}"#,
            Duration::ZERO,
        )
        .await
        .expect("enqueue mistyped");
    producer
        .enqueue(&RunArchive::default())
        .await
        .expect("enqueue good");

    wait_until(
        Duration::from_secs(30),
        "the good job ran after the bad ones",
        || async {
            let (_, text) = app.get("/metrics").await;
            metric_value(
                &text,
                "cardworker_jobs_finished_total",
                &[("queue", "archive"), ("result", "succeeded")],
            ) >= 1.0
                && metric_value(
                    &text,
                    "cardworker_jobs_finished_total",
                    &[("queue", "archive"), ("result", "dead")],
                ) >= 2.0
        },
    )
    .await;

    // The bad payloads are kept as dead jobs for inspection.
    let mut conn = app.redis.conn.clone();
    let dead: Vec<String> = conn
        .smembers(backlog_key(&app, RunArchive::QUEUE, "dead"))
        .await
        .expect("dead set");
    assert_eq!(dead.len(), 2, "both bad payloads are recorded as dead");
    let (status, _) = app.get("/healthz").await;
    assert_eq!(status, 200);
    app.stop().await.expect("clean stop");

    // Dead jobs stay inspectable through the retention period, and are trimmed after it.
    let queue = cardworker::queue::QueueName::new(&app.redis.prefix, RunArchive::QUEUE);
    let kept = intake::trim(&mut conn, &queue, intake::DEAD_RETENTION)
        .await
        .expect("trim");
    assert_eq!(kept.dead, 0, "within retention nothing dead is trimmed");
    let expired = intake::trim(&mut conn, &queue, Duration::ZERO)
        .await
        .expect("trim");
    assert_eq!(expired.dead, 2, "past retention both dead jobs are trimmed");
    assert_eq!(
        archive_payloads(&app).await,
        0,
        "their payloads are gone too"
    );
}

#[tokio::test]
async fn a_worker_that_dies_takes_the_process_down_with_it() {
    let mut app = spawn_app().await;
    // Corrupt the archive queue the way a bad deploy or a hand edit could: its active list
    // replaced by a string. Every fetch fails (WRONGTYPE), and the worker stops. (An id with no
    // payload no longer does: the fetch drops it, `queue_backend` tests.)
    let active = backlog_key(&app, RunArchive::QUEUE, "active");
    let _: () = app
        .redis
        .conn
        .clone()
        .set(&active, "not a list")
        .await
        .expect("set");

    let ended = app
        .exited_within(Duration::from_secs(30))
        .await
        .expect("the process stops on its own when a worker dies");
    let err = ended.expect_err("the process reports the dead worker as an error");
    assert!(
        format!("{err:#}").contains("archive"),
        "the error names the worker: {err:#}"
    );
}

#[tokio::test]
async fn metadata_of_workers_apalis_dropped_is_swept_and_live_ones_are_kept() {
    let redis = crate::harness::TestRedis::new().await;
    let queue = cardworker::queue::QueueName::new(&redis.prefix, "archive");
    let mut conn = redis.conn.clone();
    let workers = format!("{}:workers", queue.apalis);
    let live = format!("{}:workers:metadata:archive-pod-a-1", queue.apalis);
    let gone = format!("{}:workers:metadata:archive-pod-b-2", queue.apalis);
    let _: () = conn
        .zadd(&workers, "archive-pod-a-1", 1)
        .await
        .expect("zadd");
    let _: () = conn
        .hset(&live, "backend_name", "redis")
        .await
        .expect("hset");
    let _: () = conn
        .hset(&gone, "backend_name", "redis")
        .await
        .expect("hset");

    let removed = cardworker::queue::intake::trim_workers(&mut conn, &queue)
        .await
        .expect("sweep");

    assert_eq!(removed, 1);
    assert!(conn.exists::<_, bool>(&live).await.expect("exists"));
    assert!(!conn.exists::<_, bool>(&gone).await.expect("exists"));
}

#[tokio::test]
async fn jobs_with_the_same_entry_id_replace_each_other_in_the_intake_and_once_claims_dedupe() {
    let redis = crate::harness::TestRedis::new().await;
    let producer = cardworker_jobs::Producer::new(redis.conn.clone(), redis.prefix.clone());
    let payment_id = uuid::Uuid::new_v4();
    let submit = |retries| cardworker_jobs::SubmitPayment {
        payment_id,
        retries,
    };
    producer
        .enqueue_after(&submit(1), Duration::from_secs(60))
        .await
        .expect("first");
    producer
        .enqueue_after(&submit(2), Duration::from_secs(60))
        .await
        .expect("second");
    let mut conn = redis.conn.clone();
    let intake = cardworker_jobs::keys::intake(&redis.prefix, "payment");
    assert_eq!(conn.zcard::<_, usize>(&intake).await.expect("zcard"), 1);
    let payload: String = conn
        .hget(
            cardworker_jobs::keys::intake_payload(&redis.prefix, "payment"),
            payment_id.to_string(),
        )
        .await
        .expect("hget");
    assert!(
        payload.contains("\"retries\":2"),
        "the later job won: {payload}"
    );

    // Two pods seeing the same cron tick enqueue one run.
    let tick = RunArchive {
        scheduled_for: Some(1_700_000_000),
    };
    let first = producer
        .enqueue_once(&tick, "archive:tick:1700000000", Duration::from_secs(60))
        .await
        .expect("first pod");
    let second = producer
        .enqueue_once(&tick, "archive:tick:1700000000", Duration::from_secs(60))
        .await
        .expect("second pod");
    assert!(first && !second);
    let archive_intake = cardworker_jobs::keys::intake(&redis.prefix, "archive");
    assert_eq!(
        conn.zcard::<_, usize>(&archive_intake)
            .await
            .expect("zcard"),
        1
    );
}
