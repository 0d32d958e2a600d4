//! Approvals on the reliable path (issue 15), against real PostgreSQL and Redis and a scripted
//! Gateway: submitted once however often it is asked for, settled by recovery after a worker
//! died mid-call, decided once however the decision arrives.

use std::sync::Arc;
use std::time::Duration;

use cardworker::approvals::recovery;
use cardworker::approvals::submit::Submitted;
use cardworker::context::AppContext;
use cardworker::payments::callback::{self, Delivery};
use cardworker::reliable::{RecoveryReport, Thresholds};
use cardworker_jobs::ProcessCallback;
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::{metric_value, spawn_app_with, start_in_process, wait_until, TestApp};
use crate::money_support::{
    age, approval_status, audit_count, insert_approval, log_states, submit_approval,
    wait_for_status,
};
use crate::scripted_gateway::{Script, ScriptedGateway};

/// An app on the scripted Gateway whose recovery crons never fire during a test (recovery runs
/// are called directly).
async fn app() -> (TestApp, ScriptedGateway) {
    let gw = ScriptedGateway::start().await;
    let url = gw.url.clone();
    let app = spawn_app_with(|cfg| {
        cfg.gateway.base_url = url.into();
        cfg.payments.recovery_cron = "0 0 0 1 1 *".to_owned();
        cfg.approvals.recovery_cron = "0 0 0 1 1 *".to_owned();
    })
    .await;
    (app, gw)
}

const DUE: Thresholds = Thresholds {
    undecided: Duration::from_secs(300),
    waiting: Duration::from_secs(900),
};

async fn count(pool: &PgPool, sql: &str, id: Uuid) -> i64 {
    sqlx::query_scalar(sql)
        .bind(id.to_string())
        .fetch_one(pool)
        .await
        .expect(sql)
}

async fn decided_events(pool: &PgPool, id: Uuid) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM outbox_events WHERE aggregate_type = 'approval'
           AND aggregate_id = $1 AND event_type = 'approval.decided'",
        id,
    )
    .await
}

/// [`app`] with card `c-1`, and its pool.
async fn app_with_card() -> (TestApp, ScriptedGateway, PgPool) {
    let (app, gw) = app().await;
    let pool = app.db.pool.clone();
    app.insert_card("c-1").await;
    (app, gw, pool)
}

/// Asserts that approval `id` kept its first decision, `status`, announced once, and that the
/// other decision is on record as one conflict, however often it was delivered.
async fn first_decision_won(pool: &PgPool, id: Uuid, status: &str) {
    assert_eq!(
        approval_status(pool, id).await,
        status,
        "the first decision wins"
    );
    assert_eq!(decided_events(pool, id).await, 1);
    assert_eq!(
        audit_count(pool, "approval", id, "approval.conflict").await,
        1,
        "one conflict naming both, however often the other decision is delivered"
    );
}

/// A recovery pass of approvals as [`DUE`] says.
async fn recover(app: &TestApp) -> cardworker::reliable::RecoveryReport {
    recovery::recover(&app.ctx, DUE, 50)
        .await
        .expect("recovery")
}

/// The states of the approval's submission logs, oldest first.
async fn submit_log(pool: &PgPool, id: Uuid) -> Vec<String> {
    log_states(pool, "approval", id, "approval_submit").await
}

/// An approval of `kind` for card `c-1`, which the Gateway answers as `script` says, its
/// submission spawned ([`spawn_submit`]) and its POST at the Gateway.
async fn at_the_gateway(
    app: &TestApp,
    gw: &ScriptedGateway,
    kind: &str,
    script: Script,
) -> (Uuid, tokio::task::JoinHandle<anyhow::Result<Submitted>>) {
    let id = insert_approval(&app.db.pool, "c-1", kind, None).await;
    gw.script(id, script);
    let task = spawn_submit(app.ctx.clone(), id);
    posted_once(gw, id, "the POST at the Gateway").await;
    (id, task)
}

/// Waits up to 10 s until the Gateway has the one POST of `id` (`what` says which moment).
async fn posted_once(gw: &ScriptedGateway, id: Uuid, what: &str) {
    wait_until(Duration::from_secs(10), what, || async {
        gw.posts(id) == 1
    })
    .await;
}

/// One run of the submission job for `id`, as the worker runs it.
async fn submit_now(ctx: &AppContext, id: Uuid) -> Submitted {
    submit_approval(ctx, id).await.expect("submit")
}

/// The submission job for `id` in a task of its own (which a test may abort: a kill mid-call).
fn spawn_submit(
    ctx: Arc<AppContext>,
    id: Uuid,
) -> tokio::task::JoinHandle<anyhow::Result<Submitted>> {
    tokio::spawn(async move { submit_approval(&ctx, id).await })
}

fn every_key_is_the_id(gw: &ScriptedGateway, id: Uuid) {
    let keys = gw.seen(id).keys;
    assert!(!keys.is_empty());
    assert!(
        keys.iter()
            .all(|k| k.as_deref() == Some(id.to_string().as_str())),
        "{keys:?}"
    );
}

fn approval_callback(callback_id: &str, id: Uuid, status: &str) -> ProcessCallback {
    ProcessCallback {
        channel: "visa".to_owned(),
        callback_id: callback_id.to_owned(),
        body: format!(
            r#"{{"type":"approval.result","approval_id":"{id}","status":"{status}","channel_ref":"ch_cb"}}"#
        ),
        retries: 0,
        recorded: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_asked_for_five_times_in_a_row_and_from_two_workers_at_once_is_posted_once_with_its_key(
) {
    let (app, gw, pool) = app_with_card().await;

    // Five `enqueue approval` in a row: one POST.
    let id = insert_approval(&pool, "c-1", "issue", None).await;
    for _ in 0..5 {
        cardworker::commands::approvals::enqueue_approval(&app.ctx, id, None)
            .await
            .expect("enqueue approval");
    }
    wait_for_status(&pool, "approvals", id, "approved", 20).await;
    for _ in 0..5 {
        let again = submit_now(&app.ctx, id).await;
        assert_eq!(again, Submitted::AlreadySettled("approved".to_owned()));
    }
    assert_eq!(gw.posts(id), 1, "one POST however often it is asked for");
    every_key_is_the_id(&gw, id);

    // A second worker process on the same database and prefix; both submit every approval of
    // a batch at the same moment, and both consume the queue.
    let (second, _addr, stop_second, join_second) =
        start_in_process(app.ctx.config.as_ref().clone()).await;
    let ids: Vec<Uuid> = {
        let mut ids = Vec::new();
        for _ in 0..10 {
            ids.push(insert_approval(&pool, "c-1", "limit_change", Some(50_000)).await);
        }
        ids
    };
    let mut tasks = Vec::new();
    for id in &ids {
        for ctx in [app.ctx.clone(), second.clone()] {
            let id = *id;
            tasks.push(spawn_submit(ctx, id));
            // And the same through each process's queue.
        }
        cardworker::commands::approvals::enqueue_approval(&second, *id, None)
            .await
            .expect("enqueue approval");
    }
    for task in tasks {
        task.await.expect("join").expect("submit");
    }
    for id in &ids {
        wait_for_status(&pool, "approvals", *id, "approved", 20).await;
    }
    // The queued jobs have run: none waits in the intake and none is left in apalis (a job's
    // acknowledgement deletes it there). Nothing more was sent.
    wait_until(
        Duration::from_secs(20),
        "every queued approval job ran",
        || app.queue_idle("approval"),
    )
    .await;
    for id in &ids {
        assert_eq!(gw.posts(*id), 1, "approval {id}: one POST from two workers");
        every_key_is_the_id(&gw, *id);
        assert_eq!(decided_events(&pool, *id).await, 1);
        assert_eq!(
            gw.seen(*id).keys.len(),
            1,
            "the limit_change was sent with its key once"
        );
    }
    let _ = stop_second.send(());
    let _ = join_second.await;
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_the_post_after_the_gateway_acted_is_settled_by_recovery_without_a_second_post(
) {
    let (app, gw, pool) = app_with_card().await;
    let (id, task) = at_the_gateway(&app, &gw, "unfreeze", Script::ActThenHang("declined")).await;
    // By the time the Gateway has the request, the pending row is committed.
    assert_eq!(approval_status(&pool, id).await, "pending");
    assert_eq!(submit_log(&pool, id).await, ["pending"]);
    task.abort();
    assert!(task.await.expect_err("aborted").is_cancelled());
    assert_eq!(
        approval_status(&pool, id).await,
        "pending",
        "evidence survives the kill"
    );

    // Not yet due.
    let report = recover(&app).await;
    assert_eq!(report, RecoveryReport::default());
    // A second submission while the attempt is open sends nothing.
    let again = submit_now(&app.ctx, id).await;
    assert!(matches!(again, Submitted::AttemptOpen { .. }), "{again:?}");

    age(&pool, "approvals").await;
    let report = recover(&app).await;
    assert_eq!(report.settled, 1, "{report:?}");
    assert_eq!(approval_status(&pool, id).await, "declined");
    assert_eq!(gw.posts(id), 1, "no second POST");
    assert_eq!(gw.seen(id).acted, 1);
    assert_eq!(submit_log(&pool, id).await, ["succeeded"]);
    assert_eq!(
        log_states(&pool, "approval", id, "approval_recovery_query").await,
        ["succeeded"]
    );
    assert_eq!(decided_events(&pool, id).await, 1);
    let (code, metrics) = app.get("/metrics").await;
    assert_eq!(code, 200);
    assert!(
        metric_value(
            &metrics,
            "cardworker_approval_decisions_total",
            &[("status", "declined"), ("via", "query")]
        ) >= 1.0,
        "the decision is counted by the way it arrived"
    );
    gw.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_the_post_reached_the_gateway_is_submitted_once_by_recovery_with_the_same_key(
) {
    let (app, gw, pool) = app_with_card().await;
    let (id, task) = at_the_gateway(&app, &gw, "issue", Script::LoseThenHang).await;
    task.abort();
    let _ = task.await;
    assert_eq!(approval_status(&pool, id).await, "pending");
    assert_eq!(gw.seen(id).acted, 0, "the Gateway never took it");

    gw.script(id, Script::Answer("approved"));
    age(&pool, "approvals").await;
    let report = recover(&app).await;
    assert_eq!(report.resubmitted, 1, "{report:?}");
    // Waits until resubmitted by the app's worker and approved.
    wait_for_status(&pool, "approvals", id, "approved", 20).await;
    assert_eq!(gw.seen(id).acted, 1, "submitted once");
    assert_eq!(gw.posts(id), 2, "the lost request and the one resubmission");
    every_key_is_the_id(&gw, id);
    assert_eq!(
        submit_log(&pool, id).await,
        ["failed", "succeeded"],
        "the dead attempt closed as never seen, the resubmission answered"
    );
    assert_eq!(decided_events(&pool, id).await, 1);
    gw.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_in_review_then_approved_by_a_callback_delivered_twenty_times_is_applied_once()
{
    let (app, gw, pool) = app_with_card().await;
    let id = insert_approval(&pool, "c-1", "limit_change", Some(900_000)).await;
    gw.script(id, Script::Answer("in_review"));
    let done = submit_now(&app.ctx, id).await;
    assert!(
        matches!(&done, Submitted::Answered { status, .. } if status == "in_review"),
        "{done:?}"
    );
    assert_eq!(approval_status(&pool, id).await, "in_review");
    assert_eq!(
        decided_events(&pool, id).await,
        0,
        "in_review is not a decision"
    );
    // Submitted and waiting: asked again, nothing is sent.
    cardworker::commands::approvals::enqueue_approval(&app.ctx, id, None)
        .await
        .expect("enqueue approval");
    assert_eq!(gw.posts(id), 1);

    // A recovery query while still in review changes nothing.
    age(&pool, "approvals").await;
    let report = recover(&app).await;
    assert_eq!((report.examined, report.left), (1, 1), "{report:?}");
    assert_eq!(approval_status(&pool, id).await, "in_review");

    // The channel decides; its callback arrives twenty times at once.
    gw.decide(id, "approved");
    let job = approval_callback("cb-approve", id, "approved");
    let ctx: Arc<AppContext> = app.ctx.clone();
    let mut deliveries = Vec::new();
    for _ in 0..20 {
        let ctx = ctx.clone();
        let job = job.clone();
        deliveries.push(tokio::spawn(
            async move { callback::process(&ctx, &job).await },
        ));
    }
    let mut applied = 0;
    for d in deliveries {
        match d.await.expect("join").expect("delivery") {
            Delivery::Applied { changed: true } => applied += 1,
            Delivery::Duplicate => {}
            other => panic!("unexpected delivery {other:?}"),
        }
    }
    assert_eq!(applied, 1);
    assert_eq!(approval_status(&pool, id).await, "approved");
    assert_eq!(decided_events(&pool, id).await, 1);
    assert_eq!(
        audit_count(&pool, "approval", id, "approval.conflict").await,
        0
    );
    // A later recovery run leaves the decided approval alone.
    age(&pool, "approvals").await;
    let report = recover(&app).await;
    assert_eq!(report.examined, 0);
    assert_eq!(decided_events(&pool, id).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_approved_racing_the_post_answer_declined_applies_one_decision_and_keeps_the_other_as_one_conflict(
) {
    let (app, gw, pool) = app_with_card().await;

    // The callback first, while the POST is in flight; then the POST's answer.
    let (first, post) = at_the_gateway(&app, &gw, "issue", Script::ActThenWait("declined")).await;
    let delivered = callback::process(&app.ctx, &approval_callback("cb-1", first, "approved"))
        .await
        .expect("callback");
    assert_eq!(delivered, Delivery::Applied { changed: true });
    // Now the POST's own answer arrives: declined.
    gw.release();
    let answered = post.await.expect("join").expect("submit");
    assert!(
        matches!(&answered, Submitted::Answered { status, .. } if status == "declined"),
        "{answered:?}"
    );
    first_decision_won(&pool, first, "approved").await;

    // The POST's answer first, then the callback that contradicts it.
    let second = insert_approval(&pool, "c-1", "issue", None).await;
    gw.script(second, Script::Answer("declined"));
    let done = submit_now(&app.ctx, second).await;
    assert!(
        matches!(&done, Submitted::Answered { status, .. } if status == "declined"),
        "{done:?}"
    );
    let conflicting = approval_callback("cb-2", second, "approved");
    for _ in 0..3 {
        let d = callback::process(&app.ctx, &conflicting)
            .await
            .expect("callback");
        assert!(
            matches!(
                d,
                Delivery::Applied { changed: false } | Delivery::Duplicate
            ),
            "{d:?}"
        );
    }
    first_decision_won(&pool, second, "declined").await;
    let details: serde_json::Value = sqlx::query_scalar(
        "SELECT e.details FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          WHERE r.resource_id = $1 AND e.event_type = 'approval.conflict'",
    )
    .bind(second.to_string())
    .fetch_one(&pool)
    .await
    .expect("conflict details");
    assert_eq!(details["recorded"], "declined");
    assert_eq!(details["arrived"], "approved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_post_answer_racing_a_callback_from_another_pod_applies_exactly_one_decision() {
    let (app, gw, pool) = app_with_card().await;
    let (second, _addr, stop_second, join_second) =
        start_in_process(app.ctx.config.as_ref().clone()).await;
    let mut ids = Vec::new();
    for i in 0..10 {
        let id = insert_approval(&pool, "c-1", "issue", None).await;
        gw.script(id, Script::Answer("declined"));
        let post = spawn_submit(app.ctx.clone(), id);
        let other = second.clone();
        let cb = approval_callback(&format!("race-{i}"), id, "approved");
        let callback = tokio::spawn(async move { callback::process(&other, &cb).await });
        post.await.expect("join").expect("submit");
        callback.await.expect("join").expect("callback");
        ids.push(id);
    }
    for id in ids {
        let s = approval_status(&pool, id).await;
        assert!(s == "approved" || s == "declined", "{s}");
        assert_eq!(decided_events(&pool, id).await, 1, "approval {id}");
        // Either the callback came first (then the POST, if it was sent, conflicted or was never
        // sent) or the POST did (then the callback conflicted).
        let conflicts = audit_count(&pool, "approval", id, "approval.conflict").await;
        assert!(conflicts <= 1, "approval {id}: {conflicts} conflicts");
        if gw.posts(id) == 1 {
            assert_eq!(conflicts, 1, "approval {id}: the loser is on record");
        }
    }
    // Both pods count into this process's one recorder: one decision per approval, whichever
    // path lost its transaction and tried again.
    let (code, metrics) = app.get("/metrics").await;
    assert_eq!(code, 200);
    let mut counted = 0.0;
    for status in ["approved", "declined"] {
        for via in ["response", "query", "callback"] {
            counted += metric_value(
                &metrics,
                "cardworker_approval_decisions_total",
                &[("status", status), ("via", via)],
            );
        }
    }
    assert_eq!(counted, 10.0, "{metrics}");
    let _ = stop_second.send(());
    let _ = join_second.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_for_an_approval_not_yet_known_is_failed_with_its_reason_and_applied_when_delivered_again(
) {
    let (app, _gw) = app().await;
    let pool = app.db.pool.clone();
    app.insert_card("c-1").await;
    let id = Uuid::new_v4();
    let job = approval_callback("cb-early", id, "approved");
    let first = callback::process(&app.ctx, &job).await.expect("callback");
    assert_eq!(first, Delivery::Failed(format!("unknown approval {id}")));
    sqlx::query("INSERT INTO approvals (approval_id, card_ref, kind) VALUES ($1, 'c-1', 'issue')")
        .bind(id)
        .execute(&pool)
        .await
        .expect("insert");
    let again = callback::process(&app.ctx, &job).await.expect("callback");
    assert_eq!(again, Delivery::Applied { changed: true });
    assert_eq!(approval_status(&pool, id).await, "approved");
    assert_eq!(decided_events(&pool, id).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbled_answer_is_unknown_a_refusal_is_failed_and_neither_is_submitted_twice() {
    let (app, gw, pool) = app_with_card().await;
    let garbled = insert_approval(&pool, "c-1", "issue", None).await;
    gw.script(garbled, Script::Garbled);
    let refused = insert_approval(&pool, "c-1", "issue", None).await;
    gw.script(refused, Script::Refuse);
    let five_xx = insert_approval(&pool, "c-1", "issue", None).await;
    gw.script(five_xx, Script::ActThen503("approved"));
    for id in [garbled, refused, five_xx] {
        submit_now(&app.ctx, id).await;
    }
    assert_eq!(
        approval_status(&pool, garbled).await,
        "unknown",
        "never a decision"
    );
    assert_eq!(approval_status(&pool, five_xx).await, "unknown");
    assert_eq!(
        approval_status(&pool, refused).await,
        "failed",
        "a 4xx is final"
    );
    assert_eq!(decided_events(&pool, garbled).await, 0);
    assert_eq!(decided_events(&pool, refused).await, 1);
    // Recovery settles the 5xx from the Gateway's record (it had acted) and resubmits the
    // garbled one (the Gateway has no record of it); the failed one is final.
    gw.script(garbled, Script::Answer("approved"));
    age(&pool, "approvals").await;
    let report = recover(&app).await;
    assert_eq!((report.settled, report.resubmitted), (1, 1), "{report:?}");
    assert_eq!(approval_status(&pool, five_xx).await, "approved");
    // Waits until resubmitted and approved.
    wait_for_status(&pool, "approvals", garbled, "approved", 20).await;
    assert_eq!(gw.posts(refused), 1);
    assert_eq!(gw.posts(five_xx), 1);
    for id in [garbled, refused, five_xx] {
        every_key_is_the_id(&gw, id);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_approval_or_an_unknown_card_is_refused_when_enqueued_and_nothing_is_queued() {
    let (app, gw, pool) = app_with_card().await;
    let unknown_kind = insert_approval(&pool, "c-1", "raise_everything", None).await;
    let no_amount = insert_approval(&pool, "c-1", "limit_change", None).await;
    let no_card = insert_approval(&pool, "c-nobody", "issue", None).await;
    for (id, expected) in [
        (unknown_kind, "unknown kind"),
        (no_amount, "limit_change needs amount_minor"),
        (no_card, "unknown card"),
        (Uuid::new_v4(), "unknown approval"),
    ] {
        let err = cardworker::commands::approvals::enqueue_approval(&app.ctx, id, None)
            .await
            .expect_err("refused");
        assert_eq!(err.exit_code(), 1);
        assert!(err.to_string().contains(expected), "{err}");
    }
    let queued: i64 = redis::cmd("ZCARD")
        .arg(format!(
            "{}:intake:approval",
            app.ctx.config.redis.key_prefix
        ))
        .query_async(&mut app.ctx.redis.clone())
        .await
        .expect("zcard");
    assert_eq!(queued, 0, "nothing queued");
    // The CLI changes nothing; the job refuses them too (a producer other than the CLI), makes
    // the row final `failed` and records why, once.
    for id in [unknown_kind, no_card] {
        assert_eq!(approval_status(&pool, id).await, "requested");
    }
    let done = submit_now(&app.ctx, no_amount).await;
    assert!(matches!(done, Submitted::Refused(_)), "{done:?}");
    let again = submit_now(&app.ctx, no_amount).await;
    assert!(matches!(again, Submitted::AlreadySettled(_)), "{again:?}");
    assert_eq!(
        audit_count(&pool, "approval", no_amount, "approval.submit_refused").await,
        1
    );
    assert_eq!(approval_status(&pool, no_amount).await, "failed");
    for id in [unknown_kind, no_amount, no_card] {
        assert_eq!(gw.posts(id), 0);
    }
}
