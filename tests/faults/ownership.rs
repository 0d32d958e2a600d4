//! The poll owns its tokens: whatever happens to its worker's connection to Redis (stalled past
//! the response timeout, reset, or its registration removed), the Gateway never sees more polls
//! in flight than the limits; and a process stopped while an acquire is under way leaves no token
//! behind. The simulator counts the calls it serves in flight, per task and per card, with peaks.

use std::time::{Duration, Instant};

use cardworker::budget::Budget;
use cardworker::config::{Config, Task};
use cardworker::context::{self, AppContext};
use cardworker::limit::Limit;
use cardworker::sim::{SimStats, Simulator};
use redis::aio::ConnectionManager;
use sqlx::PgPool;

use crate::faults::{
    config_on, insert_cards, services, slow_calls, start_chains, two_token_config, Child,
    InProcess, NEVER, PREFIX,
};
use crate::harness::{assert_success, wait_until, TestDb};
use crate::private::PrivateRedis;

/// How long the simulator takes to answer a card read in the stall scenario: longer than the
/// Redis client's response timeout (10 s), so that polls outlive their worker's stream.
const SLOW_MS: u64 = 20_000;

async fn redis_cmd(conn: &mut ConnectionManager, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let _: redis::Value = cmd.query_async(conn).await.expect("redis command");
}

/// These tests' worker on `db`, the private `redis` and the simulator at `gateway`: a call may
/// take `call_secs` at the Gateway and its poll 2 s more, a lease lives `lease_ttl_secs`, and
/// nothing runs on a schedule.
fn worker_config(
    db: &TestDb,
    redis: &PrivateRedis,
    gateway: &str,
    call_secs: u64,
    lease_ttl_secs: u64,
) -> Config {
    let mut config = config_on(&db.url, &redis.url(), gateway);
    config.approvals.recovery_cron = NEVER.to_owned();
    slow_calls(&mut config, call_secs, lease_ttl_secs);
    config
}

/// A process's configuration on the private `redis` only (a budget's).
fn redis_config(redis: &PrivateRedis) -> Config {
    let mut config = Config::default();
    config.redis.url = redis.url().into();
    config.redis.key_prefix = PREFIX.to_owned();
    config
}

/// Sets the total limit and each task's.
fn set_limits(config: &mut Config, total: u32, per_task: u32) {
    config.polling.total_limit = Limit::new(total).expect("a limit");
    for task in [
        &mut config.polling.carddata,
        &mut config.polling.card_status,
    ] {
        task.limit = Limit::new(per_task).expect("a limit");
    }
}

/// The simulator's peaks against the limits: total over both poll kinds, each task's own, and
/// one call per card and task at a time.
fn assert_within_limits(stats: &SimStats, total: u64, per_task: u64, when: &str) {
    assert!(
        stats.peak_in_flight_polls <= total,
        "{when}: {} polls in flight at once, total limit {total}: {stats:?}",
        stats.peak_in_flight_polls
    );
    for kind in ["carddata", "card_status"] {
        let peak = stats.peak_per_call.get(kind).copied().unwrap_or(0);
        assert!(
            peak <= per_task,
            "{when}: {peak} {kind} polls in flight at once, task limit {per_task}: {stats:?}"
        );
    }
    assert!(
        stats.peak_same_card <= 1,
        "{when}: a card polled twice at once: {stats:?}"
    );
}

/// Waits until both tokens of the total are held by polls at the Gateway.
async fn budget_full(sim: &Simulator, what: &str) {
    wait_until(Duration::from_secs(90), what, || async {
        sim.stats().in_flight_polls == 2
    })
    .await;
}

/// Watches the simulator for `d`, failing at the first moment the peaks pass the limits.
async fn hold_within_limits(sim: &Simulator, d: Duration, when: &str) {
    let start = Instant::now();
    while start.elapsed() < d {
        assert_within_limits(&sim.stats(), 2, 2, when);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_reset_or_unregistered_worker_connection_never_lets_more_polls_reach_the_gateway_than_the_limits(
) {
    let (db, redis, sim, sim_handle) = services(SLOW_MS).await;
    let mut config = two_token_config(&db.url, &redis.url(), &sim_handle.base_url());
    slow_calls(&mut config, 25, 40);
    insert_cards(&db.pool, 6).await;
    let worker = InProcess::start(config).await;
    start_chains(&worker.ctx).await;
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");

    // 1. Redis stalls past the client's response timeout while both tokens are held: the
    //    worker's streams end (apalis drops their in-flight futures) while the polls run on.
    budget_full(&sim, "two polls at the Gateway").await;
    let calls_before = sim.stats().calls_total.values().sum::<u64>();
    redis_cmd(&mut admin, &["CLIENT", "PAUSE", "12000", "ALL"]).await;
    hold_within_limits(&sim, Duration::from_secs(30), "after a 12 s CLIENT PAUSE").await;
    assert!(!worker.exited(), "the worker rides out the stall");

    // 2. Every connection reset while both tokens are held.
    budget_full(&sim, "two polls at the Gateway after the stall").await;
    redis_cmd(&mut admin, &["CLIENT", "KILL", "TYPE", "normal"]).await;
    hold_within_limits(
        &sim,
        Duration::from_secs(10),
        "after CLIENT KILL TYPE normal",
    )
    .await;

    // 3. The workers' registrations removed while both tokens are held: their next heartbeat
    //    fails ("worker not registered") and their streams end.
    budget_full(&sim, "two polls at the Gateway after the reset").await;
    for queue in ["carddata", "card_status"] {
        let workers = format!("{}:workers", cardworker_jobs::keys::queue("cw", queue));
        redis_cmd(&mut admin, &["DEL", &workers]).await;
    }
    hold_within_limits(
        &sim,
        Duration::from_secs(30),
        "after the registrations went",
    )
    .await;

    let stats = sim.stats();
    assert_within_limits(&stats, 2, 2, "at the end");
    assert!(
        stats.calls_total.values().sum::<u64>() >= calls_before + 4,
        "polling went on through every fault: {stats:?}"
    );
    assert!(!worker.exited(), "no process exit");
    eprintln!("peaks: {stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_an_acquire_is_under_way_leaves_no_token_in_use_after_the_exit() {
    let (db, redis, sim, sim_handle) = services(100).await;
    insert_cards(&db.pool, 20).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("cardworker.toml");
    std::fs::write(
        &file,
        format!(
            r#"[database]
url = "{db}"
[redis]
url = "{redis}"
key_prefix = "cw"
[gateway]
base_url = "{gw}"
timeout_ms = 2000
[worker]
shutdown_grace_secs = 1
[polling]
total_limit = 2
handler_timeout_secs = 4
lease_ttl_secs = 300
defer_delay_secs = 1
defer_max_delay_secs = 1
reconcile_cron = "0 0 0 1 1 *"
[polling.carddata]
limit = 2
interval_secs = 1
[polling.card_status]
limit = 2
interval_secs = 1
[payments]
recovery_cron = "0 0 0 1 1 *"
[approvals]
recovery_cron = "0 0 0 1 1 *"
[telemetry]
listen = "127.0.0.1:0"
"#,
            db = db.url,
            redis = redis.url(),
            gw = sim_handle.base_url()
        ),
    )
    .expect("config");
    let config = Config::load(Some(&file)).expect("config");
    let ctx = AppContext::connect(config.clone()).await.expect("connect");
    let child = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
            .args(["run", "--config"])
            .arg(&file)
            .env("CARDWORKER_POD_NAME", "pod-a")
            .env_remove("CARDWORKER_CONFIG")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start cardworker run"),
    );
    start_chains(&ctx).await;
    wait_until(Duration::from_secs(60), "polls run", || async {
        sim.stats().calls_total.values().sum::<u64>() >= 10
    })
    .await;

    // Both tasks paused: the child's polls are refused at every acquire and deferred (1 s), so
    // that with 40 chains cycling some acquire is always under way.
    ctx.budget.pause(&Task::ALL).await.expect("pause");
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Resume and stall Redis at once: the acquires sent now are answered (granted) only after the
    // child got SIGTERM, its grace ran out and it dropped them.
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
    ctx.budget.resume(&Task::ALL).await.expect("resume");
    redis_cmd(&mut admin, &["CLIENT", "PAUSE", "5000", "ALL"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = child.0.id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    let mut child = child;
    let status = tokio::task::spawn_blocking(move || {
        let status = child.0.wait();
        (child, status)
    });
    let (_child, status) = tokio::time::timeout(Duration::from_secs(60), status)
        .await
        .expect("the child exits")
        .expect("joined");
    assert!(status.expect("wait").success(), "exit 0 on SIGTERM");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(["budget", "show", "--format", "json", "--config"])
        .arg(&file)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .expect("budget show");
    assert_success(&out, "cardworker budget show");
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(view["total"]["in_use"], 0, "no token left in use: {view}");
    for task in Task::ALL {
        assert_eq!(view["tasks"][task.label()]["in_use"], 0, "{task}: {view}");
    }
}

/// The budget of a process on the private `redis`, with the test limits.
async fn budget_on(redis: &PrivateRedis) -> (Budget, ConnectionManager) {
    let mut config = redis_config(redis);
    set_limits(&mut config, 2, 2);
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let budget = Budget::new(conn.clone(), &config);
    // The script is loaded now: under a stall, an acquire is then one EVALSHA that Redis runs once
    // the stall ends, whatever became of its caller (not a NOSCRIPT answer and a retry that a
    // dropped caller never sends).
    budget.show().await.expect("show");
    (budget, conn)
}

async fn in_use(budget: &Budget) -> u64 {
    budget.show().await.expect("show").total.in_use
}

/// Shutdown's release (`release_held`, what SIGTERM runs once the workers stopped) while an
/// acquire is at Redis, stalled: whether the acquire's future was dropped first (the worker was
/// abandoned past its grace) or is still waiting for its answer, the lease Redis grants it once
/// the stall ends is released before the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_the_lease_of_an_acquire_under_way_whether_its_future_was_dropped_or_not()
{
    let redis = PrivateRedis::start_new(false);
    for dropped in [true, false] {
        let (budget, _) = budget_on(&redis).await;
        let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
        redis_cmd(&mut admin, &["CLIENT", "PAUSE", "1500", "ALL"]).await;
        let acquire = tokio::spawn({
            let budget = budget.clone();
            async move {
                let lease = budget.new_lease_id();
                budget.acquire(Task::Carddata, &lease).await
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        if dropped {
            acquire.abort();
        }
        let released = budget.release_held().await;
        assert!(released.is_ok(), "{released:?}");
        if !dropped {
            let answer = acquire.await.expect("joined");
            assert!(
                answer.is_err(),
                "an acquire answered during shutdown does not admit a poll: {answer:?}"
            );
        }
        // Past the stall: whatever Redis still had queued has run.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let (observer, _) = budget_on(&redis).await;
        assert_eq!(
            in_use(&observer).await,
            0,
            "no token left in use (acquire future dropped: {dropped})"
        );
        assert_eq!(budget.held_count(), 0);
    }
}

/// A granted acquire whose future is dropped before its answer is read (the worker's stream ended
/// under it) still counts as held by the process: shutdown releases it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_granted_to_a_dropped_acquire_is_still_tracked_and_released_at_shutdown() {
    let redis = PrivateRedis::start_new(false);
    let (budget, _) = budget_on(&redis).await;
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
    redis_cmd(&mut admin, &["CLIENT", "PAUSE", "1000", "ALL"]).await;
    let lease = budget.new_lease_id();
    let acquire = tokio::spawn({
        let (budget, lease) = (budget.clone(), lease.clone());
        async move { budget.acquire(Task::CardStatus, &lease).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    acquire.abort();
    let (observer, _) = budget_on(&redis).await;
    wait_until(
        Duration::from_secs(10),
        "the stalled acquire is granted",
        || async { in_use(&observer).await == 1 },
    )
    .await;
    assert_eq!(
        budget.held_count(),
        1,
        "the dropped acquire's lease is tracked"
    );
    assert_eq!(budget.release_held().await.expect("release"), 1);
    assert_eq!(in_use(&observer).await, 0);
}

/// `cardworker_budget_leases_expired_total{scope}`: a released lease never counts; a lease whose
/// holder vanished (kill -9) counts once it expired, in the total and in its task's scope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_that_expire_instead_of_being_released_are_counted_per_scope() {
    let redis = PrivateRedis::start_new(false);
    let mut config = redis_config(&redis);
    config.polling.lease_ttl_secs = 1;
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let victim = Budget::new(conn.clone(), &config).with_process_id("victim");
    let healthy = Budget::new(conn, &config).with_process_id("healthy");
    let released = healthy.new_lease_id();
    healthy
        .acquire(Task::Carddata, &released)
        .await
        .expect("acquire");
    healthy.release(&[released]).await.expect("release");
    for task in [Task::Carddata, Task::CardStatus, Task::CardStatus] {
        let lease = victim.new_lease_id();
        victim.acquire(task, &lease).await.expect("acquire");
    }
    // The victim is gone without a word: its leases end by expiry.
    drop(victim);
    let view = healthy.show().await.expect("show");
    assert_eq!(view.total.in_use, 3);
    assert_eq!(
        view.total.leases_expired, 0,
        "a released lease is no expiry"
    );
    wait_until(
        Duration::from_secs(10),
        "the victim's leases expired",
        || async { healthy.show().await.expect("show").total.in_use == 0 },
    )
    .await;
    let view = healthy.show().await.expect("show");
    assert_eq!(view.total.leases_expired, 3);
    assert_eq!(view.tasks["carddata"].leases_expired, 1);
    assert_eq!(view.tasks["card_status"].leases_expired, 2);
    // Counted once: reading again does not count them again.
    assert_eq!(healthy.show().await.expect("show").total.leases_expired, 3);
}

/// How long the simulator takes to answer in the restart scenario.
const RESTART_LATENCY: Duration = Duration::from_secs(4);

async fn parked_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL OR card_status_parked_at IS NOT NULL",
    )
    .fetch_one(pool)
    .await
    .expect("parked")
}

async fn failure_records(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM integration_logs WHERE state = 'failed'")
        .fetch_one(pool)
        .await
        .expect("failures")
}

/// Every card failing at the Gateway, every chain parked at its first failure: an operator
/// restarts the chains (`enqueue`, then `unpark --all`) while their polls are at the Gateway. The
/// restarted chains' first polls wait for the old ones (the simulator never sees a card twice at
/// once), and the old polls' failures record nothing and park nothing: right after they answer,
/// no card is parked and no failure was added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_restart_while_polls_are_in_flight_never_polls_a_card_twice_and_no_stale_poll_parks_it(
) {
    let (db, redis, sim, sim_handle) = services(RESTART_LATENCY.as_millis() as u64).await;
    let cards = insert_cards(&db.pool, 4).await;
    for card in &cards {
        sim.fail_card(card);
    }
    let mut config = worker_config(&db, &redis, &sim_handle.base_url(), 6, 15);
    set_limits(&mut config, 16, 8);
    for task in [
        &mut config.polling.carddata,
        &mut config.polling.card_status,
    ] {
        task.interval_secs = 1;
        task.max_consecutive_failures = 1;
        task.parked_retry_secs = 3;
    }
    config.worker.shutdown_grace_secs = 5;
    let worker = InProcess::start(config).await;
    let ctx = worker.ctx.clone();
    start_chains(&ctx).await;
    let all_in_flight = || async { sim.stats().in_flight_polls == 8 };

    // 1. `enqueue` every chain while its first poll is at the Gateway.
    wait_until(
        Duration::from_secs(30),
        "every first poll in flight",
        all_in_flight,
    )
    .await;
    for card in &cards {
        for task in Task::ALL {
            cardworker::commands::polling::enqueue(&ctx, task, card, Some("test".to_owned()))
                .await
                .expect("enqueue");
        }
    }
    tokio::time::sleep(RESTART_LATENCY + Duration::from_millis(500)).await;
    assert_eq!(
        failure_records(&db.pool).await,
        0,
        "the replaced chains' failures are not recorded"
    );
    assert_eq!(
        parked_count(&db.pool).await,
        0,
        "no stale poll parked a card"
    );
    assert!(sim.stats().peak_same_card <= 1, "{:?}", sim.stats());

    // 2. The restarted chains fail and park (their own failures); their retries go to the
    //    Gateway, and `unpark --all` restarts them meanwhile.
    wait_until(Duration::from_secs(60), "every chain parked", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL AND card_status_parked_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .expect("parked")
            == 4
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "every parked retry in flight",
        all_in_flight,
    )
    .await;
    let recorded = failure_records(&db.pool).await;
    for task in Task::ALL {
        let unparked = cardworker::commands::polling::unpark(
            &ctx,
            task,
            cardworker::storage::cards::ParkedSelector::All,
            Some("test".to_owned()),
            &cardworker::commands::operator::Operator::cli(),
        )
        .await
        .expect("unpark");
        assert_eq!(unparked.restarted, 4, "{task}");
    }
    tokio::time::sleep(RESTART_LATENCY + Duration::from_millis(500)).await;
    assert_eq!(
        failure_records(&db.pool).await,
        recorded,
        "the replaced retries' failures are not recorded"
    );
    assert_eq!(
        parked_count(&db.pool).await,
        0,
        "no stale retry parked an un-parked card again"
    );
    let stats = sim.stats();
    assert!(
        stats.peak_same_card <= 1,
        "a card polled twice at once: {stats:?}"
    );
    assert!(!worker.exited());
}
