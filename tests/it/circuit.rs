//! The Gateway circuit breaker's script against real Redis (opening, probes, cool-downs, forcing)
//! and `cardworker circuit open|close`.

use std::time::Duration;

use cardworker::budget::{Acquired, Budget, CallReport, CircuitState, Transition};
use cardworker::config::{Config, Task};
use cardworker::limit::Limit;

use crate::harness::{assert_success, redis_url, wait_until, TestDb, TestRedis};

/// A budget with room for everything, and a circuit with a 1 s cool-down up to 4 s.
fn config(redis: &TestRedis) -> Config {
    let mut c = Config::default();
    c.redis.url = redis_url().into();
    c.redis.key_prefix = redis.prefix.clone();
    c.polling.total_limit = Limit::new(256).expect("a limit");
    c.polling.carddata.limit = Limit::new(256).expect("a limit");
    c.polling.card_status.limit = Limit::new(256).expect("a limit");
    c.polling.circuit.cooldown_secs = 1;
    c.polling.circuit.max_cooldown_secs = 4;
    c
}

/// One poll of a card among many: acquire, then release with `report`. Returns the acquire's
/// answer and the transition the release made.
async fn poll(b: &Budget, task: Task, report: CallReport) -> (Acquired, Option<Transition>) {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    poll_card(b, task, report, &format!("c-{n}")).await
}

/// One poll of `card_ref`.
async fn poll_card(
    b: &Budget,
    task: Task,
    report: CallReport,
    card_ref: &str,
) -> (Acquired, Option<Transition>) {
    let lease = b.new_lease_id();
    let got = b.acquire(task, &lease).await.expect("acquire");
    match got {
        Acquired::Acquired | Acquired::Probe { .. } => {
            let done = b
                .finish(task, &lease, report, got.probe_round(), card_ref)
                .await
                .expect("finish");
            assert!(done.existed);
            (got, done.transition)
        }
        _ => (got, None),
    }
}

async fn state(b: &Budget, task: Task) -> CircuitState {
    b.show().await.expect("show").tasks[task.label()]
        .circuit
        .state
}

#[tokio::test]
async fn a_full_outage_opens_the_circuit_at_the_tenth_failure_and_then_admits_nothing() {
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r));
    // A healthy history first: 100 successes (none of them pushed into the window, since it
    // holds no failure).
    for _ in 0..100 {
        assert_eq!(poll(&b, Task::Carddata, CallReport::Ok).await.1, None);
    }
    for i in 1..=9 {
        let (got, t) = poll(&b, Task::Carddata, CallReport::Failed).await;
        assert_eq!((got, t), (Acquired::Acquired, None), "failure {i}");
    }
    let (_, t) = poll(&b, Task::Carddata, CallReport::Failed).await;
    assert_eq!(
        t,
        Some(Transition::Opened {
            calls: 10,
            failures: 10
        })
    );
    let (got, _) = poll(&b, Task::Carddata, CallReport::Failed).await;
    assert!(
        matches!(got, Acquired::CircuitOpen { retry_in } if retry_in > Duration::ZERO && retry_in <= Duration::from_secs(1)),
        "{got:?}"
    );
    // The other task's circuit is its own.
    assert_eq!(
        poll(&b, Task::CardStatus, CallReport::Ok).await.0,
        Acquired::Acquired
    );
    let view = b.show().await.unwrap();
    let c = &view.tasks["carddata"].circuit;
    assert_eq!(c.state, CircuitState::Open);
    assert!(c.since.is_some() && c.probes_from.is_some());
    assert_eq!(c.window.failures, 10);
    assert_eq!(c.gauge(), 1.0);
    assert_eq!(
        view.tasks["card_status"].circuit.state,
        CircuitState::Closed
    );
}

#[tokio::test]
async fn a_few_bad_cards_among_healthy_ones_never_open_the_circuit() {
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r));
    // Two bad cards failing on every other call among healthy traffic: 1 failure in 3.
    for _ in 0..200 {
        poll(&b, Task::CardStatus, CallReport::Failed).await;
        poll(&b, Task::CardStatus, CallReport::Ok).await;
        poll(&b, Task::CardStatus, CallReport::Ok).await;
    }
    assert_eq!(state(&b, Task::CardStatus).await, CircuitState::Closed);
    // Nor do failures alone that are fewer than min_calls (no other traffic at all).
    let r2 = TestRedis::new().await;
    let b2 = Budget::new(r2.conn.clone(), &config(&r2));
    for _ in 0..9 {
        poll(&b2, Task::CardStatus, CallReport::Failed).await;
    }
    assert_eq!(state(&b2, Task::CardStatus).await, CircuitState::Closed);
    // Nor do two bad cards failing over and over with no other traffic: the failures are about
    // fewer than min_failing_cards distinct cards.
    let r3 = TestRedis::new().await;
    let b3 = Budget::new(r3.conn.clone(), &config(&r3));
    for _ in 0..50 {
        for bad in ["bad-1", "bad-2"] {
            let (_, t) = poll_card(&b3, Task::CardStatus, CallReport::Failed, bad).await;
            assert_eq!(t, None);
        }
    }
    assert_eq!(state(&b3, Task::CardStatus).await, CircuitState::Closed);
    // A third failing card opens it.
    let (_, t) = poll_card(&b3, Task::CardStatus, CallReport::Failed, "bad-3").await;
    assert!(matches!(t, Some(Transition::Opened { .. })), "{t:?}");
}

#[tokio::test]
async fn failures_older_than_the_window_do_not_count() {
    let r = TestRedis::new().await;
    let mut c = config(&r);
    c.polling.circuit.window_secs = 1;
    let b = Budget::new(r.conn.clone(), &c);
    for _ in 0..8 {
        poll(&b, Task::Carddata, CallReport::Failed).await;
    }
    // Past the window on the clock the window is kept by (Redis's).
    redis_clock_passes(&r, Duration::from_secs(1)).await;
    // 8 old failures + 8 new ones: only the 8 count, fewer than min_calls.
    for _ in 0..8 {
        assert_eq!(poll(&b, Task::Carddata, CallReport::Failed).await.1, None);
    }
    assert_eq!(state(&b, Task::Carddata).await, CircuitState::Closed);
    for _ in 0..2 {
        poll(&b, Task::Carddata, CallReport::Failed).await;
    }
    assert_eq!(state(&b, Task::Carddata).await, CircuitState::Open);
}

/// Returns once Redis's clock (the one the circuit's window and cool-down use) is more than
/// `span` past where it is now.
async fn redis_clock_passes(r: &TestRedis, span: Duration) {
    async fn now_ms(r: &TestRedis) -> u128 {
        let (secs, micros): (u128, u128) = redis::cmd("TIME")
            .query_async(&mut r.conn.clone())
            .await
            .expect("TIME");
        secs * 1000 + micros / 1000
    }
    let until = now_ms(r).await + span.as_millis();
    wait_until(span * 10, "Redis's clock past the span", || async {
        now_ms(r).await > until
    })
    .await;
}

async fn open(b: &Budget, task: Task) {
    for _ in 0..10 {
        poll(b, task, CallReport::Failed).await;
    }
    assert_eq!(state(b, task).await, CircuitState::Open);
}

/// Acquires until the cool-down is over and a probe is admitted.
async fn probe(b: &Budget, task: Task) -> (String, u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let lease = b.new_lease_id();
        match b.acquire(task, &lease).await.unwrap() {
            Acquired::Probe { round } => return (lease, round),
            Acquired::CircuitOpen { .. } => {}
            other => panic!("an open circuit admitted {other:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "no probe admitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn after_the_cool_down_only_the_probes_go_through_and_a_success_closes_the_circuit() {
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r));
    open(&b, Task::Carddata).await;
    let (first, round) = probe(&b, Task::Carddata).await;
    assert_eq!(state(&b, Task::Carddata).await, CircuitState::HalfOpen);
    // half_open_probes = 2: one more probe, then nothing.
    let (second, round2) = probe(&b, Task::Carddata).await;
    assert_eq!(round, round2);
    let lease = b.new_lease_id();
    assert!(matches!(
        b.acquire(Task::Carddata, &lease).await.unwrap(),
        Acquired::CircuitOpen { .. }
    ));
    // A probe that made no call frees its slot; a valid answer closes the circuit.
    let none = b
        .finish(Task::Carddata, &second, CallReport::NoCall, round, "")
        .await
        .unwrap();
    assert_eq!(none.transition, None);
    let (third, _) = probe(&b, Task::Carddata).await;
    let done = b
        .finish(Task::Carddata, &first, CallReport::Ok, round, "c-p1")
        .await
        .unwrap();
    assert!(
        matches!(
            done.transition,
            Some(Transition::Closed {
                open_calls: 10,
                open_failures: 10,
                reopens: 0,
                ..
            })
        ),
        "{done:?}"
    );
    // A late verdict of the same round changes nothing; polls flow again.
    let late = b
        .finish(Task::Carddata, &third, CallReport::Failed, round, "c-p3")
        .await
        .unwrap();
    assert_eq!(late.transition, None);
    assert_eq!(state(&b, Task::Carddata).await, CircuitState::Closed);
    assert_eq!(
        poll(&b, Task::Carddata, CallReport::Ok).await.0,
        Acquired::Acquired
    );
    let view = b.show().await.unwrap();
    assert_eq!(
        view.tasks["carddata"].circuit.window.calls, 0,
        "window cleared"
    );
}

#[tokio::test]
async fn a_failed_probe_reopens_the_circuit_with_a_doubled_cool_down_up_to_the_cap() {
    let r = TestRedis::new().await;
    let b = Budget::new(r.conn.clone(), &config(&r));
    open(&b, Task::CardStatus).await;
    let mut cooldowns = Vec::new();
    for _ in 0..3 {
        let (lease, round) = probe(&b, Task::CardStatus).await;
        let done = b
            .finish(Task::CardStatus, &lease, CallReport::Failed, round, "c-p")
            .await
            .unwrap();
        match done.transition {
            Some(Transition::Reopened { cooldown_ms }) => cooldowns.push(cooldown_ms),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(cooldowns, [2000, 4000, 4000]);
    let view = b.show().await.unwrap();
    let c = &view.tasks["card_status"].circuit;
    assert_eq!(
        (c.state, c.reopens, c.cooldown_secs),
        (CircuitState::Open, 3, Some(4))
    );
}

#[tokio::test]
async fn a_probe_that_never_reports_frees_its_slot_after_a_lease() {
    let r = TestRedis::new().await;
    let mut c = config(&r);
    c.polling.handler_timeout_secs = 7;
    c.polling.lease_ttl_secs = 12;
    c.polling.circuit.half_open_probes = 1;
    let b = Budget::new(r.conn.clone(), &c);
    open(&b, Task::Carddata).await;
    let _lost = probe(&b, Task::Carddata).await; // its pod dies: no finish
    let lease = b.new_lease_id();
    assert!(matches!(
        b.acquire(Task::Carddata, &lease).await.unwrap(),
        Acquired::CircuitOpen { .. }
    ));
    // Pretend the lease time has passed.
    let key = cardworker::budget::circuit::circuit_key(&r.prefix, Task::Carddata);
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("probe_until")
        .arg(1)
        .query_async(&mut r.conn.clone())
        .await
        .unwrap();
    let (next, round) = probe(&b, Task::Carddata).await;
    let done = b
        .finish(Task::Carddata, &next, CallReport::Ok, round, "c-p")
        .await
        .unwrap();
    assert!(matches!(done.transition, Some(Transition::Closed { .. })));
}

#[tokio::test]
async fn a_disabled_breaker_never_opens_but_an_operator_can_still_force_it() {
    let r = TestRedis::new().await;
    let mut c = config(&r);
    c.polling.circuit.enabled = false;
    let b = Budget::new(r.conn.clone(), &c);
    for _ in 0..50 {
        assert_eq!(poll(&b, Task::Carddata, CallReport::Failed).await.1, None);
    }
    assert_eq!(state(&b, Task::Carddata).await, CircuitState::Closed);
    b.force_circuit(Task::Carddata, true).await.unwrap();
    let lease = b.new_lease_id();
    assert_eq!(
        b.acquire(Task::Carddata, &lease).await.unwrap(),
        Acquired::CircuitOpen {
            retry_in: Duration::ZERO
        }
    );
}

fn cardworker(args: &[&str], config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env("USER", "alice")
        .env_remove("CARDWORKER_OPERATOR")
        .output()
        .expect("run cardworker")
}

#[tokio::test]
async fn an_operator_forces_a_circuit_open_and_closed_and_each_action_is_on_record() {
    let r = TestRedis::new().await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cardworker.toml");
    let mut c = config(&r);
    c.database.url = db.url.clone().into();
    std::fs::write(&path, c.to_toml_string().unwrap()).unwrap();
    let ok = |args: &[&str]| {
        let out = cardworker(args, &path);
        assert_success(&out, &format!("{args:?}"));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = ok(&[
        "circuit",
        "open",
        "--task",
        "card-status",
        "--reason",
        "Gateway maintenance window",
    ]);
    assert!(out.contains("forced open (was closed)"), "{out}");
    let b = Budget::new(r.conn.clone(), &c);
    // Forced open: no probes however long the cool-down (1 s) has been over.
    redis_clock_passes(&r, Duration::from_secs(1)).await;
    let lease = b.new_lease_id();
    assert!(matches!(
        b.acquire(Task::CardStatus, &lease).await.unwrap(),
        Acquired::CircuitOpen { .. }
    ));
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["budget", "show", "--format", "json"])).unwrap();
    assert_eq!(json["tasks"]["card_status"]["circuit"]["state"], "open");
    assert_eq!(json["tasks"]["card_status"]["circuit"]["forced"], true);
    assert_eq!(json["tasks"]["carddata"]["circuit"]["state"], "closed");
    let text = ok(&["budget", "show"]);
    assert!(text.contains("open (forced by an operator)"), "{text}");

    let out = ok(&["circuit", "close", "--task", "card_status"]);
    assert!(
        out.contains("forced closed (was open, forced open)"),
        "{out}"
    );
    assert_eq!(
        b.acquire(Task::CardStatus, &lease).await.unwrap(),
        Acquired::Acquired
    );

    let events: Vec<(String, String, Option<String>, String)> = sqlx::query_as(
        "SELECT e.event_type, e.actor, e.details->>'reason', r.resource_id
           FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id ORDER BY e.id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let got: Vec<(&str, &str, Option<&str>, &str)> = events
        .iter()
        .map(|(t, a, why, res)| (t.as_str(), a.as_str(), why.as_deref(), res.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "operator.circuit_open",
                "operator:alice",
                Some("Gateway maintenance window"),
                "card_status"
            ),
            ("gateway.circuit_opened", "cardworker", None, "card_status"),
            (
                "operator.circuit_close",
                "operator:alice",
                None,
                "card_status"
            ),
            ("gateway.circuit_closed", "cardworker", None, "card_status"),
        ]
    );
}
