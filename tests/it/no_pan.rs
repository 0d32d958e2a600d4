//! No card number (PAN) in free text: external text that carries one, however it is written, is
//! masked wherever it is stored (reasons, summaries, audit details, a callback body's free
//! fields), a callback body is stored as its known fields only, identifiers are stored exactly
//! (spec section 10), and a `card_token` that looks like a PAN makes the Gateway's answer unknown.
//! `pan_oracle.rs` searches every place the product writes.

use std::time::Duration;

use cardworker::config::Task;
use cardworker::payments::callback;
use cardworker::telemetry::pan::contains_pan;
use cardworker_jobs::ProcessCallback;

use crate::harness::{spawn_app, wait_until, TestApp};

/// Every text the database keeps about anything, as one string.
async fn everything_stored(app: &TestApp) -> String {
    sqlx::query_scalar(
        "SELECT concat_ws(' | ',
            (SELECT string_agg(concat_ws(' ', body, reason, resource_id), ' ') FROM inbound_callbacks),
            (SELECT string_agg(concat_ws(' ', actor, summary, details::text), ' ') FROM audit_events),
            (SELECT string_agg(resource_id, ' ') FROM audit_resources),
            (SELECT string_agg(concat_ws(' ', resource_id, request_summary, response_summary,
                                         error, recovery_summary), ' ') FROM integration_logs),
            (SELECT string_agg(concat_ws(' ', card_ref, card_token), ' ') FROM cards))",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("stored text")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_keeps_its_card_ref_exactly_and_stores_no_pan_in_its_free_fields() {
    let app = spawn_app().await;
    for (i, card_ref) in [
        "4111.1111.1111.1111",
        "4111 / 1111 / 1111 / 1111",
        "４１１１１１１１１１１１１１１１",
    ]
    .into_iter()
    .enumerate()
    {
        let body = serde_json::json!({
            "type": "card.status", "card_ref": card_ref, "status": "frozen",
            "cardholder_pan": "5555 5555 5555 4444", "cvv": "123",
        })
        .to_string();
        let done = callback::process(
            &app.ctx,
            &ProcessCallback {
                channel: "visa".to_owned(),
                callback_id: format!("cb-{i}"),
                body,
                retries: 0,
                recorded: false,
            },
        )
        .await
        .expect("processed");
        assert!(
            matches!(done, callback::Delivery::Failed { .. }),
            "an unknown card: {done:?}"
        );
        // The card_ref is an identifier: kept as received, in the row and its stored body.
        let (resource_id, body, reason): (String, String, String) = sqlx::query_as(
            "SELECT resource_id, body, reason FROM inbound_callbacks WHERE callback_id = $1",
        )
        .bind(format!("cb-{i}"))
        .fetch_one(&app.db.pool)
        .await
        .expect("row");
        assert_eq!(resource_id, card_ref);
        let stored: serde_json::Value = serde_json::from_str(&body).expect("stored body");
        assert_eq!(stored["card_ref"], card_ref);
        assert_eq!(reason, "unknown card [redacted]");
    }
    let free_text: String = sqlx::query_scalar(
        "SELECT concat_ws(' | ',
            (SELECT string_agg(reason, ' ') FROM inbound_callbacks),
            (SELECT string_agg(concat_ws(' ', summary, details->>'reason'), ' ') FROM audit_events))",
    )
    .fetch_one(&app.db.pool)
    .await
    .expect("free text");
    assert!(free_text.contains("unknown card"), "{free_text}");
    assert!(!contains_pan(&free_text), "a PAN is stored: {free_text}");
    let stored = everything_stored(&app).await;
    assert!(
        !stored.contains("cardholder_pan") && !stored.contains("cvv") && !stored.contains("5555"),
        "{stored}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_token_that_looks_like_a_pan_makes_the_answer_unknown_and_is_never_stored() {
    let app = spawn_app().await;
    app.insert_card("c-9").await;
    app.sim
        .set_card_ready("c-9", "tok_4111-1111-1111-1111", "1111", 12, 2030);
    cardworker::commands::polling::enqueue(&app.ctx, Task::Carddata, "c-9", None)
        .await
        .expect("enqueue");
    let unknown_polls = "SELECT count(*) FROM integration_logs WHERE resource_id = 'c-9'
          AND scenario = 'carddata_poll' AND state = 'unknown'";
    wait_until(
        Duration::from_secs(30),
        "the poll is recorded unknown",
        || async {
            sqlx::query_scalar::<_, i64>(unknown_polls)
                .fetch_one(&app.db.pool)
                .await
                .expect("count")
                >= 1
        },
    )
    .await;
    let (state, token): (String, Option<String>) =
        sqlx::query_as("SELECT data_state, card_token FROM cards WHERE card_ref = 'c-9'")
            .fetch_one(&app.db.pool)
            .await
            .expect("card");
    assert_eq!((state.as_str(), token), ("pending", None));
    let stored = everything_stored(&app).await;
    assert!(stored.contains("looks like a card number"), "{stored}");
    assert!(!contains_pan(&stored), "a PAN is stored: {stored}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_and_its_callback_whose_ids_hold_a_luhn_passing_digit_run_are_stored_under_their_ids(
) {
    // `08263-5281-4469` inside this id is 13 digits with dashes that pass Luhn: the masker must
    // see the id, not a card number, or the callback's row and the payment's outbox event are
    // stored under a redacted id nobody can look up.
    let app = spawn_app().await;
    app.insert_card("c-9").await;
    let pid: uuid::Uuid = "ffa08263-5281-4469-a0b7-9b403e676268"
        .parse()
        .expect("uuid");
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, 'c-9', 1234, 'CNY')",
    )
    .bind(pid)
    .execute(&app.db.pool)
    .await
    .expect("insert payment");
    let callback_id = format!("payment-{pid}");
    let job = ProcessCallback {
        channel: "pay".to_owned(),
        callback_id: callback_id.clone(),
        body: format!(
            r#"{{"type":"payment.result","payment_id":"{pid}","status":"accepted","channel_ref":"ch-1"}}"#
        ),
        retries: 0,
        recorded: false,
    };
    assert_eq!(
        callback::process(&app.ctx, &job).await.expect("processed"),
        callback::Delivery::Applied { changed: true }
    );
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inbound_callbacks WHERE channel = 'pay' AND callback_id = $1 AND state = 'applied'",
    )
    .bind(&callback_id)
    .fetch_one(&app.db.pool)
    .await
    .expect("callback row");
    assert_eq!(rows, 1, "the callback is stored under its id as delivered");
    let events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1 AND event_type = 'payment.accepted'",
    )
    .bind(pid.to_string())
    .fetch_one(&app.db.pool)
    .await
    .expect("outbox");
    assert_eq!(events, 1, "the decided event names the payment as it is");
    let stored = everything_stored(&app).await;
    assert!(!stored.contains("[redacted]"), "{stored}");
}
