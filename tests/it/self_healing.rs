//! Self-healing on the shared services, within one test prefix: a producer's poll request merges
//! into a polled card, reconcile adds back cards Redis lost, money queued before a Redis loss is
//! recovered from PostgreSQL, and text PostgreSQL refuses is cleaned.

use std::time::Duration;

use cardworker::config::Task;
use cardworker::context::AppContext;
use cardworker::payments::{callback, recovery};
use cardworker::polling::due_queue::Standing;
use cardworker::polling::{lease, reconcile};
use cardworker::storage::records::{self, LogRecord, LogState};
use redis::AsyncCommands as _;
use uuid::Uuid;

use crate::harness::{
    spawn_app_prepared, spawn_app_with, test_config, wait_until, TestDb, TestRedis,
};
use crate::money_support::age;
use crate::polling::{calls, chain_of};

/// Deletes every key of the prefix: what a Redis flush does to one deployment (never FLUSHALL
/// on the shared Redis).
async fn flush_prefix(redis: &TestRedis) {
    let mut conn = redis.conn.clone();
    for key in redis.keys().await {
        let _: () = conn.del(&key).await.expect("del");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_poll_job_for_a_card_that_is_polled_brings_its_next_poll_forward_and_leaves_one_entry(
) {
    let app = spawn_app_with(|cfg| cfg.polling.card_status.interval_secs = 1).await;
    app.card_with_chain(Task::CardStatus, "c-1", Duration::from_secs(3600))
        .await;
    // The documented producer API: a request for a poll of the card.
    let id = app.enqueue_status_poll("c-1").await;
    assert_eq!(id, "c-1");
    wait_until(Duration::from_secs(20), "polled now and again", || async {
        calls(&app, "card_status") >= 3
    })
    .await;
    let entries: usize = app
        .redis
        .conn
        .clone()
        .zcard(
            lease::due_queue(&app.redis.prefix, Task::CardStatus)
                .keys()
                .due
                .clone(),
        )
        .await
        .expect("zcard");
    assert_eq!(entries, 1, "one entry per card");
    let with_payload: usize = app
        .redis
        .conn
        .clone()
        .zcard(cardworker_jobs::keys::intake(
            &app.redis.prefix,
            "card_status",
        ))
        .await
        .expect("zcard");
    assert_eq!(with_payload, 0, "the request left no intake entry");

    // A card without an entry gets one from the producer's request.
    app.insert_card("c-2").await;
    app.enqueue_status_poll("c-2").await;
    assert!(chain_of(&app.ctx, Task::CardStatus, "c-2").await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_adds_back_a_card_redis_lost_and_a_parked_card_whose_retry_is_overdue_but_not_one_parked_lately(
) {
    let app = spawn_app_with(|cfg| {
        cfg.polling.card_status.interval_secs = 3600;
        cfg.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    })
    .await;
    for card in ["c-lost", "c-parked-long-ago", "c-parked-now"] {
        app.insert_card(card).await;
    }
    sqlx::query(
        "UPDATE cards SET card_status_parked_at = now() - interval '30 days' \
         WHERE card_ref = 'c-parked-long-ago'",
    )
    .execute(&app.db.pool)
    .await
    .expect("park long ago");
    sqlx::query("UPDATE cards SET card_status_parked_at = now() WHERE card_ref = 'c-parked-now'")
        .execute(&app.db.pool)
        .await
        .expect("park now");
    // None of the three is in the due queue (Redis lost them, say).
    let pass = reconcile::run_once(&app.ctx, Task::CardStatus)
        .await
        .expect("reconcile");
    assert_eq!((pass.examined, pass.started), (1, 1));
    assert!(chain_of(&app.ctx, Task::CardStatus, "c-lost")
        .await
        .is_some());
    let parked = reconcile::restore_parked_retries(&app.ctx, Task::CardStatus)
        .await
        .expect("parked retries");
    assert_eq!(parked, 1);
    assert!(chain_of(&app.ctx, Task::CardStatus, "c-parked-long-ago")
        .await
        .is_some());
    assert_eq!(
        chain_of(&app.ctx, Task::CardStatus, "c-parked-now").await,
        None
    );
    // Everything is in place: a second run adds nothing.
    let again = reconcile::run_once(&app.ctx, Task::CardStatus)
        .await
        .expect("reconcile");
    assert_eq!(again.started, 0);
    assert_eq!(
        reconcile::restore_parked_retries(&app.ctx, Task::CardStatus)
            .await
            .expect("parked retries"),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_enqueued_and_lost_with_a_redis_flush_is_submitted_exactly_once_by_recovery() {
    // Enqueued while no worker runs, then the deployment's Redis keys are flushed.
    let db = TestDb::new().await;
    let redis = TestRedis::new().await;
    let config = test_config(&db, &redis, "http://127.0.0.1:9");
    let ctx = AppContext::connect(config).await.expect("connect");
    let payment = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, 'c-1', 100, 'CNY')",
    )
    .bind(payment)
    .execute(&db.pool)
    .await
    .expect("payment");
    cardworker::commands::payments::enqueue_payment(&ctx, payment)
        .await
        .expect("enqueue");
    let callback_body = r#"{"type":"payment.result","payment_id":"00000000-0000-0000-0000-000000000000","status":"accepted","channel_ref":"x"}"#;
    assert_eq!(
        callback::record_received(&db.pool, "visa", "cb-lost", callback_body)
            .await
            .expect("record"),
        callback::Received::Recorded
    );
    flush_prefix(&redis).await;
    drop(ctx);

    // A worker comes up on the empty Redis; recovery finds the payment in PostgreSQL.
    let app = spawn_app_prepared(db, redis, |_| {}).await;
    age(&app.db.pool, "payments").await;
    sqlx::query("UPDATE inbound_callbacks SET queued_at = now() - interval '1 hour'")
        .execute(&app.db.pool)
        .await
        .expect("age");
    let report = recovery::recover(&app.ctx, Duration::from_secs(300), 50)
        .await
        .expect("recovery");
    assert_eq!(report.resubmitted, 1);
    let swept = callback::sweep_received(&app.ctx, Duration::from_secs(300), 50)
        .await
        .expect("sweep");
    assert_eq!(swept, 1);
    wait_until(
        Duration::from_secs(20),
        "the payment is accepted",
        || async {
            crate::money_support::payment_status(&app.db.pool, payment).await == "accepted"
        },
    )
    .await;
    wait_until(
        Duration::from_secs(20),
        "the callback is processed",
        || async {
            sqlx::query_scalar::<_, String>(
                "SELECT state FROM inbound_callbacks WHERE callback_id = 'cb-lost'",
            )
            .fetch_one(&app.db.pool)
            .await
            .expect("state")
                != "received"
        },
    )
    .await;
    // Idempotent: a second recovery and sweep do nothing more.
    recovery::recover(&app.ctx, Duration::ZERO, 50)
        .await
        .expect("recovery");
    assert_eq!(
        callback::sweep_received(&app.ctx, Duration::ZERO, 50)
            .await
            .expect("sweep"),
        0
    );
    wait_until(
        Duration::from_secs(15),
        "no payment or callback job queued or running",
        || async { app.queue_idle("payment").await && app.queue_idle("callback").await },
    )
    .await;
    assert_eq!(app.sim.submissions(payment), 1, "submitted exactly once");
    let deliveries: i32 = sqlx::query_scalar(
        "SELECT deliveries FROM inbound_callbacks WHERE callback_id = 'cb-lost'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("deliveries");
    assert_eq!(deliveries, 1, "the sweep does not count a delivery");
}

#[tokio::test]
async fn a_nul_byte_in_a_gateway_error_body_is_cleaned_before_it_reaches_postgres() {
    let db = TestDb::new().await;
    let mut conn = db.pool.acquire().await.expect("conn");
    let now = chrono::Utc::now();
    let id = records::insert_terminal_log(
        &mut conn,
        &LogRecord {
            correlation_id: Uuid::now_v7(),
            resource_type: "card",
            resource_id: "c-1".into(),
            scenario: "card_status_poll",
            state: LogState::Failed,
            request_summary: "GET".into(),
            response_summary: "HTTP 502 body: bad\0gateway".into(),
            http_status: Some(502),
            error: Some("HTTP 502\0".into()),
            recovery_summary: None,
            started_at: now,
            finished_at: now,
        },
    )
    .await
    .expect("a NUL byte is not a reason to lose the record");
    let (summary, error): (String, String) =
        sqlx::query_as("SELECT response_summary, error FROM integration_logs WHERE id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .expect("row");
    assert_eq!(summary, "HTTP 502 body: bad\u{FFFD}gateway");
    assert_eq!(error, "HTTP 502\u{FFFD}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_that_panics_leaves_a_counted_failure_and_one_that_times_out_a_plain_successor() {
    let app = spawn_app_with(|cfg| {
        cfg.polling.card_status.interval_secs = 3600;
        // A handler's limit above the first failure's back-off (8–12 s).
        cfg.polling.handler_timeout_secs = 30;
        cfg.polling.lease_ttl_secs = 40;
        cfg.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    })
    .await;
    app.card_with_chain(Task::CardStatus, "c-1", Duration::from_secs(3600))
        .await;
    let job = crate::polling::leased_status_poll(&app.ctx, "c-1").await;
    // The successor waits as the card's entry, its state beside it.
    let waiting_state = || async {
        let (standing, state) = chain_of(&app.ctx, Task::CardStatus, "c-1")
            .await
            .expect("the card is polled");
        assert!(matches!(standing, Standing::Waiting { .. }), "{standing:?}");
        state
    };

    cardworker::polling::poll::after_abnormal_end(
        job.clone(),
        app.ctx.clone(),
        cardworker::runner::JobError::Panicked("boom".into()),
    )
    .await;
    assert_eq!(waiting_state().await.failures, 1);
    // Its call may still be at the Gateway: the successor waits at least the handler's limit
    // (30 s), not only the first failure's back-off (8–12 s).
    let (standing, _) = chain_of(&app.ctx, Task::CardStatus, "c-1")
        .await
        .expect("the card is polled");
    let Standing::Waiting { due_ms } = standing else {
        panic!("{standing:?}");
    };
    let in_ms = due_ms as i64 - chrono::Utc::now().timestamp_millis();
    assert!(
        in_ms >= 29_000,
        "the successor of an abnormal end is due in {in_ms} ms, before the handler's limit"
    );
    let error: String =
        sqlx::query_scalar("SELECT error FROM integration_logs WHERE state = 'failed'")
            .fetch_one(&app.db.pool)
            .await
            .expect("one failure record");
    assert!(error.contains("panic: boom"), "{error}");

    let next = crate::polling::leased_status_poll(&app.ctx, "c-1").await;
    cardworker::polling::poll::after_abnormal_end(
        next,
        app.ctx.clone(),
        cardworker::runner::JobError::TimedOut(Duration::from_secs(15)),
    )
    .await;
    assert_eq!(
        waiting_state().await.failures,
        1,
        "a timeout is not counted"
    );
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM integration_logs")
        .fetch_one(&app.db.pool)
        .await
        .expect("count");
    assert_eq!(records, 1, "a timeout writes no record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_postgres_refuses_is_a_counted_failure_that_parks_instead_of_retrying_forever() {
    let app = spawn_app_with(|cfg| {
        cfg.polling.carddata.interval_secs = 1;
        cfg.polling.carddata.max_consecutive_failures = 2;
        cfg.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    })
    .await;
    app.insert_card("c-1").await;
    // A token with a NUL byte: valid JSON, refused by PostgreSQL's text (SQLSTATE 22021).
    app.sim
        .set_card_ready("c-1", "tok_\u{0}x", "4242", 12, 2030);
    app.start_chain(Task::Carddata, "c-1", Duration::ZERO).await;
    wait_until(Duration::from_secs(30), "the chain is parked", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL",
        )
        .fetch_one(&app.db.pool)
        .await
        .expect("parked")
            == 1
    })
    .await;
    let errors: Vec<String> =
        sqlx::query_scalar("SELECT error FROM integration_logs WHERE state = 'failed' ORDER BY id")
            .fetch_all(&app.db.pool)
            .await
            .expect("failures");
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors.iter().all(|e| e.contains("could not be recorded")),
        "{errors:?}"
    );
    let data_state: String = sqlx::query_scalar("SELECT data_state FROM cards")
        .fetch_one(&app.db.pool)
        .await
        .expect("card");
    assert_eq!(
        data_state, "pending",
        "nothing of the refused change was kept"
    );
    // Parked, and (issue 10) still scheduled: the chain's next job is its parked retry.
    let parked: bool = sqlx::query_scalar(
        "SELECT carddata_parked_at IS NOT NULL FROM cards WHERE card_ref = 'c-1'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("card");
    assert!(parked, "the chain is parked");
    assert!(chain_of(&app.ctx, Task::Carddata, "c-1").await.is_some());
}
