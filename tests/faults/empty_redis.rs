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
