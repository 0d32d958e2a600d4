//! Unchanged polls: counted in the card's poll state in the due queue and in hourly fleet counters
//! that expire, reset by a recorded change or failure, and shown by `investigate`, which says
//! plainly when the count restarted because Redis lost its data. (What one acknowledgement does
//! to the state is in tests/faults/due_queue.rs.)

use std::time::Duration;

use cardworker::commands::investigate;
use cardworker::config::Task;
use cardworker::gateway::CardStatus;
use cardworker::polling::unchanged::Since;
use redis::AsyncCommands as _;

use crate::harness::{spawn_app_with, wait_until, TestApp};

fn fast(cfg: &mut cardworker::config::Config) {
    cfg.polling.carddata.interval_secs = 1;
    cfg.polling.card_status.interval_secs = 1;
}

async fn card_status_view(app: &TestApp, card: &str) -> investigate::UnchangedView {
    let inv = investigate::investigate(&app.ctx, card)
        .await
        .expect("investigate");
    inv.unchanged_polls
        .into_iter()
        .find(|u| u.task == "card_status")
        .expect("card_status view")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn investigate_counts_unchanged_polls_since_the_last_change_and_says_the_count_restarted_after_redis_lost_its_data(
) {
    let app = spawn_app_with(fast).await;
    for card in ["c-changes", "c-steady"] {
        app.insert_card(card).await;
        for task in Task::ALL {
            app.start_chain(task, card, Duration::ZERO).await;
        }
    }
    // The fleet totals lag the polls by up to one flush (unchanged::FLUSH_EVERY).
    wait_until(
        Duration::from_secs(30),
        "unchanged polls of both cards, in the fleet totals too",
        || async {
            card_status_view(&app, "c-changes").await.card_count >= Some(2)
                && card_status_view(&app, "c-steady").await.card_count >= Some(2)
                && card_status_view(&app, "c-steady").await.all_cards_total >= 4
        },
    )
    .await;

    // A card without recent changes: counted since its chain started.
    let steady = card_status_view(&app, "c-steady").await;
    assert_eq!(steady.since_kind, Some(Since::ChainStart));
    assert!(steady.last_unchanged_at.is_some());
    assert!(steady.all_cards_total >= 4, "{steady:?}");
    assert!(
        steady.explanation.contains("since the chain started")
            && steady.explanation.contains("not known"),
        "{}",
        steady.explanation
    );

    // A card with a recent change: counted since the change.
    app.sim.set_card_status("c-changes", CardStatus::Frozen);
    wait_until(
        Duration::from_secs(30),
        "the change, then an unchanged poll",
        || async {
            let v = card_status_view(&app, "c-changes").await;
            v.since_kind == Some(Since::ChangeOrFailure) && v.card_count >= Some(1)
        },
    )
    .await;
    let changed = card_status_view(&app, "c-changes").await;
    assert!(
        changed
            .explanation
            .contains("since the chain's last recorded change or failure"),
        "{}",
        changed.explanation
    );
    let text = investigate::render_text(
        &investigate::investigate(&app.ctx, "c-changes")
            .await
            .expect("investigate"),
    );
    assert!(
        text.contains("since the chain's last recorded change or failure"),
        "{text}"
    );

    // Redis loses the deployment's data: every count restarts, and investigate says so.
    let lost_at = chrono::Utc::now();
    let mut conn = app.redis.conn.clone();
    for key in app.redis.keys().await {
        let _: () = conn.del(&key).await.expect("del");
    }
    wait_until(
        Duration::from_secs(60),
        "the schedule restored and polling again",
        || async { card_status_view(&app, "c-steady").await.card_count >= Some(1) },
    )
    .await;
    let inv = investigate::investigate(&app.ctx, "c-steady")
        .await
        .expect("investigate");
    let after = inv
        .unchanged_polls
        .iter()
        .find(|u| u.task == "card_status")
        .expect("view");
    assert_eq!(after.since_kind, Some(Since::ChainStart));
    assert!(
        after
            .since
            .is_some_and(|s| s.timestamp() >= lost_at.timestamp()),
        "the count began after the loss: {after:?}"
    );
    assert!(
        inv.counts_since
            .is_some_and(|e| e.timestamp() >= lost_at.timestamp()),
        "Redis's counts begin at the new epoch marker: {:?}",
        inv.counts_since
    );
    assert!(
        after.explanation.contains("The count restarted")
            && after.explanation.contains("Redis's counts restarted at"),
        "{}",
        after.explanation
    );
}
