//! How late polling runs (`chain::lateness`, the gauges `cardworker_poll_due_now` and
//! `cardworker_poll_overdue_seconds`), read from a real Redis: waiting polls count from their due
//! time, a deferred poll from the time it was first due, and an entry of the late set goes once
//! its chain no longer waits on a deferral.

use std::time::Duration;

use cardworker::config::Task;
use cardworker::polling::chain;
use cardworker_jobs::ChainState;
use redis::AsyncCommands as _;

use crate::harness::{wait_until, TestRedis};

const TASK: Task = Task::Carddata;

/// The budget defers `card`'s poll of `state` by an hour (a 60 s run marker).
async fn defer_an_hour(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
    card: &str,
    state: &ChainState,
) -> chain::Deferred {
    let (hour, marker) = (Duration::from_secs(3600), Duration::from_secs(60));
    chain::defer(conn, prefix, TASK, card, state, hour, marker)
        .await
        .unwrap()
}

#[tokio::test]
async fn due_polls_count_from_their_due_time_and_a_deferred_one_from_when_it_was_first_due() {
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let prefix = redis.prefix.clone();
    let nothing = chain::lateness(&mut conn, &prefix, TASK).await.unwrap();
    assert_eq!(
        nothing,
        chain::Lateness::default(),
        "no chain, nothing late"
    );

    // Two polls due now, one due in an hour.
    for card in ["c-1", "c-2"] {
        chain::start(&mut conn, &prefix, TASK, card, Duration::ZERO)
            .await
            .unwrap();
    }
    let later = chain::start(&mut conn, &prefix, TASK, "c-3", Duration::from_secs(3600))
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(5),
        "the two due polls to be 200 ms late",
        || async {
            let late = chain::lateness(&mut conn.clone(), &prefix, TASK)
                .await
                .unwrap();
            late.due_now == 2 && late.overdue >= Duration::from_millis(200)
        },
    )
    .await;

    // c-3's poll is deferred (its budget was short) by an hour: the due set now says an hour
    // from now, but the poll was due when it was deferred, and it counts as due from then.
    let deferred = ChainState {
        chain: later,
        failures: 0,
        deferrals: 1,
        turn: 0,
    };
    assert_eq!(
        defer_an_hour(&mut conn, &prefix, "c-3", &deferred).await,
        chain::Deferred::Written
    );
    let late_key = chain::late_key(&prefix, TASK);
    let first_due: Option<f64> = conn.zscore(&late_key, "c-3").await.unwrap();
    assert!(first_due.is_some(), "the first deferral keeps its due time");
    let late = chain::lateness(&mut conn, &prefix, TASK).await.unwrap();
    assert_eq!(late.due_now, 3, "two due and one deferred");

    // A second deferral keeps the first due time.
    let again = ChainState {
        deferrals: 2,
        ..deferred.clone()
    };
    assert_eq!(
        defer_an_hour(&mut conn, &prefix, "c-3", &again).await,
        chain::Deferred::Written
    );
    let still: Option<f64> = conn.zscore(&late_key, "c-3").await.unwrap();
    assert_eq!(still, first_due);

    // The poll ran and wrote its successor: no longer deferred, so the next read drops it.
    let ran = ChainState {
        deferrals: 0,
        ..deferred
    };
    assert!(chain::schedule(
        &mut conn,
        &prefix,
        TASK,
        "c-3",
        &ran,
        Duration::from_secs(3600)
    )
    .await
    .unwrap());
    let late = chain::lateness(&mut conn, &prefix, TASK).await.unwrap();
    assert_eq!(late.due_now, 2, "only the two due polls");
    let left: u64 = conn.zcard(&late_key).await.unwrap();
    assert_eq!(
        left, 0,
        "the read removed the entry of the chain that polled"
    );
}
