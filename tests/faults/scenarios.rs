//! One test per fault.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cardworker::config::{Config, Task};

use cardworker::context::{self, AppContext};
use cardworker::gateway::CardStatus;
use cardworker::limit::Limit;
use cardworker::polling::due_queue::{PollState, Standing, Step, Successor};
use cardworker::polling::lease;
use cardworker::sim::PaymentBehaviour;
use redis::aio::ConnectionManager;
use redis::AsyncCommands as _;
use sqlx::PgPool;

use crate::faults::{self, services, Child, InProcess};
use crate::harness::{wait_for_count, wait_until, TestDb};
use crate::private::{PrivatePg, PrivateRedis};

pub(crate) use crate::faults::{count, insert_cards, insert_payment, payment_status, simulator};

/// The test config on `db`, the private Redis `redis` (prefix "cw") and the Gateway `gateway`.
fn config_on(db_url: &str, redis: &PrivateRedis, gateway: &str, grace: u64) -> Config {
    let mut config = faults::config_on(db_url, &redis.url(), gateway);
    config.gateway.timeout_ms = 2_000;
    config.polling.handler_timeout_secs = 4;
    config.polling.lease_ttl_secs = 10;
    config.polling.total_limit = Limit::new(16).expect("a limit");
    config.polling.carddata.limit = Limit::new(8).expect("a limit");
    config.polling.card_status.limit = Limit::new(8).expect("a limit");
    config.polling.carddata.interval_secs = 2;
    config.polling.card_status.interval_secs = 2;
    config.worker.shutdown_grace_secs = 10;
    config.worker.redis_outage_grace_secs = grace;
    config
}

/// The unchanged polls per card (those with at least one), as the tally in each card's poll
/// state counts them.
pub(crate) async fn polls_per_card(
    conn: &mut ConnectionManager,
    task: Task,
) -> BTreeMap<String, i64> {
    let states: BTreeMap<String, String> = conn
        .hgetall(lease::due_queue("cw", task).keys().state.clone())
        .await
        .unwrap_or_default();
    states
        .into_iter()
        .filter_map(|(card, raw)| {
            let n = PollState::parse(&raw).tally?.count;
            (n > 0).then_some((card, n as i64))
        })
        .collect()
}

/// Every card has exactly one entry per task in the due queue (waiting, or leased by its running
/// poll), with its state beside it.
pub(crate) async fn assert_one_chain_each(conn: &mut ConnectionManager, cards: &[String]) {
    for task in Task::ALL {
        let queue = lease::due_queue("cw", task);
        let scores: Vec<Option<f64>> = redis::cmd("ZMSCORE")
            .arg(&queue.keys().due)
            .arg(cards)
            .query_async(conn)
            .await
            .expect("zmscore");
        let missing: Vec<&String> = cards
            .iter()
            .zip(&scores)
            .filter(|(_, s)| s.is_none())
            .map(|(card, _)| card)
            .collect();
        assert!(
            missing.is_empty(),
            "{task}: cards not in the due queue: {missing:?}"
        );
        let indexed: usize = conn.zcard(&queue.keys().due).await.expect("zcard");
        assert_eq!(indexed, cards.len(), "{task}: one entry per card");
        let states: usize = conn.hlen(&queue.keys().state).await.expect("hlen");
        assert_eq!(states, cards.len(), "{task}: one state per card");
    }
}

/// Shared by both Redis faults: 100 cards polling, Redis stopped for `outage`, back empty or
/// with its data; the worker must ride it out and every card must be polled again.
async fn redis_outage(persistent: bool, outage: Duration) {
    let db = TestDb::new().await;
    let mut redis = PrivateRedis::start_new(persistent);
    let (sim, sim_handle) = simulator().await;
    let config = config_on(&db.url, &redis, &sim_handle.base_url(), 60);
    let cards = insert_cards(&db.pool, 100).await;
    let worker = InProcess::start(config).await;
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    faults::start_chains(&worker.ctx).await;
    wait_until(Duration::from_secs(60), "every card polled", || {
        let mut conn = conn.clone();
        async move { polls_per_card(&mut conn, Task::CardStatus).await.len() == 100 }
    })
    .await;
    let before = polls_per_card(&mut conn, Task::CardStatus).await;

    redis.stop();
    let down_at = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the probe reports Redis down",
        || async { worker.metric("cardworker_redis_up", &[]).await == 0.0 },
    )
    .await;
    // At least once, however long the probe took to notice: Redis stays stopped until after the
    // checks.
    loop {
        assert!(!worker.exited(), "the worker rides out the outage");
        assert_eq!(worker.get("/healthz").await.0, 200, "/healthz stays 200");
        assert_eq!(worker.get("/readyz").await.0, 503, "/readyz fails");
        if down_at.elapsed() >= outage {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    redis.start();
    let back_at = Instant::now();
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");

    // Every card polled again within 45 s of Redis returning, plus the budget's fence when Redis
    // came back empty (a data loss: nothing is admitted until every poll admitted before it has
    // left the Gateway).
    let fence = if persistent {
        Duration::ZERO
    } else {
        worker.ctx.budget.fence_length()
    };
    wait_until(
        Duration::from_secs(45) + fence,
        "every card polled again",
        || {
            let mut conn = conn.clone();
            let before = before.clone();
            async move {
                let now = polls_per_card(&mut conn, Task::CardStatus).await;
                if persistent {
                    before
                        .iter()
                        .all(|(card, n)| now.get(card).copied().unwrap_or(0) > *n)
                } else {
                    now.len() == 100
                }
            }
        },
    )
    .await;
    let healed = back_at.elapsed();
    assert!(!worker.exited(), "no process exit");
    wait_until(Duration::from_secs(10), "redis_up back to 1", || async {
        worker.metric("cardworker_redis_up", &[]).await == 1.0
    })
    .await;
    wait_until(
        Duration::from_secs(30),
        "every worker runs again",
        || async {
            worker
                .metric("cardworker_worker_up", &[("worker", "carddata")])
                .await
                == 1.0
                && worker
                    .metric("cardworker_worker_up", &[("worker", "card_status")])
                    .await
                    == 1.0
                && worker
                    .metric("cardworker_worker_up", &[("worker", "payment")])
                    .await
                    == 1.0
        },
    )
    .await;
    assert_one_chain_each(&mut conn, &cards).await;
    // Nothing changed at the Gateway and nothing failed: no record at all.
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM integration_logs").await,
        0
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM outbox_events").await,
        0
    );
    eprintln!("redis outage {outage:?} (persistent: {persistent}): every card polled again {healed:?} after Redis returned");
    worker.stop().await.expect("a clean stop after the outage");
    drop(sim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_for_ten_seconds_and_back_empty_is_ridden_out_and_every_card_polled_again() {
    redis_outage(false, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_with_its_data_is_ridden_out_and_the_same_chains_go_on() {
    redis_outage(true, Duration::from_secs(3)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_longer_than_the_grace_still_stops_the_process_non_zero() {
    let (db, mut redis, _sim, sim_handle) = services(0).await;
    let mut worker = InProcess::start(config_on(&db.url, &redis, &sim_handle.base_url(), 2)).await;
    redis.stop();
    let ended = worker
        .exited_within(Duration::from_secs(30))
        .await
        .expect("the process stops once the grace is over");
    let err = ended.expect_err("non-zero");
    assert!(
        format!("{err:#}").contains("redis_outage_grace_secs"),
        "the error names the grace: {err:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_twenty_seconds_while_cards_change_records_every_change_once() {
    let mut pg = PrivatePg::start_new();
    let admin = PgPool::connect(&pg.url("postgres")).await.expect("admin");
    sqlx::query("CREATE DATABASE cw")
        .execute(&admin)
        .await
        .expect("create db");
    admin.close().await;
    let pool = PgPool::connect(&pg.url("cw")).await.expect("pool");
    cardworker::storage::migrate(&pool).await.expect("migrate");
    let redis = PrivateRedis::start_new(false);
    let (sim, sim_handle) = simulator().await;
    let mut config = config_on(&pg.url("cw"), &redis, &sim_handle.base_url(), 60);
    config.polling.carddata.interval_secs = 1;
    config.polling.card_status.interval_secs = 1;
    let cards = insert_cards(&pool, 20).await;
    for card in &cards {
        sim.set_card_ready(card, "tok_x", "4242", 12, 2030);
    }
    let worker = InProcess::start(config).await;
    faults::start_chains(&worker.ctx).await;
    let sql = "SELECT count(*) FROM cards WHERE data_state = 'ready'";
    let limit = Duration::from_secs(60);
    wait_for_count(&pool, sql, 20, limit, "card data recorded").await;
    pool.close().await;

    pg.stop();
    for card in &cards {
        sim.set_card_status(card, CardStatus::Active);
    }
    let down_at = Instant::now();
    while down_at.elapsed() < Duration::from_secs(20) {
        assert!(!worker.exited(), "no exit while PostgreSQL is down");
        assert_eq!(worker.get("/healthz").await.0, 200);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    pg.start();
    let pool = PgPool::connect(&pg.url("cw")).await.expect("pool");
    wait_until(Duration::from_secs(60), "every change recorded", || async {
        count(&pool, "SELECT count(*) FROM cards WHERE status = 'active'").await == 20
    })
    .await;
    // A duplicate would come from a status poll still in flight: wait until every card's status
    // has been polled again (a chain runs one poll at a time, so each poll in flight now has
    // ended). Card data is ready, so its chains have ended.
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let then = polls_per_card(&mut conn, Task::CardStatus).await;
    wait_until(
        Duration::from_secs(60),
        "every card's status polled again",
        || {
            let mut conn = conn.clone();
            let (then, cards) = (then.clone(), cards.clone());
            async move {
                let now = polls_per_card(&mut conn, Task::CardStatus).await;
                cards
                    .iter()
                    .all(|c| now.get(c).copied().unwrap_or(0) > then.get(c).copied().unwrap_or(0))
            }
        },
    )
    .await;
    assert!(!worker.exited());
    for (what, sql) in [
        (
            "status change logs",
            "SELECT count(*) FROM integration_logs WHERE scenario = 'card_status_poll' AND state = 'succeeded'",
        ),
        (
            "status outbox events",
            "SELECT count(*) FROM outbox_events WHERE event_type = 'card.status_changed'",
        ),
        (
            "data outbox events",
            "SELECT count(*) FROM outbox_events WHERE event_type = 'card.data_ready'",
        ),
        (
            "card versions (data + status)",
            "SELECT sum(version)::bigint / 2 FROM cards",
        ),
    ] {
        assert_eq!(count(&pool, sql).await, 20, "{what}: each change recorded once");
    }
    let scores: Vec<Option<f64>> = redis::cmd("ZMSCORE")
        .arg(&lease::due_queue("cw", Task::CardStatus).keys().due)
        .arg(&cards)
        .query_async(&mut conn)
        .await
        .expect("zmscore");
    assert!(scores.iter().all(Option::is_some), "no status card lost");
    worker.stop().await.expect("clean stop");
    pool.close().await;
}

/// A Gateway that accepts connections and never answers; counts the requests it read.
async fn blackhole() -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut socket, _)) = listener.accept().await {
            let log = log.clone();
            held.push(tokio::spawn(async move {
                use tokio::io::AsyncReadExt as _;
                let mut buf = vec![0u8; 4096];
                if let Ok(n) = socket.read(&mut buf).await {
                    let line = String::from_utf8_lossy(&buf[..n])
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .to_owned();
                    log.lock().expect("log").push(line);
                }
                // Never answer; hold the connection until the client gives up.
                let _ = socket.read(&mut buf).await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }));
        }
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_blackhole_gives_failed_polls_an_unknown_payment_and_returns_every_token() {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let (gateway, seen) = blackhole().await;
    let mut config = config_on(&db.url, &redis, &gateway, 60);
    // A leaked token would stay for the whole test.
    config.polling.lease_ttl_secs = 300;
    let cards = insert_cards(&db.pool, 4).await;
    let worker = InProcess::start(config).await;
    faults::start_chains(&worker.ctx).await;
    let payment = insert_payment(&db.pool).await;
    cardworker::commands::payments::enqueue_payment(&worker.ctx, payment)
        .await
        .expect("enqueue payment");

    let chains_failed_twice = "SELECT count(*) FROM (SELECT 1 FROM integration_logs
          WHERE resource_type = 'card' AND state = 'failed'
          GROUP BY resource_id, scenario HAVING count(*) >= 2) t";
    let limit = Duration::from_secs(60);
    let what = "two failed polls per chain";
    wait_for_count(&db.pool, chains_failed_twice, 8, limit, what).await;
    wait_until(
        Duration::from_secs(30),
        "the payment is unknown",
        || async { payment_status(&db.pool, payment).await == "unknown" },
    )
    .await;
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM integration_logs WHERE resource_type = 'payment' AND state = 'unknown'",
        )
        .await,
        1
    );
    // Between attempts (back-off) no token is held: each timed-out call returned its tokens.
    wait_until(Duration::from_secs(30), "every token returned", || async {
        let in_use = worker.ctx.budget.in_use().await.expect("in use");
        in_use.values().all(|n| *n == 0)
    })
    .await;
    let posts = seen
        .lock()
        .expect("log")
        .iter()
        .filter(|l| l.starts_with("POST /v1/payments"))
        .count();
    assert_eq!(posts, 1, "one submission, never repeated by the worker");
    assert!(!worker.exited());
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    assert_one_chain_each(&mut conn, &cards).await;
    worker.stop().await.expect("clean stop");
}

/// Pod `pod-a` on the config file `file` ([`run_child`]), and a context of the same deployment
/// for the test to act as the CLI.
async fn pod_a(file: &std::path::Path) -> (Child, Arc<AppContext>) {
    (run_child(file, "pod-a"), faults::context_of(file).await)
}

/// [`pod_a`] with one call of its under way at the Gateway: `enqueue` puts the job on the queue
/// through the context, then the test waits up to 30 s until `at_gateway` (described by `what`)
/// sees the call arrive.
async fn pod_a_mid_call<E, EFut, G, GFut>(
    file: &std::path::Path,
    enqueue: E,
    what: &str,
    at_gateway: G,
) -> (Child, Arc<AppContext>)
where
    E: FnOnce(Arc<AppContext>) -> EFut,
    EFut: std::future::Future<Output = Result<(), cardworker::commands::CommandError>>,
    G: FnMut() -> GFut,
    GFut: std::future::Future<Output = bool>,
{
    let (pod, ctx) = pod_a(file).await;
    enqueue(Arc::clone(&ctx)).await.expect("enqueue");
    wait_until(Duration::from_secs(30), what, at_gateway).await;
    (pod, ctx)
}

/// Pod `pod-b` on the config file `file`, the survivor of a killed pod: started, and waited for
/// up to 60 s until its recovery did what `done` checks.
async fn survivor<F, Fut>(file: &std::path::Path, what: &str, done: F) -> Child
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let pod = run_child(file, "pod-b");
    wait_until(Duration::from_secs(60), what, done).await;
    pod
}

/// Asserts that no integration log is pending: the attempt of the killed pod has been closed.
async fn assert_killed_attempts_log_closed(pool: &PgPool) {
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM integration_logs WHERE state = 'pending'"
        )
        .await,
        0,
        "the killed attempt's log is closed"
    );
}

/// `cardworker run --config CONFIG_FILE` as pod `pod`, killed when dropped.
fn run_child(config_file: &std::path::Path, pod: &str) -> Child {
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(["run", "--config"])
        .arg(config_file)
        .env("CARDWORKER_POD_NAME", pod)
        .env_remove("CARDWORKER_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start cardworker run");
    Child(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_with_sigkill_mid_payment_leaves_one_submission_settled_by_recovery() {
    let (db, redis, sim, sim_handle) = services(0).await;
    let payment = insert_payment(&db.pool).await;
    sim.set_payment_behaviour(payment, PaymentBehaviour::Hang);
    let (_dir, file) = kill_config(&db, &redis, &sim_handle.base_url(), "payments");
    let (mut first, ctx) = pod_a_mid_call(
        &file,
        |ctx| async move { cardworker::commands::payments::enqueue_payment(&ctx, payment).await },
        "the Gateway has the submission",
        || async { sim.submissions(payment) == 1 },
    )
    .await;
    // The submission is the payment queue's one job, in the first pod's inflight set.
    let queue =
        apalis_redis::Config::default().queue(cardworker_jobs::keys::queue("cw", "payment"));
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let jobs: Vec<String> = conn.hkeys(queue.job_data_hash()).await.expect("hkeys");
    assert_eq!(jobs.len(), 1, "one payment job: {jobs:?}");
    let job = jobs[0].clone();
    first.kill_9();

    let settled = || async { payment_status(&db.pool, payment).await == "accepted" };
    let mut second = survivor(&file, "recovery settled the payment", settled).await;
    // The killed pod's job comes back to the survivor once the payment queue's orphan window has
    // passed, and runs there: its acknowledgement deletes its data, which only a run does.
    let window =
        cardworker::runner::spawn::orphan_window_of::<cardworker_jobs::SubmitPayment>(&ctx.config);
    wait_until(
        window + Duration::from_secs(60),
        "the killed pod's job re-queued and run again by the survivor",
        || {
            let mut conn = conn.clone();
            let (data, job) = (queue.job_data_hash(), job.clone());
            async move {
                !conn
                    .hexists::<_, _, bool>(data, job)
                    .await
                    .expect("hexists")
            }
        },
    )
    .await;
    assert!(second.running(), "the survivor runs on");
    assert_eq!(sim.submissions(payment), 1, "no double submission");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_events WHERE event_type = 'payment.accepted'"
        )
        .await,
        1,
        "one settlement"
    );
    assert_killed_attempts_log_closed(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_intake_entries_go_to_the_dead_set_with_a_reason_and_no_worker_stops() {
    let (db, redis, _sim, sim_handle) = services(0).await;
    let worker = InProcess::start(config_on(&db.url, &redis, &sim_handle.base_url(), 60)).await;
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let poison: [(&str, &[u8]); 5] = [
        ("payment", b"not json at all"),
        ("approval", b"{\"unknown\":\"shape\"}"),
        ("callback", b"\xc3\x28 broken"),
        ("archive", b"[1,2,3]"),
        ("reconcile", b"\xed\xa0\x80"),
    ];
    for (queue, payload) in poison {
        let _: () = redis::pipe()
            .hset(
                cardworker_jobs::keys::intake_payload("cw", queue),
                "poison",
                payload,
            )
            .ignore()
            .zadd(cardworker_jobs::keys::intake("cw", queue), "poison", 0)
            .ignore()
            .query_async(&mut conn)
            .await
            .expect("write poison");
    }
    // A good job behind them.
    worker
        .ctx
        .producer
        .enqueue(&cardworker_jobs::RunArchive::default())
        .await
        .expect("good job");
    for (queue, _) in poison {
        let dead_key = format!("{}:dead", cardworker_jobs::keys::queue("cw", queue));
        wait_until(Duration::from_secs(30), queue, || {
            let mut conn = conn.clone();
            let dead_key = dead_key.clone();
            async move { conn.scard::<_, usize>(&dead_key).await.unwrap_or(0) == 1 }
        })
        .await;
        let ids: BTreeSet<String> = conn.smembers(&dead_key).await.expect("dead");
        let id = ids.into_iter().next().expect("one dead job");
        let meta = format!("{}:meta:{id}", cardworker_jobs::keys::queue("cw", queue));
        let result: Option<String> = conn.hget(&meta, "result").await.expect("meta");
        let result = result.unwrap_or_default();
        assert!(
            result.contains("UTF-8") || result.contains("decode"),
            "{queue}: the reason is kept: {result}"
        );
    }
    wait_until(Duration::from_secs(30), "the good job ran", || async {
        worker
            .metric(
                "cardworker_jobs_finished_total",
                &[("queue", "archive"), ("result", "succeeded")],
            )
            .await
            >= 1.0
    })
    .await;
    assert!(!worker.exited());
    assert_eq!(worker.get("/healthz").await.0, 200);
    for kind in [
        "carddata",
        "card_status",
        "payment",
        "callback",
        "archive",
        "reconcile",
    ] {
        assert_eq!(
            worker
                .metric("cardworker_worker_up", &[("worker", kind)])
                .await,
            1.0,
            "{kind} runs"
        );
    }
    worker.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_redis_refuses_after_the_commit_is_written_once_redis_is_back() {
    let mut redis = PrivateRedis::start_new(true);
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let shutdown = cardworker::shutdown::Shutdown::new();
    let queue = lease::due_queue("cw", Task::CardStatus);
    lease::start(&mut conn, "cw", Task::CardStatus, "c-1", Duration::ZERO)
        .await
        .expect("start");
    let leased = queue
        .fetch(&mut conn, 1, Duration::from_secs(60))
        .await
        .expect("fetch");
    let calls = cardworker::queue::batch::poll_acks(&conn);
    redis.stop();
    let successor = Successor {
        card_ref: "c-1",
        lease: leased[0].lease,
        next_in: Duration::from_secs(5),
        next: leased[0].state.after(Step::Reset, 3, chrono::Utc::now()),
    };
    let handed = lease::ack_or_retry(
        &calls,
        &shutdown,
        &queue,
        successor,
        Instant::now() + Duration::from_secs(50),
    )
    .await;
    assert!(handed, "refused now, handed to the background");
    redis.start();
    // The successor's state is written beside the card's due entry.
    wait_until(Duration::from_secs(30), "the successor is written", || {
        let (mut conn, queue) = (conn.clone(), queue.clone());
        async move {
            queue
                .entry(&mut conn, "c-1")
                .await
                .ok()
                .flatten()
                .is_some_and(|(standing, state)| {
                    matches!(standing, Standing::Waiting { .. }) && state.failures == 3
                })
        }
    })
    .await;
    shutdown.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_enqueued_before_redis_is_flushed_is_submitted_exactly_once_by_recovery() {
    let (db, redis, sim, sim_handle) = services(0).await;
    let mut config = config_on(&db.url, &redis, &sim_handle.base_url(), 60);
    config.approvals.recovery_after_secs = 10;
    config.approvals.recovery_cron = "* * * * * *".to_owned();
    sqlx::query("INSERT INTO cards (card_ref) VALUES ('c-1')")
        .execute(&db.pool)
        .await
        .expect("card");
    let id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO approvals (approval_id, card_ref, kind, amount_minor)
         VALUES ($1, 'c-1', 'limit_change', 250000)",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .expect("approval");

    // Enqueued while no worker runs: the job exists only in Redis, and Redis loses everything.
    let ctx = AppContext::connect(config.clone()).await.expect("connect");
    cardworker::commands::approvals::enqueue_approval(&ctx, id, None)
        .await
        .expect("enqueue approval");
    let mut conn = context::connect_redis(&redis.url()).await.expect("redis");
    let queued: i64 = conn.zcard("cw:intake:approval").await.expect("zcard");
    assert_eq!(queued, 1, "the job is queued");
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut conn)
        .await
        .expect("flush the private redis");
    drop(ctx);

    let worker = InProcess::start(config).await;
    wait_until(
        Duration::from_secs(60),
        "recovery submitted the approval and the sim approved it",
        || async {
            sqlx::query_scalar::<_, String>("SELECT status FROM approvals WHERE approval_id = $1")
                .bind(id)
                .fetch_one(&db.pool)
                .await
                .expect("status")
                == "approved"
        },
    )
    .await;
    let record = sim.approval_record(id).expect("the sim saw it");
    assert_eq!(
        record.idempotency_keys,
        [id.to_string()],
        "submitted exactly once, with its key"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_events WHERE event_type = 'approval.decided'"
        )
        .await,
        1
    );
    worker.stop().await.expect("clean stop");
}

/// The worker's config for the SIGKILL scenarios, in a new temporary directory: the recovery of
/// the `[recovering]` section (`payments` or `approvals`) runs every second and takes up a row
/// 10 s after it was last touched.
fn kill_config(
    db: &TestDb,
    redis: &PrivateRedis,
    gateway: &str,
    recovering: &str,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = faults::config_file(
        dir.path(),
        &db.url,
        &redis.url(),
        gateway,
        &format!(
            r#"timeout_ms = 20000
[worker]
shutdown_grace_secs = 5
[polling]
handler_timeout_secs = 25
lease_ttl_secs = 30
reconcile_cron = "0 0 0 1 1 *"
[{recovering}]
recovery_after_secs = 10
recovery_cron = "* * * * * *"
[telemetry]
listen = "127.0.0.1:0"
"#
        ),
    );
    (dir, file)
}

async fn insert_approval(pool: &PgPool) -> uuid::Uuid {
    sqlx::query("INSERT INTO cards (card_ref) VALUES ('c-1') ON CONFLICT DO NOTHING")
        .execute(pool)
        .await
        .expect("card");
    let id = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO approvals (approval_id, card_ref, kind) VALUES ($1, 'c-1', 'issue')")
        .bind(id)
        .execute(pool)
        .await
        .expect("approval");
    id
}

async fn approval_status(pool: &PgPool, id: uuid::Uuid) -> String {
    sqlx::query_scalar("SELECT status FROM approvals WHERE approval_id = $1")
        .bind(id)
        .fetch_one(pool)
        .await
        .expect("status")
}

/// kill -9 of a `cardworker run` while its POST is at the Gateway: `acted` says whether the
/// Gateway took the request before the kill.
async fn approval_killed_mid_post(acted: bool) {
    use crate::scripted_gateway::{Script, ScriptedGateway};
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let gw = ScriptedGateway::start().await;
    let id = insert_approval(&db.pool).await;
    gw.script(
        id,
        if acted {
            Script::ActThenHang("declined")
        } else {
            Script::LoseThenHang
        },
    );
    let (_dir, file) = kill_config(&db, &redis, &gw.url, "approvals");
    let (mut first, _ctx) = pod_a_mid_call(
        &file,
        |ctx| async move { cardworker::commands::approvals::enqueue_approval(&ctx, id, None).await },
        "the POST is at the Gateway",
        || async { gw.posts(id) == 1 },
    )
    .await;
    first.kill_9();
    assert_eq!(
        approval_status(&db.pool, id).await,
        "pending",
        "evidence survives the kill"
    );

    // What the Gateway answers from now on: its record (or, never having seen it, a 404 and then
    // the resubmission is approved).
    gw.script(id, Script::Answer("approved"));
    let expected = if acted { "declined" } else { "approved" };
    let settled = || async { approval_status(&db.pool, id).await == expected };
    let mut second = survivor(&file, "recovery settled the approval", settled).await;
    assert!(second.running(), "the survivor runs on");
    let seen = gw.seen(id);
    assert_eq!(seen.acted, 1, "the Gateway acted once");
    assert_eq!(
        seen.keys.len(),
        if acted { 1 } else { 2 },
        "no second POST after the Gateway acted; one resubmission when it never saw it"
    );
    assert!(seen
        .keys
        .iter()
        .all(|k| k.as_deref() == Some(id.to_string().as_str())));
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM outbox_events WHERE event_type = 'approval.decided'"
        )
        .await,
        1
    );
    assert_killed_attempts_log_closed(&db.pool).await;
    gw.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_worker_is_killed_with_sigkill_after_the_gateway_acted_is_settled_by_recovery_without_a_second_post(
) {
    approval_killed_mid_post(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_worker_is_killed_with_sigkill_before_the_gateway_took_it_is_submitted_once_more_with_the_same_key(
) {
    approval_killed_mid_post(false).await;
}
