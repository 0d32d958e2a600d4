//! Workers that survive slow work: two `cardworker run` processes while polls take 20 s, with
//! timeouts that allow it (gateway 25 s, handler 27 s, lease 40 s). No worker may be declared
//! dead and no card polled twice at once.
//!
//! This is the short, deterministic version: the cards are arranged so that the first process's
//! four card-status slots all hold 20 s calls while three more fetched jobs wait in its buffer,
//! the very state in which apalis-redis stops heartbeating (main's code loses the process within
//! about 20 s here). The statistical version (a quarter of 24 cards slow, 100 s, both tasks) is
//! `make bench-slowdown`.

use std::time::{Duration, Instant};

use cardworker::config::Task;
use cardworker::polling::lease;
use cardworker::runner::spawn::{orphan_window, HEARTBEAT};

use crate::harness::{spawn_worker, wait_until};
use crate::worker_support::{polling_env, Polling, PollingEnv};

const SLOW_MS: u64 = 20_000;
const RUN_FOR: Duration = Duration::from_secs(35);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_whose_slots_all_hold_20_s_polls_stay_alive_and_never_poll_a_card_twice_at_once(
) {
    // The scenario is only meaningful when a slow call outlasts apalis's own 3-heartbeat window.
    assert!(Duration::from_millis(SLOW_MS) > HEARTBEAT * 3);
    assert!(orphan_window(Duration::from_secs(27), HEARTBEAT) > Duration::from_secs(27));
    let PollingEnv {
        db,
        redis,
        sim,
        sim_handle: _sim_handle,
        dir: _dir,
        config: path,
    } = polling_env(
        5,
        8,
        &Polling {
            gateway_timeout_ms: 25_000,
            shutdown_grace_secs: 5,
            total_limit: 8,
            handler_timeout_secs: 27,
            lease_ttl_secs: 40,
            task_limit: 4,
            interval_secs: 2,
            // Only the chains this test starts: a scheduled reconcile (every 10 minutes by
            // default) crossed by the run would start chains of its own for these cards (seen
            // once: peak 8 where 4 expected).
            more_polling: "reconcile_cron = \"0 0 0 1 1 *\"\n",
        },
    )
    .await;
    // c-00 answers at once, c-01..c-07 after 20 s.
    for i in 0..8 {
        let card = format!("c-{i:02}");
        sqlx::query("INSERT INTO cards (card_ref) VALUES ($1)")
            .bind(&card)
            .execute(&db.pool)
            .await
            .unwrap();
        if i > 0 {
            sim.set_card_latency(&card, Some(SLOW_MS));
        }
    }
    let mut workers = vec![spawn_worker(&path)];
    let mut conn = redis.conn.clone();
    let start = |card: String, delay_ms: u64| {
        let mut conn = conn.clone();
        let prefix = redis.prefix.clone();
        async move {
            lease::start(
                &mut conn,
                &prefix,
                Task::CardStatus,
                &card,
                Duration::from_millis(delay_ms),
            )
            .await
            .unwrap();
        }
    };
    // The first fetch takes c-00..c-03; when c-00 is done, the next takes c-04..c-07: one of them
    // gets the last token, three wait in the buffer behind four 20 s calls.
    for i in 0..4 {
        start(format!("c-{i:02}"), 0).await;
    }
    for i in 4..8 {
        start(format!("c-{i:02}"), 600).await;
    }
    wait_until(
        Duration::from_secs(10),
        "four slow calls in flight",
        || async { sim.stats().in_flight >= 4 },
    )
    .await;
    // The peer whose heartbeats would find the first process's heartbeat stale.
    workers.push(spawn_worker(&path));
    let _ = &mut conn;
    let started = Instant::now();
    while started.elapsed() < RUN_FOR {
        for (i, w) in workers.iter_mut().enumerate() {
            if let Some(status) = w.child.try_wait().unwrap() {
                panic!(
                    "worker {i} exited after {:?} with {status}: a slow poll made it look dead",
                    started.elapsed()
                );
            }
        }
        assert!(
            sim.stats().peak_same_card <= 1,
            "a card was polled twice at once: {:?}",
            sim.stats()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let stats = sim.stats();
    assert_eq!(stats.peak_same_card, 1, "{stats:?}");
    // The budget held: at most the card-status limit in flight, fleet-wide.
    assert_eq!(stats.peak_in_flight, 4, "{stats:?}");
    // Every slow card was polled, and polling went on after them.
    for i in 1..8 {
        assert!(
            sim.card(&format!("c-{i:02}")).is_some(),
            "c-{i:02} never polled"
        );
    }
    assert!(
        stats.calls_total.get("card_status").copied().unwrap_or(0) > 8,
        "{stats:?}"
    );
    for w in &workers {
        w.terminate();
    }
    for w in &mut workers {
        let status = w.child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "a clean exit after SIGTERM");
    }
}
