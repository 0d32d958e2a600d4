//! The budget and the chains across a Redis that comes back empty while polls are at the
//! Gateway: the leases and chain entries of those polls are gone with the data, and nothing may
//! admit new polls beside them beyond the limits, nor poll their cards a second time at once.
//! Found by `make chaos` (docs/RELIABILITY.md). The process that notices the loss writes its
//! running polls' leases and chain entries back before the full reconcile looks for dead chains.

use std::time::{Duration, Instant};

use crate::faults::{self, insert_cards, services, two_token_config, InProcess};

/// Longer than Redis's down time and the worker's recovery of its chains, so that the polls in
/// flight when Redis goes are still at the Gateway when new polls could be admitted.
const SLOW_MS: u64 = 25_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_in_flight_when_redis_comes_back_empty_still_count_against_the_limits_and_their_cards_are_not_polled_again_at_once(
) {
    let (db, mut redis, sim, sim_handle) = services(SLOW_MS).await;
    let mut config = two_token_config(&db.url, &redis.url(), &sim_handle.base_url());
    faults::slow_calls(&mut config, 30, 45);
    insert_cards(&db.pool, 6).await;
    let worker = InProcess::start(config).await;
    faults::start_chains(&worker.ctx).await;
    faults::two_polls_at_the_gateway(&sim).await;

    // Redis goes and comes back empty while both polls are at the Gateway.
    tokio::task::block_in_place(|| {
        redis.stop();
        redis.start();
    });
    let back = Instant::now();
    while back.elapsed() < Duration::from_millis(SLOW_MS) {
        let stats = sim.stats();
        assert!(
            stats.peak_in_flight_polls <= 2,
            "{} polls in flight at once after Redis came back empty, total limit 2: {stats:?}",
            stats.peak_in_flight_polls
        );
        assert!(
            stats.peak_same_card <= 1,
            "a card polled twice at once after Redis came back empty: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!worker.exited(), "the worker rides out the restart");
    let _ = worker.stop().await;
}

/// Waits until `done()` holds, at most `limit`; fails with `what`.
async fn until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_that_failed_while_redis_went_down_again_is_retried_once_redis_answers_with_its_data_kept(
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use cardworker::runner::redis_watch::RedisWatch;
    use cardworker::telemetry::RedisStatus;

    let mut redis = crate::private::PrivateRedis::start_new(true);
    let conn = cardworker::context::connect_redis(&redis.url())
        .await
        .expect("redis");
    // The restore writes to Redis, as the full reconcile's enqueue does: it fails while Redis is
    // down.
    let attempts = Arc::new(AtomicUsize::new(0));
    let restored = Arc::new(AtomicUsize::new(0));
    let noticed = Arc::new(AtomicUsize::new(0));
    let on_data_lost = {
        let (conn, attempts, restored) = (conn.clone(), attempts.clone(), restored.clone());
        Arc::new(move || {
            let (mut conn, attempts, restored) = (conn.clone(), attempts.clone(), restored.clone());
            Box::pin(async move {
                attempts.fetch_add(1, Ordering::SeqCst);
                let _: i64 = redis::cmd("INCR")
                    .arg("probe:restores")
                    .query_async(&mut conn)
                    .await?;
                restored.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }) as futures::future::BoxFuture<'static, anyhow::Result<()>>
        })
    };
    let on_data_lost_here = {
        let noticed = noticed.clone();
        Arc::new(move || {
            noticed.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(()) }) as futures::future::BoxFuture<'static, anyhow::Result<()>>
        })
    };
    let status = RedisStatus::default();
    let watch = RedisWatch {
        conn: conn.clone(),
        prefix: "probe".to_owned(),
        status: status.clone(),
        on_data_lost,
        on_data_lost_here,
        budget: None,
        epoch: None,
        answered_before: false,
        restore_pending: false,
    };
    let stop = Arc::new(tokio::sync::Notify::new());
    let run = tokio::spawn({
        let stop = stop.clone();
        watch.run(async move { stop.notified().await })
    });
    let limit = Duration::from_secs(20);
    until("the first start's restore", limit, || {
        restored.load(Ordering::SeqCst) == 1
    })
    .await;

    // Redis loses its data while the worker runs; the probe notices, and Redis goes down before
    // the restore (which waits for the other pods to write back first) reaches it.
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut conn.clone())
        .await
        .expect("flush");
    until("the loss noticed", limit, || {
        noticed.load(Ordering::SeqCst) == 1
    })
    .await;
    tokio::task::block_in_place(|| redis.stop());
    until("the restore tried while Redis is down", limit, || {
        attempts.load(Ordering::SeqCst) == 2
    })
    .await;
    // The probe after the failed restore finds Redis down: the restore's clean-up (dropping the
    // marker it had re-created, so that a probe retries) went to the stopped Redis too.
    until(
        "the probe after the restore finding Redis down",
        limit,
        || !status.is_up(),
    )
    .await;
    assert_eq!(restored.load(Ordering::SeqCst), 1);

    // Redis comes back with its data, the re-created marker included.
    tokio::task::block_in_place(|| redis.start());
    until(
        "the restore done once Redis answers again (the schedule would otherwise wait for the \
         reconcile cron)",
        limit,
        || restored.load(Ordering::SeqCst) == 2,
    )
    .await;
    stop.notify_one();
    run.await.expect("the probe ends");
}
