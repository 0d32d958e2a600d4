//! What the polling budget sends to Redis per admitted poll, counted by a private
//! redis-server's `INFO commandstats` (the shared Redis would count other clients too), including
//! the commands that run inside the script. Counted, never timed.

use std::collections::BTreeMap;

use cardworker::budget::{Acquired, Budget, CallReport, Slot};
use cardworker::config::{Config, Task};
use cardworker::context;
use cardworker::limit::Limit;

use crate::private::PrivateRedis;
use crate::redis_cost::{counted, reset};

/// `counted` leaves out `INFO` (it reads the counts with it): the `INFO` calls since the last
/// reset, other than that read (a command's count does not include the call that reads it).
async fn info_calls(conn: &mut redis::aio::ConnectionManager) -> u64 {
    let text: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("info");
    let all: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_info:"))
        .and_then(|r| r.split("calls=").nth(1))
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    all.saturating_sub(1)
}

/// The commands Redis ran since the last reset, by name, `INFO` included ([`info_calls`]).
async fn commands(conn: &mut redis::aio::ConnectionManager) -> BTreeMap<String, u64> {
    let (mut calls, _) = counted(conn).await;
    calls.insert("info".to_owned(), info_calls(conn).await);
    calls
}

/// A private redis-server, a budget of 8 tokens (4 per task) under prefix `cost` on it, and its
/// connection.
async fn budget_on() -> (PrivateRedis, Budget, redis::aio::ConnectionManager) {
    let redis = PrivateRedis::start_new(false);
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let mut c = Config::default();
    c.redis.key_prefix = "cost".to_owned();
    c.polling.total_limit = Limit::new(8).expect("a limit");
    c.polling.carddata.limit = Limit::new(4).expect("a limit");
    c.polling.card_status.limit = Limit::new(4).expect("a limit");
    (redis, Budget::new(conn.clone(), &c), conn)
}

/// What a budget answered, asserted to be [`Acquired::Acquired`]: the slot or lease it grants.
fn granted<T>((got, grant): (Acquired, T)) -> T {
    assert_eq!(got, Acquired::Acquired);
    grant
}

/// The lease of a carddata slot acquired (`acquire_slot`), whose end the next acquire may carry.
async fn acquired(b: &Budget) -> String {
    granted(
        b.acquire_slot(Task::Carddata, &b.new_lease_id())
            .await
            .expect("acquire"),
    )
}

/// A carddata poll admitted (`admit`): its slot.
async fn admitted(b: &Budget) -> Slot {
    granted(
        b.admit(Task::Carddata, &b.new_lease_id())
            .await
            .expect("admit"),
    )
}

#[tokio::test]
async fn a_slot_that_turns_over_costs_one_call_of_eleven_commands() {
    let (_redis, b, conn) = budget_on().await;
    // Steady state: a few slots busy, then each poll's end is carried by the next acquire of the
    // same task, which takes its slot over.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(acquired(&b).await);
    }
    let mut stats = conn.clone();
    reset(&mut stats).await;
    const POLLS: u64 = 200;
    for i in 0..POLLS as usize {
        let done = held.remove(0);
        b.finish_carried(Task::Carddata, done, CallReport::Ok, 0, &format!("c-{i}"));
        held.push(acquired(&b).await);
    }
    let calls = commands(&mut stats).await;
    let per = |name: &str| calls.get(name).copied().unwrap_or(0) as f64 / POLLS as f64;
    let all: u64 = calls.values().sum();
    eprintln!("per poll: {calls:?}");
    assert_eq!(
        per("evalsha"),
        1.0,
        "one round trip per admitted poll: {calls:?}"
    );
    // TIME, the circuit's HMGET (once for the finish and the admission), the override HGET, the
    // pause SISMEMBER, two ZCARD, two ZADD XX (the slot re-scored in both sets), and the fence:
    // INFO server (the run_id of the server that answers) and the fence hash's HMGET.
    assert_eq!(per("time"), 1.0, "{calls:?}");
    assert_eq!(per("hmget"), 2.0, "{calls:?}");
    assert_eq!(per("info"), 1.0, "{calls:?}");
    assert_eq!(per("zadd"), 2.0, "{calls:?}");
    assert_eq!(
        per("zrem"),
        0.0,
        "no remove-and-add on a turnover: {calls:?}"
    );
    assert!(
        all as f64 / POLLS as f64 <= 11.0,
        "{} commands per poll: {calls:?}",
        all as f64 / POLLS as f64
    );
    assert_eq!(b.show().await.unwrap().total.in_use, 3);
}

#[tokio::test]
async fn polls_on_kept_slots_cost_the_budget_only_its_renewals() {
    let (_redis, b, conn) = budget_on().await;
    // Three polls at once, kept, then a renewal allows reuse.
    let mut held = Vec::new();
    for _ in 0..3 {
        let slot = admitted(&b).await;
        held.push(slot);
    }
    for slot in held.drain(..) {
        b.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, "c");
    }
    b.renew().await.unwrap();
    let mut stats = conn.clone();
    reset(&mut stats).await;
    let (trips, started) = (b.round_trips(), std::time::Instant::now());
    const POLLS: u64 = 1_000;
    for i in 0..POLLS {
        let slot = admitted(&b).await;
        b.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, &format!("c-{i}"));
        if i == POLLS / 2 {
            b.renew().await.unwrap();
        }
    }
    b.renew().await.unwrap();
    let calls = commands(&mut stats).await;
    let all: u64 = calls.values().sum();
    eprintln!("{POLLS} polls: {calls:?}");
    // Our two renewals, plus the background loop's (one a second) on a slow machine: no call
    // per poll.
    let renewals = calls.get("evalsha").copied().unwrap_or(0);
    assert_eq!(renewals, b.round_trips() - trips, "{calls:?}");
    assert!(
        (2..=3 + started.elapsed().as_secs()).contains(&renewals),
        "{renewals} budget calls for {POLLS} polls: {calls:?}"
    );
    // A renewal of one task's slots: TIME, the waiters read, SMEMBERS, HMGET of the overrides,
    // two ZCARD, the circuit's HMGET (both tasks), ZMSCORE and two ZADD XX for the kept slots,
    // the HSET that records them as kept, and the fence's INFO server and HMGET.
    assert!(
        all <= renewals * 16,
        "{all} commands for {POLLS} polls: {calls:?}"
    );
    let view = b.show().await.unwrap();
    assert_eq!(
        (view.total.in_use, view.total.kept),
        (0, 3),
        "the three slots are still counted, as kept: no poll runs"
    );
}
