//! `gateway-sim --seed-from-db`: a restarted simulator answers what the worker recorded, so a
//! second `make run` records no change that never happened.

use std::time::Duration;

use cardworker::commands::sim::{seed, SeedReport};
use cardworker::config::Task;
use cardworker::gateway::{CardData, CardStatus};

use crate::harness::{metric_value, spawn_app_with, wait_until, TestApp};

async fn status_outcome(app: &TestApp, outcome: &str) -> f64 {
    let (_, text) = app.get("/metrics").await;
    metric_value(
        &text,
        "cardworker_poll_outcomes_total",
        &[("task", "card_status"), ("outcome", outcome)],
    )
}

#[tokio::test]
async fn a_simulator_seeded_from_the_database_answers_every_card_as_stored_so_polls_record_no_change(
) {
    let app = spawn_app_with(|cfg| cfg.polling.card_status.interval_secs = 1).await;
    for card_ref in ["c-1", "c-2", "c-3"] {
        app.insert_card(card_ref).await;
    }
    // What an earlier run recorded: c-2 ready and active, c-3 frozen, c-1 as created.
    sqlx::query(
        "UPDATE cards SET data_state = 'ready', card_token = 'tok_seeded', pan_last4 = '4242', \
         expiry_month = 12, expiry_year = 2030, status = 'active' WHERE card_ref = 'c-2'",
    )
    .execute(&app.db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE cards SET status = 'frozen' WHERE card_ref = 'c-3'")
        .execute(&app.db.pool)
        .await
        .unwrap();

    // The app's simulator is fresh, as after a restart: without seeding it would answer
    // "inactive" for c-2 and c-3, two changes that never happened.
    let report = seed(&app.sim, &app.db.pool).await.unwrap();
    assert_eq!(
        report,
        SeedReport {
            seeded: 3,
            ready: 1,
            skipped: 0
        }
    );
    let c2 = app.sim.card("c-2").expect("seeded");
    assert_eq!(c2.status, CardStatus::Active);
    assert_eq!(
        c2.data,
        CardData::Ready {
            card_token: "tok_seeded".to_owned(),
            pan_last4: "4242".to_owned(),
            expiry_month: 12,
            expiry_year: 2030,
        }
    );
    assert_eq!(app.sim.card("c-3").unwrap().status, CardStatus::Frozen);
    assert_eq!(app.sim.card("c-1").unwrap().status, CardStatus::Inactive);

    for card_ref in ["c-1", "c-2", "c-3"] {
        app.start_chain(Task::CardStatus, card_ref, Duration::ZERO)
            .await;
    }
    // Two rounds of polls of every card.
    wait_until(
        Duration::from_secs(30),
        "six unchanged card_status polls",
        || async { status_outcome(&app, "skipped_unchanged").await >= 6.0 },
    )
    .await;
    assert_eq!(status_outcome(&app, "persisted_change").await, 0.0);
    assert_eq!(status_outcome(&app, "persisted_failure").await, 0.0);
    let changes: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events")
        .fetch_one(&app.db.pool)
        .await
        .unwrap();
    assert_eq!(changes, 0, "no change was recorded");
}
