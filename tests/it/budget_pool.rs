//! The slots a process keeps between its polls (`budget::pool`), against real Redis: a poll on a
//! kept slot needs no Redis call, and everything that used to stop a poll at its acquire (a pause,
//! a lowered limit, an open circuit, another process waiting, a lost Redis) still stops it, at the
//! process's next renewal.

use std::time::Duration;

use cardworker::budget::{self, Acquired, Budget, CallReport, ShortReason};
use cardworker::config::Task;
use cardworker::limit::Limit;
use redis::aio::ConnectionManager;

use crate::budget::{config, fresh_budget, fresh_config};
use crate::harness::TestRedis;

async fn card(conn: &mut ConnectionManager, key: &str) -> u64 {
    redis::cmd("ZCARD")
        .arg(key)
        .query_async(conn)
        .await
        .expect("zcard")
}

/// Waits (bounded) until `done` holds, checking every 20 ms.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A poll admitted and finished with `report`: the slot it ran on.
async fn poll_once(b: &Budget, task: Task, report: CallReport) -> String {
    let (got, slot) = b.admit(task, &b.new_lease_id()).await.expect("admit");
    assert_eq!(got, Acquired::Acquired);
    let lease = slot.lease.clone();
    b.finish_poll(task, slot, report, 0, "card-1");
    lease
}

/// `n` polls of `task` at once, all finished: their slots are kept, idle.
async fn keep_slots(b: &Budget, task: Task, n: usize) {
    let mut slots = Vec::new();
    for _ in 0..n {
        let (got, slot) = b.admit(task, &b.new_lease_id()).await.expect("admit");
        assert_eq!(got, Acquired::Acquired);
        slots.push(slot);
    }
    for slot in slots {
        b.finish_poll(task, slot, CallReport::Ok, 0, "c");
    }
}

#[tokio::test]
async fn after_a_renewal_allows_it_a_poll_starts_on_the_kept_slot_without_a_redis_call() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    let first = poll_once(&b, Task::Carddata, CallReport::Ok).await;
    assert_eq!(b.idle_count(), 1, "the finished poll's slot is kept");
    b.renew().await.expect("renew");
    let trips = b.round_trips();
    for _ in 0..50 {
        assert_eq!(poll_once(&b, Task::Carddata, CallReport::Ok).await, first);
    }
    assert_eq!(b.round_trips(), trips, "no budget call for 50 polls");
    assert_eq!(b.reused(), 50);
    // Still one member in both sets, counted by every process.
    assert_eq!(card(&mut conn, &budget::total_key(&r.prefix)).await, 1);
    assert_eq!(
        card(&mut conn, &budget::task_key(&r.prefix, Task::Carddata)).await,
        1
    );
    // Between polls it is kept, not in use: no poll runs on it.
    let view = b.show().await.unwrap();
    assert_eq!((view.total.in_use, view.total.kept), (0, 1));
    // Shutdown gives the kept slot back at once.
    assert_eq!(b.release_held().await.unwrap(), 1);
    assert_eq!(card(&mut conn, &budget::total_key(&r.prefix)).await, 0);
}

#[tokio::test]
async fn a_renewal_refreshes_a_kept_slot_s_expiry_from_redis_time() {
    let (r, mut conn, mut c) = fresh_config(4, 2, 2).await;
    c.polling.lease_ttl_secs = 30;
    let b = Budget::new(r.conn.clone(), &c);
    let lease = poll_once(&b, Task::Carddata, CallReport::Ok).await;
    let total = budget::total_key(&r.prefix);
    let _: () = redis::cmd("ZADD")
        .arg(&total)
        .arg(1)
        .arg(&lease)
        .query_async(&mut conn)
        .await
        .unwrap();
    b.renew().await.expect("renew");
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let score: f64 = redis::cmd("ZSCORE")
        .arg(&total)
        .arg(&lease)
        .query_async(&mut conn)
        .await
        .unwrap();
    let left_ms = score as i64 - (s * 1000 + us / 1000);
    assert!(
        (25_000..=30_000).contains(&left_ms),
        "expiry {left_ms} ms away"
    );
}

#[tokio::test]
async fn a_pause_reaches_a_process_that_keeps_slots_at_its_next_renewal_and_its_slots_go_back() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    poll_once(&b, Task::Carddata, CallReport::Ok).await;
    b.renew().await.expect("renew");
    b.pause(&[Task::Carddata]).await.unwrap();
    b.renew().await.expect("renew");
    assert_eq!(b.idle_count(), 0, "the kept slot is given back");
    let (got, _) = b.admit(Task::Carddata, &b.new_lease_id()).await.unwrap();
    assert_eq!(
        got,
        Acquired::Short {
            reason: ShortReason::Paused
        }
    );
    b.flush_carried().await.unwrap();
    assert_eq!(card(&mut conn, &budget::total_key(&r.prefix)).await, 0);
    // The other task is not paused: it still keeps its slots.
    poll_once(&b, Task::CardStatus, CallReport::Ok).await;
    b.renew().await.expect("renew");
    let before = b.reused();
    poll_once(&b, Task::CardStatus, CallReport::Ok).await;
    assert_eq!(b.reused(), before + 1);
}

#[tokio::test]
async fn a_lowered_limit_makes_a_process_give_back_the_slots_it_keeps_over_it() {
    let (r, mut conn, b) = fresh_budget(8, 4, 4).await;
    // Three polls at once, then all three slots kept.
    keep_slots(&b, Task::Carddata, 3).await;
    b.renew().await.expect("renew");
    assert_eq!(b.idle_count(), 3);
    b.set_override(Task::Carddata, Limit::new(1).expect("a limit"))
        .await
        .unwrap();
    b.renew().await.expect("renew");
    assert_eq!(b.idle_count(), 0);
    b.flush_carried().await.unwrap();
    let cd = budget::task_key(&r.prefix, Task::Carddata);
    assert_eq!(card(&mut conn, &cd).await, 0);
    // From here every poll asks Redis, and the new limit holds.
    let (got, slot) = b.admit(Task::Carddata, &b.new_lease_id()).await.unwrap();
    assert_eq!(got, Acquired::Acquired);
    let (got, _) = b.admit(Task::Carddata, &b.new_lease_id()).await.unwrap();
    assert_eq!(
        got,
        Acquired::Short {
            reason: ShortReason::Task
        }
    );
    b.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, "c");
}

#[tokio::test]
async fn another_process_refused_a_token_makes_the_others_give_their_idle_slots_back() {
    let (r, mut conn, c) = fresh_config(2, 2, 2).await;
    let busy = Budget::new(r.conn.clone(), &c).with_process_id("pod-a-1");
    let starved = Budget::new(r.conn.clone(), &c).with_process_id("pod-b-2");
    let mut slots = Vec::new();
    for _ in 0..2 {
        let (got, slot) = busy
            .admit(Task::Carddata, &busy.new_lease_id())
            .await
            .unwrap();
        assert_eq!(got, Acquired::Acquired);
        slots.push(slot);
    }
    for slot in slots {
        busy.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, "c");
    }
    busy.renew().await.expect("renew");
    assert_eq!(busy.idle_count(), 2, "kept while nobody else wants a token");
    let (got, _) = starved
        .admit(Task::CardStatus, &starved.new_lease_id())
        .await
        .unwrap();
    assert_eq!(
        got,
        Acquired::Short {
            reason: ShortReason::Total
        }
    );
    busy.renew().await.expect("renew");
    assert_eq!(
        busy.idle_count(),
        0,
        "a waiter elsewhere: the idle slots go back"
    );
    busy.flush_carried().await.unwrap();
    assert_eq!(card(&mut conn, &budget::total_key(&r.prefix)).await, 0);
    let (got, _) = starved
        .admit(Task::CardStatus, &starved.new_lease_id())
        .await
        .unwrap();
    assert_eq!(got, Acquired::Acquired);
}

#[tokio::test]
async fn a_kept_slot_lost_with_redis_is_dropped_and_never_re_created_past_the_limit() {
    let (r, mut conn, c) = fresh_config(1, 1, 1).await;
    let b = Budget::new(r.conn.clone(), &c).with_process_id("pod-a-1");
    poll_once(&b, Task::Carddata, CallReport::Ok).await;
    b.renew().await.expect("renew");
    // Redis loses the sets (a flush, a failover to an empty replica); another process takes the
    // only token meanwhile.
    let _: () = redis::cmd("DEL")
        .arg(budget::total_key(&r.prefix))
        .arg(budget::task_key(&r.prefix, Task::Carddata))
        .query_async(&mut conn)
        .await
        .unwrap();
    let other = Budget::new(r.conn.clone(), &c).with_process_id("pod-b-2");
    assert_eq!(
        other.acquire(Task::Carddata, "other").await.unwrap(),
        Acquired::Acquired
    );
    b.renew().await.expect("renew");
    assert_eq!(b.idle_count(), 0, "the lost slot is dropped");
    assert_eq!(b.held_count(), 0);
    assert_eq!(card(&mut conn, &budget::total_key(&r.prefix)).await, 1);
}

#[tokio::test]
async fn successes_on_kept_slots_are_counted_before_the_next_failure_so_the_window_keeps_their_order(
) {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    let window = budget::circuit::window_key(&r.prefix, Task::Carddata);
    let read = |mut conn: ConnectionManager| {
        let window = window.clone();
        async move {
            let w: Vec<String> = redis::cmd("LRANGE")
                .arg(&window)
                .arg(0)
                .arg(-1)
                .query_async(&mut conn)
                .await
                .unwrap();
            w
        }
    };
    // A first failure puts a failure in the window (successes count only from then on).
    poll_once(&b, Task::Carddata, CallReport::Failed).await;
    b.flush_carried().await.unwrap();
    assert_eq!(read(conn.clone()).await.len(), 1);
    poll_once(&b, Task::Carddata, CallReport::Ok).await;
    b.renew().await.expect("renew");
    let before = read(conn.clone()).await.len();
    for _ in 0..5 {
        poll_once(&b, Task::Carddata, CallReport::Ok).await;
    }
    assert_eq!(
        read(conn.clone()).await.len(),
        before,
        "not reported one by one"
    );
    let (got, slot) = b.admit(Task::Carddata, &b.new_lease_id()).await.unwrap();
    assert_eq!(got, Acquired::Acquired);
    b.finish_poll(Task::Carddata, slot, CallReport::Failed, 0, "card-9");
    b.flush_carried().await.unwrap();
    let w = read(conn.clone()).await;
    // Newest first: the failure, then the five successes before it.
    assert!(w[0].starts_with('f') && w[0].ends_with(":card-9"), "{w:?}");
    assert!(w[1..6].iter().all(|e| e.starts_with('s')), "{w:?}");
    let _ = &mut conn;
}

#[tokio::test]
async fn a_process_with_nothing_to_do_gives_its_kept_slots_back_and_stops_renewing() {
    let (r, mut conn, b) = fresh_budget(4, 2, 2).await;
    poll_once(&b, Task::Carddata, CallReport::Ok).await;
    until("the idle slot goes back", || b.idle_count() == 0).await;
    until("the slot is released in Redis", || b.carried_count() == 0).await;
    let total = budget::total_key(&r.prefix);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while card(&mut conn, &total).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "slot never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Nothing left to renew: the loop stopped and sends nothing more.
    let trips = b.round_trips();
    let quiet_until = tokio::time::Instant::now() + budget::pool::RENEW_EVERY * 2;
    while tokio::time::Instant::now() < quiet_until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(b.round_trips(), trips);
}

#[tokio::test]
async fn a_poll_refused_a_total_token_makes_its_own_process_give_back_the_other_task_s_idle_slots()
{
    let (r, mut conn, b) = fresh_budget(2, 2, 2).await;
    keep_slots(&b, Task::Carddata, 2).await;
    b.renew().await.expect("renew");
    assert_eq!(b.idle_count(), 2);
    let (got, _) = b.admit(Task::CardStatus, &b.new_lease_id()).await.unwrap();
    assert_eq!(
        got,
        Acquired::Short {
            reason: ShortReason::Total
        }
    );
    assert_eq!(b.idle_count(), 0);
    b.flush_carried().await.unwrap();
    assert_eq!(card(&mut conn, &budget::total_key(&r.prefix)).await, 0);
    let (got, _) = b.admit(Task::CardStatus, &b.new_lease_id()).await.unwrap();
    assert_eq!(got, Acquired::Acquired);
}

#[tokio::test]
async fn a_circuit_forced_open_reaches_a_process_that_keeps_slots_at_its_next_renewal() {
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r, 4, 2, 2));
    poll_once(&b, Task::CardStatus, CallReport::Ok).await;
    b.renew().await.expect("renew");
    b.force_circuit(Task::CardStatus, true).await.unwrap();
    b.renew().await.expect("renew");
    assert_eq!(b.idle_count(), 0, "the kept slot is given back");
    let before = b.reused();
    let (got, _) = b.admit(Task::CardStatus, &b.new_lease_id()).await.unwrap();
    assert!(matches!(got, Acquired::CircuitOpen { .. }), "{got:?}");
    assert_eq!(b.reused(), before);
}

/// What a renewal records and `show` reads: the idle kept slots apart from the tokens of running
/// polls, per task and in total, and nothing kept once the process gives its slots back.
#[tokio::test]
async fn show_counts_running_polls_as_in_use_and_idle_kept_slots_as_kept() {
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r, 8, 4, 4));
    let counts = |v: &budget::BudgetView, task: Task| {
        let t = &v.tasks[task.label()];
        (t.in_use, t.kept)
    };
    // Two card-status polls run; three carddata slots are kept idle.
    keep_slots(&b, Task::Carddata, 3).await;
    let mut running = Vec::new();
    for _ in 0..2 {
        let (got, slot) = b
            .admit(Task::CardStatus, &b.new_lease_id())
            .await
            .expect("admit");
        assert_eq!(got, Acquired::Acquired);
        running.push(slot);
    }
    b.renew().await.expect("renew");
    let view = b.show().await.unwrap();
    assert_eq!(counts(&view, Task::Carddata), (0, 3), "{view:?}");
    assert_eq!(counts(&view, Task::CardStatus), (2, 0), "{view:?}");
    assert_eq!((view.total.in_use, view.total.kept), (2, 3), "{view:?}");

    // A poll starts on a kept slot: from the next renewal it counts as in use.
    let (got, slot) = b
        .admit(Task::Carddata, &b.new_lease_id())
        .await
        .expect("admit");
    assert_eq!(got, Acquired::Acquired);
    b.renew().await.expect("renew");
    let view = b.show().await.unwrap();
    assert_eq!(counts(&view, Task::Carddata), (1, 2), "{view:?}");

    // Every poll ends and the process gives everything back: nothing in use, nothing kept.
    b.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, "c");
    for slot in running {
        b.finish_poll(Task::CardStatus, slot, CallReport::Ok, 0, "c");
    }
    b.renew().await.expect("renew");
    let view = b.show().await.unwrap();
    assert_eq!((view.total.in_use, view.total.kept), (0, 5), "{view:?}");
    b.release_held().await.expect("release");
    let view = b.show().await.unwrap();
    assert_eq!((view.total.in_use, view.total.kept), (0, 0), "{view:?}");
}

#[tokio::test]
async fn a_held_budget_admits_nothing_until_the_hold_is_over_and_then_asks_redis_again() {
    // A hold follows a failed budget call or a probe that found Redis down or emptied: until it
    // is over, no poll is admitted, not even on a kept slot, and Redis is not asked.
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r, 4, 2, 2));
    poll_once(&b, Task::Carddata, CallReport::Ok).await;
    b.renew().await.expect("renew");
    b.hold_for(Duration::from_millis(300));
    assert!(b.is_held());
    let trips = b.round_trips();
    let (got, slot) = b
        .admit(Task::Carddata, &b.new_lease_id())
        .await
        .expect("admit");
    assert_eq!(
        got,
        Acquired::Short {
            reason: ShortReason::Total
        }
    );
    assert!(slot.lease.is_empty(), "no lease during a hold");
    assert_eq!(b.round_trips(), trips, "Redis is not asked during a hold");
    until("the hold is over", || !b.is_held()).await;
    let (got, _) = b
        .admit(Task::Carddata, &b.new_lease_id())
        .await
        .expect("admit");
    assert_eq!(got, Acquired::Acquired);
}
