//! The due queue of a polling task shard (`polling::due_queue`): what a fetch hands out, which
//! lease an acknowledgement obeys, what an ended lease gives back, and its script on a
//! three-master Redis Cluster. Each test runs on a redis-server (or cluster) of its own.

// An unwrap() that fails is the test failing, at its line.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cardworker::config::Task;
use cardworker::context;
use cardworker::polling::due_queue::{
    DueQueue, Lease, Leased, Merged, PollState, ShardKeys, Standing, Step, StillHeld, Successor,
};
use cardworker::polling::lease;
use cardworker::queue::batch::ScriptCalls;
use redis::aio::ConnectionManager;

use crate::cluster::PrivateCluster;
use crate::private::PrivateRedis;

const LONG: Duration = Duration::from_secs(60);

async fn queue_on(redis: &PrivateRedis) -> (DueQueue, ConnectionManager) {
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    (DueQueue::new(ShardKeys::new("cw", Task::Carddata, 0)), conn)
}

/// Writes `card_ref` due `ms_ago` ms ago (negative: in the future), on Redis's clock.
async fn due_since(queue: &DueQueue, conn: &mut ConnectionManager, card_ref: &str, ms_ago: i64) {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    let now = secs * 1000 + micros / 1000;
    let _: () = redis::cmd("ZADD")
        .arg(&queue.keys().due)
        .arg(now - ms_ago)
        .arg(card_ref)
        .query_async(conn)
        .await
        .unwrap();
}

/// A private Redis and a queue on it that holds each of `due` (a card and how many ms ago it
/// became due), with a connection to that Redis.
async fn queue_with_due(due: &[(&str, i64)]) -> (PrivateRedis, DueQueue, ConnectionManager) {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    for (card_ref, ms_ago) in due {
        due_since(&queue, &mut conn, card_ref, *ms_ago).await;
    }
    (redis, queue, conn)
}

/// The successor of a poll of `card_ref` under `lease` that leaves its state as it is, due
/// `next_in` from the acknowledgement.
fn keep(card_ref: &str, lease: Lease, next_in: Duration) -> Successor<'_> {
    Successor {
        card_ref,
        lease,
        next_in,
        next: PollState::default(),
    }
}

/// Acknowledges the poll of `card_ref` under `lease`, the card due again at once.
async fn ack_now(
    queue: &DueQueue,
    conn: &mut ConnectionManager,
    card_ref: &str,
    lease: Lease,
) -> StillHeld<()> {
    queue
        .ack(conn, &keep(card_ref, lease, Duration::ZERO))
        .await
        .unwrap()
}

/// Acknowledges `successors` in one call; answers each one's verdict, in order.
async fn ack_all(
    queue: &DueQueue,
    conn: &mut ConnectionManager,
    successors: &[Successor<'_>],
) -> Vec<StillHeld<()>> {
    queue.ack_many(conn, successors).await.unwrap()
}

/// A private Redis and a queue on it whose cards c-1 and c-2 one fetch leased (both under one
/// lease), with a connection and the fetch's answer.
async fn two_leased() -> (PrivateRedis, DueQueue, ConnectionManager, Vec<Leased>) {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    for card in ["c-1", "c-2"] {
        queue.add(&mut conn, card, Duration::ZERO).await.unwrap();
    }
    let leased = queue.fetch(&mut conn, 2, LONG).await.unwrap();
    (redis, queue, conn, leased)
}

fn cards(leased: &[Leased]) -> Vec<&str> {
    leased.iter().map(|l| l.card_ref.as_str()).collect()
}

#[tokio::test]
async fn a_fetch_leases_the_earliest_due_cards_first_and_none_that_is_not_due_yet() {
    let (_redis, queue, mut conn) =
        queue_with_due(&[("c-late", 30_000), ("c-later", 60_000), ("c-just", 10)]).await;
    due_since(&queue, &mut conn, "c-future", -60_000).await;

    let first = queue.fetch(&mut conn, 2, LONG).await.unwrap();
    assert_eq!(cards(&first), ["c-later", "c-late"], "the oldest due first");
    let rest = queue.fetch(&mut conn, 10, LONG).await.unwrap();
    assert_eq!(
        cards(&rest),
        ["c-just"],
        "leased cards and cards not due yet are not handed out"
    );
    assert!(first[0].due_ms < first[1].due_ms);
}

#[tokio::test]
async fn an_acknowledgement_writes_the_next_due_time_only_for_the_lease_that_holds_the_card() {
    let (_redis, queue, mut conn) = queue_with_due(&[("c-1", 1_000)]).await;
    let [leased] = <[Leased; 1]>::try_from(queue.fetch(&mut conn, 5, LONG).await.unwrap()).unwrap();

    assert_eq!(
        ack_now(&queue, &mut conn, "c-1", leased.lease).await,
        StillHeld::Yes(())
    );
    assert_eq!(
        queue
            .ack(
                &mut conn,
                &keep("c-1", leased.lease, Duration::from_secs(3600))
            )
            .await
            .unwrap(),
        StillHeld::Stale,
        "a repeated acknowledgement changes nothing"
    );
    let again = queue.fetch(&mut conn, 5, LONG).await.unwrap();
    assert_eq!(
        cards(&again),
        ["c-1"],
        "the successor is due at once, as the first acknowledgement said"
    );
    assert_ne!(
        again[0].lease, leased.lease,
        "each lease has a name of its own"
    );
    assert_eq!(
        queue.release(&mut conn, &leased).await.unwrap(),
        StillHeld::Stale,
        "the first lease no longer holds the card"
    );
}

#[tokio::test]
async fn a_lease_that_ends_makes_the_card_due_again_and_its_late_acknowledgement_changes_nothing() {
    let (_redis, queue, mut conn) = queue_with_due(&[("c-1", 1_000)]).await;
    let short = Duration::from_millis(200);
    let first = queue.fetch(&mut conn, 5, short).await.unwrap();
    assert_eq!(cards(&first), ["c-1"]);
    assert!(queue.fetch(&mut conn, 5, LONG).await.unwrap().is_empty());

    // Its holder dies: the lease ends on Redis's clock and the card is handed out again.
    let start = Instant::now();
    let second = loop {
        let got = queue.fetch(&mut conn, 5, LONG).await.unwrap();
        if !got.is_empty() {
            break got;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the lease never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(cards(&second), ["c-1"]);
    assert_eq!(
        second[0].due_ms,
        first[0].lease.deadline_ms(),
        "due again as of the ended lease's deadline"
    );
    assert_eq!(
        ack_now(&queue, &mut conn, "c-1", first[0].lease).await,
        StillHeld::Stale,
        "the dead holder's late acknowledgement"
    );
    assert!(
        queue.fetch(&mut conn, 5, LONG).await.unwrap().is_empty(),
        "the second lease still holds the card"
    );
}

#[tokio::test]
async fn a_card_given_back_unpolled_keeps_its_place_by_due_time() {
    let (_redis, queue, mut conn) = queue_with_due(&[("c-old", 50_000), ("c-new", 1_000)]).await;
    let old = queue.fetch(&mut conn, 1, LONG).await.unwrap();
    assert_eq!(cards(&old), ["c-old"]);
    due_since(&queue, &mut conn, "c-newer", 500).await;

    // No token was free: the card goes back as due as it was, ahead of the later ones.
    assert_eq!(
        queue.release(&mut conn, &old[0]).await.unwrap(),
        StillHeld::Yes(())
    );
    let next = queue.fetch(&mut conn, 3, LONG).await.unwrap();
    assert_eq!(cards(&next), ["c-old", "c-new", "c-newer"]);
    assert_eq!(next[0].due_ms, old[0].due_ms);
}

#[tokio::test]
async fn an_extended_lease_outlives_its_first_deadline_and_only_its_new_name_holds_the_card() {
    let (_redis, queue, mut conn) = queue_with_due(&[("c-1", 1_000)]).await;
    let first = queue
        .fetch(&mut conn, 1, Duration::from_millis(300))
        .await
        .unwrap();
    let StillHeld::Yes(extended) = queue
        .extend(&mut conn, "c-1", first[0].lease, LONG)
        .await
        .unwrap()
    else {
        panic!("the lease held its card");
    };
    assert!(extended.deadline_ms() > first[0].lease.deadline_ms() + 50_000);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        queue.fetch(&mut conn, 5, LONG).await.unwrap().is_empty(),
        "past the first deadline, the extended lease still holds the card"
    );
    assert_eq!(
        ack_now(&queue, &mut conn, "c-1", first[0].lease).await,
        StillHeld::Stale,
        "the lease's old name"
    );
    assert_eq!(
        ack_now(&queue, &mut conn, "c-1", extended).await,
        StillHeld::Yes(())
    );
}

#[tokio::test]
async fn adding_a_card_leaves_an_entry_it_has_as_it_is_and_a_removed_card_s_poll_acknowledges_nothing(
) {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    assert!(queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap());
    let leased = queue.fetch(&mut conn, 1, LONG).await.unwrap();
    assert_eq!(cards(&leased), ["c-1"]);
    assert!(
        !queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap(),
        "reconcile adding a card whose poll runs"
    );
    assert!(queue.fetch(&mut conn, 1, LONG).await.unwrap().is_empty());

    assert!(queue.remove(&mut conn, "c-1").await.unwrap());
    assert_eq!(
        ack_now(&queue, &mut conn, "c-1", leased[0].lease).await,
        StillHeld::Stale
    );
    let left: u64 = redis::cmd("ZCARD")
        .arg(&queue.keys().due)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "the removed card stays removed");
}

#[tokio::test]
async fn the_head_tells_the_earliest_due_time_and_how_many_cards_are_due_in_one_call() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    let empty = queue.head(&mut conn).await.unwrap();
    assert_eq!((empty.earliest_due_ms, empty.due_now), (None, 0));

    due_since(&queue, &mut conn, "c-1", 40_000).await;
    due_since(&queue, &mut conn, "c-2", 5_000).await;
    due_since(&queue, &mut conn, "c-3", -60_000).await;
    let head = queue.head(&mut conn).await.unwrap();
    assert_eq!(head.due_now, 2);
    let overdue = head.now_ms - head.earliest_due_ms.unwrap();
    assert!(
        (40_000..41_000).contains(&overdue),
        "overdue by {overdue} ms"
    );

    // A leased card is not due; once its lease ends it is, as of the lease's deadline (later
    // than c-2's due time, which stays the earliest).
    let leased = queue
        .fetch(&mut conn, 1, Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(cards(&leased), ["c-1"]);
    assert_eq!(queue.head(&mut conn).await.unwrap().due_now, 1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let head = queue.head(&mut conn).await.unwrap();
    assert_eq!(head.due_now, 2);
    let overdue = head.now_ms - head.earliest_due_ms.unwrap();
    assert!((5_000..6_000).contains(&overdue), "overdue by {overdue} ms");
}

/// What one holder saw: the card, when its fetch returned, and when it sent its acknowledgement
/// (`None`: it died holding the card).
type Hold = (String, Instant, Option<Instant>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_fetching_and_acknowledging_at_once_never_hold_one_card_twice_and_dead_holders_cards_come_back(
) {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    const CARDS: usize = 40;
    for i in 0..CARDS {
        queue
            .add(&mut conn, &format!("c-{i:02}"), Duration::ZERO)
            .await
            .unwrap();
    }
    let holds: Arc<Mutex<Vec<(Hold, bool)>>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(2);
    let mut workers = Vec::new();
    for w in 0..6u64 {
        let (queue, mut conn, holds) = (queue.clone(), conn.clone(), holds.clone());
        workers.push(tokio::spawn(async move {
            let mut n = w;
            while Instant::now() < until {
                let got = queue
                    .fetch(&mut conn, 3, Duration::from_millis(250))
                    .await
                    .unwrap();
                let fetched = Instant::now();
                for leased in got {
                    n += 1;
                    // Every seventh holder dies holding its card.
                    if n % 7 == 0 {
                        holds
                            .lock()
                            .unwrap()
                            .push(((leased.card_ref, fetched, None), false));
                        continue;
                    }
                    tokio::time::sleep(Duration::from_millis(n % 5)).await;
                    let sent = Instant::now();
                    let held = ack_now(&queue, &mut conn, &leased.card_ref, leased.lease).await;
                    holds.lock().unwrap().push((
                        (leased.card_ref, fetched, Some(sent)),
                        held == StillHeld::Yes(()),
                    ));
                }
                if n % 3 == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let holds = holds.lock().unwrap().clone();
    let mut per_card: BTreeMap<String, Vec<(Instant, Option<Instant>, bool)>> = BTreeMap::new();
    for ((card, fetched, sent), held) in &holds {
        per_card
            .entry(card.clone())
            .or_default()
            .push((*fetched, *sent, *held));
    }
    // Two acknowledged holds of one card never overlap: each ran between its fetch and its
    // acknowledgement, and both found their lease holding the card.
    for (card, mut hs) in per_card.clone() {
        hs.retain(|h| h.2);
        hs.sort_by_key(|h| h.0);
        for pair in hs.windows(2) {
            let (Some(first_sent), second_fetched) = (pair[0].1, pair[1].0) else {
                continue;
            };
            assert!(
                first_sent <= second_fetched,
                "{card} held twice at once: {pair:?}"
            );
        }
    }
    // Every card whose holder died (half a second or more before the end) was handed out again
    // once its 250 ms lease ended.
    let died: Vec<(&str, Instant)> = holds
        .iter()
        .filter(|((_, fetched, sent), _)| {
            sent.is_none() && *fetched + Duration::from_millis(500) < until
        })
        .map(|((card, fetched, _), _)| (card.as_str(), *fetched))
        .collect();
    assert!(!died.is_empty(), "some holders died");
    let lost: Vec<_> = died
        .iter()
        .filter(|(card, at)| !per_card[*card].iter().any(|h| h.0 > *at))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} dead holders' cards were never handed out again: {lost:?}",
        lost.len(),
        died.len()
    );
}

#[tokio::test]
async fn the_due_queue_script_runs_on_a_three_master_redis_cluster_with_a_shard_on_each_master() {
    let cluster = tokio::task::spawn_blocking(PrivateCluster::start)
        .await
        .unwrap();
    // Shards of the card-data task until each master serves one.
    let mut by_master: BTreeMap<u16, u16> = BTreeMap::new();
    for shard in 0..200 {
        let keys = ShardKeys::new("cw", Task::Carddata, shard);
        by_master
            .entry(cluster.node_for(&keys.due))
            .or_insert(shard);
        if by_master.len() == 3 {
            break;
        }
    }
    assert_eq!(by_master.len(), 3, "a shard on each master: {by_master:?}");
    for (port, shard) in &by_master {
        let queue = DueQueue::new(ShardKeys::new("cw", Task::Carddata, *shard));
        let mut conn = context::connect_redis(&PrivateCluster::url(*port))
            .await
            .unwrap();
        assert!(queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap());
        let leased = queue.fetch(&mut conn, 5, LONG).await.unwrap();
        assert_eq!(cards(&leased), ["c-1"], "shard {shard} on master {port}");
        assert_eq!(
            queue
                .ack(&mut conn, &keep("c-1", leased[0].lease, LONG))
                .await
                .unwrap(),
            StillHeld::Yes(())
        );
        assert_eq!(queue.head(&mut conn).await.unwrap().due_now, 0);

        // The cluster does hold the script to its slots: another master refuses the shard.
        let other = cluster.ports().into_iter().find(|p| p != port).unwrap();
        let mut elsewhere = context::connect_redis(&PrivateCluster::url(other))
            .await
            .unwrap();
        let refused = queue.head(&mut elsewhere).await.unwrap_err();
        assert!(
            format!("{refused:#}").to_lowercase().contains("moved"),
            "another master answered: {refused:#}"
        );
    }
}

#[tokio::test]
async fn a_card_acknowledged_and_fetched_again_at_once_gets_a_lease_of_a_new_name_every_time() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap();
    let mut names = Vec::new();
    for _ in 0..200 {
        let leased = queue.fetch(&mut conn, 1, LONG).await.unwrap();
        let lease = leased[0].lease;
        if let Some(&previous) = names.last() {
            // The previous lease's repeated acknowledgement (a retry after a lost reply) must not
            // end this one, however soon after it this one began.
            assert_eq!(
                queue
                    .ack(&mut conn, &keep("c-1", previous, LONG))
                    .await
                    .unwrap(),
                StillHeld::Stale
            );
        }
        names.push(lease);
        assert_eq!(
            ack_now(&queue, &mut conn, "c-1", lease).await,
            StillHeld::Yes(())
        );
    }
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        names.len(),
        "every lease has a name of its own"
    );
}

#[tokio::test]
async fn acknowledgements_sent_in_one_call_each_obey_their_own_lease() {
    let (_redis, queue, mut conn, leased) = two_leased().await;
    let (one, two) = (&leased[0], &leased[1]);
    assert_eq!(
        ack_now(&queue, &mut conn, &one.card_ref, one.lease).await,
        StillHeld::Yes(())
    );
    let held = ack_all(
        &queue,
        &mut conn,
        &[
            keep(&one.card_ref, one.lease, LONG),
            keep(&two.card_ref, two.lease, Duration::ZERO),
        ],
    )
    .await;
    assert_eq!(held, [StillHeld::Stale, StillHeld::Yes(())]);
    let again = queue.fetch(&mut conn, 5, LONG).await.unwrap();
    assert_eq!(
        cards(&again).len(),
        2,
        "the stale acknowledgement did not move c-1 an hour out"
    );
}

/// Fetches `card_ref` (due now) and acknowledges its poll with `step` and `failures`, due again
/// at once; answers the state the fetch handed out.
async fn poll_once(
    queue: &DueQueue,
    conn: &mut ConnectionManager,
    card_ref: &str,
    step: Step,
    failures: u32,
) -> PollState {
    let leased = queue.fetch(conn, 1, LONG).await.unwrap();
    assert_eq!(cards(&leased), [card_ref]);
    let successor = Successor {
        card_ref,
        lease: leased[0].lease,
        next_in: Duration::ZERO,
        next: leased[0].state.after(step, failures, chrono::Utc::now()),
    };
    assert_eq!(
        queue.ack(conn, &successor).await.unwrap(),
        StillHeld::Yes(())
    );
    leased[0].state.clone()
}

#[tokio::test]
async fn an_acknowledgement_writes_the_next_poll_s_state_with_its_due_time_and_the_fetch_hands_it_out(
) {
    use cardworker::polling::unchanged::Since;
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    assert!(queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap());

    let first = poll_once(&queue, &mut conn, "c-1", Step::Unchanged, 0).await;
    assert_eq!((first.failures, first.deferrals), (0, 0));
    let tally = first.tally.expect("an added card has a fresh tally");
    assert_eq!(
        (tally.count, tally.last, tally.since_kind),
        (0, None, Since::ChainStart)
    );

    let after_unchanged = poll_once(&queue, &mut conn, "c-1", Step::Reset, 2).await;
    let tally = after_unchanged.tally.unwrap();
    assert_eq!(tally.count, 1, "one unchanged poll counted");
    assert!(tally.last.is_some());

    let after_failure = poll_once(&queue, &mut conn, "c-1", Step::Keep, 3).await;
    assert_eq!((after_failure.failures, after_failure.deferrals), (2, 0));
    let tally = after_failure.tally.unwrap();
    assert_eq!(
        (tally.count, tally.since_kind),
        (0, Since::ChangeOrFailure),
        "a recorded failure starts the count again"
    );
    let (standing, state) = queue.entry(&mut conn, "c-1").await.unwrap().unwrap();
    assert!(matches!(standing, Standing::Waiting { .. }), "{standing:?}");
    assert_eq!(
        (state.failures, state.tally.unwrap().count),
        (3, 0),
        "a step that keeps the tally keeps its count"
    );
}

#[tokio::test]
async fn a_stale_acknowledgement_or_finish_writes_nothing_to_the_card_s_state_or_due_time() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap();
    let first = queue
        .fetch(&mut conn, 1, Duration::from_millis(50))
        .await
        .unwrap();
    // The first lease ends; a second holder takes the card.
    let second = loop {
        let got = queue.fetch(&mut conn, 1, LONG).await.unwrap();
        if let Some(leased) = got.into_iter().next() {
            break leased;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let late = Successor {
        card_ref: "c-1",
        lease: first[0].lease,
        next_in: Duration::ZERO,
        next: first[0].state.after(Step::Reset, 5, chrono::Utc::now()),
    };
    assert_eq!(queue.ack(&mut conn, &late).await.unwrap(), StillHeld::Stale);
    assert_eq!(
        queue
            .finish(&mut conn, "c-1", first[0].lease)
            .await
            .unwrap(),
        StillHeld::Stale
    );
    let (standing, state) = queue.entry(&mut conn, "c-1").await.unwrap().unwrap();
    assert_eq!(
        standing,
        Standing::Leased {
            deadline_ms: second.lease.deadline_ms()
        },
        "the second holder still holds the card"
    );
    assert_eq!(
        state.failures, 0,
        "the stale acknowledgement wrote no state"
    );

    assert_eq!(
        queue.finish(&mut conn, "c-1", second.lease).await.unwrap(),
        StillHeld::Yes(())
    );
    assert_eq!(queue.entry(&mut conn, "c-1").await.unwrap(), None);
    let left: usize = redis::cmd("HLEN")
        .arg(&queue.keys().state)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0, "a finished card's state goes with its due entry");
}

#[tokio::test]
async fn a_merge_brings_a_waiting_card_forward_leaves_a_leased_one_to_its_poll_and_starts_one_without_an_entry(
) {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    queue.add(&mut conn, "c-wait", LONG).await.unwrap();
    queue
        .add(&mut conn, "c-held", Duration::ZERO)
        .await
        .unwrap();
    let held = queue.fetch(&mut conn, 1, LONG).await.unwrap();
    assert_eq!(cards(&held), ["c-held"]);

    assert_eq!(
        queue
            .merge(&mut conn, "c-wait", Duration::ZERO)
            .await
            .unwrap(),
        Merged::IntoLive
    );
    assert_eq!(
        queue
            .merge(&mut conn, "c-held", Duration::ZERO)
            .await
            .unwrap(),
        Merged::IntoLive
    );
    assert_eq!(
        queue
            .merge(&mut conn, "c-new", Duration::ZERO)
            .await
            .unwrap(),
        Merged::Started
    );
    // A later request never puts a waiting card back.
    queue.merge(&mut conn, "c-wait", LONG).await.unwrap();

    let due = queue.fetch(&mut conn, 10, LONG).await.unwrap();
    let mut got = cards(&due);
    got.sort();
    assert_eq!(
        got,
        ["c-new", "c-wait"],
        "the leased card is not handed out"
    );
    assert_eq!(
        queue
            .ack(&mut conn, &keep("c-held", held[0].lease, LONG))
            .await
            .unwrap(),
        StillHeld::Yes(()),
        "the merge left the running poll's lease in place"
    );
}

#[tokio::test]
async fn a_fetch_that_finds_nothing_due_tells_how_soon_the_next_card_is() {
    use cardworker::polling::due_queue::Fetched;
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    assert_eq!(
        queue.fetch_or_wait(&mut conn, 5, LONG).await.unwrap(),
        Fetched::NoneDue { next_in: None },
        "an empty shard"
    );
    queue.add(&mut conn, "c-later", LONG).await.unwrap();
    let Fetched::NoneDue {
        next_in: Some(wait),
    } = queue.fetch_or_wait(&mut conn, 5, LONG).await.unwrap()
    else {
        panic!("nothing is due yet");
    };
    assert!(
        (LONG - Duration::from_secs(2)..=LONG).contains(&wait),
        "the waiting card is due in {wait:?}"
    );
    queue
        .add(&mut conn, "c-held", Duration::ZERO)
        .await
        .unwrap();
    let held = queue
        .fetch(&mut conn, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(cards(&held), ["c-held"]);
    let Fetched::NoneDue {
        next_in: Some(wait),
    } = queue.fetch_or_wait(&mut conn, 5, LONG).await.unwrap()
    else {
        panic!("nothing is due yet");
    };
    assert!(
        (Duration::from_secs(3)..=Duration::from_secs(5)).contains(&wait),
        "the lease ends in {wait:?}, before the waiting card is due"
    );
}

/// The Redis commands (inner ones counted, `INFO commandstats`) that fetching `n` due cards in
/// one call and acknowledging them in one call cost.
async fn commands_for_a_round_of(n: usize) -> u64 {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    let cards: Vec<String> = (0..n).map(|i| format!("c-{i}")).collect();
    let refs: Vec<(&str, Duration)> = cards.iter().map(|c| (c.as_str(), Duration::ZERO)).collect();
    queue.add_many(&mut conn, &refs).await.unwrap();
    crate::redis_cost::reset(&mut conn).await;

    let leased = queue.fetch(&mut conn, n, LONG).await.unwrap();
    assert_eq!(leased.len(), n);
    let successors: Vec<Successor<'_>> = leased
        .iter()
        .map(|l| keep(&l.card_ref, l.lease, LONG))
        .collect();
    let held = ack_all(&queue, &mut conn, &successors).await;
    assert!(held.iter().all(|h| *h == StillHeld::Yes(())), "{held:?}");
    let (calls, _) = crate::redis_cost::counted(&mut conn).await;
    calls.values().sum()
}

#[tokio::test]
async fn a_round_of_32_cards_costs_redis_as_many_commands_as_a_round_of_one() {
    let one = commands_for_a_round_of(1).await;
    let many = commands_for_a_round_of(32).await;
    assert_eq!(
        many, one,
        "a fetch and an acknowledgement write their cards with one command each, whatever their \
         number ({one} commands for one card, {many} for 32)"
    );
}

/// The Redis commands (inner ones counted) that adding `n` cards in one call costs, when every
/// other one of them has an entry already; and how many the call added.
async fn commands_to_add(n: usize) -> (u64, usize) {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    let cards: Vec<String> = (0..n).map(|i| format!("c-{i}")).collect();
    let present: Vec<(&str, Duration)> = cards
        .iter()
        .step_by(2)
        .map(|c| (c.as_str(), LONG))
        .collect();
    queue.add_many(&mut conn, &present).await.unwrap();
    crate::redis_cost::reset(&mut conn).await;

    let all: Vec<(&str, Duration)> = cards.iter().map(|c| (c.as_str(), Duration::ZERO)).collect();
    let added = queue.add_many(&mut conn, &all).await.unwrap();
    let (calls, _) = crate::redis_cost::counted(&mut conn).await;
    (calls.values().sum(), added)
}

#[tokio::test]
async fn adding_cards_in_one_call_costs_redis_as_many_commands_for_32_cards_as_for_two() {
    let (two, added_of_two) = commands_to_add(2).await;
    let (many, added_of_many) = commands_to_add(32).await;
    assert_eq!(
        (added_of_two, added_of_many),
        (1, 16),
        "only the cards without an entry are added"
    );
    assert_eq!(
        many, two,
        "a reconcile pass's add reads and writes its cards with one command each, whatever their \
         number ({two} commands for two cards, {many} for 32)"
    );
}

#[tokio::test]
async fn a_card_added_twice_in_one_call_is_added_once_at_its_first_due_time() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    let added = queue
        .add_many(&mut conn, &[("c-1", Duration::ZERO), ("c-1", LONG)])
        .await
        .unwrap();
    assert_eq!(added, 1);
    let leased = queue.fetch(&mut conn, 2, LONG).await.unwrap();
    assert_eq!(cards(&leased), ["c-1"], "due at once, as first named");
    let state = &leased[0].state;
    assert_eq!(
        (state.failures, state.tally.as_ref().map(|t| t.count)),
        (0, Some(0)),
        "with a fresh state: {state:?}"
    );
}

#[tokio::test]
async fn a_card_named_twice_in_one_acknowledgement_is_acknowledged_once() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    queue.add(&mut conn, "c-1", Duration::ZERO).await.unwrap();
    let leased = queue.fetch(&mut conn, 1, LONG).await.unwrap();
    let one = &leased[0];
    let held = ack_all(
        &queue,
        &mut conn,
        &[
            keep(&one.card_ref, one.lease, Duration::ZERO),
            keep(&one.card_ref, one.lease, LONG),
        ],
    )
    .await;
    assert_eq!(
        held,
        [StillHeld::Yes(()), StillHeld::Stale],
        "the first successor ends the lease the second names"
    );
    let again = queue.fetch(&mut conn, 1, LONG).await.unwrap();
    assert_eq!(
        cards(&again),
        ["c-1"],
        "the first successor's due time stands"
    );
}

#[tokio::test]
async fn acknowledgements_ending_within_the_linger_of_each_other_reach_redis_in_one_script_call() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    let names: Vec<String> = (0..4).map(|i| format!("c-{i}")).collect();
    let refs: Vec<(&str, Duration)> = names.iter().map(|c| (c.as_str(), Duration::ZERO)).collect();
    queue.add_many(&mut conn, &refs).await.unwrap();
    let leased = queue.fetch(&mut conn, 4, LONG).await.unwrap();
    assert_eq!(leased.len(), 4);
    // A linger far above the gap below, so that a loaded machine cannot split the batch.
    let calls = ScriptCalls::lingering(
        conn.clone(),
        redis::Script::new(cardworker_jobs::due::SCRIPT),
        lease::ACK_WIDTH,
        Duration::from_secs(2),
    );
    crate::redis_cost::reset(&mut conn).await;

    // The first poll ends alone; the other three 50 ms later, within the first's linger.
    let alone = keep(&leased[0].card_ref, leased[0].lease, LONG);
    let first = lease::ack(&calls, &queue, &alone);
    let rest =
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            futures::future::join_all(leased[1..].iter().map(|l| async {
                lease::ack(&calls, &queue, &keep(&l.card_ref, l.lease, LONG)).await
            }))
            .await
        };
    let (first, rest) = tokio::join!(first, rest);
    assert_eq!(first.unwrap(), StillHeld::Yes(()));
    for held in rest {
        assert_eq!(held.unwrap(), StillHeld::Yes(()));
    }
    let (counted, _) = crate::redis_cost::counted(&mut conn).await;
    assert_eq!(
        counted.get("evalsha").copied().unwrap_or(0) + counted.get("eval").copied().unwrap_or(0),
        1,
        "four acknowledgements within the linger go in one script call: {counted:?}"
    );
    assert!(
        queue.fetch(&mut conn, 4, LONG).await.unwrap().is_empty(),
        "every successor was written, due later"
    );
}

#[tokio::test]
async fn an_acknowledgement_naming_a_lease_that_is_no_number_acknowledges_nothing_for_it_and_the_rest_as_usual(
) {
    let (_redis, queue, mut conn, leased) = two_leased().await;
    let (one, two) = (&leased[0], &leased[1]);
    // A raw call, as another producer of the shared script could send it: the typed API cannot
    // name such a lease.
    let keys = queue.keys();
    let held: Vec<u8> = redis::Script::new(cardworker_jobs::due::SCRIPT)
        .key(&keys.due)
        .key(&keys.last_lease)
        .key(&keys.state)
        .arg("batch")
        .arg(&one.card_ref)
        .arg("not-a-lease")
        .arg(0)
        .arg(PollState::default().to_raw())
        .arg(&two.card_ref)
        .arg(two.lease.score())
        .arg(0)
        .arg(PollState::default().to_raw())
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        held,
        [0, 1],
        "only the lease that holds its card acknowledges it"
    );
    let again = queue.fetch(&mut conn, 5, LONG).await.unwrap();
    assert_eq!(
        cards(&again),
        [two.card_ref.as_str()],
        "c-2 is due again; c-1 is still under its lease"
    );
}

#[tokio::test]
async fn a_card_whose_due_score_has_a_fraction_is_fetched_with_its_whole_milliseconds() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    // Scores the project writes are whole milliseconds; one written by hand may not be.
    let _: () = redis::cmd("ZADD")
        .arg(&queue.keys().due)
        .arg("1764000000000.75")
        .arg("c-1")
        .query_async(&mut conn)
        .await
        .unwrap();
    let leased = queue.fetch(&mut conn, 1, LONG).await.unwrap();
    assert_eq!(cards(&leased), ["c-1"]);
    assert_eq!(leased[0].due_ms, 1_764_000_000_000);
}

#[tokio::test]
async fn the_polls_of_a_big_fetch_acknowledged_one_by_one_each_obey_their_own_lease() {
    let redis = PrivateRedis::start_new(false);
    let (queue, mut conn) = queue_on(&redis).await;
    for i in 0..20 {
        let card = format!("c-{i:02}");
        queue.add(&mut conn, &card, Duration::ZERO).await.unwrap();
    }
    let leased = queue.fetch(&mut conn, 20, LONG).await.unwrap();
    assert_eq!(leased.len(), 20);
    // One card of twenty named with its lease: the lease holds more than the range a call reads
    // for one card, so the script checks that card's score instead.
    let (first, second) = (&leased[0], &leased[1]);
    let stale = Lease::from_score(first.lease.score() - 1);
    let held = ack_all(
        &queue,
        &mut conn,
        &[
            keep(&first.card_ref, stale, Duration::ZERO),
            keep(&second.card_ref, second.lease, Duration::ZERO),
            keep(&second.card_ref, second.lease, LONG),
        ],
    )
    .await;
    assert_eq!(
        held,
        [StillHeld::Stale, StillHeld::Yes(()), StillHeld::Stale],
        "a stale lease holds nothing, and a card named twice is acknowledged once"
    );
    for poll in &leased[2..] {
        assert_eq!(
            ack_now(&queue, &mut conn, &poll.card_ref, poll.lease).await,
            StillHeld::Yes(()),
            "{} under its own lease",
            poll.card_ref
        );
    }
    let again = queue.fetch(&mut conn, 30, LONG).await.unwrap();
    let mut due: Vec<&str> = cards(&again);
    due.sort_unstable();
    let want: Vec<String> = (1..20).map(|i| format!("c-{i:02}")).collect();
    assert_eq!(
        due, want,
        "every acknowledged card is due again; c-00 is still leased"
    );
}
