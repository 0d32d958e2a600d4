//! The reliable paths, measured: pending before the call, recovery after a kill mid-call,
//! callbacks applied once however often they are delivered.

use std::sync::Arc;
use std::time::Duration;

use cardworker::config::Task;
use cardworker::context::AppContext;
use cardworker::gateway::{GatewayClient, PaymentResult, PaymentStatus};
use cardworker::payments::callback::{self, Delivery};
use cardworker::payments::recovery::{self, RecoveryReport};
use cardworker::payments::submit::Submitted;
use cardworker::sim::PaymentBehaviour;
use cardworker_jobs::ProcessCallback;
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::{spawn_app_with, wait_until, TestApp};
use crate::money_support::{
    age, insert_payment, log_states, payment_status, submit_payment, wait_for_status,
};

/// An app whose recovery cron never fires during a test (recovery runs are called directly).
async fn app() -> TestApp {
    spawn_app_with(|cfg| {
        cfg.payments.recovery_cron = "0 0 0 1 1 *".to_owned();
    })
    .await
}

/// The payment's status.
async fn count(pool: &PgPool, sql: &str, id: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(id)
        .fetch_one(pool)
        .await
        .expect(sql)
}

/// States of the payment's integration log rows of one scenario, oldest first.
/// [`app`], its pool, and a payment for card `c-1` in it.
async fn app_with_payment() -> (TestApp, PgPool, Uuid) {
    app_with_payment_of("c-1").await
}

/// [`app`], its pool, and a payment for `card_ref` in it.
async fn app_with_payment_of(card_ref: &str) -> (TestApp, PgPool, Uuid) {
    let app = app().await;
    let pool = app.db.pool.clone();
    let id = insert_payment(&pool, card_ref).await;
    (app, pool, id)
}

/// A recovery pass of payments left 300 s.
async fn recover(app: &TestApp) -> RecoveryReport {
    recovery::recover(&app.ctx, Duration::from_secs(300), 50)
        .await
        .expect("recovery")
}

/// The states of the payment's submission logs, oldest first.
async fn submit_log(pool: &PgPool, id: Uuid) -> Vec<String> {
    log_states(pool, "payment", id, "payment_submit").await
}

fn distinct_keys(app: &TestApp, id: Uuid) -> Vec<String> {
    let mut keys = app
        .sim
        .payment_record(id)
        .map(|r| r.idempotency_keys)
        .unwrap_or_default();
    keys.sort();
    keys.dedup();
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_call_leaves_a_pending_row_that_recovery_settles_for_every_answer() {
    let app = app().await;
    let pool = app.db.pool.clone();
    let accepted = insert_payment(&pool, "c-1").await;
    let rejected = insert_payment(&pool, "c-1").await;
    let forgotten = insert_payment(&pool, "c-1").await;

    // Kill mid-call: the Gateway holds every answer; the job's core runs in a task that is
    // aborted once the Gateway has the request.
    let mut killed = Vec::new();
    for id in [accepted, rejected, forgotten] {
        app.sim.set_payment_behaviour(id, PaymentBehaviour::Hang);
        let ctx = app.ctx.clone();
        let task = tokio::spawn(async move { submit_payment(&ctx, id).await });
        wait_until(
            Duration::from_secs(10),
            "the Gateway received the submission",
            || async { app.sim.submissions(id) == 1 },
        )
        .await;
        // Which path writes pending: by the time the Gateway has the request, the pending row is
        // committed and visible to anyone.
        assert_eq!(submit_log(&pool, id).await, ["pending"]);
        assert_eq!(payment_status(&pool, id).await, "pending");
        task.abort();
        assert!(task.await.expect_err("aborted").is_cancelled());
        killed.push(id);
    }
    for id in &killed {
        assert_eq!(
            payment_status(&pool, *id).await,
            "pending",
            "evidence survives the kill"
        );
        assert_eq!(submit_log(&pool, *id).await, ["pending"]);
    }

    // What the Gateway knows afterwards: accepted (Hang stored it), rejected, never seen.
    app.sim.store_payment(PaymentResult {
        payment_id: rejected,
        status: PaymentStatus::Rejected,
        channel_ref: "ch_rej".to_owned(),
    });
    app.sim.forget_payment(forgotten);
    for id in &killed {
        app.sim.set_payment_behaviour(*id, PaymentBehaviour::Accept);
    }

    // Not yet due: recovery leaves young payments alone.
    let report = recover(&app).await;
    assert_eq!(report, RecoveryReport::default());

    age(&pool, "payments").await;
    let report = recover(&app).await;
    assert_eq!(
        report,
        RecoveryReport {
            examined: 3,
            settled: 2,
            resubmitted: 1,
            refused: 0,
            left: 0,
            skipped: 0
        }
    );

    assert_eq!(payment_status(&pool, accepted).await, "accepted");
    assert_eq!(payment_status(&pool, rejected).await, "rejected");
    // The dead attempts' own logs are closed, each with the recovery query beside it.
    assert_eq!(submit_log(&pool, accepted).await, ["succeeded"]);
    assert_eq!(submit_log(&pool, rejected).await, ["succeeded"]);
    assert_eq!(
        log_states(&pool, "payment", accepted, "payment_recovery_query").await,
        ["succeeded"]
    );
    let summary: String = sqlx::query_scalar(
        "SELECT recovery_summary FROM integration_logs WHERE resource_id = $1 AND scenario = 'payment_submit'",
    )
    .bind(rejected.to_string())
    .fetch_one(&pool)
    .await
    .expect("summary");
    assert!(
        summary.contains("settled by recovery: rejected"),
        "{summary}"
    );

    // 404: resubmitted through the reliable path (pending first), by the app's worker.
    // Waits until the forgotten payment is resubmitted and accepted.
    wait_for_status(&pool, "payments", forgotten, "accepted", 20).await;
    assert_eq!(
        submit_log(&pool, forgotten).await,
        ["failed", "succeeded"],
        "the dead attempt closed as failed (never seen), the resubmission succeeded"
    );
    assert_eq!(app.sim.submissions(forgotten), 2);
    let submissions: i32 =
        sqlx::query_scalar("SELECT submissions FROM payments WHERE payment_id = $1")
            .bind(forgotten)
            .fetch_one(&pool)
            .await
            .expect("submissions");
    assert_eq!(submissions, 2);

    // One key per payment, ever, and it is the payment id.
    for id in &killed {
        assert_eq!(distinct_keys(&app, *id), [id.to_string()]);
    }
    // Nothing left pending; one settlement event per payment.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM integration_logs WHERE state = 'pending' AND $1 = $1",
            ""
        )
        .await,
        0
    );
    for id in &killed {
        let events = count(
            &pool,
            "SELECT count(*) FROM outbox_events WHERE aggregate_type = 'payment' AND aggregate_id = $1
               AND event_type IN ('payment.accepted', 'payment.rejected')",
            &id.to_string(),
        )
        .await;
        assert_eq!(events, 1, "payment {id}");
    }

    // Settled payments are not submitted again.
    let again = submit_payment(&app.ctx, accepted).await.expect("submit");
    assert_eq!(again, Submitted::AlreadySettled("accepted".to_owned()));
    assert_eq!(app.sim.submissions(accepted), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_submission_stays_unknown_until_recovery_asks_the_gateway() {
    let (app, pool, id) = app_with_payment().await;
    app.sim
        .set_payment_behaviour(id, PaymentBehaviour::ServerError);

    cardworker::commands::payments::enqueue_payment(&app.ctx, id)
        .await
        .expect("enqueue payment");
    // Waits until a 5xx leaves the payment unknown.
    wait_for_status(&pool, "payments", id, "unknown", 15).await;
    assert_eq!(submit_log(&pool, id).await, ["unknown"]);
    assert_eq!(
        app.sim.submissions(id),
        1,
        "an unknown answer is not retried blindly"
    );

    // A failed query leaves it unknown, on record.
    app.sim.set_payment_behaviour(id, PaymentBehaviour::Accept);
    age(&pool, "payments").await;
    app.sim.set_error_rate(1.0);
    let report = recover(&app).await;
    assert_eq!(report.left, 1);
    assert_eq!(payment_status(&pool, id).await, "unknown");
    assert_eq!(
        log_states(&pool, "payment", id, "payment_recovery_query").await,
        ["failed"]
    );
    app.sim.set_error_rate(0.0);

    // The 503 was never stored: 404, resubmitted with the same key, accepted.
    age(&pool, "payments").await;
    let report = recover(&app).await;
    assert_eq!(report.resubmitted, 1);
    // Waits until resubmitted and accepted.
    wait_for_status(&pool, "payments", id, "accepted", 15).await;
    assert_eq!(distinct_keys(&app, id), [id.to_string()]);

    // The CLI refuses unknown payments and does not resubmit settled ones.
    let err = cardworker::commands::payments::enqueue_payment(&app.ctx, Uuid::new_v4())
        .await
        .expect_err("unknown payment");
    assert_eq!(err.exit_code(), 1);
    cardworker::commands::payments::enqueue_payment(&app.ctx, id)
        .await
        .expect("settled: ok");
    wait_until(
        Duration::from_secs(15),
        "no payment job queued or running",
        || app.queue_idle("payment"),
    )
    .await;
    assert_eq!(app.sim.submissions(id), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_leaves_the_payment_requested_and_retries_with_the_same_key() {
    let (app, pool, id) = app_with_payment().await;
    // A Gateway that refuses connections: nothing was sent.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let ctx = AppContext {
        config: app.ctx.config.clone(),
        pool: app.ctx.pool.clone(),
        redis: app.ctx.redis.clone(),
        producer: app.ctx.producer.clone(),
        gateway: GatewayClient::new(&format!("http://127.0.0.1:{port}"), Duration::from_secs(2))
            .expect("client"),
        health: Default::default(),
        redis_status: Default::default(),
        budget: app.ctx.budget.clone(),
        shutdown: app.ctx.shutdown.clone(),
        poll_acks: app.ctx.poll_acks.clone(),
        card_reads: app.ctx.card_reads.clone(),
    };
    let done = submit_payment(&ctx, id).await.expect("submit");
    let Submitted::Failed {
        status: after,
        retry_in,
        ..
    } = done
    else {
        panic!("expected a failed submission, got {done:?}");
    };
    assert_eq!(after, "requested");
    assert!(retry_in.is_some());
    assert_eq!(payment_status(&pool, id).await, "requested");
    assert_eq!(submit_log(&pool, id).await, ["failed"]);
    // The retry goes through the intake and the app's worker (real Gateway) submits it.
    // Waits until the retry is accepted.
    wait_for_status(&pool, "payments", id, "accepted", 20).await;
    assert_eq!(distinct_keys(&app, id), [id.to_string()]);
    // Unknown payments: recorded, nothing sent.
    let unknown = Uuid::new_v4();
    let done = submit_payment(&app.ctx, unknown).await.expect("submit");
    assert_eq!(done, Submitted::UnknownRow);
    assert_eq!(app.sim.submissions(unknown), 0);
    let refused = count(
        &pool,
        "SELECT count(*) FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          WHERE e.event_type = 'payment.submit_refused' AND r.resource_id = $1",
        &unknown.to_string(),
    )
    .await;
    assert_eq!(refused, 1);
}

/// A first delivery of callback `id` of channel `visa` with `body`.
fn visa_callback(id: &str, body: String) -> ProcessCallback {
    ProcessCallback {
        channel: "visa".to_owned(),
        callback_id: id.to_owned(),
        body,
        retries: 0,
        recorded: false,
    }
}

/// [`app`], its pool, and a payment of card `c-9` that callback `callback_id` accepted.
async fn accepted_by_callback(callback_id: &str) -> (TestApp, PgPool, Uuid) {
    let (app, pool, pid) = app_with_payment_of("c-9").await;
    let decision = visa_callback(callback_id, payment_result(pid, "accepted"));
    assert_eq!(
        callback::process(&app.ctx, &decision)
            .await
            .expect("decision"),
        Delivery::Applied { changed: true }
    );
    (app, pool, pid)
}

/// The body of a callback saying payment `pid` is `status` (channel ref `ch_9`).
fn payment_result(pid: Uuid, status: &str) -> String {
    format!(
        r#"{{"type":"payment.result","payment_id":"{pid}","status":"{status}","channel_ref":"ch_9"}}"#
    )
}

/// Callback `id` saying card `card_ref` is now `status`.
fn card_callback(id: &str, card_ref: &str, status: &str) -> ProcessCallback {
    let body = format!(r#"{{"type":"card.status","card_ref":"{card_ref}","status":"{status}"}}"#);
    visa_callback(id, body)
}

/// The card `card_ref` as stored.
async fn load_card(pool: &PgPool, card_ref: &str) -> cardworker::storage::cards::Card {
    cardworker::storage::cards::load(pool, card_ref)
        .await
        .expect("load")
        .expect("card")
}

/// The outbox events about `aggregate_id`.
async fn outbox_count(pool: &PgPool, aggregate_id: &str) -> i64 {
    let sql = "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1";
    count(pool, sql, aggregate_id).await
}

/// The integration logs of callbacks about `resource_id`.
async fn callback_logs(pool: &PgPool, resource_id: &str) -> i64 {
    let sql =
        "SELECT count(*) FROM integration_logs WHERE resource_id = $1 AND scenario = 'callback'";
    count(pool, sql, resource_id).await
}

/// How often callback `callback_id` was delivered.
async fn delivery_count(pool: &PgPool, callback_id: &str) -> i64 {
    let sql = "SELECT deliveries::bigint FROM inbound_callbacks WHERE callback_id = $1";
    count(pool, sql, callback_id).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_callback_delivered_twenty_times_concurrently_applies_once() {
    let app = app().await;
    let pool = app.db.pool.clone();
    app.insert_card("c-1").await;
    let job = card_callback("cb-1", "c-1", "frozen");

    let ctx: Arc<AppContext> = app.ctx.clone();
    let runs: Vec<_> = (0..20)
        .map(|_| {
            let ctx = ctx.clone();
            let job = job.clone();
            tokio::spawn(async move { callback::process(&ctx, &job).await })
        })
        .collect();
    let mut applied = 0;
    let mut duplicates = 0;
    for run in runs {
        match run.await.expect("join").expect("delivery") {
            Delivery::Applied { changed: true } => applied += 1,
            Delivery::Duplicate => duplicates += 1,
            other => panic!("unexpected delivery outcome {other:?}"),
        }
    }
    assert_eq!((applied, duplicates), (1, 19));

    let (rows, deliveries, state): (i64, i64, String) = sqlx::query_as(
        "SELECT count(*), sum(deliveries)::bigint, min(state) FROM inbound_callbacks",
    )
    .fetch_one(&pool)
    .await
    .expect("callbacks");
    assert_eq!((rows, deliveries, state.as_str()), (1, 20, "applied"));
    let card = load_card(&pool, "c-1").await;
    assert_eq!((card.status.as_str(), card.version), ("frozen", 1));
    assert_eq!(outbox_count(&pool, "c-1").await, 1);
    assert_eq!(callback_logs(&pool, "c-1").await, 1);

    // And through the queue: 20 more deliveries of the same callback via the intake (distinct
    // entry ids) are acknowledged without applying anything.
    for _ in 0..20 {
        app.producer().enqueue(&job).await.expect("enqueue");
    }
    wait_until(Duration::from_secs(20), "40 deliveries counted", || async {
        delivery_count(&pool, "cb-1").await == 40
    })
    .await;
    let card = load_card(&pool, "c-1").await;
    assert_eq!(card.version, 1);
    assert_eq!(outbox_count(&pool, "c-1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_callback_is_kept_with_its_reason_and_applied_when_delivered_again() {
    let app = app().await;
    let pool = app.db.pool.clone();
    let job = card_callback("cb-7", "c-9", "active");

    let first = callback::process(&app.ctx, &job).await.expect("delivery");
    assert_eq!(first, Delivery::Failed("unknown card c-9".to_owned()));
    let (state, reason): (String, Option<String>) = sqlx::query_as(
        "SELECT state, reason FROM inbound_callbacks WHERE channel = 'visa' AND callback_id = 'cb-7'",
    )
    .fetch_one(&pool)
    .await
    .expect("row");
    assert_eq!(
        (state.as_str(), reason.as_deref()),
        ("failed", Some("unknown card c-9"))
    );

    app.insert_card("c-9").await;
    // Redelivered through the CLI path and the app's worker.
    let dir = std::env::temp_dir().join(format!("cw-cb-{}", Uuid::new_v4()));
    std::fs::write(&dir, &job.body).expect("body file");
    cardworker::commands::payments::enqueue_callback(&app.ctx, "visa", "cb-7", &dir)
        .await
        .expect("enqueue callback");
    let _ = std::fs::remove_file(&dir);
    wait_until(Duration::from_secs(15), "the redelivery is applied", || async {
        count(&pool, "SELECT count(*) FROM inbound_callbacks WHERE state = 'applied' AND callback_id = $1", "cb-7")
            .await
            == 1
    })
    .await;
    let card = load_card(&pool, "c-9").await;
    assert_eq!((card.status.as_str(), card.version), ("active", 1));
    assert_eq!(delivery_count(&pool, "cb-7").await, 2);

    // Malformed bodies are kept as failed with the reason, never dropped.
    for (id, body) in [
        ("cb-bad-1", "not json"),
        (
            "cb-bad-2",
            r#"{"type":"card.status","card_ref":"c-9","status":"melted"}"#,
        ),
        ("cb-bad-3", r#"{"type":"refund"}"#),
    ] {
        let job = visa_callback(id, body.to_owned());
        let got = callback::process(&app.ctx, &job).await.expect("delivery");
        assert!(
            matches!(&got, Delivery::Failed(r) if r.starts_with("malformed body")),
            "{got:?}"
        );
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM inbound_callbacks WHERE state = 'failed' AND reason LIKE 'malformed body%' AND $1 = $1", "").await,
        3
    );

    // A payment result callback settles the payment once.
    let pid = insert_payment(&pool, "c-9").await;
    let pay = visa_callback("cb-pay", payment_result(pid, "accepted"));
    assert_eq!(
        callback::process(&app.ctx, &pay).await.expect("pay"),
        Delivery::Applied { changed: true }
    );
    assert_eq!(
        callback::process(&app.ctx, &pay).await.expect("pay"),
        Delivery::Duplicate
    );
    assert_eq!(payment_status(&pool, pid).await, "accepted");

    let records = cardworker::commands::investigate::investigate(&app.ctx, "c-9")
        .await
        .expect("investigate");
    assert_eq!(records.payments.len(), 1);
    assert_eq!(records.callbacks.len(), 3, "{:?}", records.callbacks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_and_a_poll_at_once_end_in_one_consistent_state_and_polling_never_writes_pending(
) {
    use cardworker::gateway::CardStatus;
    use cardworker::runner::RunJob;

    let app = app().await;
    let pool = app.db.pool.clone();
    for round in 0..10 {
        let card_ref = format!("c-race-{round}");
        app.insert_card(&card_ref).await;
        // Half the rounds they disagree on purpose (the poll sees frozen, the callback says
        // active); whatever the interleaving, the version check makes the card's final state the
        // last change applied, and every applied change is on record.
        let pushed = if round % 2 == 0 { "active" } else { "frozen" };
        app.sim.set_card_status(&card_ref, CardStatus::Frozen);
        let cb = card_callback(&format!("race-{round}"), &card_ref, pushed);
        app.start_chain(Task::CardStatus, &card_ref, Duration::from_secs(3600))
            .await;
        let poll = crate::polling::leased_status_poll(&app.ctx, &card_ref).await;
        let (ctx1, ctx2) = (app.ctx.clone(), app.ctx.clone());
        let a = tokio::spawn(async move { callback::process(&ctx1, &cb).await });
        let b = tokio::spawn(async move { poll.run(ctx2).await });
        let delivery = a.await.expect("join").expect("callback");
        b.await.expect("join").expect("poll");
        assert!(matches!(delivery, Delivery::Applied { .. }), "{delivery:?}");

        let card = load_card(&pool, &card_ref).await;
        let events: Vec<(String, i64)> = sqlx::query_as(
            "SELECT payload->>'status', (payload->>'version')::bigint FROM outbox_events
              WHERE aggregate_id = $1 AND event_type = 'card.status_changed' ORDER BY id",
        )
        .bind(&card_ref)
        .fetch_all(&pool)
        .await
        .expect("events");
        // One consistent state: one version step per announced change, and the card shows the
        // last one announced.
        assert_eq!(
            card.version,
            events.len() as i64,
            "round {round}: {events:?}"
        );
        let last = events.last().expect("at least one change");
        assert_eq!(
            (card.status.as_str(), card.version),
            (last.0.as_str(), last.1)
        );
        if pushed == "frozen" {
            assert_eq!(
                events.len(),
                1,
                "the same change seen twice is applied once"
            );
        }
        // Both facts are investigable: the callback (row and log) and the change(s).
        let inv = cardworker::commands::investigate::investigate(&app.ctx, &card_ref)
            .await
            .expect("investigate");
        assert_eq!(inv.callbacks.len(), 1);
        assert!(!inv.timeline.is_empty());
        assert_eq!(callback_logs(&pool, &card_ref).await, 1);
    }

    // Failed polls are recorded too, terminally: polling never writes a pending row.
    app.insert_card("c-fail").await;
    app.sim.fail_card("c-fail");
    app.start_chain(Task::CardStatus, "c-fail", Duration::from_secs(3600))
        .await;
    let poll = crate::polling::leased_status_poll(&app.ctx, "c-fail").await;
    poll.run(app.ctx.clone())
        .await
        .expect("failed poll recorded");
    let polls = count(
        &pool,
        "SELECT count(*) FROM integration_logs WHERE scenario LIKE '%poll%' AND $1 = $1",
        "",
    )
    .await;
    assert!(polls >= 2, "polls were recorded ({polls})");
    let pending = count(
        &pool,
        "SELECT count(*) FROM integration_logs WHERE state = 'pending' AND $1 = $1",
        "",
    )
    .await;
    assert_eq!(
        pending, 0,
        "neither polling nor callbacks ever write a pending log"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contradicting_callback_delivered_twice_is_audited_as_one_conflict() {
    // Found by `make chaos` (seed 105): the same contradicting callback processed twice wrote two
    // conflict audit events for one contradiction.
    let (app, pool, pid) = accepted_by_callback("cb-pay").await;
    let job = |id: &str, status: &str| visa_callback(id, payment_result(pid, status));
    let contra = job("cb-pay-contra", "rejected");
    assert!(matches!(
        callback::process(&app.ctx, &contra).await.expect("contra"),
        Delivery::Failed(r) if r.starts_with(callback::CONTRADICTION)
    ));
    assert_eq!(
        callback::process(&app.ctx, &contra).await.expect("again"),
        Delivery::Duplicate
    );
    let conflicts: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT e.id) FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          WHERE e.event_type = 'payment.conflict' AND r.resource_type = 'payment' AND r.resource_id = $1",
    )
    .bind(pid.to_string())
    .fetch_one(&pool)
    .await
    .expect("conflicts");
    assert_eq!(conflicts, 1);
    let deliveries: i32 = sqlx::query_scalar(
        "SELECT deliveries FROM inbound_callbacks WHERE callback_id = 'cb-pay-contra'",
    )
    .fetch_one(&pool)
    .await
    .expect("deliveries");
    assert_eq!(deliveries, 2, "the second delivery is counted");
    assert_eq!(payment_status(&pool, pid).await, "accepted");
}

/// The state and reason of one `visa` callback row.
async fn callback_row(pool: &PgPool, callback_id: &str) -> (String, String, i32) {
    sqlx::query_as(
        "SELECT state, coalesce(reason, ''), deliveries FROM inbound_callbacks
          WHERE channel = 'visa' AND callback_id = $1",
    )
    .bind(callback_id)
    .fetch_one(pool)
    .await
    .expect("callback row")
}

/// Ages every received callback by an hour: the sweep finds them due.
async fn age_callbacks(pool: &PgPool) {
    sqlx::query("UPDATE inbound_callbacks SET queued_at = now() - interval '1 hour'")
        .execute(pool)
        .await
        .expect("age");
}

/// A sweep of callbacks received more than 300 s ago: how many it re-enqueued.
async fn sweep(app: &TestApp) -> usize {
    callback::sweep_received(&app.ctx, Duration::from_secs(300), 50)
        .await
        .expect("sweep")
}

/// Waits up to 15 s until callback `callback_id` is failed.
async fn wait_for_callback_failed(pool: &PgPool, callback_id: &str) {
    let what = format!("callback {callback_id} failed");
    wait_until(Duration::from_secs(15), &what, || async {
        callback_row(pool, callback_id).await.0 == "failed"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contradicting_callback_delivered_twice_through_enqueue_callback_stays_final_and_is_never_swept_again(
) {
    // Found by `make chaos` (seeds 401 and 402): the second delivery set the contradiction back to
    // `received`, its job took it for a duplicate, and the sweep re-enqueued it forever.
    let (app, pool, pid) = accepted_by_callback("cb-decision").await;
    let body = |status: &str| payment_result(pid, status);
    let file = std::env::temp_dir().join(format!("cw-cb-{}", Uuid::new_v4()));
    std::fs::write(&file, body("rejected")).expect("body file");
    let deliver = || async {
        cardworker::commands::payments::enqueue_callback(&app.ctx, "visa", "cb-contra", &file)
            .await
            .expect("enqueue callback");
    };

    deliver().await;
    // Waits until the first delivery is failed as a contradiction.
    wait_for_callback_failed(&pool, "cb-contra").await;
    let (_, reason, _) = callback_row(&pool, "cb-contra").await;
    assert!(reason.starts_with(callback::CONTRADICTION), "{reason}");

    deliver().await;
    let _ = std::fs::remove_file(&file);
    let (state, reason_now, deliveries) = callback_row(&pool, "cb-contra").await;
    assert_eq!(
        (state.as_str(), reason_now.as_str(), deliveries),
        ("failed", reason.as_str(), 2),
        "the second delivery is counted and the contradiction kept as it was"
    );
    wait_until(
        Duration::from_secs(15),
        "no callback job queued or running",
        || async { app.queue_idle("callback").await },
    )
    .await;
    let (state, reason_after, deliveries) = callback_row(&pool, "cb-contra").await;
    assert_eq!(
        (state.as_str(), reason_after.as_str(), deliveries),
        ("failed", reason.as_str(), 2),
        "the job leaves the contradiction final"
    );
    age_callbacks(&pool).await;
    assert_eq!(sweep(&app).await, 0, "a sweep re-enqueues nothing");
    assert_eq!(
        count(
            &pool,
            "SELECT count(DISTINCT e.id) FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
              WHERE e.event_type = 'payment.conflict' AND r.resource_type = 'payment' AND r.resource_id = $1",
            &pid.to_string()
        )
        .await,
        1,
        "the conflict is audited once"
    );
    assert_eq!(payment_status(&pool, pid).await, "accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contradiction_a_redelivery_left_received_is_failed_again_by_its_next_job_and_swept_no_more(
) {
    // A contradiction that a redelivery recorded as `received` without its final state (as a
    // release whose `enqueue callback` reset contradictions leaves it): the sweep's job makes it
    // `failed` again.
    let (app, pool, pid) = accepted_by_callback("cb-decision").await;
    let job = |id: &str, status: &str| visa_callback(id, payment_result(pid, status));
    assert!(matches!(
        callback::process(&app.ctx, &job("cb-contra", "rejected")).await.expect("contra"),
        Delivery::Failed(r) if r.starts_with(callback::CONTRADICTION)
    ));
    let (_, reason, _) = callback_row(&pool, "cb-contra").await;
    sqlx::query(
        "UPDATE inbound_callbacks SET state = 'received', queued_at = now() - interval '1 hour'
          WHERE callback_id = 'cb-contra'",
    )
    .execute(&pool)
    .await
    .expect("left received");

    assert_eq!(sweep(&app).await, 1);
    // Waits until the swept job makes the contradiction failed again.
    wait_for_callback_failed(&pool, "cb-contra").await;
    assert_eq!(
        callback_row(&pool, "cb-contra").await,
        ("failed".to_owned(), reason, 1),
        "kept with its reason; the sweep counts no delivery"
    );
    age_callbacks(&pool).await;
    assert_eq!(sweep(&app).await, 0);
}
