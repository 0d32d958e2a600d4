//! A token counts a call at the Gateway, not a wait in the worker: a poll that stops waiting for
//! its call at `gateway.timeout_ms` keeps its tokens until the call is answered, or until
//! `polling.handler_timeout_secs` after it was sent. The simulator counts a call in flight from
//! its arrival to its answer, whether or not the worker still waits for it.

use std::time::Duration;

use cardworker::budget::Budget;
use cardworker::config::{Config, Task};

use cardworker::context;
use cardworker::limit::Limit;
use cardworker::sim::SimStats;
use tokio::sync::oneshot;

use crate::faults::{self, config_on, insert_cards, services, InProcess, NEVER};
use crate::harness::wait_until;
use crate::private::PrivateRedis;

/// How long the simulator takes to answer every card read: past the client's timeout (1 s),
/// within the handler's (3 s).
const ANSWER_AFTER_MS: u64 = 2_500;

fn calls(stats: &SimStats) -> u64 {
    ["carddata", "card_status"]
        .iter()
        .map(|k| stats.calls_total.get(*k).copied().unwrap_or(0))
        .sum()
}

fn assert_within_limits(stats: &SimStats) {
    assert!(
        stats.peak_in_flight_polls <= 2,
        "{} polls at the Gateway at once, total limit 2: {stats:?}",
        stats.peak_in_flight_polls
    );
    for kind in ["carddata", "card_status"] {
        let peak = stats.peak_per_call.get(kind).copied().unwrap_or(0);
        assert!(
            peak <= 2,
            "{peak} {kind} polls at the Gateway at once, task limit 2: {stats:?}"
        );
    }
}

/// Two budgets on `redis` with the given handler timeout and lease TTL (seconds): the process
/// `name` under test, and an observer that reads the fleet's leases.
async fn budgets(
    redis: &PrivateRedis,
    handler_secs: u64,
    lease_secs: u64,
    name: &str,
) -> (Budget, Budget) {
    let mut config = Config::default();
    config.redis.url = redis.url().into();
    config.redis.key_prefix = "cw".to_owned();
    config.polling.handler_timeout_secs = handler_secs;
    config.polling.lease_ttl_secs = lease_secs;
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    (
        Budget::new(conn.clone(), &config).with_process_id(name),
        Budget::new(conn, &config).with_process_id("observer"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_abandoned_at_the_client_timeout_keeps_its_tokens_until_the_gateway_answers_it() {
    let (db, redis, sim, sim_handle) = services(ANSWER_AFTER_MS).await;
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    let mut config = config_on(&db.url, &redis.url(), &sim_handle.base_url());
    faults::slow_calls(&mut config, 1, 10);
    config.polling.total_limit = Limit::new(2).expect("a limit");
    for task in [
        &mut config.polling.carddata,
        &mut config.polling.card_status,
    ] {
        task.limit = Limit::new(2).expect("a limit");
        task.interval_secs = 1;
        task.max_consecutive_failures = 1000;
    }
    config.polling.defer_delay_secs = 1;
    config.polling.defer_max_delay_secs = 2;
    // The circuit counts every timeout but never opens here, so that polls keep coming.
    config.polling.circuit.window_calls = 10_000;
    config.polling.circuit.min_calls = 10_000;
    config.worker.shutdown_grace_secs = 5;
    config.approvals.recovery_cron = NEVER.to_owned();
    insert_cards(&db.pool, 8).await;
    let worker = InProcess::start(config).await;
    faults::start_chains(&worker.ctx).await;

    // Every call outlives the client's timeout: each poll records a timeout and ends after 1 s,
    // while the Gateway works on its call for 2.5 s. The budget must count the call, not the wait.
    let mut abandoned_seen = 0;
    wait_until(
        Duration::from_secs(120),
        "24 card calls through the simulator",
        || {
            let stats = sim.stats();
            assert_within_limits(&stats);
            abandoned_seen = abandoned_seen.max(
                Task::ALL
                    .iter()
                    .map(|t| worker.ctx.budget.abandoned_calls(*t))
                    .sum(),
            );
            async move { calls(&stats) >= 24 }
        },
    )
    .await;
    assert_within_limits(&sim.stats());
    assert!(
        abandoned_seen > 0,
        "tokens were held for calls the polls stopped waiting for"
    );

    // The polls themselves completed: each timeout is a recorded failure, counted in the circuit,
    // and no job went to the dead set.
    let failures: i64 =
        sqlx::query_scalar("SELECT count(*) FROM integration_logs WHERE state = 'failed'")
            .fetch_one(&db.pool)
            .await
            .expect("failures");
    assert!(failures >= 10, "timeouts recorded as failures: {failures}");
    let view = worker.ctx.budget.show().await.expect("show");
    let counted: u64 = view.tasks.values().map(|t| t.circuit.window.failures).sum();
    assert!(
        counted >= 10,
        "the circuit counts the timeouts as failures: {view:?}"
    );
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
    for queue in ["carddata", "card_status"] {
        let dead: u64 = redis::cmd("SCARD")
            .arg(format!(
                "{}:dead",
                cardworker_jobs::keys::queue("cw", queue)
            ))
            .query_async(&mut admin)
            .await
            .unwrap_or(0);
        assert_eq!(dead, 0, "no {queue} job is dead");
    }
}

/// A graceful stop waits for the calls its polls stopped waiting for: their tokens go back when
/// the Gateway answers them (or at their deadline), not with the rest of the process's leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_keeps_an_abandoned_call_s_tokens_until_the_gateway_answers_it() {
    use cardworker::budget::{Acquired, Slot};
    use std::time::Instant;

    let redis = PrivateRedis::start_new(false);
    let (budget, observer) = budgets(&redis, 20, 30, "stopping").await;
    let lease = budget.new_lease_id();
    let granted = budget
        .acquire(Task::Carddata, &lease)
        .await
        .expect("acquire");
    assert_eq!(granted, Acquired::Acquired);
    let (answer, answered) = oneshot::channel::<()>();
    budget.run_started(Task::Carddata, &lease);
    budget.hold_abandoned(
        Task::Carddata,
        Slot {
            lease,
            expires: Instant::now() + Duration::from_secs(30),
        },
        Instant::now() + Duration::from_secs(20),
        async move {
            let _ = answered.await;
        },
    );
    assert_eq!(budget.abandoned_calls(Task::Carddata), 1);

    let release = tokio::spawn({
        let budget = budget.clone();
        async move { budget.release_held().await }
    });
    // The stop waits: the call is still at the Gateway, so its token still counts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!release.is_finished(), "the release waits for the call");
    assert_eq!(observer.show().await.expect("show").total.in_use, 1);

    answer.send(()).expect("the hold waits for the answer");
    let released = tokio::time::timeout(Duration::from_secs(5), release)
        .await
        .expect("the release ends once the call is answered")
        .expect("joined");
    assert!(released.is_ok(), "{released:?}");
    wait_until(Duration::from_secs(5), "the token is back", || async {
        observer.show().await.expect("show").total.in_use == 0
    })
    .await;
    assert_eq!(budget.abandoned_calls(Task::Carddata), 0);
}

/// A call sent late in its poll counts past the expiry its lease got at the acquire: the lease is
/// extended, so that it neither expires nor goes back before the call's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_call_that_outlasts_its_lease_keeps_its_tokens_until_its_deadline() {
    use cardworker::budget::Slot;
    use std::time::Instant;

    let redis = PrivateRedis::start_new(false);
    // A short lease, so that the call's deadline comes after its expiry.
    let (budget, observer) = budgets(&redis, 8, 4, "late").await;
    let lease = budget.new_lease_id();
    let acquired_at = Instant::now();
    budget
        .acquire(Task::CardStatus, &lease)
        .await
        .expect("acquire");
    budget.run_started(Task::CardStatus, &lease);
    let deadline = acquired_at + Duration::from_secs(8);
    budget.hold_abandoned(
        Task::CardStatus,
        Slot {
            lease,
            expires: acquired_at + Duration::from_secs(4),
        },
        deadline,
        std::future::pending::<()>(),
    );
    // Past the lease's first expiry, before the call's deadline: still counted, never expired.
    while Instant::now() < acquired_at + Duration::from_secs(6) {
        let view = observer.show().await.expect("show");
        assert_eq!(view.total.in_use, 1, "held until the deadline: {view:?}");
        assert_eq!(view.total.leases_expired, 0, "{view:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_until(
        Duration::from_secs(6),
        "the token is back after the deadline",
        || async { observer.show().await.expect("show").total.in_use == 0 },
    )
    .await;
    assert!(Instant::now() >= deadline, "not before the deadline");
    let view = observer.show().await.expect("show");
    assert_eq!(
        view.total.leases_expired, 0,
        "released, not expired: {view:?}"
    );
}

/// A worker stopped while its polls wait for the Gateway (a rolling deploy, with the Gateway slow)
/// abandons them at the end of its shutdown grace, but their calls are still at the Gateway: their
/// tokens stay held until `polling.handler_timeout_secs` after each poll began (the lease is left
/// to lapse in Redis), and no other worker admits a poll beside them meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_while_its_polls_wait_for_the_gateway_leaves_their_tokens_held_while_the_calls_run(
) {
    // Answered within the client's timeout (7 s), long after the shutdown grace (1 s).
    let (db, redis, sim, sim_handle) = services(5_000).await;
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    let mut config = faults::two_token_config(&db.url, &redis.url(), &sim_handle.base_url());
    faults::slow_calls(&mut config, 7, 20);
    config.worker.shutdown_grace_secs = 1;
    insert_cards(&db.pool, 6).await;
    let stopping = InProcess::start(config.clone()).await;
    faults::start_chains(&stopping.ctx).await;
    // Both polls of the stopping worker at the Gateway.
    faults::two_polls_at_the_gateway(&sim).await;
    let other = InProcess::start(config).await;
    let stopped_at = std::time::Instant::now();
    let stopped = stopping.stop().await;
    assert!(stopped.is_ok(), "a graceful stop: {stopped:?}");
    assert!(
        stopped_at.elapsed() < Duration::from_secs(4),
        "the stop ended at its grace, before the calls were answered"
    );

    // The two calls run on at the Gateway for about 4 s more: nothing is admitted beside them.
    while stopped_at.elapsed() < Duration::from_secs(5) {
        assert_within_limits(&sim.stats());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Once their deadline is over, the other worker polls.
    sim.set_latency(50, 0);
    let before = calls(&sim.stats());
    wait_until(
        Duration::from_secs(40),
        "the other worker polling once the stopped worker's calls are over",
        || async { calls(&sim.stats()) >= before + 4 },
    )
    .await;
    assert_within_limits(&sim.stats());
    drop(other);
}
