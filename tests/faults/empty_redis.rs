//! The budget and the chains across a Redis that comes back empty while polls are at the
//! Gateway: the leases and chain entries of those polls are gone with the data, and nothing may
//! admit new polls beside them beyond the limits, nor poll their cards a second time at once.
//! Found by `make chaos` (docs/RELIABILITY.md). The process that notices the loss writes its
//! running polls' leases and chain entries back before the full reconcile looks for dead chains.

use std::time::{Duration, Instant};

use cardworker::config::{Config, Limit, Task};
use cardworker::polling::reconcile;
use cardworker::sim::Simulator;

use crate::harness::{start_in_process, wait_until, TestDb};
use crate::private::PrivateRedis;

/// Longer than Redis's down time and the worker's recovery of its chains, so that the polls in
/// flight when Redis goes are still at the Gateway when new polls could be admitted.
const SLOW_MS: u64 = 25_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_in_flight_when_redis_comes_back_empty_still_count_against_the_limits_and_their_cards_are_not_polled_again_at_once(
) {
    let db = TestDb::new().await;
    let mut redis = PrivateRedis::start_new(false);
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(SLOW_MS, 0);
    let mut config = Config::default();
    config.database.url = db.url.clone().into();
    config.redis.url = redis.url().into();
    config.redis.key_prefix = "cw".to_owned();
    config.gateway.base_url = sim_handle.base_url().into();
    config.gateway.timeout_ms = 30_000;
    config.polling.handler_timeout_secs = 32;
    config.polling.lease_ttl_secs = 45;
    config.polling.total_limit = Limit::new(2).expect("a limit");
    config.polling.carddata.limit = Limit::new(2).expect("a limit");
    config.polling.card_status.limit = Limit::new(2).expect("a limit");
    config.polling.carddata.interval_secs = 1;
    config.polling.card_status.interval_secs = 1;
    config.polling.defer_delay_secs = 1;
    config.polling.defer_max_delay_secs = 2;
    config.telemetry.listen = "127.0.0.1:0".to_owned();
    config.worker.shutdown_grace_secs = 5;
    config.worker.redis_outage_grace_secs = 120;
    config.payments.recovery_cron = "0 0 0 1 1 *".to_owned();
    config.approvals.recovery_cron = "0 0 0 1 1 *".to_owned();
    config.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    let cards: Vec<String> = (0..6).map(|i| format!("c-{i:03}")).collect();
    sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
        .bind(&cards)
        .execute(&db.pool)
        .await
        .expect("insert cards");
    let (ctx, _addr, stop, join) = start_in_process(config).await;
    for task in Task::ALL {
        reconcile::sweep(&ctx, task).await.expect("start chains");
    }
    wait_until(
        Duration::from_secs(60),
        "two polls at the Gateway",
        || async { sim.stats().in_flight_polls == 2 },
    )
    .await;

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
    assert!(!join.is_finished(), "the worker rides out the restart");
    let _ = stop.send(());
    let _ = join.await;
}
