//! Moving polling chains into the due queue (`polling::takeover`), on a redis-server of the test's
//! own: what each kind of chain becomes, and that a second run changes nothing.

// An unwrap() that fails is the test failing, at its line.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use cardworker::config::Task;
use cardworker::context;
use cardworker::keys;
use cardworker::polling::due_queue::{DueQueue, ShardKeys, Standing, LEASED};
use cardworker::polling::takeover::FED;
use cardworker::polling::takeover::{take_over, TakenOver};
use cardworker::polling::unchanged::Since;
use redis::aio::ConnectionManager;

use crate::private::PrivateRedis;

const TASK: Task = Task::CardStatus;
const NOT_BEFORE: Duration = Duration::from_secs(20);

async fn now_ms(conn: &mut ConnectionManager) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    secs * 1000 + micros / 1000
}

/// Writes a chain of the release before: its entry, and its due-set member if `score` is given.
async fn chain(conn: &mut ConnectionManager, card: &str, entry: &str, score: Option<u64>) {
    let _: () = redis::cmd("HSET")
        .arg(keys::chain_key("cw", TASK))
        .arg(card)
        .arg(entry)
        .query_async(conn)
        .await
        .unwrap();
    if let Some(score) = score {
        let _: () = redis::cmd("ZADD")
            .arg(keys::due_key("cw", TASK))
            .arg(score)
            .arg(card)
            .query_async(conn)
            .await
            .unwrap();
    }
}

async fn key_exists(conn: &mut ConnectionManager, key: &str) -> bool {
    redis::cmd("EXISTS")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn moving_chains_over_keeps_each_waiting_card_s_due_time_and_state_and_leaves_no_chain() {
    let redis = PrivateRedis::start_new(false);
    let mut conn = context::connect_redis(&redis.url()).await.unwrap();
    let queue = DueQueue::new(ShardKeys::new("cw", TASK, 0));
    let now = now_ms(&mut conn).await;
    let waiting_due = now + 60_000;
    // A waiting chain: 3 unchanged polls since a change, next poll after 2 failures and 1
    // deferral.
    chain(
        &mut conn,
        "c-wait",
        "ABCDEFGH|3|t0gmqo|ct0gmqa|2.1",
        Some(waiting_due),
    )
    .await;
    // A chain whose job was fed 5 s ago (it may be polling now), with its run marker.
    chain(
        &mut conn,
        "c-running",
        &format!("ABCDEFGH|0|0|st0gmqa|0|ABCDEFGH#{}@{now}", now - 5_000),
        Some(FED + now - 5_000),
    )
    .await;
    // An entry of an older format, and a chain whose due-set member is gone.
    chain(
        &mut conn,
        "c-old",
        "ABCDEFGH|1700000000000",
        Some(now - 1_000),
    )
    .await;
    chain(&mut conn, "c-lost", "ABCDEFGH|0|0|st0gmqa|4", None).await;

    let done = take_over(&mut conn, "cw", TASK, &queue, NOT_BEFORE)
        .await
        .unwrap();
    assert_eq!(
        done,
        TakenOver {
            chains: 4,
            added: 4
        }
    );

    let (standing, state) = queue.entry(&mut conn, "c-wait").await.unwrap().unwrap();
    assert_eq!(
        standing,
        Standing::Waiting {
            due_ms: waiting_due
        }
    );
    assert_eq!((state.failures, state.deferrals), (2, 1));
    let tally = state.tally.unwrap();
    assert_eq!((tally.count, tally.since_kind), (3, Since::ChangeOrFailure));

    for card in ["c-running", "c-lost"] {
        let (standing, _) = queue.entry(&mut conn, card).await.unwrap().unwrap();
        let Standing::Waiting { due_ms } = standing else {
            panic!("{card}: {standing:?}");
        };
        assert!(
            due_ms >= now + NOT_BEFORE.as_millis() as u64,
            "{card}: due {} ms from the move, before a poll of the release before is over",
            due_ms as i64 - now as i64
        );
    }
    let (_, lost) = queue.entry(&mut conn, "c-lost").await.unwrap().unwrap();
    assert_eq!(lost.failures, 4);

    let (standing, old) = queue.entry(&mut conn, "c-old").await.unwrap().unwrap();
    assert_eq!(
        standing,
        Standing::Waiting {
            due_ms: now - 1_000
        }
    );
    let tally = old
        .tally
        .expect("an entry without a tally starts a fresh one");
    assert_eq!((tally.count, tally.since_kind), (0, Since::ChainStart));

    assert!(!key_exists(&mut conn, &keys::chain_key("cw", TASK)).await);
    assert!(!key_exists(&mut conn, &keys::due_key("cw", TASK)).await);
    let again = take_over(&mut conn, "cw", TASK, &queue, NOT_BEFORE)
        .await
        .unwrap();
    assert_eq!(again, TakenOver::default(), "a second run finds nothing");
}

#[tokio::test]
async fn a_card_the_due_queue_already_holds_keeps_its_entry_when_its_chain_moves_over() {
    let redis = PrivateRedis::start_new(false);
    let mut conn = context::connect_redis(&redis.url()).await.unwrap();
    let queue = DueQueue::new(ShardKeys::new("cw", TASK, 0));
    queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap();
    let leased = queue
        .fetch(&mut conn, 1, Duration::from_secs(60))
        .await
        .unwrap();
    // A pod of the release before wrote the card's chain again meanwhile.
    let now = now_ms(&mut conn).await;
    chain(&mut conn, "c-1", "ABCDEFGH|0|0|st0gmqa|7", Some(now)).await;

    let done = take_over(&mut conn, "cw", TASK, &queue, NOT_BEFORE)
        .await
        .unwrap();
    assert_eq!(
        done,
        TakenOver {
            chains: 1,
            added: 0
        }
    );
    let (standing, state) = queue.entry(&mut conn, "c-1").await.unwrap().unwrap();
    assert_eq!(
        standing,
        Standing::Leased {
            deadline_ms: leased[0].lease.deadline_ms()
        },
        "the running poll's lease still holds the card"
    );
    assert_eq!(
        state.failures, 0,
        "the chain's state did not overwrite the card's"
    );
    assert!(leased[0].lease.score() > LEASED);
    assert!(!key_exists(&mut conn, &keys::chain_key("cw", TASK)).await);
}
