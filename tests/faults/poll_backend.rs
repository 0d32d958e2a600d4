//! The polling workers' apalis backend (`polling::backend`): a real apalis worker fetching
//! straight from a due queue on a redis-server of the test's own.

// An unwrap() that fails is the test failing, at its line.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apalis::prelude::*;
use cardworker::config::Task;
use cardworker::context;
use cardworker::polling::backend::{FetchPause, LeasedPoll, PollBackend, PollFetch};
use cardworker::polling::due_queue::{DueQueue, ShardKeys, Step, Successor, LEASED};
use redis::aio::ConnectionManager;

use crate::private::PrivateRedis;

/// What the test's handler shares: the queue, a connection, the worker's polls under way (the
/// count the backend fetches by), and what it saw.
#[derive(Clone)]
struct Seen {
    queue: DueQueue,
    conn: ConnectionManager,
    running: Arc<AtomicUsize>,
    /// Per card, the payloads of its polls.
    polls: Arc<Mutex<BTreeMap<String, Vec<LeasedPoll>>>>,
    /// The most cards leased in Redis at once, read at each poll's start.
    most_leased: Arc<AtomicUsize>,
    done: Arc<tokio::sync::Notify>,
}

impl Seen {
    /// Nothing seen yet, on `queue` through `conn`.
    fn on(queue: &DueQueue, conn: &ConnectionManager) -> Self {
        Self {
            queue: queue.clone(),
            conn: conn.clone(),
            running: Arc::default(),
            polls: Arc::default(),
            most_leased: Arc::default(),
            done: Arc::default(),
        }
    }
}

/// A stop for a worker's `run_until`: notify the first to stop the second.
fn stop_signal() -> (
    Arc<tokio::sync::Notify>,
    impl std::future::Future<Output = Result<(), std::io::Error>>,
) {
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = {
        let stop = stop.clone();
        async move {
            stop.notified().await;
            Ok::<(), std::io::Error>(())
        }
    };
    (stop, stopped)
}

async fn poll(raw: String, seen: Data<Seen>) -> Result<(), BoxDynError> {
    seen.running.fetch_add(1, Ordering::AcqRel);
    let poll: LeasedPoll = serde_json::from_str(&raw)?;
    let mut conn = seen.conn.clone();
    let leased: usize = redis::cmd("ZCOUNT")
        .arg(&seen.queue.keys().due)
        .arg(LEASED)
        .arg("+inf")
        .query_async(&mut conn)
        .await?;
    seen.most_leased.fetch_max(leased, Ordering::AcqRel);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let before = poll.state();
    let successor = Successor {
        card_ref: &poll.card_ref,
        lease: poll.lease(),
        next_in: Duration::from_secs(3600),
        next: before.after(Step::Unchanged, before.failures + 1, chrono::Utc::now()),
    };
    seen.queue.ack(&mut conn, &successor).await?;
    seen.polls
        .lock()
        .unwrap()
        .entry(poll.card_ref.clone())
        .or_default()
        .push(poll);
    seen.running.fetch_sub(1, Ordering::AcqRel);
    seen.done.notify_one();
    Ok(())
}

/// A private redis-server, a connection to it and `task`'s due queue (shard 0) on it.
async fn private_queue(task: Task) -> (PrivateRedis, ConnectionManager, DueQueue) {
    let redis = PrivateRedis::start_new(false);
    let conn = context::connect_redis(&redis.url()).await.unwrap();
    (redis, conn, DueQueue::new(ShardKeys::new("cw", task, 0)))
}

/// How a test's worker fetches: `slots` at once, each under a 30 s lease, idle for at most
/// `idle_max`, gathering for `gather`.
fn fetching(slots: usize, idle_max: Duration, gather: Duration) -> PollFetch {
    PollFetch {
        slots,
        lease: Duration::from_secs(30),
        idle_max,
        gather,
    }
}

/// The number of polls `seen` recorded.
fn polls_seen(seen: &Seen) -> usize {
    seen.polls.lock().unwrap().values().map(Vec::len).sum()
}

/// Starts an apalis worker named `name` on a [`PollBackend`] of `queue` (through `conn`) that
/// fetches by `fetch`, polling with [`poll`] into `seen`; notify the stop it answers to end it.
fn start_worker(
    name: &str,
    queue: &DueQueue,
    conn: &ConnectionManager,
    seen: &Seen,
    fetch: PollFetch,
) -> (
    Arc<tokio::sync::Notify>,
    tokio::task::JoinHandle<Result<(), WorkerError>>,
) {
    let backend = PollBackend::new(
        queue.clone(),
        conn.clone(),
        fetch,
        seen.running.clone(),
        FetchPause::default(),
    );
    let worker = WorkerBuilder::new(name)
        .backend(backend)
        .data(seen.clone())
        .concurrency(fetch.slots)
        .build(poll);
    let (stop, stopped) = stop_signal();
    (stop, tokio::spawn(worker.run_until(stopped)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_worker_leases_only_as_many_cards_as_it_has_free_slots_and_polls_each_due_card_once()
{
    let (_redis, mut conn, queue) = private_queue(Task::CardStatus).await;
    const CARDS: usize = 30;
    const SLOTS: usize = 4;
    for i in 0..CARDS {
        queue
            .add(&mut conn, &format!("c-{i:02}"), Duration::ZERO)
            .await
            .unwrap();
    }
    let seen = Seen::on(&queue, &conn);
    let fetch = fetching(SLOTS, Duration::from_millis(20), Duration::from_millis(10));
    let (stop, run) = start_worker("poll-backend-test", &queue, &conn, &seen, fetch);
    tokio::time::timeout(Duration::from_secs(30), async {
        while polls_seen(&seen) < CARDS {
            seen.done.notified().await;
        }
    })
    .await
    .expect("every due card polled within 30 s");
    // A little longer: a card polled twice would show now (each is due again in an hour).
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.notify_one();
    run.await.unwrap().unwrap();

    let polls = seen.polls.lock().unwrap().clone();
    assert_eq!(polls.len(), CARDS, "every card polled");
    for (card, ps) in &polls {
        assert_eq!(ps.len(), 1, "{card} polled {} times", ps.len());
        assert_eq!(
            ps[0].state().failures,
            0,
            "{card}: the state the fetch handed out"
        );
    }
    let most = seen.most_leased.load(Ordering::Acquire);
    assert!(
        (1..=SLOTS).contains(&most),
        "at most {SLOTS} cards leased at once (one per free slot), saw {most}"
    );
    let head = queue.head(&mut conn).await.unwrap();
    assert_eq!(
        head.due_now, 0,
        "every poll acknowledged with its successor"
    );
    let (_, state) = queue.entry(&mut conn, "c-00").await.unwrap().unwrap();
    assert_eq!(
        state.failures, 1,
        "the acknowledgement wrote the successor's state"
    );
}

async fn slow_poll(raw: String, seen: Data<Seen>) -> Result<(), BoxDynError> {
    let poll: LeasedPoll = serde_json::from_str(&raw)?;
    seen.done.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let successor = Successor {
        card_ref: &poll.card_ref,
        lease: poll.lease(),
        next_in: Duration::from_secs(3600),
        next: poll.state().after(Step::Unchanged, 0, chrono::Utc::now()),
    };
    seen.queue.ack(&mut seen.conn.clone(), &successor).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_poll_worker_gives_the_cards_it_fetched_and_never_started_back_at_their_due_time()
{
    let (_redis, mut conn, queue) = private_queue(Task::Carddata).await;
    for i in 0..4 {
        queue
            .add(&mut conn, &format!("c-{i}"), Duration::ZERO)
            .await
            .unwrap();
    }
    let mut due_before = BTreeMap::new();
    for i in 0..4 {
        let card = format!("c-{i}");
        let (standing, _) = queue.entry(&mut conn, &card).await.unwrap().unwrap();
        due_before.insert(card, standing);
    }
    let seen = Seen::on(&queue, &conn);
    // The backend leases for four slots, the worker runs one poll at a time: three cards wait
    // fetched and unstarted while the first poll runs.
    let fetch = PollFetch {
        slots: 4,
        lease: Duration::from_secs(60),
        idle_max: Duration::from_millis(20),
        gather: Duration::from_millis(10),
    };
    let backend = PollBackend::new(
        queue.clone(),
        conn.clone(),
        fetch,
        seen.running.clone(),
        FetchPause::default(),
    );
    let worker = WorkerBuilder::new("poll-backend-close-test")
        .backend(backend)
        .data(seen.clone())
        .concurrency(1)
        .build(slow_poll);
    let (stop, stopped) = stop_signal();
    let run = tokio::spawn(worker.run_until(stopped));
    tokio::time::timeout(Duration::from_secs(10), seen.done.notified())
        .await
        .expect("a first poll starts");
    stop.notify_one();
    run.await.unwrap().unwrap();

    let leased: usize = redis::cmd("ZCOUNT")
        .arg(&queue.keys().due)
        .arg(LEASED)
        .arg("+inf")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(leased, 0, "no card stays leased once the worker stopped");
    let mut given_back = 0;
    for (card, before) in &due_before {
        let (standing, _) = queue.entry(&mut conn, card).await.unwrap().unwrap();
        if standing == *before {
            given_back += 1;
        }
    }
    assert_eq!(
        given_back, 3,
        "the three unstarted cards wait again at their own due time"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_poll_worker_wakes_when_the_next_card_is_due_not_after_its_longest_wait() {
    let (_redis, mut conn, queue) = private_queue(Task::Carddata).await;
    for i in 0..3 {
        queue
            .add(&mut conn, &format!("c-{i}"), Duration::from_millis(400))
            .await
            .unwrap();
    }
    let seen = Seen::on(&queue, &conn);
    // The first fetch finds nothing due: the worker must come back when the cards are, not
    // after its longest wait.
    let fetch = fetching(4, Duration::from_secs(60), Duration::from_millis(10));
    let (stop, run) = start_worker("poll-backend-idle-test", &queue, &conn, &seen, fetch);
    let polled = tokio::time::timeout(Duration::from_secs(10), async {
        while seen.polls.lock().unwrap().len() < 3 {
            seen.done.notified().await;
        }
    })
    .await;
    stop.notify_one();
    run.await.unwrap().unwrap();
    assert!(
        polled.is_ok(),
        "cards due 400 ms after the start polled within 10 s (the longest idle wait is 60 s); polled: {:?}",
        seen.polls.lock().unwrap().keys().collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_worker_that_leased_every_due_card_gathers_the_cards_coming_due_into_one_fetch() {
    let (_redis, mut conn, queue) = private_queue(Task::Carddata).await;
    queue
        .add(&mut conn, "c-first", Duration::ZERO)
        .await
        .unwrap();
    let seen = Seen::on(&queue, &conn);
    let fetch = fetching(8, Duration::from_millis(20), Duration::from_millis(600));
    let (stop, run) = start_worker("poll-backend-gather", &queue, &conn, &seen, fetch);

    // The first fetch leased the one due card with seven slots to spare; cards coming due one by
    // one within the gather window that follows are leased by one fetch, under one lease.
    tokio::time::timeout(Duration::from_secs(10), async {
        while polls_seen(&seen) < 1 {
            seen.done.notified().await;
        }
    })
    .await
    .expect("the first card polled");
    let trickle: Vec<String> = (0..4).map(|i| format!("c-{i}")).collect();
    for card in &trickle {
        queue.add(&mut conn, card, Duration::ZERO).await.unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        while polls_seen(&seen) < 1 + trickle.len() {
            seen.done.notified().await;
        }
    })
    .await
    .expect("every card of the trickle polled");
    stop.notify_one();
    run.await.unwrap().unwrap();

    let polls = seen.polls.lock().unwrap().clone();
    let leases: std::collections::BTreeSet<u64> =
        trickle.iter().map(|card| polls[card][0].lease).collect();
    assert_eq!(
        leases.len(),
        1,
        "the trickle's cards were leased by one fetch (one lease score): {leases:?}"
    );
}
