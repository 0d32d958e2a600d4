//! Operator actions name who did them, and none stands without its record: the command line
//! records `CARDWORKER_OPERATOR` (else the OS user) `via` `cli`; the request is committed before
//! the action (one that cannot be is not carried out, and says so, exit 1), and its outcome
//! after it (`applied` or `failed`); one whose outcome PostgreSQL does not take stays `requested`,
//! shown as outcome unknown by the CLI, `investigate` and the console.

use std::process::Command;

use crate::harness::{assert_success, redis_url, spawn_app, TestApp};

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

/// The details of the audit events of `event_type`, oldest first.
async fn operator_events(app: &TestApp, event_type: &str) -> Vec<serde_json::Value> {
    sqlx::query_scalar("SELECT details FROM audit_events WHERE event_type = $1 ORDER BY id")
        .bind(event_type)
        .fetch_all(&app.db.pool)
        .await
        .expect("the operator events")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_audit_event_cannot_be_written_is_not_carried_out_and_says_so() {
    let app = spawn_app().await;
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
    let app = spawn_app().await;
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
    assert_success(&out, "cardworker budget");
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
    assert_success(&out, "cardworker budget");
    let (actor, had, status): (String, Option<bool>, Option<String>) = sqlx::query_as(
        "SELECT actor, (details->'outcome'->>'had_override')::bool, details->'outcome'->>'status'
           FROM audit_events WHERE event_type = 'operator.budget_clear'",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("the operator.budget_clear event");
    assert_eq!(actor, "operator:Bob");
    assert_eq!(had, Some(false), "what the action found is on its event");
    assert_eq!(status.as_deref(), Some("applied"));
}

/// Installs a trigger on `audit_events` that raises `message` for the rows `when` selects, at
/// `timing` (`BEFORE UPDATE`, or a constraint trigger deferred to the commit).
async fn refuse_in_postgres(app: &TestApp, name: &str, trigger: &str) {
    for sql in [
        format!(
            "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION '{name}: refused by the test'; END $$"
        ),
        trigger.to_owned(),
    ] {
        sqlx::query(&sql)
            .execute(&app.db.pool)
            .await
            .expect("install the refusing trigger");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_request_postgresql_refuses_at_commit_is_not_carried_out_and_says_so() {
    let app = spawn_app().await;
    // PostgreSQL takes the event's INSERT and refuses the transaction at its commit.
    refuse_in_postgres(
        &app,
        "refuse_at_commit",
        "CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON audit_events
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
           WHEN (NEW.event_type = 'operator.budget_pause') EXECUTE FUNCTION refuse_at_commit()",
    )
    .await;
    let out = cli(
        &app,
        &app.db.url,
        "Alice",
        &["budget", "pause", "--task", "carddata", "--reason", "brake"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("not carried out"), "{stderr}");
    assert!(
        !paused(&app, "carddata").await,
        "a brake without its record stands: {stderr}"
    );
    assert!(operator_events(&app, "operator.budget_pause")
        .await
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_whose_outcome_cannot_be_recorded_stands_on_record_as_requested_and_investigate_and_the_console_say_its_outcome_is_unknown(
) {
    let app = spawn_app().await;
    app.insert_card("c-1").await;
    // PostgreSQL takes the request and refuses every later write to an operator event: it fails
    // between the action and its outcome.
    refuse_in_postgres(
        &app,
        "refuse_outcome",
        "CREATE TRIGGER refuse_outcome BEFORE UPDATE ON audit_events FOR EACH ROW
           WHEN (NEW.event_type LIKE 'operator.%') EXECUTE FUNCTION refuse_outcome()",
    )
    .await;
    let out = cli(
        &app,
        &app.db.url,
        "Alice",
        &[
            "circuit",
            "open",
            "--task",
            "carddata",
            "--reason",
            "gateway incident",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("outcome unknown"), "{stderr}");
    let view = serde_json::to_value(app.ctx.budget.show().await.expect("budget")).expect("json");
    assert_eq!(
        view["tasks"]["carddata"]["circuit"]["state"],
        serde_json::json!("open"),
        "the action was carried out: {view}"
    );
    // It stands with its record: requested, its outcome unknown.
    let events = operator_events(&app, "operator.circuit_open").await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["outcome"]["status"], "requested", "{events:?}");
    assert_eq!(events[0]["reason"], "gateway incident");

    // `investigate` says so, as text and JSON.
    let inv = cardworker::commands::investigate::investigate(&app.ctx, "c-1")
        .await
        .expect("investigate");
    let json = serde_json::to_value(&inv).expect("json");
    let fact = json["fleet_facts"]
        .as_array()
        .expect("fleet facts")
        .iter()
        .find(|f| f["event_type"] == "operator.circuit_open")
        .expect("the action among the fleet facts");
    assert_eq!(fact["outcome"], "unknown", "{fact}");
    let text = cardworker::commands::investigate::render_text(&inv);
    assert!(text.contains("outcome unknown"), "{text}");

    // And so do the console's fleet page and card page.
    let console = crate::console::ConsoleProcess::start(&app, None).await;
    for path in ["/", "/cards/c-1"] {
        let page = reqwest::get(format!("{}{path}", console.url))
            .await
            .expect("the page")
            .text()
            .await
            .expect("body");
        assert!(
            page.contains("data-outcome=\"unknown\"") && page.contains("outcome unknown"),
            "{path}: {page}"
        );
    }
}

#[tokio::test]
async fn an_action_that_fails_is_on_record_as_failed_with_its_error_and_shown_so() {
    use cardworker::commands::operator::{carry_out, Action, NotRecorded, Operator, OUTCOME_SQL};
    let db = crate::harness::TestDb::new().await;
    let action = Action::new(
        "budget_pause",
        "task",
        vec!["carddata".to_owned()],
        "carddata paused".to_owned(),
        Some("brake".to_owned()),
    );
    let done = carry_out(&db.pool, &action, &Operator::console("Ada"), async {
        Err::<((), serde_json::Value), _>(anyhow::anyhow!("Redis said no"))
    })
    .await;
    assert!(matches!(done, Err(NotRecorded::Failed(_))), "{done:?}");
    let (status, error, shown): (Option<String>, Option<String>, Option<String>) =
        sqlx::query_as(&format!(
            "SELECT e.details->'outcome'->>'status', e.details->'outcome'->>'error', {OUTCOME_SQL}
               FROM audit_events e WHERE e.event_type = 'operator.budget_pause'"
        ))
        .fetch_one(&db.pool)
        .await
        .expect("the operator.budget_pause event");
    assert_eq!(status.as_deref(), Some("failed"));
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("Redis said no")),
        "{error:?}"
    );
    assert_eq!(shown.as_deref(), Some("failed"));
}
