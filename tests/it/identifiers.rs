//! Identifiers are kept exactly as received (spec section 10): a callback id that happens to be
//! a Luhn-passing number is a key like any other, and two distinct ids never become one.

use std::collections::{HashMap, HashSet};

use cardworker::payments::callback::{self, Delivery};
use cardworker::telemetry::pan::luhn;
use cardworker_jobs::ProcessCallback;
use futures::StreamExt as _;
use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{Rng as _, SeedableRng as _};

use crate::harness::{spawn_app, TestApp};

/// A `card.status` callback, delivered by the ingress straight to the job (not yet recorded).
pub fn status_callback(channel: &str, id: &str, card_ref: &str, status: &str) -> ProcessCallback {
    ProcessCallback {
        channel: channel.to_owned(),
        callback_id: id.to_owned(),
        body: serde_json::json!({"type": "card.status", "card_ref": card_ref, "status": status})
            .to_string(),
        retries: 0,
        recorded: false,
    }
}

/// The ids stored on `channel`, with their state and delivery count, by id.
async fn stored_callbacks(app: &TestApp, channel: &str) -> HashMap<String, (String, i32)> {
    sqlx::query_as::<_, (String, String, i32)>(
        "SELECT callback_id, state, deliveries FROM inbound_callbacks WHERE channel = $1",
    )
    .bind(channel)
    .fetch_all(&app.db.pool)
    .await
    .expect("stored callbacks")
    .into_iter()
    .map(|(id, state, deliveries)| (id, (state, deliveries)))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_numeric_callback_ids_that_pass_luhn_are_each_applied_under_their_own_id() {
    let app = spawn_app().await;
    let ids = ["4111111111111111", "4012888888881881", "5555555555554444"];
    for (i, id) in ids.iter().enumerate() {
        let card = format!("c-{i}");
        app.insert_card(&card).await;
        let got = callback::process(&app.ctx, &status_callback("visa", id, &card, "frozen"))
            .await
            .expect("delivery");
        assert_eq!(got, Delivery::Applied { changed: true }, "callback {id}");
    }
    let frozen: i64 = sqlx::query_scalar("SELECT count(*) FROM cards WHERE status = 'frozen'")
        .fetch_one(&app.db.pool)
        .await
        .expect("cards");
    assert_eq!(frozen, 3, "each callback froze its own card");
    let stored = stored_callbacks(&app, "visa").await;
    let expected: HashMap<String, (String, i32)> = ids
        .iter()
        .map(|id| ((*id).to_owned(), ("applied".to_owned(), 1)))
        .collect();
    assert_eq!(stored, expected, "each stored under its id as delivered");
    // The audit links and the outbox name the cards, and the callbacks' rows name their card.
    let resources: Vec<String> = sqlx::query_scalar(
        "SELECT resource_id FROM inbound_callbacks WHERE channel = 'visa' ORDER BY resource_id",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("resources");
    assert_eq!(resources, ["c-0", "c-1", "c-2"]);
}

/// `len` random digits whose Luhn check is `passes`.
fn numeric_id(rng: &mut StdRng, len: usize, passes: bool) -> String {
    let mut digits: Vec<u8> = (0..len).map(|_| rng.random_range(0..10)).collect();
    let last = len - 1;
    let check = (0..10)
        .find(|&d| {
            digits[last] = d;
            luhn(&digits) == passes
        })
        .expect("some last digit passes and some fails");
    digits[last] = check;
    digits.iter().map(|d| char::from(b'0' + d)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn property_a_thousand_numeric_callback_ids_delivered_twice_are_each_applied_once_under_their_exact_id(
) {
    let app = spawn_app().await;
    let cards: Vec<String> = (0..8).map(|i| format!("c-{i}")).collect();
    for card in &cards {
        app.insert_card(card).await;
    }
    let mut rng = StdRng::seed_from_u64(0x0039_1d5e);
    let mut ids: Vec<String> = Vec::new();
    let mut distinct = HashSet::new();
    while ids.len() < 1_000 {
        let len = rng.random_range(13..=19);
        let id = numeric_id(&mut rng, len, ids.len().is_multiple_of(2));
        if distinct.insert(id.clone()) {
            ids.push(id);
        }
    }
    let passing = ids
        .iter()
        .filter(|id| luhn(&id.bytes().map(|b| b - b'0').collect::<Vec<_>>()))
        .count();
    assert_eq!(passing, 500, "half of the ids pass Luhn");
    let jobs: Vec<ProcessCallback> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let status = ["active", "frozen"][rng.random_range(0..2)];
            status_callback("bank", id, &cards[i % cards.len()], status)
        })
        .collect();
    // Every callback twice, in a shuffled order, four deliveries at a time.
    let mut order: Vec<usize> = (0..2 * jobs.len()).map(|n| n % jobs.len()).collect();
    order.shuffle(&mut rng);
    let outcomes: Vec<(usize, Delivery)> = futures::stream::iter(order)
        .map(|i| {
            let (ctx, job) = (app.ctx.clone(), &jobs[i]);
            async move { (i, callback::process(&ctx, job).await.expect("delivery")) }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let mut applied = vec![0; jobs.len()];
    let mut duplicates = vec![0; jobs.len()];
    for (i, outcome) in outcomes {
        match outcome {
            Delivery::Applied { .. } => applied[i] += 1,
            Delivery::Duplicate => duplicates[i] += 1,
            Delivery::Failed(reason) => panic!("callback {} failed: {reason}", ids[i]),
        }
    }
    for (i, id) in ids.iter().enumerate() {
        assert_eq!((applied[i], duplicates[i]), (1, 1), "callback {id}");
    }
    let stored = stored_callbacks(&app, "bank").await;
    assert_eq!(stored.len(), 1_000);
    for id in &ids {
        assert_eq!(
            stored.get(id),
            Some(&("applied".to_owned(), 2)),
            "callback {id} is stored under its exact id, applied, with both deliveries counted"
        );
    }
    let logs: i64 =
        sqlx::query_scalar("SELECT count(*) FROM integration_logs WHERE scenario = 'callback'")
            .fetch_one(&app.db.pool)
            .await
            .expect("logs");
    assert_eq!(logs, 1_000, "one terminal record per applied callback");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_whose_key_the_contract_forbids_is_refused_once_with_its_reason() {
    let app = spawn_app().await;
    app.insert_card("c-1").await;
    let long = "9".repeat(cardworker::storage::ident::MAX_CHARS + 1);
    for (id, why) in [
        ("", "callback_id is empty"),
        (
            "cb\n1",
            "callback_id holds a control character (U+000A) at character 2",
        ),
        (
            "cb\u{0}1",
            "callback_id holds a control character (U+0000) at character 2",
        ),
        (long.as_str(), "at most 200 are accepted"),
    ] {
        let got = callback::process(&app.ctx, &status_callback("visa", id, "c-1", "frozen"))
            .await
            .expect("a refused key is handled, not an error");
        match got {
            Delivery::Failed(reason) => assert!(reason.contains(why), "{reason}"),
            other => panic!("{id:?} was {other:?}"),
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM inbound_callbacks")
        .fetch_one(&app.db.pool)
        .await
        .expect("rows");
    assert_eq!(rows, 0, "no row is keyed by a forbidden id");
    let refused: Vec<String> = sqlx::query_scalar(
        "SELECT summary FROM audit_events WHERE event_type = 'callback.refused' ORDER BY id",
    )
    .fetch_all(&app.db.pool)
    .await
    .expect("refusals");
    assert_eq!(refused.len(), 4, "each refusal recorded once: {refused:?}");
    assert!(refused[1].contains(r#""cb\n1""#), "{}", refused[1]);
    let status: String = sqlx::query_scalar("SELECT status FROM cards WHERE card_ref = 'c-1'")
        .fetch_one(&app.db.pool)
        .await
        .expect("card");
    assert_eq!(status, "inactive", "nothing was applied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_callback_refuses_a_forbidden_key_with_exit_2_and_records_nothing() {
    let app = spawn_app().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let body = dir.path().join("body.json");
    std::fs::write(
        &body,
        r#"{"type":"card.status","card_ref":"c-1","status":"frozen"}"#,
    )
    .expect("body");
    let err = cardworker::commands::payments::enqueue_callback(&app.ctx, "visa", "", &body)
        .await
        .expect_err("an empty callback id is refused");
    assert_eq!(err.exit_code(), 2, "{err}");
    assert!(err.to_string().contains("callback_id is empty"), "{err}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM inbound_callbacks")
        .fetch_one(&app.db.pool)
        .await
        .expect("rows");
    assert_eq!(rows, 0);
    assert!(app.queue_idle("callback").await, "nothing was enqueued");
}
