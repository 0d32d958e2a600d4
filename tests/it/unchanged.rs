//! Unchanged polls (issue 19): counted in the card's chain entry and in hourly fleet counters that
//! expire, reset by a recorded change or failure, and shown by `investigate`, which says plainly
//! when the count restarted because Redis lost its data.

use std::time::Duration;

use cardworker::commands::investigate;
use cardworker::config::Task;
use cardworker::gateway::CardStatus;
use cardworker::polling::chain::{self, Count};
use cardworker::polling::unchanged::{self, Since};
use cardworker_jobs::ChainState;
use redis::AsyncCommands as _;

use crate::harness::{spawn_app_with, wait_until, TestApp, TestRedis};

fn next(chain: &str) -> ChainState {
    ChainState {
        chain: chain.to_owned(),
        ..ChainState::default()
    }
}

async fn tally(redis: &TestRedis, task: Task, card: &str) -> Option<unchanged::Tally> {
    unchanged::entry(&mut redis.conn.clone(), &redis.prefix, task, card)
        .await
        .expect("entry")
        .and_then(|e| e.tally)
}

/// A fresh prefix with `card`'s `task` chain started, its first poll due in a minute: the prefix,
/// a connection to it and the chain id.
pub(crate) async fn chain_a_minute_out(
    task: Task,
    card: &str,
) -> (TestRedis, redis::aio::ConnectionManager, String) {
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let id = chain::start(
        &mut conn,
        &redis.prefix,
        task,
        card,
        Duration::from_secs(60),
    )
    .await
    .expect("start");
    (redis, conn, id)
}

#[tokio::test]
async fn an_unchanged_poll_adds_one_to_the_cards_tally_and_the_hours_fleet_counter_in_the_scheduling_call(
) {
    let (redis, mut conn, id) = chain_a_minute_out(Task::CardStatus, "c-1").await;
    let (prefix, task) = (redis.prefix.as_str(), Task::CardStatus);
    let started = tally(&redis, task, "c-1")
        .await
        .expect("a fresh chain has a tally");
    assert_eq!(started.count, 0);
    assert_eq!(started.last, None);
    assert_eq!(started.since_kind, Since::ChainStart);

    let at = chrono::Utc::now();
    for _ in 0..2 {
        let written = chain::schedule_counted(
            &mut conn,
            prefix,
            task,
            "c-1",
            &next(&id),
            Duration::from_secs(60),
            &Count::Unchanged(at),
        )
        .await
        .expect("schedule");
        assert!(written);
    }
    let t = tally(&redis, task, "c-1").await.expect("tally");
    assert_eq!(t.count, 2);
    assert!(t.last.is_some_and(|l| l >= started.since));
    assert_eq!(t.since, started.since, "an unchanged poll keeps `since`");

    // The fleet-wide counter is written by the process's next flush (every few seconds).
    unchanged::flush(&mut conn, prefix).await.expect("flush");
    let hour_key = unchanged::hour_key(prefix, task, &unchanged::hour_bucket(at));
    let total: u64 = conn.get(&hour_key).await.expect("get");
    assert_eq!(total, 2);
    let ttl: i64 = conn.ttl(&hour_key).await.expect("ttl");
    assert!(
        ttl > 0 && ttl <= unchanged::HOUR_TTL_SECS,
        "the hourly counter expires: ttl {ttl}"
    );

    // A stale job's successor is not written and not counted.
    let stale = chain::schedule_counted(
        &mut conn,
        prefix,
        task,
        "c-1",
        &next("01OTHERCHAIN"),
        Duration::from_secs(60),
        &Count::Unchanged(at),
    )
    .await
    .expect("schedule");
    assert!(!stale);
    unchanged::flush(&mut conn, prefix).await.expect("flush");
    let total: u64 = conn.get(&hour_key).await.expect("get");
    assert_eq!(total, 2, "a stale successor counts nothing");
    assert_eq!(tally(&redis, task, "c-1").await.map(|t| t.count), Some(2));
}

#[tokio::test]
async fn a_recorded_change_or_failure_resets_the_count_and_a_deferral_keeps_it() {
    let (redis, mut conn, id) = chain_a_minute_out(Task::Carddata, "c-2").await;
    let (prefix, task) = (redis.prefix.as_str(), Task::Carddata);
    let base = conn.clone();
    let schedule = |count: Count| {
        let mut conn = base.clone();
        let id = id.clone();
        async move {
            chain::schedule_counted(
                &mut conn,
                prefix,
                task,
                "c-2",
                &next(&id),
                Duration::from_secs(60),
                &count,
            )
            .await
            .expect("schedule")
        }
    };
    for _ in 0..3 {
        schedule(Count::Unchanged(chrono::Utc::now())).await;
    }
    let before = tally(&redis, task, "c-2").await.expect("tally");
    assert_eq!(before.count, 3);

    // A deferral (the budget layer's plain `schedule`) leaves the tally alone.
    chain::schedule(
        &mut conn,
        prefix,
        task,
        "c-2",
        &next(&id),
        Duration::from_secs(5),
    )
    .await
    .expect("defer");
    assert_eq!(tally(&redis, task, "c-2").await, Some(before.clone()));

    schedule(Count::Reset).await;
    let reset = tally(&redis, task, "c-2").await.expect("tally");
    assert_eq!(reset.count, 0);
    assert_eq!(reset.since_kind, Since::ChangeOrFailure);
    assert!(reset.since >= before.since);
    assert_eq!(
        reset.last, before.last,
        "the last unchanged poll stays known"
    );
    schedule(Count::Unchanged(chrono::Utc::now())).await;
    let after = tally(&redis, task, "c-2").await.expect("tally");
    assert_eq!((after.count, after.since_kind), (1, Since::ChangeOrFailure));
}

#[tokio::test]
async fn a_chain_entry_written_before_the_tally_stays_live_and_gains_a_tally_at_its_next_write() {
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let (prefix, task) = (redis.prefix.as_str(), Task::CardStatus);
    let due = chain::redis_now_ms(&mut conn).await.expect("now") + 60_000;
    let _: () = conn
        .hset(
            chain::chain_key(prefix, task),
            "c-3",
            format!("01OLDCHAIN|{due}"),
        )
        .await
        .expect("hset");
    let _: () = conn
        .zadd(chain::due_key(prefix, task), "c-3", due)
        .await
        .expect("zadd");
    assert_eq!(tally(&redis, task, "c-3").await, None);
    // Still live for reconcile (its due time is read from the index).
    let started = chain::start_if_dead(
        &mut conn,
        prefix,
        task,
        "c-3",
        Duration::ZERO,
        Duration::from_secs(600),
    )
    .await
    .expect("reconcile");
    assert!(!started, "a live old-format chain is left alone");
    let state = chain::check(
        &mut conn,
        prefix,
        task,
        "c-3",
        &next("01OLDCHAIN"),
        std::time::Duration::from_secs(60),
    )
    .await
    .expect("check");
    assert_eq!(state, chain::Liveness::Live);
    chain::schedule_counted(
        &mut conn,
        prefix,
        task,
        "c-3",
        &next("01OLDCHAIN"),
        Duration::from_secs(60),
        &Count::Unchanged(chrono::Utc::now()),
    )
    .await
    .expect("schedule");
    let t = tally(&redis, task, "c-3").await.expect("tally now");
    assert_eq!((t.count, t.since_kind), (1, Since::ChainStart));
    let live = chain::live_chains(&mut conn, prefix, task, &["c-3".to_owned()])
        .await
        .expect("live");
    assert_eq!(live, vec![Some("01OLDCHAIN".to_owned())]);
}

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
