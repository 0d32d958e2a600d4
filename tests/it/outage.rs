//! Gateway trouble against a real worker: a full outage opens the circuit (a bounded number of
//! records, nothing parked, every card polled again after recovery); one bad card among healthy
//! ones parks alone; a parked chain comes back by itself; `unpark` restarts parked chains once.

use std::time::{Duration, Instant};

use cardworker::commands::polling as cli;
use cardworker::config::{Config, Task};
use cardworker::gateway::CardStatus;
use cardworker::storage::cards::ParkedSelector;

use crate::harness::{metric_value, spawn_app_with, wait_for_count, wait_until, TestApp};

const CARDS: usize = 40;

fn card(i: usize) -> String {
    format!("c-{i:02}")
}

async fn scalar(app: &TestApp, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&app.db.pool)
        .await
        .expect(sql)
}

async fn metric(app: &TestApp, name: &str, labels: &[(&str, &str)]) -> f64 {
    let (_, text) = app.get("/metrics").await;
    metric_value(&text, name, labels)
}

/// Waits until `task`'s circuit gauge reads closed. It is a fleet-wide gauge, read in the
/// background every `telemetry.fleet_gauges_secs`: the closed circuit shows within a few of those
/// rounds.
async fn wait_gauge_closed(app: &TestApp, task: &str) {
    let refresh = app.ctx.config.telemetry.fleet_gauges_every();
    let what = format!("{task}'s circuit gauge reads closed");
    wait_until(refresh * 3, &what, || async {
        metric(app, "cardworker_gateway_circuit_open", &[("task", task)]).await == 0.0
    })
    .await;
}

/// How often `task`'s circuit went `to` (`open`, `half_open`, `closed`).
async fn transitions(app: &TestApp, task: &str, to: &str) -> f64 {
    let labels = [("task", task), ("to", to)];
    metric(app, "cardworker_gateway_circuit_transitions_total", &labels).await
}

fn calls(app: &TestApp, call: &str) -> u64 {
    app.sim.stats().calls_total.get(call).copied().unwrap_or(0)
}

/// Both tasks every 2 s, parking after 4 failures, a circuit with a short cool-down (2 s, up to
/// 8 s) and short deferrals, so that recovery is quick to observe.
fn outage_config(cfg: &mut Config) {
    cfg.polling.carddata.interval_secs = 2;
    cfg.polling.card_status.interval_secs = 2;
    cfg.polling.carddata.max_consecutive_failures = 4;
    cfg.polling.card_status.max_consecutive_failures = 4;
    cfg.polling.defer_delay_secs = 1;
    cfg.polling.defer_max_delay_secs = 4;
    cfg.polling.circuit.cooldown_secs = 2;
    cfg.polling.circuit.max_cooldown_secs = 8;
}

/// `CARDS` cards with a chain of each task, first polls spread over 2 s; returns when each was
/// polled once.
async fn cards_polled_once(app: &TestApp) {
    for i in 0..CARDS {
        app.insert_card(&card(i)).await;
        for task in Task::ALL {
            let delay = Duration::from_millis((i as u64 * 50) % 2000);
            app.start_chain(task, &card(i), delay).await;
        }
    }
    wait_until(
        Duration::from_secs(30),
        "every card polled once",
        || async {
            calls(app, "carddata") >= CARDS as u64 && calls(app, "card_status") >= CARDS as u64
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_outage_of_60_s_writes_at_most_40_logs_parks_nothing_and_every_card_resumes() {
    const OUTAGE: Duration = Duration::from_secs(60);
    let app = spawn_app_with(outage_config).await;
    cards_polled_once(&app).await;
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM integration_logs").await,
        0
    );

    app.sim.set_error_rate(1.0);
    let began = Instant::now();
    // During the outage the circuit opens for both tasks and stays open or half-open.
    let mut samples = Vec::new();
    while began.elapsed() < OUTAGE {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (_, text) = app.get("/metrics").await;
        samples.push([Task::Carddata, Task::CardStatus].map(|t| {
            metric_value(
                &text,
                "cardworker_gateway_circuit_open",
                &[("task", t.label())],
            )
        }));
    }
    let first_open = samples
        .iter()
        .position(|s| s == &[1.0, 1.0])
        .expect("the circuit opened for both tasks");
    // How soon it opened is not a property of its own (it depends on how fast this machine
    // polls): what the outage cost before and after it opened is, bounded by the integration logs
    // counted below.
    assert!(
        samples[first_open..].iter().all(|s| s == &[1.0, 1.0]),
        "open (or half-open) for the rest of the outage: {samples:?}"
    );
    let logs_in_outage = scalar(&app, "SELECT count(*) FROM integration_logs").await;
    let deferred = metric(
        &app,
        "cardworker_poll_deferred_total",
        &[("reason", "gateway_circuit_open")],
    )
    .await;

    // Recovery; each card's state changes, so that a poll after it shows in PostgreSQL.
    app.sim.set_error_rate(0.0);
    for i in 0..CARDS {
        app.sim.set_card_status(&card(i), CardStatus::Frozen);
        app.sim.set_card_ready(&card(i), "tok_x", "4242", 12, 2030);
    }
    let recovered = Instant::now();
    wait_until(
        Duration::from_secs(60),
        "every card polled again, both tasks",
        || async {
            scalar(
                &app,
                "SELECT count(*) FROM cards WHERE status = 'frozen' AND data_state = 'ready'",
            )
            .await
                == CARDS as i64
        },
    )
    .await;
    let resumed_in = recovered.elapsed();

    assert!(
        (1..=40).contains(&logs_in_outage),
        "{logs_in_outage} integration logs for the whole outage"
    );
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL OR card_status_parked_at IS NOT NULL"
        )
        .await,
        0,
        "nothing parked"
    );
    assert!(deferred > 0.0, "polls were deferred by the open circuit");
    // One record per outage and task, not per card.
    for event in ["gateway.circuit_opened", "gateway.circuit_closed"] {
        let per_task: Vec<(String, i64)> = sqlx::query_as(
            "SELECT r.resource_id, count(*) FROM audit_events e
               JOIN audit_resources r ON r.audit_event_id = e.id
              WHERE e.event_type = $1 GROUP BY 1 ORDER BY 1",
        )
        .bind(event)
        .fetch_all(&app.db.pool)
        .await
        .unwrap();
        assert_eq!(
            per_task,
            [("card_status".to_owned(), 1), ("carddata".to_owned(), 1)],
            "{event}"
        );
    }
    for t in ["carddata", "card_status"] {
        wait_gauge_closed(&app, t).await;
        assert!(transitions(&app, t, "closed").await >= 1.0);
    }
    eprintln!(
        "outage {OUTAGE:?}: {logs_in_outage} integration logs, {deferred} deferrals; every card \
         polled again {resumed_in:?} after recovery"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_card_failing_alone_among_40_healthy_ones_parks_after_its_failures_and_the_circuit_stays_closed(
) {
    let app = spawn_app_with(outage_config).await;
    cards_polled_once(&app).await;
    let bad = card(7);
    app.sim.fail_card(&bad);
    let sql = "SELECT count(*) FROM cards WHERE card_status_parked_at IS NOT NULL AND carddata_parked_at IS NOT NULL";
    let limit = Duration::from_secs(40);
    wait_for_count(&app.db.pool, sql, 1, limit, "the bad card is parked").await;
    let per_card: Vec<(String, i64)> = sqlx::query_as(
        "SELECT resource_id, count(*) FROM integration_logs WHERE state = 'failed' GROUP BY 1",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(
        per_card,
        [(bad.clone(), 8)],
        "4 failures per task, that card only"
    );
    let parked: Vec<String> = sqlx::query_scalar(
        "SELECT card_ref FROM cards WHERE carddata_parked_at IS NOT NULL OR card_status_parked_at IS NOT NULL",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(parked, [bad]);
    // The healthy cards keep being polled, and no circuit opened.
    let before = calls(&app, "card_status");
    wait_until(Duration::from_secs(10), "healthy polls go on", || async {
        calls(&app, "card_status") >= before + 40
    })
    .await;
    for t in ["carddata", "card_status"] {
        wait_gauge_closed(&app, t).await;
        assert_eq!(transitions(&app, t, "open").await, 0.0);
    }
    assert_eq!(
        metric(
            &app,
            "cardworker_poll_deferred_total",
            &[("reason", "gateway_circuit_open")]
        )
        .await,
        0.0
    );
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM audit_events WHERE event_type LIKE 'gateway.circuit_%'"
        )
        .await,
        0
    );
}

/// Cards whose card-status chain is parked.
async fn parked(app: &TestApp) -> i64 {
    scalar(
        app,
        "SELECT count(*) FROM cards WHERE card_status_parked_at IS NOT NULL",
    )
    .await
}

async fn wait_parked(app: &TestApp, n: i64, limit: Duration) {
    wait_until(limit, &format!("{n} card-status chains parked"), || async {
        parked(app).await == n
    })
    .await;
}

/// A worker polling card status every second, parking after 2 failures and retrying after
/// `retry_secs`, and card c-1 failing with its chain started.
async fn one_failing_card(retry_secs: u64) -> TestApp {
    let app = spawn_app_with(|cfg| {
        cfg.polling.card_status.interval_secs = 1;
        cfg.polling.card_status.max_consecutive_failures = 2;
        cfg.polling.card_status.parked_retry_secs = retry_secs;
    })
    .await;
    app.insert_card("c-1").await;
    app.sim.fail_card("c-1");
    app.start_chain(Task::CardStatus, "c-1", Duration::ZERO)
        .await;
    app
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_chain_comes_back_by_itself_after_parked_retry_secs_once_its_card_answers() {
    let app = one_failing_card(3).await;
    wait_parked(&app, 1, Duration::from_secs(20)).await;
    let parked_at = Instant::now();
    let logs = scalar(&app, "SELECT count(*) FROM integration_logs").await;
    assert_eq!(logs, 2);
    app.sim.heal_card("c-1");
    let calls_parked = calls(&app, "card_status");
    wait_parked(&app, 0, Duration::from_secs(20)).await;
    let waited = parked_at.elapsed();
    assert!(
        waited >= Duration::from_millis(2500),
        "the retry waited for parked_retry_secs: {waited:?}"
    );
    // One poll (the retry), one record (the un-parking), and polling goes on.
    assert_eq!(calls(&app, "card_status"), calls_parked + 1);
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM audit_events WHERE event_type = 'poll.unparked'"
        )
        .await,
        1
    );
    assert_eq!(
        scalar(&app, "SELECT count(*) FROM integration_logs").await,
        logs
    );
    wait_until(Duration::from_secs(10), "regular polls again", || async {
        calls(&app, "card_status") >= calls_parked + 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_chains_failed_retry_leaves_it_parked_with_one_failure_record() {
    let app = one_failing_card(2).await;
    wait_until(Duration::from_secs(30), "two retries failed", || async {
        calls(&app, "card_status") >= 4
    })
    .await;
    // Two failures parked it; each retry (every 2 s) is one call and one failure log, and it
    // stays parked; the parking itself was announced once.
    // A retry's log lands just after its call: wait until the two agree (more logs than calls
    // never would).
    wait_until(
        Duration::from_secs(10),
        "one failure log per call",
        || async {
            let calls_now = calls(&app, "card_status") as i64;
            scalar(&app, "SELECT count(*) FROM integration_logs").await == calls_now
        },
    )
    .await;
    assert_eq!(
        scalar(
            &app,
            "SELECT count(*) FROM audit_events WHERE event_type = 'poll.parked'"
        )
        .await,
        1
    );
    assert_eq!(parked(&app).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpark_all_restarts_every_parked_chain_once_and_a_second_run_is_a_no_op() {
    let app = spawn_app_with(|cfg| {
        cfg.polling.card_status.interval_secs = 1;
        cfg.polling.card_status.max_consecutive_failures = 1;
    })
    .await;
    let bad = ["c-1", "c-2", "c-3", "c-4"];
    for c in bad.iter().chain(&["c-ok"]) {
        app.insert_card(c).await;
    }
    for c in bad {
        app.sim.fail_card(c);
    }
    for c in bad.iter().chain(&["c-ok"]) {
        app.start_chain(Task::CardStatus, c, Duration::ZERO).await;
    }
    wait_parked(&app, 4, Duration::from_secs(20)).await;
    cardworker::polling::publish_parked_chains(&app.ctx)
        .await
        .expect("count the parked chains");
    assert_eq!(
        metric(&app, "cardworker_parked_chains", &[("task", "card_status")]).await,
        4.0
    );
    assert_eq!(
        metric(&app, "cardworker_parked_chains", &[("task", "carddata")]).await,
        0.0
    );
    for c in bad {
        app.sim.heal_card(c);
    }

    // One card first, then those parked before a time, then the rest.
    let one = cli::unpark(
        &app.ctx,
        Task::CardStatus,
        ParkedSelector::CardRef("c-1".to_owned()),
        None,
        &cardworker::commands::operator::Operator::cli(),
    )
    .await
    .unwrap();
    assert_eq!(one.restarted, 1);
    let nothing_older = cli::unpark(
        &app.ctx,
        Task::CardStatus,
        ParkedSelector::ParkedBefore(chrono::Utc::now() - chrono::Duration::hours(1)),
        None,
        &cardworker::commands::operator::Operator::cli(),
    )
    .await
    .unwrap();
    assert_eq!(nothing_older.restarted, 0);
    assert_eq!(nothing_older.audit_event_id, None, "a no-op writes nothing");

    // The CLI, twice.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cardworker.toml");
    std::fs::write(&path, app.ctx.config.to_toml_string().unwrap()).unwrap();
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
            .args([
                "unpark",
                "--task",
                "card-status",
                "--all",
                "--reason",
                "gateway fixed the channel",
                "--format",
                "json",
            ])
            .arg("--config")
            .arg(&path)
            .output()
            .expect("run unpark")
    };
    let first = run();
    assert!(first.status.success(), "{first:?}");
    let json: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    assert_eq!(json["restarted"], 3, "{json}");
    let second = run();
    let json: serde_json::Value = serde_json::from_slice(&second.stdout).unwrap();
    assert_eq!(json["restarted"], 0, "{json}");
    assert_eq!(json["audit_event_id"], serde_json::Value::Null);

    assert_eq!(parked(&app).await, 0);
    // Two unpark actions on record (the single card, then --all linked to its three cards).
    let events: Vec<(String, Option<String>, i64)> = sqlx::query_as(
        "SELECT e.event_type, e.details->>'reason', count(r.id)
           FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          WHERE e.event_type LIKE 'operator.%' GROUP BY e.id ORDER BY e.id",
    )
    .fetch_all(&app.db.pool)
    .await
    .unwrap();
    assert_eq!(
        events,
        [
            ("operator.unpark".to_owned(), None, 1),
            (
                "operator.unpark".to_owned(),
                Some("gateway fixed the channel".to_owned()),
                3
            ),
        ]
    );
    // Every restarted chain polls (once restarted, each card answers and stays un-parked).
    let polled = calls(&app, "card_status");
    wait_until(
        Duration::from_secs(20),
        "the four restarted chains poll",
        || async { calls(&app, "card_status") >= polled + 4 },
    )
    .await;
    let inv = cardworker::commands::investigate::investigate(&app.ctx, "c-3")
        .await
        .unwrap();
    assert_eq!(inv.manual_facts.len(), 1);
    assert_eq!(inv.manual_facts[0].event_type, "operator.unpark");
    assert_eq!(
        inv.manual_facts[0].reason.as_deref(),
        Some("gateway fixed the channel")
    );
}

/// Waits until `event` (`gateway.circuit_opened`, …) is on record for both tasks, reading
/// PostgreSQL only (no scrape).
async fn circuit_event_for_both_tasks(app: &TestApp, event: &str, limit: Duration) {
    wait_until(limit, &format!("{event} for both tasks"), || async {
        let tasks: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT r.resource_id FROM audit_events e
               JOIN audit_resources r ON r.audit_event_id = e.id
              WHERE e.event_type = $1",
        )
        .bind(event)
        .fetch_all(&app.db.pool)
        .await
        .expect("circuit events");
        tasks.len() == 2
    })
    .await;
}

/// The operator's case: a worker nobody scrapes (its fleet-wide gauges' refresh paused after the
/// round at start), a Gateway-wide outage that opens both circuits, then one `curl /metrics`.
/// That one scrape finds the gauges older than a refresh period, wakes the refresh and waits for
/// its round, so it shows the open circuits, and an age younger than the period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_scrape_after_an_unscraped_outage_shows_the_circuit_open_now() {
    let app = spawn_app_with(|cfg| {
        outage_config(cfg);
        cfg.telemetry.fleet_gauges_secs = 1;
    })
    .await;
    cards_polled_once(&app).await;
    app.sim.set_error_rate(1.0);
    circuit_event_for_both_tasks(&app, "gateway.circuit_opened", Duration::from_secs(60)).await;

    let at = Instant::now();
    let (status, text) = app.get("/metrics").await;
    let took = at.elapsed();
    assert_eq!(status, 200);
    for t in ["carddata", "card_status"] {
        assert_eq!(
            metric_value(&text, "cardworker_gateway_circuit_open", &[("task", t)]),
            1.0,
            "{t}'s circuit is open (or half-open) during the outage, and one scrape shows it"
        );
    }
    let age = metric_value(&text, "cardworker_fleet_gauges_age_seconds", &[]);
    assert!(
        age < 1.0,
        "the values are from the round the scrape woke: {age} s old"
    );
    assert!(took < Duration::from_secs(2), "the scrape waited {took:?}");
}
