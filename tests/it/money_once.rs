//! Money submitted once, whatever is repeated: an operator who runs `enqueue` twice, recovery
//! running while a slow attempt is still in flight, a concurrent POST answered 409, a retry that
//! races its own commit, a row the worker must refuse. Against real PostgreSQL and Redis and the
//! simulator, taught to act on a POST and answer late, and to answer 409 to a concurrent POST
//! with the same `Idempotency-Key`.
//!
//! Each test reads the simulator's request log: for every payment and approval, at most one
//! POST before any query that answered 404.

use std::sync::Arc;
use std::time::Duration;

use cardworker::approvals::{recovery as approval_recovery, submit as approval_submit};
use cardworker::context::AppContext;
use cardworker::gateway::CallKind;
use cardworker::payments::recovery as payment_recovery;
use cardworker::payments::submit as payment_submit;
use cardworker::queue::QueueName;
use cardworker::reliable::Thresholds;
use cardworker::sim::SimConfigPatch;
use uuid::Uuid;

use crate::harness::{spawn_app_with, wait_until, TestApp};
use crate::money_support::{
    audit_count, insert_approval, insert_payment, status_in, submit_approval, submit_payment,
    wait_for_status,
};

/// An app whose recovery crons never fire (recovery runs are called directly), with a Gateway
/// timeout of `timeout_ms`.
async fn app(timeout_ms: u64) -> TestApp {
    spawn_app_with(|cfg| {
        cfg.payments.recovery_cron = "0 0 0 1 1 *".to_owned();
        cfg.approvals.recovery_cron = "0 0 0 1 1 *".to_owned();
        cfg.gateway.timeout_ms = timeout_ms;
        cfg.polling.handler_timeout_secs = timeout_ms / 1000 + 2;
        cfg.polling.lease_ttl_secs = timeout_ms / 1000 + 8;
    })
    .await
}

/// [`app`], its pool, and a payment for card `c-1` in it.
async fn app_with_payment(timeout_ms: u64) -> (TestApp, sqlx::PgPool, Uuid) {
    let app = app(timeout_ms).await;
    let pool = app.db.pool.clone();
    let id = insert_payment(&pool, "c-1").await;
    (app, pool, id)
}

/// Recovery as if `recovery_after_secs` were 0: everything undecided is due at once.
const AT_ONCE: Thresholds = Thresholds {
    undecided: Duration::ZERO,
    waiting: Duration::ZERO,
};

fn knobs(app: &TestApp, patch: SimConfigPatch) {
    app.sim.update_config(&patch).expect("simulator knobs");
}

/// The Gateway calls about `id`, in order, as the simulator logged them: `POST` (with
/// `Idempotency-Key = id`) or `GET`.
fn calls(app: &TestApp, id: Uuid) -> Vec<&'static str> {
    let id = id.to_string();
    app.sim
        .recent_requests()
        .iter()
        .filter_map(|r| match r.call {
            CallKind::PaymentSubmit | CallKind::ApprovalSubmit
                if r.idempotency_key.as_deref() == Some(id.as_str()) =>
            {
                Some("POST")
            }
            CallKind::PaymentQuery | CallKind::ApprovalQuery if r.path.ends_with(&id) => {
                Some("GET")
            }
            _ => None,
        })
        .collect()
}

/// An app with card `c-1` and a Gateway timeout of 5 s, whose Gateway holds a POST `delay_ms`
/// before it acts (a GET meanwhile answers 404) and answers 409 to a concurrent POST with the
/// same key.
async fn acting_late(delay_ms: u64) -> TestApp {
    let app = app(5_000).await;
    app.insert_card("c-1").await;
    knobs(
        &app,
        SimConfigPatch {
            post_act_delay_ms: Some(delay_ms),
            conflict_concurrent_posts: Some(true),
            ..SimConfigPatch::default()
        },
    );
    app
}

/// Waits up to `limit_secs` until the Gateway calls about `id` are `want` ([`calls`]).
async fn wait_for_calls(app: &TestApp, id: Uuid, want: &[&str], limit_secs: u64) {
    let what = format!("the calls about {id} to be {want:?}");
    wait_until(Duration::from_secs(limit_secs), &what, || async {
        calls(app, id) == want
    })
    .await;
}

/// Sets the columns of payment `id` as `set` says (an SQL `SET` list).
async fn set_payment(pool: &sqlx::PgPool, id: Uuid, set: &str) {
    sqlx::query(&format!("UPDATE payments SET {set} WHERE payment_id = $1"))
        .bind(id)
        .execute(pool)
        .await
        .expect(set);
}

fn late_answers(app: &TestApp) {
    // The Gateway acts at once and answers after 3 s; the client gives up after 2 s.
    knobs(
        app,
        SimConfigPatch {
            post_answer_delay_ms: Some(3_000),
            ..SimConfigPatch::default()
        },
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_payment_again_on_an_unknown_payment_queries_it_and_never_posts_twice() {
    let (app, pool, id) = app_with_payment(2_000).await;
    late_answers(&app);

    cardworker::commands::payments::enqueue_payment(&app.ctx, id)
        .await
        .expect("enqueue payment");
    // Waits until the late answer leaves the payment unknown.
    wait_for_status(&pool, "payments", id, "unknown", 20).await;

    // The operator runs it again: the row is queried, never POSTed again.
    cardworker::commands::payments::enqueue_payment(&app.ctx, id)
        .await
        .expect("enqueue payment again");
    assert_eq!(status_in(&pool, "payments", id).await, "accepted");
    assert_eq!(calls(&app, id), ["POST", "GET"]);
    assert_eq!(app.sim.submissions(id), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_approval_again_on_an_unknown_approval_queries_it_and_never_posts_twice() {
    let app = app(2_000).await;
    let pool = app.db.pool.clone();
    app.insert_card("c-1").await;
    late_answers(&app);
    let id = insert_approval(&pool, "c-1", "issue", None).await;

    cardworker::commands::approvals::enqueue_approval(&app.ctx, id, None)
        .await
        .expect("enqueue approval");
    // Waits until the late answer leaves the approval unknown.
    wait_for_status(&pool, "approvals", id, "unknown", 20).await;

    cardworker::commands::approvals::enqueue_approval(&app.ctx, id, None)
        .await
        .expect("enqueue approval again");
    assert_eq!(status_in(&pool, "approvals", id).await, "approved");
    assert_eq!(calls(&app, id), ["POST", "GET"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_on_a_pending_row_posts_nothing_before_its_deadline_and_queries_after_it() {
    let (app, pool, id) = app_with_payment(2_000).await;
    // A worker took it and may still be calling (or died mid-call): pending, deadline ahead.
    let in_flight =
        "status = 'pending', submissions = 1, attempt_deadline = now() + interval '1 hour'";
    set_payment(&pool, id, in_flight).await;
    cardworker::commands::payments::enqueue_payment(&app.ctx, id)
        .await
        .expect("enqueue on a pending payment exits 0");
    assert_eq!(status_in(&pool, "payments", id).await, "pending");
    assert!(calls(&app, id).is_empty(), "{:?}", calls(&app, id));

    // Past its deadline the attempt has certainly ended: asked now; never seen, so resubmitted.
    set_payment(&pool, id, "attempt_deadline = now() - interval '1 second'").await;
    cardworker::commands::payments::enqueue_payment(&app.ctx, id)
        .await
        .expect("enqueue after the deadline");
    // Waits until resubmitted and accepted.
    wait_for_status(&pool, "payments", id, "accepted", 20).await;
    assert_eq!(calls(&app, id), ["GET", "POST"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_never_queries_or_resubmits_an_attempt_still_in_flight() {
    // The POST is held 2 s before the Gateway acts (a GET meanwhile answers 404), within the
    // client's 5 s timeout; a concurrent POST with the same key would be answered 409.
    let app = acting_late(2_000).await;
    let pool = app.db.pool.clone();
    let id = insert_approval(&pool, "c-1", "issue", None).await;
    let ctx: Arc<AppContext> = app.ctx.clone();
    let attempt = tokio::spawn(async move { submit_approval(&ctx, id).await });
    // Waits until the POST is on the wire.
    wait_for_calls(&app, id, &["POST"], 10).await;
    assert_eq!(status_in(&pool, "approvals", id).await, "pending");

    // Recovery with recovery_after_secs at 0 leaves it alone: the attempt may still answer.
    let report = approval_recovery::recover(&app.ctx, AT_ONCE, 50)
        .await
        .expect("recovery");
    assert_eq!(report.examined, 0, "{report:?}");

    attempt.await.expect("join").expect("submission");
    wait_for_status(&pool, "approvals", id, "approved", 10).await;
    assert_eq!(calls(&app, id), ["POST"]);
    assert_eq!(
        audit_count(&pool, "approval", id, "approval.conflict").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_to_an_idempotent_post_leaves_the_row_unknown_for_recovery_never_failed() {
    let app = acting_late(1_500).await;
    let pool = app.db.pool.clone();
    let approval = insert_approval(&pool, "c-1", "issue", None).await;
    let payment = insert_payment(&pool, "c-1").await;

    // Another request with the same keys is still being processed by the Gateway.
    let base = app.sim_handle.base_url();
    let http = reqwest::Client::new();
    let earlier = {
        let (http, base) = (http.clone(), base.clone());
        tokio::spawn(async move {
            let a = http
                .post(format!("{base}/v1/approvals"))
                .header("Idempotency-Key", approval.to_string())
                .json(&serde_json::json!({"approval_id": approval, "card_ref": "c-1", "kind": "issue"}))
                .send();
            let p = http
                .post(format!("{base}/v1/payments"))
                .header("Idempotency-Key", payment.to_string())
                .json(&serde_json::json!({"payment_id": payment, "card_ref": "c-1", "amount_minor": 1234, "currency": "CNY"}))
                .send();
            let (a, p) = tokio::join!(a, p);
            (
                a.map(|r| r.status().as_u16()),
                p.map(|r| r.status().as_u16()),
            )
        })
    };
    wait_until(
        Duration::from_secs(10),
        "both earlier POSTs in progress",
        || async { calls(&app, approval).len() == 1 && calls(&app, payment).len() == 1 },
    )
    .await;

    let a = submit_approval(&app.ctx, approval)
        .await
        .expect("approval submission");
    let p = submit_payment(&app.ctx, payment)
        .await
        .expect("payment submission");
    assert!(
        matches!(a, approval_submit::Submitted::Unknown { .. }),
        "{a:?}"
    );
    assert!(
        matches!(p, payment_submit::Submitted::Unknown { .. }),
        "{p:?}"
    );
    assert_eq!(status_in(&pool, "approvals", approval).await, "unknown");
    assert_eq!(status_in(&pool, "payments", payment).await, "unknown");
    let (ea, ep) = earlier.await.expect("join");
    assert_eq!((ea.ok(), ep.ok()), (Some(200), Some(200)));

    // Recovery asks and settles both from the Gateway's record, without another POST.
    let report = approval_recovery::recover(&app.ctx, AT_ONCE, 50)
        .await
        .expect("approval recovery");
    assert_eq!(report.settled, 1, "{report:?}");
    let report = payment_recovery::recover(&app.ctx, Duration::ZERO, 50)
        .await
        .expect("payment recovery");
    assert_eq!(report.settled, 1, "{report:?}");
    assert_eq!(status_in(&pool, "approvals", approval).await, "approved");
    assert_eq!(status_in(&pool, "payments", payment).await, "accepted");
    assert_eq!(calls(&app, approval), ["POST", "POST", "GET"]);
    assert_eq!(calls(&app, payment), ["POST", "POST", "GET"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_scheduled_only_after_the_outcome_it_follows_has_committed() {
    let (mut app, pool, id) = app_with_payment(2_000).await;
    // No worker takes the retry: what is scheduled stays in Redis for the test to count.
    app.stop().await.expect("stop the worker");
    let mut config = (*app.ctx.config).clone();
    // Nothing listens there: the request is never received, which schedules a retry.
    config.gateway.base_url = "http://127.0.0.1:9".into();
    let ctx = AppContext::connect(config).await.expect("context");
    // PostgreSQL refuses the outcome ("back to requested") every time it is written.
    for sql in [
        "CREATE FUNCTION refuse_requested() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'outcome refused by the test'; END $$",
        "CREATE TRIGGER refuse_requested BEFORE UPDATE ON payments FOR EACH ROW
           WHEN (OLD.status = 'pending' AND NEW.status = 'requested')
           EXECUTE FUNCTION refuse_requested()",
    ] {
        sqlx::query(sql).execute(&pool).await.expect("trigger");
    }

    let outcome = submit_payment(&ctx, id).await;
    assert!(
        outcome.is_err(),
        "the outcome could not be recorded: {outcome:?}"
    );
    let queue = QueueName::new(&ctx.config.redis.key_prefix, "payment");
    let mut conn = ctx.redis.clone();
    let waiting = cardworker::queue::intake::waiting(&mut conn, &queue)
        .await
        .expect("queue");
    assert_eq!(
        waiting, 0,
        "a retry was scheduled for an outcome that never committed"
    );
    // The attempt stays open; recovery settles it once its deadline has passed.
    assert_eq!(status_in(&pool, "payments", id).await, "pending");

    // With the outcome accepted by PostgreSQL, the retry follows the commit.
    sqlx::query("DROP TRIGGER refuse_requested ON payments")
        .execute(&pool)
        .await
        .expect("drop trigger");
    set_payment(&pool, id, "status = 'requested'").await;
    let outcome = submit_payment(&ctx, id).await.expect("submission");
    assert!(
        matches!(
            outcome,
            payment_submit::Submitted::Failed {
                retry_in: Some(_),
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(status_in(&pool, "payments", id).await, "requested");
    let waiting = cardworker::queue::intake::waiting(&mut conn, &queue)
        .await
        .expect("queue");
    assert_eq!(waiting, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_worker_refuses_is_failed_once_with_its_reason_and_never_sent() {
    let app = app(2_000).await;
    let pool = app.db.pool.clone();
    app.insert_card("c-1").await;
    let no_card = insert_approval(&pool, "c-nowhere", "issue", None).await;
    let bad_kind = insert_approval(&pool, "c-1", "upgrade", None).await;
    let no_amount = insert_approval(&pool, "c-1", "limit_change", None).await;
    let rows = [no_card, bad_kind, no_amount];

    // The CLI refuses them (exit 1) and says why.
    let mut cli_reasons = Vec::new();
    for id in rows {
        let err = cardworker::commands::approvals::enqueue_approval(&app.ctx, id, None)
            .await
            .expect_err("refused");
        assert_eq!(err.exit_code(), 1);
        cli_reasons.push(err.to_string());
    }

    // Recovery finds them (their job lost, say): one query each, then final `failed`, the
    // job's reason stored, nothing POSTed; a second run leaves them alone.
    for _ in 0..2 {
        sqlx::query("UPDATE approvals SET updated_at = now() - interval '1 hour'")
            .execute(&pool)
            .await
            .expect("age");
        approval_recovery::recover(&app.ctx, AT_ONCE, 50)
            .await
            .expect("recovery");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for (id, cli) in rows.iter().zip(&cli_reasons) {
        wait_for_status(&pool, "approvals", *id, "failed", 10).await;
        let reason: Option<String> =
            sqlx::query_scalar("SELECT failure_reason FROM approvals WHERE approval_id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .expect("reason");
        let reason = reason.expect("a refused row keeps its reason");
        assert!(
            cli.contains(&reason),
            "CLI said {cli:?}, the row keeps {reason:?}"
        );
        assert_eq!(calls(&app, *id), ["GET"], "never POSTed");
        assert_eq!(
            audit_count(&pool, "approval", *id, "approval.submit_refused").await,
            1
        );
        let decided: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1
               AND event_type = 'approval.decided'",
        )
        .bind(id.to_string())
        .fetch_one(&pool)
        .await
        .expect("outbox");
        assert_eq!(decided, 1);
    }
    assert!(
        cli_reasons[0].contains("unknown card"),
        "{}",
        cli_reasons[0]
    );

    // The job refuses the same rows in its own transaction.
    let fresh = insert_approval(&pool, "c-nowhere-either", "issue", None).await;
    let done = submit_approval(&app.ctx, fresh).await.expect("submission");
    assert!(
        matches!(&done, approval_submit::Submitted::Refused(r) if r.contains("unknown card")),
        "{done:?}"
    );
    assert_eq!(status_in(&pool, "approvals", fresh).await, "failed");
    assert!(calls(&app, fresh).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_to_a_query_sent_before_the_latest_post_never_resubmits() {
    // Found by `make chaos` (seed 108): recovery's query left while the row was `unknown`; another
    // path POSTed it again meanwhile (its answer unreadable: still `unknown`), and the query's 404,
    // about the attempt before that POST, came back last and resubmitted: a second POST with no
    // 404 after the first.
    let (app, pool, id) = app_with_payment(10_000).await;
    let unknown = "status = 'unknown', submissions = 1, updated_at = now() - interval '1 hour'";
    set_payment(&pool, id, unknown).await;
    app.sim.set_latency(1_500, 0);
    let ctx = app.ctx.clone();
    let run =
        tokio::spawn(async move { payment_recovery::recover(&ctx, Duration::ZERO, 50).await });
    // Waits until the recovery query on the wire.
    wait_for_calls(&app, id, &["GET"], 10).await;
    // A second attempt goes out while the query is on the wire, its answer lost too.
    set_payment(
        &pool,
        id,
        "submissions = 2, updated_at = now() - interval '1 hour'",
    )
    .await;
    let report = run.await.expect("join").expect("recovery");
    assert_eq!(
        (report.resubmitted, report.skipped),
        (0, 1),
        "the 404 is about the first attempt: {report:?}"
    );
    assert_eq!(status_in(&pool, "payments", id).await, "unknown");
    // The next run asks again, about the latest attempt.
    app.sim.set_latency(0, 0);
    let report = payment_recovery::recover(&app.ctx, Duration::ZERO, 50)
        .await
        .expect("recovery");
    assert_eq!(report.resubmitted, 1, "{report:?}");
}

/// `cardworker enqueue payment|approval --…-id ID` as a process of its own, against `app`'s
/// database, prefix and simulator, on a host whose clock is `offset_secs` ahead (negative:
/// behind) of the database's; its stdout.
async fn enqueue_from_a_skewed_host(
    app: &TestApp,
    what: &str,
    id: Uuid,
    offset_secs: i64,
) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(["enqueue", what, &format!("--{what}-id"), &id.to_string()])
        .env_remove("CARDWORKER_CONFIG")
        .env("CARDWORKER__DATABASE__URL", &app.db.url)
        .env("CARDWORKER__REDIS__URL", crate::harness::redis_url())
        .env("CARDWORKER__REDIS__KEY_PREFIX", &app.redis.prefix)
        .env("CARDWORKER__GATEWAY__BASE_URL", app.sim_handle.base_url())
        .env(
            "CARDWORKER__GATEWAY__TIMEOUT_MS",
            app.ctx.config.gateway.timeout_ms.to_string(),
        )
        .env(cardworker::clock::TEST_OFFSET_ENV, offset_secs.to_string())
        .output()
        .await
        .expect("run cardworker enqueue");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "enqueue {what} {id} exited {:?}: {stdout}{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The operator's `enqueue` from a host whose clock is `offset_secs` off, on three rows:
/// payment `held`, whose POST the Gateway holds (a query meanwhile answers 404), and payment
/// `died` and approval `died_approval`, whose attempts died before their POSTs left, their
/// deadlines 5 s past on the database's clock. Every row ends decided with exactly one POST: the
/// held one never queried nor POSTed again while its attempt may still be in flight, the dead
/// ones queried and POSTed once.
async fn each_row_is_posted_exactly_once_from_a_host_whose_clock_is_off_by(offset_secs: i64) {
    // The Gateway holds every POST 6 s before it acts; the client waits up to 10 s, so an
    // attempt's deadline is 40 s after its pending commit.
    let app = app(10_000).await;
    let pool = app.db.pool.clone();
    app.insert_card("c-1").await;
    knobs(
        &app,
        SimConfigPatch {
            post_act_delay_ms: Some(6_000),
            conflict_concurrent_posts: Some(true),
            ..SimConfigPatch::default()
        },
    );
    let held = insert_payment(&pool, "c-1").await;
    let died = insert_payment(&pool, "c-1").await;
    let died_approval = insert_approval(&pool, "c-1", "issue", None).await;
    for (table, column, id) in [
        ("payments", "payment_id", died),
        ("approvals", "approval_id", died_approval),
    ] {
        sqlx::query(&format!(
            "UPDATE {table} SET status = 'pending', submissions = 1,
                    attempt_deadline = now() - interval '5 seconds',
                    updated_at = now() - interval '45 seconds'
              WHERE {column} = $1"
        ))
        .bind(id)
        .execute(&pool)
        .await
        .expect("an attempt that died before its POST left");
    }

    cardworker::commands::payments::enqueue_payment(&app.ctx, held)
        .await
        .expect("enqueue payment");
    // Waits until the held payment's POST is on the wire.
    wait_for_calls(&app, held, &["POST"], 20).await;
    assert_eq!(status_in(&pool, "payments", held).await, "pending");

    let said = enqueue_from_a_skewed_host(&app, "payment", held, offset_secs).await;
    assert!(said.contains("may still be in flight"), "{said}");
    let said = enqueue_from_a_skewed_host(&app, "payment", died, offset_secs).await;
    assert!(said.contains("queried the Gateway now"), "{said}");
    let said = enqueue_from_a_skewed_host(&app, "approval", died_approval, offset_secs).await;
    assert!(said.contains("queried the Gateway now"), "{said}");

    wait_until(Duration::from_secs(40), "every row decided", || async {
        status_in(&pool, "payments", held).await == "accepted"
            && status_in(&pool, "payments", died).await == "accepted"
            && status_in(&pool, "approvals", died_approval).await == "approved"
    })
    .await;
    assert_eq!(
        calls(&app, held),
        ["POST"],
        "held: never queried nor POSTed again"
    );
    assert_eq!(
        calls(&app, died),
        ["GET", "POST"],
        "died: queried, then POSTed once"
    );
    assert_eq!(calls(&app, died_approval), ["GET", "POST"]);
    assert_eq!(app.sim.submissions(held), 1);
    assert_eq!(app.sim.submissions(died), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_from_a_host_whose_clock_runs_120_s_ahead_posts_each_payment_and_approval_exactly_once(
) {
    each_row_is_posted_exactly_once_from_a_host_whose_clock_is_off_by(120).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_from_a_host_whose_clock_runs_120_s_behind_posts_each_payment_and_approval_exactly_once(
) {
    each_row_is_posted_exactly_once_from_a_host_whose_clock_is_off_by(-120).await;
}
