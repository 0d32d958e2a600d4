//! Polling: zero writes for unchanged polls, one record set per change or failure, parking,
//! reconcile, chains at scale, stale and unknown jobs, and the polling CLI.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cardworker::app;
use cardworker::commands::polling as cli;
use cardworker::config::{Config, Task};
use cardworker::context::AppContext;
use cardworker::gateway::CardStatus;
use cardworker::limit::Limit;
use cardworker::polling::due_queue::{PollState, Standing, LEASED};
use cardworker::polling::{lease, reconcile};
use cardworker_jobs::{keys, Job, PollCardStatus, PollTicket};
use futures::StreamExt as _;
use redis::AsyncCommands as _;
use sqlx::{Connection as _, PgConnection};
use tokio::sync::oneshot;

use crate::harness::{
    metric_value, spawn_app, spawn_app_with, wait_for_count, wait_until, TestApp,
};

const TABLES: &[&str] = &[
    "cards",
    "integration_logs",
    "audit_events",
    "audit_resources",
    "outbox_events",
    "payments",
    "inbound_callbacks",
    "integration_logs_archive",
    "audit_events_archive",
    "audit_resources_archive",
];

/// (state, error, recovery_summary, http_status) of one integration log.
type FailedLog = (String, Option<String>, Option<String>, Option<i32>);

/// Per table: (row count, n_tup_ins, n_tup_upd, n_tup_del).
type Counters = BTreeMap<String, (i64, i64, i64, i64)>;

async fn counters(conn: &mut PgConnection) -> Counters {
    // A fresh snapshot each time: within a transaction PostgreSQL would otherwise keep serving
    // the first one.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .expect("clear stats snapshot");
    let mut out = Counters::new();
    for table in TABLES {
        let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&mut *conn)
            .await
            .expect("count rows");
        let (ins, upd, del): (i64, i64, i64) = sqlx::query_as(
            "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(&mut *conn)
        .await
        .expect("table stats");
        out.insert((*table).to_owned(), (rows, ins, upd, del));
    }
    out
}

async fn other_backends(conn: &mut PgConnection, db: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(db)
    .fetch_one(&mut *conn)
    .await
    .expect("pg_stat_activity")
}

/// Reads the counters until `ready` holds (and, with `alone`, no other backend is connected to
/// the database): PostgreSQL publishes a backend's counters late, at the latest when it exits.
async fn counters_when(
    conn: &mut PgConnection,
    db: &str,
    alone: bool,
    ready: impl Fn(&Counters) -> bool,
) -> Counters {
    let start = std::time::Instant::now();
    loop {
        if alone && start.elapsed() > Duration::from_secs(5) {
            // A closed pool's idle session can linger on a loaded machine; ending it makes it
            // publish its counters now (a backend flushes its statistics when it exits).
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = $1 AND pid <> pg_backend_pid() AND state = 'idle'",
            )
            .bind(db)
            .execute(&mut *conn)
            .await
            .expect("terminate idle backends");
        }
        let gone = !alone || other_backends(conn, db).await == 0;
        let c = counters(conn).await;
        if gone && ready(&c) {
            return c;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let who: Vec<(Option<String>, Option<String>, Option<String>)> = sqlx::query_as(
                "SELECT application_name, state, query FROM pg_stat_activity
                  WHERE datname = $1 AND pid <> pg_backend_pid()",
            )
            .bind(db)
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_default();
            panic!("statistics never settled: {c:?}; other backends: {who:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn outcome(app: &TestApp, task: &str, outcome: &str) -> f64 {
    let (_, text) = app.get("/metrics").await;
    metric_value(
        &text,
        "cardworker_poll_outcomes_total",
        &[("task", task), ("outcome", outcome)],
    )
}

async fn finished_jobs(app: &TestApp, queue: &str) -> f64 {
    let (_, text) = app.get("/metrics").await;
    metric_value(
        &text,
        "cardworker_jobs_finished_total",
        &[("queue", queue), ("result", "succeeded")],
    )
}

/// The calls of kind `call` the simulator served.
pub(crate) fn calls(app: &TestApp, call: &str) -> u64 {
    app.sim.stats().calls_total.get(call).copied().unwrap_or(0)
}

/// Where `card_ref`'s `task` polling stands in the due queue of `ctx`'s deployment, and its
/// state; `None` when the due queue does not hold the card.
pub(crate) async fn chain_of(
    ctx: &AppContext,
    task: Task,
    card_ref: &str,
) -> Option<(Standing, PollState)> {
    lease::due_queue(ctx.prefix(), task)
        .entry(&mut ctx.redis.clone(), card_ref)
        .await
        .expect("read the due queue")
}

/// Takes a lease on `card_ref`'s `task` card for an hour (as a worker's fetch would, without
/// waiting for it to come due, so that the test's workers leave it alone), and answers the
/// ticket a fetched poll job carries. The card must be in the due queue.
pub(crate) async fn hold(ctx: &AppContext, task: Task, card_ref: &str) -> PollTicket {
    let queue = lease::due_queue(ctx.prefix(), task);
    let mut conn = ctx.redis.clone();
    let (_, state) = queue
        .entry(&mut conn, card_ref)
        .await
        .expect("read the due queue")
        .expect("the card is in the due queue");
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn)
        .await
        .expect("time");
    let now = secs * 1000 + micros / 1000;
    let lease = LEASED + now + 3_600_000;
    let _: () = redis::cmd("ZADD")
        .arg(&queue.keys().due)
        .arg("XX")
        .arg(lease)
        .arg(card_ref)
        .query_async(&mut conn)
        .await
        .expect("lease the card");
    PollTicket {
        lease,
        due_ms: now,
        state: state.to_raw(),
    }
}

fn fast(cfg: &mut Config) {
    cfg.polling.carddata.interval_secs = 1;
    cfg.polling.card_status.interval_secs = 1;
}

async fn scalar(app: &TestApp, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&app.db.pool)
        .await
        .expect(sql)
}

/// A card_status poll of `card_ref` under a lease it holds for an hour ([`hold`]), as a job.
pub(crate) async fn leased_status_poll(ctx: &AppContext, card_ref: &str) -> PollCardStatus {
    PollCardStatus {
        card_ref: card_ref.into(),
        ticket: hold(ctx, Task::CardStatus, card_ref).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unchanged_polls_write_nothing_and_one_change_writes_exactly_one_record_set() {
    let mut app = spawn_app_with(fast).await;
    let mut stats = PgConnection::connect(&app.db.url)
        .await
        .expect("stats connection");

    // Warm-up: create the cards on a connection of their own and close it, then wait until its
    // inserts are visible in the statistics. From then on the baseline is settled.
    {
        let mut writer = PgConnection::connect(&app.db.url).await.expect("writer");
        sqlx::query("INSERT INTO cards (card_ref) SELECT 'c-' || g FROM generate_series(1, 50) g")
            .execute(&mut writer)
            .await
            .expect("insert cards");
        writer.close().await.expect("close writer");
    }
    let baseline = counters_when(&mut stats, &app.db.name, false, |c| c["cards"].1 == 50).await;
    for i in 1..=50 {
        for task in Task::ALL {
            app.start_chain(task, &format!("c-{i}"), Duration::ZERO)
                .await;
        }
    }
    wait_until(Duration::from_secs(60), "500 unchanged polls", || async {
        outcome(&app, "carddata", "skipped_unchanged").await
            + outcome(&app, "card_status", "skipped_unchanged").await
            >= 500.0
    })
    .await;
    // Row counts are immediate: nothing was written.
    let after_unchanged = counters(&mut stats).await;
    for (table, (rows, ..)) in &after_unchanged {
        assert_eq!(
            *rows, baseline[table].0,
            "rows of {table} after unchanged polls"
        );
    }
    assert_eq!(outcome(&app, "card_status", "persisted_change").await, 0.0);
    assert_eq!(outcome(&app, "carddata", "persisted_change").await, 0.0);

    // The unchanged polls are counted in Redis: per card in its chain entry, and fleet-wide per
    // task and hour in a counter that expires (written every few seconds by each process: flushed
    // here instead of waited for).
    cardworker::polling::unchanged::flush(&mut app.ctx.redis.clone(), app.ctx.prefix())
        .await
        .expect("flush");
    let hour = cardworker::polling::unchanged::hour_bucket(chrono::Utc::now());
    let key = cardworker::polling::unchanged::hour_key(app.ctx.prefix(), Task::CardStatus, &hour);
    let total: i64 = app.ctx.redis.clone().get(&key).await.unwrap_or(0);
    let one = chain_of(&app.ctx, Task::CardStatus, "c-7")
        .await
        .and_then(|(_, state)| state.tally)
        .map_or(0, |t| t.count);
    assert!(total >= 200 && one >= 1, "total {total}, c-7 {one}");
    let ttl: i64 = app.ctx.redis.clone().ttl(&key).await.expect("ttl");
    assert!(ttl > 0 && ttl <= 49 * 3600, "ttl {ttl}");

    // One card changes.
    app.sim.set_card_status("c-7", CardStatus::Active);
    wait_until(
        Duration::from_secs(20),
        "the change is persisted",
        || async { outcome(&app, "card_status", "persisted_change").await >= 1.0 },
    )
    .await;

    // Stop the worker: its pool closes, its backends exit and publish their counters. Wait until
    // they are gone and the change's writes are visible, so the comparison below is real.
    app.stop().await.expect("stops cleanly");
    // Close every pool on the database (the worker's and the test's own), so that every backend
    // exits and publishes its counters.
    app.ctx.pool.close().await;
    app.db.pool.close().await;
    let last = counters_when(&mut stats, &app.db.name, true, |c| {
        c["integration_logs"].1 == 1 && c["cards"].2 == 1
    })
    .await;
    for (table, now) in &last {
        let before = baseline[table];
        let expected = match table.as_str() {
            "cards" => (before.0, before.1, before.2 + 1, before.3),
            "integration_logs" | "audit_events" | "audit_resources" | "outbox_events" => {
                (before.0 + 1, before.1 + 1, before.2, before.3)
            }
            _ => before,
        };
        assert_eq!(
            *now, expected,
            "{table}: (rows, ins, upd, del) after 500+ unchanged polls and one change"
        );
    }
    let (state, scenario): (String, String) =
        sqlx::query_as("SELECT state, scenario FROM integration_logs")
            .fetch_one(&mut stats)
            .await
            .expect("the log");
    assert_eq!(
        (state.as_str(), scenario.as_str()),
        ("succeeded", "card_status_poll")
    );
    let (status, version): (String, i64) =
        sqlx::query_as("SELECT status, version FROM cards WHERE card_ref = 'c-7'")
            .fetch_one(&mut stats)
            .await
            .expect("card");
    assert_eq!((status.as_str(), version), ("active", 1));
    let linked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          JOIN integration_logs l ON l.id = e.integration_log_id
         WHERE e.event_type = 'card.status_changed' AND r.resource_id = 'c-7'
           AND e.correlation_id = l.correlation_id",
    )
    .fetch_one(&mut stats)
    .await
    .expect("linked audit");
    assert_eq!(linked, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_poll_writes_one_failed_log_and_one_audit_pair() {
    // A long interval keeps the first retry (about 10 s) out of the picture.
    let mut app = spawn_app_with(|cfg| cfg.polling.card_status.interval_secs = 60).await;
    app.insert_card("c-1").await;
    app.sim.fail_card("c-1");
    app.start_chain(Task::CardStatus, "c-1", Duration::ZERO)
        .await;
    wait_until(
        Duration::from_secs(20),
        "the failure is recorded",
        || async { outcome(&app, "card_status", "persisted_failure").await >= 1.0 },
    )
    .await;
    let logs: Vec<FailedLog> =
        sqlx::query_as("SELECT state, error, recovery_summary, http_status FROM integration_logs")
            .fetch_all(&app.db.pool)
            .await
            .expect("logs");
    assert_eq!(logs.len(), 1, "{logs:?}");
    let (state, error, recovery, http) = &logs[0];
    assert_eq!(state, "failed");
    assert!(error.is_some());
    assert_eq!(*http, Some(503));
    let recovery = recovery.clone().unwrap_or_default();
    assert!(
        recovery.starts_with("retry in ") && recovery.contains("(failure 1 of 10)"),
        "{recovery}"
    );
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM audit_events WHERE event_type = 'poll.failed'"
        )
        .await,
        1
    );
    assert_eq!(scalar(&app, "SELECT count(*) FROM audit_events").await, 1);
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM audit_resources").await,
        1
    );
    assert_eq!(scalar(&app, "SELECT count(*) FROM outbox_events").await, 0);
    assert_eq!(scalar(&app, "SELECT version FROM cards").await, 0);
    // The chain lives on, with its failure count, for the back-off retry.
    assert!(chain_of(&app.ctx, Task::CardStatus, "c-1").await.is_some());

    // No UPDATE of integration_logs, ever, on the polling path.
    app.stop().await.expect("stops cleanly");
    // Close every pool on the database (the worker's and the test's own), so that every backend
    // exits and publishes its counters.
    app.ctx.pool.close().await;
    app.db.pool.close().await;
    let mut stats = PgConnection::connect(&app.db.url).await.expect("stats");
    let last = counters_when(&mut stats, &app.db.name, true, |c| {
        c["integration_logs"].1 == 1
    })
    .await;
    assert_eq!(last["integration_logs"].2, 0, "integration_logs updates");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_that_always_fails_is_parked_with_its_retry_scheduled_and_enqueue_restarts_it() {
    let app = spawn_app_with(|cfg| {
        fast(cfg);
        cfg.polling.card_status.max_consecutive_failures = 3;
    })
    .await;
    app.insert_card("c-1").await;
    app.sim.fail_card("c-1");
    app.start_chain(Task::CardStatus, "c-1", Duration::ZERO)
        .await;
    let sql = "SELECT count(*) FROM cards WHERE card_status_parked_at IS NOT NULL";
    let limit = Duration::from_secs(30);
    wait_for_count(&app.db.pool, sql, 1, limit, "the chain is parked").await;
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM integration_logs WHERE state = 'failed'"
        )
        .await,
        3
    );
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM integration_logs").await,
        3
    );
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM audit_events WHERE event_type = 'poll.failed'"
        )
        .await,
        3
    );
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM audit_events WHERE event_type = 'poll.parked'"
        )
        .await,
        1
    );
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM audit_resources").await,
        4
    );
    let last: String = sqlx::query_scalar(
        "SELECT recovery_summary FROM integration_logs ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("last log");
    assert!(
        last.contains("parked after 3 consecutive failures")
            && last.contains("retried automatically in 21600 s")
            && last.contains("cardworker unpark --task card_status --card-ref c-1"),
        "{last}"
    );
    // The parked chain stays scheduled: its next job is the retry, 6 h from now.
    let parked_chain = chain_of(&app.ctx, Task::CardStatus, "c-1").await;
    assert!(parked_chain.is_some());
    let calls_when_parked = calls(&app, "card_status");
    assert_eq!(calls_when_parked, 3);

    // Reconcile's sweep leaves a parked chain alone.
    let (examined, started) = reconcile::sweep(&app.ctx, Task::CardStatus)
        .await
        .expect("reconcile");
    assert_eq!((examined, started), (0, 0));
    assert_eq!(
        chain_of(&app.ctx, Task::CardStatus, "c-1").await,
        parked_chain
    );

    // An explicit enqueue restarts it now.
    app.sim.heal_card("c-1");
    cli::enqueue(&app.ctx, Task::CardStatus, "c-1", None)
        .await
        .expect("enqueue");
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM cards WHERE card_status_parked_at IS NOT NULL"
        )
        .await,
        0
    );
    wait_until(Duration::from_secs(20), "polled again", || async {
        outcome(&app, "card_status", "skipped_unchanged").await >= 1.0
    })
    .await;
    assert!(chain_of(&app.ctx, Task::CardStatus, "c-1").await.is_some());
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM integration_logs").await,
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_for_an_unknown_card_is_acknowledged_without_a_gateway_call() {
    let app = spawn_app().await;
    app.enqueue_status_poll("c-nobody").await;
    wait_until(Duration::from_secs(20), "the job ran", || async {
        finished_jobs(&app, PollCardStatus::QUEUE).await >= 1.0
    })
    .await;
    assert_eq!(calls(&app, "card_status"), 0);
    assert_eq!(chain_of(&app.ctx, Task::CardStatus, "c-nobody").await, None);
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM integration_logs").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_twice_leaves_one_chain() {
    let app = spawn_app().await;
    app.insert_card("c-1").await;
    cli::enqueue(&app.ctx, Task::CardStatus, "c-1", None)
        .await
        .expect("first");
    cli::enqueue(&app.ctx, Task::CardStatus, "c-1", None)
        .await
        .expect("second");
    // One entry per card in the due queue, whatever the enqueues.
    let due_set = lease::due_queue(app.ctx.prefix(), Task::CardStatus)
        .keys()
        .due
        .clone();
    let entries: i64 = app
        .ctx
        .redis
        .clone()
        .zcard(&due_set)
        .await
        .expect("due set");
    assert_eq!(entries, 1);
    let intake = keys::intake(app.ctx.prefix(), PollCardStatus::QUEUE);
    let with_payload: i64 = app.ctx.redis.clone().zcard(&intake).await.expect("intake");
    assert_eq!(with_payload, 0, "a poll request has no intake entry");
    wait_until(Duration::from_secs(20), "one poll", || async {
        outcome(&app, "card_status", "skipped_unchanged").await >= 1.0
    })
    .await;
    // The next poll is 300 s away: once the poll wrote its successor, the card waits.
    wait_until(Duration::from_secs(10), "successor scheduled", || async {
        let n: i64 = app
            .ctx
            .redis
            .clone()
            .zcount(&due_set, "-inf", format!("({LEASED}"))
            .await
            .unwrap_or(0);
        n == 1
    })
    .await;
    assert_eq!(calls(&app, "card_status"), 1);
    assert!(chain_of(&app.ctx, Task::CardStatus, "c-1").await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_polling_cli_enqueues_reconciles_and_investigates() {
    let app = spawn_app().await;
    app.insert_card("c-1").await;
    app.insert_card("c-2").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cardworker.toml");
    std::fs::write(&path, app.ctx.config.to_toml_string().expect("toml")).expect("write config");
    let bin = env!("CARGO_BIN_EXE_cardworker");
    let run = |args: &[&str]| {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(args).arg("--config").arg(&path);
        cmd.env_remove("CARDWORKER_CONFIG");
        cmd.output().expect("run cardworker")
    };

    let out = run(&["enqueue", "card-status", "--card-ref", "c-nobody"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown card"));

    let out = run(&["reconcile", "--format", "json"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["started"]["carddata"], 2);
    assert_eq!(json["started"]["card_status"], 2);
    // A second pass finds every chain alive.
    let out = run(&["reconcile", "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["started"]["carddata"], 0);

    app.sim.set_card_status("c-1", CardStatus::Frozen);
    cli::enqueue(
        &app.ctx,
        Task::CardStatus,
        "c-1",
        Some("customer says the card is frozen".to_owned()),
    )
    .await
    .expect("enqueue");
    wait_until(Duration::from_secs(20), "the change", || async {
        outcome(&app, "card_status", "persisted_change").await >= 1.0
    })
    .await;

    let out = run(&["investigate", "--card-ref", "c-1"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("unchanged polls are counted, not recorded"),
        "{text}"
    );
    assert!(text.contains("card.status_changed"), "{text}");
    assert!(
        text.contains("operator.enqueue") && text.contains("customer says the card is frozen"),
        "{text}"
    );
    let out = run(&["investigate", "--card-ref", "c-1", "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["card"]["status"], "frozen");
    // The change (log + audit event) and the operator's enqueue.
    assert!(
        json["timeline"].as_array().is_some_and(|t| t.len() == 3),
        "{}",
        json["timeline"]
    );
    assert!(json["timeline"][0]["correlation_id"].is_string());
    // The operator's action is a manual fact of the card, with who and why.
    let facts = json["manual_facts"].as_array().expect("manual facts");
    assert_eq!(facts.len(), 1, "{facts:?}");
    assert_eq!(facts[0]["event_type"], "operator.enqueue");
    assert_eq!(facts[0]["reason"], "customer says the card is frozen");
    assert!(facts[0]["actor"]
        .as_str()
        .is_some_and(|a| a.starts_with("operator:")));
    assert!(json["payments"].is_array() && json["callbacks"].is_array());
    assert_eq!(json["unchanged_polls"].as_array().map(Vec::len), Some(2));

    let out = run(&["investigate", "--card-ref", "c-nobody"]);
    assert_eq!(out.status.code(), Some(1));
}

/// A second `cardworker run` on the same database and prefix.
struct Restarted {
    ctx: Arc<AppContext>,
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    join: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn restart(config: Config) -> Restarted {
    let ctx = AppContext::connect(config).await.expect("connect");
    let running = app::start(ctx.clone()).await.expect("start");
    let addr = running.addr;
    let (stop, stopped) = oneshot::channel::<()>();
    let join = tokio::spawn(running.wait(async move {
        let _ = stopped.await;
    }));
    Restarted {
        ctx,
        addr,
        stop: Some(stop),
        join,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_chains_due_at_once_are_all_polled_without_a_worker_stopping() {
    const CARDS: i64 = 20_000;
    let mut app = spawn_app_with(|cfg| {
        cfg.polling.total_limit = Limit::new(64).expect("a limit");
        cfg.polling.card_status.limit = Limit::new(64).expect("a limit");
        cfg.polling.carddata.limit = Limit::new(64).expect("a limit");
        cfg.database.max_connections = 20;
    })
    .await;
    // The worker is stopped while the backlog builds up.
    app.stop().await.expect("stops");
    sqlx::query("INSERT INTO cards (card_ref) SELECT 'c-' || g FROM generate_series(1, $1) g")
        .bind(CARDS)
        .execute(&app.db.pool)
        .await
        .expect("insert cards");
    let prefix = app.ctx.prefix().to_owned();
    let conn = app.ctx.redis.clone();
    futures::stream::iter(1..=CARDS)
        .map(|i| {
            let mut conn = conn.clone();
            let prefix = prefix.clone();
            async move {
                lease::start(
                    &mut conn,
                    &prefix,
                    Task::CardStatus,
                    &format!("c-{i}"),
                    Duration::ZERO,
                )
                .await
                .expect("start chain")
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;

    let mut second = restart((*app.ctx.config).clone()).await;
    let health = format!("http://{}/healthz", second.addr);
    wait_until(
        Duration::from_secs(150),
        "as many calls as cards",
        || async { calls(&app, "card_status") >= CARDS as u64 },
    )
    .await;
    // Every card, not merely as many calls: the simulator keeps each card it was asked about.
    wait_until(Duration::from_secs(60), "every card polled", || async {
        (1..=CARDS).all(|i| app.sim.card(&format!("c-{i}")).is_some())
    })
    .await;
    let status = reqwest::get(&health).await.expect("healthz").status();
    assert_eq!(status.as_u16(), 200);
    assert!(!second.join.is_finished(), "the worker process ended");
    // Every card is in the due queue, scheduled for its next poll.
    let chains: i64 = second
        .ctx
        .redis
        .clone()
        .zcard(
            lease::due_queue(&prefix, Task::CardStatus)
                .keys()
                .due
                .clone(),
        )
        .await
        .expect("zcard");
    assert_eq!(chains, CARDS);
    if let Some(stop) = second.stop.take() {
        let _ = stop.send(());
    }
    second
        .join
        .await
        .expect("join")
        .expect("the restarted worker stops cleanly");
}
