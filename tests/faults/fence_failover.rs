//! The fence after the Redis losses that come through the network: a worker cut off from Redis
//! while Redis restarts empty, and a failover to a replica that lagged. Each worker reaches Redis
//! through a TCP proxy of the test's own ([`Proxy`](crate::proxy::Proxy)), which the test cuts off or switches to
//! another server. As in [`crate::fence`], the simulator counts a call in flight from its arrival
//! to its answer; its peak must never pass the total limit, and every card is polled again once
//! the fence is over.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cardworker::config::Task;
use cardworker::context::{self, AppContext};
use cardworker::polling::reconcile;
use cardworker::sim::Simulator;
use redis::aio::ConnectionManager;

use crate::faults::{insert_cards, start_chains, two_polls_at_the_gateway, InProcess};
use crate::fence::{
    self, assert_within_limits, config, epoch_marker_written, keys_exist, ran_before,
    slow_simulator, ANSWER_AFTER_MS, CARDS,
};
use crate::harness::{wait_until, TestDb};
use crate::private::PrivateRedis;
use crate::proxy::Proxy;

/// How long the worker stays cut off from Redis: longer than every hold a process keeps by a
/// timer of its own, and shorter than the fence.
const CUT_OFF: Duration = Duration::from_secs(20);

/// The run_id of the redis-server behind `conn`.
async fn run_id(conn: &mut ConnectionManager) -> String {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .expect("info");
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .expect("run_id")
        .trim()
        .to_owned()
}

/// Restores the chains (a reconcile comes round), retrying while the worker's connections find
/// their way to the server that answers now.
async fn restore_chains(ctx: &Arc<AppContext>, what: &str) {
    wait_until(Duration::from_secs(20), what, || async {
        let mut ok = true;
        for task in Task::ALL {
            ok &= reconcile::sweep(ctx, task).await.is_ok();
        }
        ok
    })
    .await;
}

/// Asserts the limits on every look until `until`.
async fn within_limits_until(sim: &Simulator, until: Instant, when: &str) {
    while Instant::now() < until {
        assert_within_limits(&sim.stats(), when);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The Gateway is quick again: every card is polled again soon after the fence that began at
/// `lost`, and both workers ride the loss out.
async fn polled_again_after_the_fence(
    sim: &Simulator,
    fence: Duration,
    lost: Instant,
    workers: [InProcess; 2],
) {
    fence::polled_again_after_the_fence(sim, fence, lost).await;
    for (name, worker) in ["A", "B"].iter().zip(&workers) {
        assert!(!worker.exited(), "worker {name} rides out the loss");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_from_redis_while_it_restarts_empty_admits_no_poll_beside_those_at_the_gateway_and_nor_does_any_other(
) {
    let db = TestDb::new().await;
    let mut redis = PrivateRedis::start_new(false);
    let proxy = Proxy::start(redis.port).await;
    let (sim, sim_handle) = slow_simulator().await;
    let direct = config(&db, &redis.url(), &sim_handle.base_url());
    let mut through_proxy = direct.clone();
    through_proxy.redis.url = proxy.url().into();
    insert_cards(&db.pool, CARDS).await;
    ran_before(&db, &redis.url()).await;

    // Worker A reaches Redis through the proxy, and both polls at the Gateway are its own; worker
    // B, started then, reaches Redis directly and finds the budget full.
    let a = InProcess::start(through_proxy).await;
    start_chains(&a.ctx).await;
    wait_until(
        Duration::from_secs(60),
        "two polls of worker A at the Gateway",
        || async { sim.stats().in_flight_polls == 2 },
    )
    .await;
    let b = InProcess::start(direct.clone()).await;
    let fence = b.ctx.budget.fence_length();

    // A is cut off, and Redis restarts empty while A's polls are at the Gateway: their leases are
    // gone, and A cannot write them back. B notices the loss (its probe re-creates the epoch
    // marker, and B writes back what its own running polls hold: nothing), and its chains are
    // restored as a reconcile would.
    proxy.cut();
    let cut = Instant::now();
    tokio::task::block_in_place(|| redis.restart_empty());
    let restarted = Instant::now();
    epoch_marker_written(&redis.url(), "worker B noticing the loss").await;
    let admin = context::connect_redis(&redis.url()).await.expect("redis");
    restore_chains(&b.ctx, "worker B's chains restored after the restart").await;

    // Nothing is admitted beside A's calls while they are at the Gateway, nor after, while A is
    // cut off.
    within_limits_until(&sim, cut + CUT_OFF, "while worker A is cut off").await;
    let mut admin = admin.clone();
    let (fenced_by, until): (Option<String>, Option<u64>) = redis::cmd("HMGET")
        .arg(cardworker::budget::fence_key("cw"))
        .arg("run_id")
        .arg("until")
        .query_async(&mut admin)
        .await
        .expect("the fence hash");
    assert_eq!(
        fenced_by,
        Some(run_id(&mut admin).await),
        "the first script after the restart set the fence"
    );
    assert!(until.is_some_and(|u| u > 0), "a fence is set: {until:?}");

    // A is back while the fence is still on; then the Gateway is quick again, and every chain
    // gets its turn soon after the fence.
    proxy.route_to(redis.port);
    within_limits_until(
        &sim,
        Instant::now() + Duration::from_secs(1),
        "with worker A back",
    )
    .await;
    polled_again_after_the_fence(&sim, fence, restarted, [a, b]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_that_lagged_admits_no_poll_beside_those_at_the_gateway() {
    let db = TestDb::new().await;
    let primary = PrivateRedis::start_new(false);
    let replica = PrivateRedis::start_new(false);
    // The replica follows the primary through a link of the test's own, which the test cuts to
    // make it lag.
    let link = Proxy::start(primary.port).await;
    let mut replica_admin = context::connect_redis(&replica.url()).await.expect("redis");
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(link.port)
        .query_async(&mut replica_admin)
        .await
        .expect("replicaof");
    // Every worker reaches Redis through the proxy, which points at the primary.
    let proxy = Proxy::start(primary.port).await;
    let (sim, sim_handle) = slow_simulator().await;
    let config = config(&db, &proxy.url(), &sim_handle.base_url());
    insert_cards(&db.pool, CARDS).await;
    ran_before(&db, &primary.url()).await;
    // The epoch marker of the deployment's Redis: the workers find it there, so no probe takes
    // their start for a data loss (and no full reconcile starts polls before the test does).
    let mut primary_admin = context::connect_redis(&primary.url()).await.expect("redis");
    let _: () = redis::cmd("SET")
        .arg(cardworker::runner::redis_watch::epoch_key("cw"))
        .arg("ran-before")
        .query_async(&mut primary_admin)
        .await
        .expect("the epoch marker");
    let a = InProcess::start(config.clone()).await;
    let b = InProcess::start(config.clone()).await;
    let fence = a.ctx.budget.fence_length();

    // The replica holds what a deployment that ran before holds (the fence hash naming the
    // primary, the epoch marker), then falls behind: the chains and the leases of the
    // polls below reach the primary only.
    let keys = [
        cardworker::budget::fence_key("cw"),
        cardworker::runner::redis_watch::epoch_key("cw"),
    ];
    keys_exist(
        &replica_admin,
        &keys,
        Duration::from_secs(20),
        "the replica in step with the primary",
    )
    .await;
    link.cut();
    start_chains(&a.ctx).await;
    two_polls_at_the_gateway(&sim).await;
    let leases: usize = redis::cmd("ZCARD")
        .arg(cardworker::budget::total_key("cw"))
        .query_async(&mut replica_admin)
        .await
        .expect("zcard");
    assert_eq!(
        leases, 0,
        "the replica lags: it holds no lease of the polls"
    );

    // The failover: the replica is promoted, and the proxy switches to it. Its run_id is not the
    // primary's, which its fence hash names. The chains are restored as a reconcile would.
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut replica_admin)
        .await
        .expect("replicaof no one");
    proxy.route_to(replica.port);
    let failed_over = Instant::now();
    restore_chains(&a.ctx, "the chains restored after the failover").await;

    // Nothing is admitted beside the two calls, by either worker, until they are over; then the
    // Gateway is quick again, and every chain gets its turn soon after the fence.
    within_limits_until(
        &sim,
        failed_over + Duration::from_millis(ANSWER_AFTER_MS + 2_000),
        "after the failover",
    )
    .await;
    polled_again_after_the_fence(&sim, fence, failed_over, [a, b]).await;
}
