//! Operator actions name who did them and commit with their audit event, or not at all: the
//! command line records `CARDWORKER_OPERATOR` (else the OS user) `via` `cli`, and an action whose
//! audit event cannot be written is not carried out, and says so (exit 1).

use std::process::Command;

use crate::harness::{redis_url, spawn_app_with, TestApp};

/// `cardworker ARGS` against `app`'s Redis prefix and the database at `database_url`.
fn cli(app: &TestApp, database_url: &str, operator: &str, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(args)
        .env_remove("CARDWORKER_CONFIG")
        .env("CARDWORKER__DATABASE__URL", database_url)
        .env("CARDWORKER__REDIS__URL", redis_url())
        .env("CARDWORKER__REDIS__KEY_PREFIX", &app.redis.prefix)
        .env("CARDWORKER_OPERATOR", operator)
        .output()
        .expect("run cardworker")
}

async fn paused(app: &TestApp, task: &str) -> bool {
    let view = app.ctx.budget.show().await.expect("budget");
    serde_json::to_value(view).expect("json")["tasks"][task]["paused"] == serde_json::json!(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_audit_event_cannot_be_written_is_not_carried_out_and_says_so() {
    let app = spawn_app_with(|_| {}).await;
    // Nothing listens on port 9: PostgreSQL is unreachable for this command.
    let out = cli(
        &app,
        "postgres://root@127.0.0.1:9/nowhere?connect_timeout=2",
        "Alice",
        &[
            "budget",
            "pause",
            "--task",
            "all",
            "--reason",
            "gateway maintenance",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not carried out"), "{stderr}");
    assert!(!paused(&app, "carddata").await, "the brake was not applied");
    assert!(!paused(&app, "card_status").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_action_is_recorded_under_the_named_operator_via_the_cli_with_its_outcome() {
    let app = spawn_app_with(|_| {}).await;
    let out = cli(
        &app,
        &app.db.url,
        "Alice",
        &[
            "budget",
            "pause",
            "--task",
            "carddata",
            "--reason",
            "incident 7",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(paused(&app, "carddata").await);
    let (actor, via, reason): (String, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT actor, details->>'via', details->>'reason' FROM audit_events
          WHERE event_type = 'operator.budget_pause'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("the operator.budget_pause event");
    assert_eq!(actor, "operator:Alice");
    assert_eq!(via.as_deref(), Some("cli"));
    assert_eq!(reason.as_deref(), Some("incident 7"));

    let out = cli(
        &app,
        &app.db.url,
        "Bob",
        &["budget", "clear", "--task", "carddata"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (actor, had): (String, Option<bool>) = sqlx::query_as(
        "SELECT actor, (details->'outcome'->>'had_override')::bool FROM audit_events
          WHERE event_type = 'operator.budget_clear'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("the operator.budget_clear event");
    assert_eq!(actor, "operator:Bob");
    assert_eq!(had, Some(false), "what the action found is on its event");
}
