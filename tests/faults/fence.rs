//! A Redis data loss is fenced in Redis, on Redis's clock: after a `FLUSHALL`, or a restart from an
//! append-only file that missed its last writes, no budget script admits a poll until every poll
//! that may still be at the Gateway has ended (`Budget::fence_length`), whatever pod asks, and
//! then every card is polled again. The simulator counts a call in flight from its arrival to its
//! answer; its peak must never pass the total limit.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cardworker::budget::{Acquired, Budget, CallReport};
use cardworker::config::{Config, Task};
use cardworker::context;
use cardworker::polling::reconcile;
use cardworker::sim::{SimHandle, SimStats, Simulator};

use crate::faults::{
    self, insert_cards, services, simulator, start_chains, two_polls_at_the_gateway,
    two_token_config, InProcess,
};
use crate::harness::{wait_until, TestDb};
use crate::private::PrivateRedis;

/// How long the simulator takes to answer a card read: within the client's timeout and the
/// handler's, and longer than an outage hold, so that the polls admitted before a loss are still
/// at the Gateway when new ones could be admitted.
pub(crate) const ANSWER_AFTER_MS: u64 = 6_000;
pub(crate) const CARDS: usize = 6;

/// Two tokens in all and two per task, every card due each second, on a Gateway whose client
/// gives up after 7 s (a poll after 9 s, its lease after 20 s).
pub(crate) fn config(db: &TestDb, redis_url: &str, gateway: &str) -> Config {
    let mut config = two_token_config(&db.url, redis_url, gateway);
    faults::slow_calls(&mut config, 7, 20);
    config
}

fn card(i: usize) -> String {
    format!("c-{i:03}")
}

/// What a deployment that ran before holds on an intact Redis: its first start recorded long ago
/// in PostgreSQL, and the fence hash naming the redis-server that holds the budget's data. A pod
/// of it that starts now is not fenced, and a data loss from here on is.
pub(crate) async fn ran_before(db: &TestDb, redis_url: &str) {
    sqlx::query("INSERT INTO budget_deployment (started_at) VALUES (now() - interval '1 day')")
        .execute(&db.pool)
        .await
        .expect("the deployment's first start");
    let mut conn = context::connect_redis(redis_url).await.expect("redis");
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .expect("info");
    let run_id = info
        .lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .expect("run_id")
        .trim()
        .to_owned();
    let _: () = redis::cmd("HSET")
        .arg(cardworker::budget::fence_key("cw"))
        .arg("run_id")
        .arg(run_id)
        .arg("until")
        .arg(0)
        .query_async(&mut conn)
        .await
        .expect("the fence hash");
}

pub(crate) fn assert_within_limits(stats: &SimStats, when: &str) {
    assert!(
        stats.peak_in_flight_polls <= 2,
        "{} polls at the Gateway at once {when}, total limit 2: {stats:?}",
        stats.peak_in_flight_polls
    );
}

/// Watches the simulator until every card has been at the Gateway again (both tasks) at some
/// moment at least `after` from now, asserting the limits on every look.
pub(crate) async fn every_card_polled_again(sim: &Simulator, after: Duration, limit: Duration) {
    let started = Instant::now();
    let from = started + after;
    let mut seen: HashSet<(String, String)> = HashSet::new();
    loop {
        let stats = sim.stats();
        assert_within_limits(&stats, "after the data loss");
        if Instant::now() >= from {
            for (card, kinds) in &stats.in_flight_per_card {
                for (kind, n) in kinds {
                    if *n > 0 {
                        seen.insert((card.clone(), kind.clone()));
                    }
                }
            }
        }
        let done = (0..CARDS).all(|i| {
            ["carddata", "card_status"]
                .iter()
                .all(|k| seen.contains(&(card(i), (*k).to_owned())))
        });
        if done {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "not every card polled again within {limit:?} (from {after:?} on): seen {seen:?}; {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The simulator, answering every card read well after [`ANSWER_AFTER_MS`].
pub(crate) async fn slow_simulator() -> (Simulator, SimHandle) {
    let (sim, sim_handle) = simulator().await;
    sim.set_latency(ANSWER_AFTER_MS, 0);
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    (sim, sim_handle)
}

/// A worker of a deployment that ran before, on `db` and the private Redis at `redis_url`, with
/// its chains started and both tokens held by polls at the slow simulator; and its config.
async fn worker_at_the_gateway(
    db: &TestDb,
    redis_url: &str,
) -> (Simulator, SimHandle, Config, InProcess) {
    let (sim, sim_handle) = slow_simulator().await;
    let config = config(db, redis_url, &sim_handle.base_url());
    insert_cards(&db.pool, CARDS).await;
    ran_before(db, redis_url).await;
    let worker = InProcess::start(config.clone()).await;
    start_chains(&worker.ctx).await;
    two_polls_at_the_gateway(&sim).await;
    (sim, sim_handle, config, worker)
}

/// A [`worker_at_the_gateway`] on a new test database and private Redis, whose Redis is then
/// emptied while both polls are at the Gateway: the database, the Redis, the simulator (and its
/// handle), the worker's config, the worker, and when the Redis was emptied.
async fn flushed_at_the_gateway() -> (
    TestDb,
    PrivateRedis,
    Simulator,
    SimHandle,
    Config,
    InProcess,
    Instant,
) {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let (sim, sim_handle, config, worker) = worker_at_the_gateway(&db, &redis.url()).await;
    let flushed = flushall(&redis.url()).await;
    (db, redis, sim, sim_handle, config, worker, flushed)
}

/// Empties the private Redis at `url`; answers when.
async fn flushall(url: &str) -> Instant {
    let mut admin = context::connect_redis(url).await.expect("redis");
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .expect("flushall");
    Instant::now()
}

/// Asserts the limits on every look at the simulator until `hold` has passed since `since`.
async fn hold_within_limits(sim: &Simulator, since: Instant, hold: Duration, when: &str) {
    while since.elapsed() < hold {
        assert_within_limits(&sim.stats(), when);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Makes the Gateway quick again and waits until every chain has had its turn after the fence
/// of length `fence` that began at `since`.
pub(crate) async fn polled_again_after_the_fence(sim: &Simulator, fence: Duration, since: Instant) {
    sim.set_latency(200, 0);
    every_card_polled_again(
        sim,
        fence.saturating_sub(since.elapsed()),
        fence + Duration::from_secs(60),
    )
    .await;
}

/// Waits up to 10 s until the Redis at `redis_url` holds the deployment's epoch marker (a
/// worker's Redis probe wrote it, or wrote it again after a loss).
pub(crate) async fn epoch_marker_written(redis_url: &str, what: &str) {
    let admin = context::connect_redis(redis_url).await.expect("redis");
    let epoch = [cardworker::keys::epoch_key("cw")];
    keys_exist(&admin, &epoch, Duration::from_secs(10), what).await;
}

/// Waits up to `limit` until every one of `keys` exists on the Redis behind `admin`; `what`
/// describes the wait.
pub(crate) async fn keys_exist(
    admin: &redis::aio::ConnectionManager,
    keys: &[String],
    limit: Duration,
    what: &str,
) {
    wait_until(limit, what, || {
        let mut admin = admin.clone();
        async move {
            redis::cmd("EXISTS")
                .arg(keys)
                .query_async::<usize>(&mut admin)
                .await
                .unwrap_or(0)
                == keys.len()
        }
    })
    .await;
}

/// A pod of the test's own: admits polls of `cards` through the budget as a worker does and sends
/// each admitted one to the simulator, holding its tokens until the answer. Runs until `stop`.
fn pod(
    budget: Budget,
    gateway: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        let mut admitted = 0;
        let mut i = 0;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            i += 1;
            let (got, slot) = match budget.admit(Task::Carddata, &budget.new_lease_id()).await {
                Ok(answer) => answer,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !matches!(got, Acquired::Acquired | Acquired::Probe { .. }) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            admitted += 1;
            let url = format!("{gateway}/v1/cards/{}/data", card(i % CARDS));
            let budget = budget.clone();
            let http = http.clone();
            tokio::spawn(async move {
                let _ = http
                    .get(url)
                    .send()
                    .await
                    .and_then(|r| r.error_for_status());
                budget.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, "");
            });
        }
        admitted
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_flushall_no_pod_admits_a_poll_beside_those_at_the_gateway_until_they_are_over() {
    // Redis loses everything while both polls are at the Gateway. Another pod of the deployment
    // asks for tokens at once, and the worker's chains are restored as a reconcile would.
    let (_db, redis, sim, sim_handle, config, worker, flushed) = flushed_at_the_gateway().await;
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let other = Budget::new(conn, &config)
        .with_process_id("other-pod")
        .ran_before();
    let fence = other.fence_length();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let other_pod = pod(other, sim_handle.base_url(), stop.clone());
    start_chains(&worker.ctx).await;

    // Nothing is admitted beside the two calls, by either pod, until they are over; then every
    // card is polled again.
    let hold = Duration::from_millis(ANSWER_AFTER_MS + 2_000);
    hold_within_limits(&sim, flushed, hold, "after the FLUSHALL").await;
    stop.store(true, std::sync::atomic::Ordering::Release);
    let admitted = other_pod.await.expect("the other pod");
    // The Gateway is quick again: every chain gets its turn soon after the fence.
    polled_again_after_the_fence(&sim, fence, flushed).await;
    assert!(!worker.exited(), "the worker rides out the loss");
    eprintln!("the other pod was admitted {admitted} times");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_started_during_the_fence_admits_nothing_until_it_ends() {
    let (_db, _redis, sim, _sim_handle, config, worker, flushed) = flushed_at_the_gateway().await;

    // A second worker process starts while the calls are still at the Gateway, and the chains
    // are restored at once (its own reconcile, or any other).
    let second = InProcess::start(config).await;
    start_chains(&second.ctx).await;
    let fence = second.ctx.budget.fence_length();
    let hold = Duration::from_millis(ANSWER_AFTER_MS + 2_000);
    hold_within_limits(&sim, flushed, hold, "with a pod started after the FLUSHALL").await;
    // The Gateway is quick again: every chain gets its turn soon after the fence.
    polled_again_after_the_fence(&sim, fence, flushed).await;
    drop(second);
    drop(worker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_an_append_only_file_that_missed_its_last_writes_admits_no_poll_beside_those_at_the_gateway(
) {
    let db = TestDb::new().await;
    let mut redis = PrivateRedis::start_synced_each_second();
    let (sim, sim_handle) = slow_simulator().await;
    let config = config(&db, &redis.url(), &sim_handle.base_url());
    insert_cards(&db.pool, CARDS).await;
    ran_before(&db, &redis.url()).await;
    let worker = InProcess::start(config.clone()).await;
    let fence = worker.ctx.budget.fence_length();
    epoch_marker_written(&redis.url(), "the epoch marker").await;
    // The file as it stands before any poll is admitted: what survives the crash below.
    let aof = redis.aof();
    let kept = std::fs::metadata(&aof).expect("the append-only file").len();
    start_chains(&worker.ctx).await;
    two_polls_at_the_gateway(&sim).await;

    // The host goes down with the writes since then unsynced: the server is killed and its file
    // loses its tail (the leases of the two polls and the chains' progress), then it starts again
    // from that file. The reconcile comes round and the chains are live again.
    tokio::task::block_in_place(|| {
        redis.kill();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&aof)
            .expect("open the append-only file");
        file.set_len(kept).expect("truncate the append-only file");
        drop(file);
        redis.start();
    });
    let restarted = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the chains restored after the restart",
        || async {
            let mut ok = true;
            for task in Task::ALL {
                ok &= reconcile::sweep(&worker.ctx, task).await.is_ok();
            }
            ok
        },
    )
    .await;
    let hold = Duration::from_millis(ANSWER_AFTER_MS + 1_000);
    let when = "after the restart from the append-only file";
    hold_within_limits(&sim, restarted, hold, when).await;
    // The Gateway is quick again: every chain gets its turn soon after the fence.
    polled_again_after_the_fence(&sim, fence, restarted).await;
    assert!(!worker.exited(), "the worker rides out the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_deployment_that_starts_before_redis_answers_is_not_fenced() {
    // A pod of a new deployment that starts while Redis does not answer (not up yet), and whose
    // first acquires fail too, must still carry the deployment's first start when one gets
    // through: Redis holds no fence hash then because it never held the deployment's data, not
    // because it lost it.
    let db = TestDb::new().await;
    let mut redis = PrivateRedis::start_new(false);
    let config = config(&db, &redis.url(), "http://127.0.0.1:9");
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let budget = Budget::new(conn, &config);
    redis.stop();
    budget
        .record_start(&db.pool)
        .await
        .expect("the first start is recorded in PostgreSQL, Redis or not");
    let lease = budget.new_lease_id();
    assert!(
        budget.acquire(Task::Carddata, &lease).await.is_err(),
        "Redis is down"
    );
    redis.start();
    let fence = budget.fence_length();
    wait_until(
        Duration::from_secs(10),
        "a poll admitted once Redis is up, with no fence",
        || async {
            let lease = budget.new_lease_id();
            matches!(
                budget.acquire(Task::Carddata, &lease).await,
                Ok(Acquired::Acquired)
            )
        },
    )
    .await;
    assert!(
        fence > Duration::from_secs(10),
        "the wait is shorter than a fence"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_deployment_whose_first_poll_comes_long_after_its_start_is_not_fenced() {
    // The fence hash is written as the worker starts: a first acquire that comes later than half
    // a fence (no card due before then, say) finds it and is not taken for a data loss. A short
    // fence keeps the wait short: the passing of that time is what the test is about.
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let mut config = config(&db, &redis.url(), "http://127.0.0.1:9");
    config.gateway.timeout_ms = 1_000;
    config.polling.handler_timeout_secs = 2;
    config.polling.lease_ttl_secs = 7;
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let budget = Budget::new(conn, &config);
    budget
        .record_start(&db.pool)
        .await
        .expect("record the first start");
    tokio::time::sleep(budget.fence_length() / 2 + Duration::from_millis(500)).await;
    let lease = budget.new_lease_id();
    assert_eq!(
        budget
            .acquire(Task::Carddata, &lease)
            .await
            .expect("acquire"),
        Acquired::Acquired,
        "no fence: the deployment's Redis never lost anything"
    );
}

/// Every card of both tasks in the due queue: (`task:card`, whether a poll holds it, its due
/// time or its lease's deadline).
async fn due_entries(conn: &mut redis::aio::ConnectionManager) -> Vec<(String, bool, u64)> {
    use cardworker::polling::due_queue::LEASED;
    let mut out = Vec::new();
    for task in Task::ALL {
        let due: Vec<(String, u64)> = redis::cmd("ZRANGE")
            .arg(cardworker::keys::poll_due_key("cw", task, 0))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await
            .expect("the due set");
        out.extend(
            due.into_iter()
                .map(|(card, s)| (format!("{}:{card}", task.label()), s >= LEASED, s % LEASED)),
        );
    }
    out
}

/// The polls of each task `worker` deferred because the budget was unavailable (a fence counts
/// so).
async fn fenced_deferrals(worker: &InProcess) -> Vec<f64> {
    let mut n = Vec::new();
    for task in Task::ALL {
        n.push(
            worker
                .metric(
                    "cardworker_poll_deferred_total",
                    &[("task", task.label()), ("reason", "budget_unavailable")],
                )
                .await,
        );
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_fenced_after_a_flushall_gives_its_card_back_at_its_due_time_and_its_worker_fetches_nothing_more_within_the_fence(
) {
    let (db, redis, sim, sim_handle) = services(50).await;
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    let config = config(&db, &redis.url(), &sim_handle.base_url());
    insert_cards(&db.pool, CARDS).await;
    ran_before(&db, &redis.url()).await;
    let worker = InProcess::start(config.clone()).await;
    start_chains(&worker.ctx).await;
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .expect("flushall");
    start_chains(&worker.ctx).await;
    let due_before: std::collections::BTreeMap<String, u64> = due_entries(&mut admin)
        .await
        .into_iter()
        .map(|(card, _, at)| (card, at))
        .collect();

    // Every card comes due at once; each poll fetched finds the fence on, and its card goes back
    // at its own due time (it keeps its place), while its worker fetches nothing more until the
    // fence is over: not a fetch and a refusal every back-off, each a script call for nothing.
    let fenced_until = || {
        let mut admin = admin.clone();
        async move {
            let until: Option<u64> = redis::cmd("HGET")
                .arg(cardworker::budget::fence_key("cw"))
                .arg("until")
                .query_async(&mut admin)
                .await
                .expect("the fence hash");
            until.unwrap_or(0)
        }
    };
    wait_until(Duration::from_secs(10), "the fence on", || async {
        fenced_until().await > 0
    })
    .await;
    wait_until(
        Duration::from_secs(10),
        "a first wave of fenced polls deferred, in each task",
        || async { fenced_deferrals(&worker).await.iter().all(|n| *n >= 1.0) },
    )
    .await;
    wait_until(
        Duration::from_secs(10),
        "every card given back, at its own due time",
        || {
            let mut admin = admin.clone();
            let due_before = due_before.clone();
            async move {
                let entries = due_entries(&mut admin).await;
                entries.len() == 2 * CARDS
                    && entries
                        .iter()
                        .all(|(card, held, at)| !held && due_before.get(card) == Some(at))
            }
        },
    )
    .await;
    let first_wave = fenced_deferrals(&worker).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        fenced_until().await > u64::try_from(chrono::Utc::now().timestamp_millis()).unwrap_or(0),
        "the fence lasts the test's window"
    );
    assert_eq!(
        fenced_deferrals(&worker).await,
        first_wave,
        "no card fetched again within the fence"
    );
    assert_eq!(
        sim.stats().in_flight_polls,
        0,
        "no poll is admitted within the fence"
    );
    drop(worker);
}
