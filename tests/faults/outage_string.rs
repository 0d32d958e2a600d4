//! A string of short Redis outages: six of 3 to 11 s within two minutes, `CLIENT PAUSE`s and
//! restarts that come back empty, while two `cardworker run` processes poll cards, submit payments
//! and apply callbacks. Each outage is within `worker.redis_outage_grace_secs`, so none of them,
//! nor all of them together, may stop a process, and nothing queued may be lost.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cardworker::config::Task;
use cardworker::context::{self, AppContext};
use cardworker::gateway::CardStatus;
use redis::aio::ConnectionManager;
use sqlx::PgPool;

use crate::faults::{self, services};
use crate::harness::wait_until;
use crate::scenarios::{
    assert_one_chain_each, count, insert_cards, insert_payment, payment_status, polls_per_card,
};

/// One fault of the string.
#[derive(Debug, Clone, Copy)]
enum Outage {
    /// `CLIENT PAUSE` for this long: Redis keeps its data and answers nobody.
    Pause(Duration),
    /// Stopped for this long, and started again empty (no persistence).
    EmptyRestart(Duration),
}

impl Outage {
    fn length(self) -> Duration {
        match self {
            Self::Pause(d) | Self::EmptyRestart(d) => d,
        }
    }
}

/// The string of the combined-fault run that stopped a process (three pauses of 10 to 11 s,
/// three empty restarts of about 3 s), with Redis answering for [`BETWEEN`] between outages:
/// 41 s of outages in 77 s.
const OUTAGES: [Outage; 6] = [
    Outage::Pause(Duration::from_secs(11)),
    Outage::EmptyRestart(Duration::from_secs(3)),
    Outage::EmptyRestart(Duration::from_secs(3)),
    Outage::Pause(Duration::from_secs(11)),
    Outage::Pause(Duration::from_secs(10)),
    Outage::EmptyRestart(Duration::from_secs(3)),
];
/// How long Redis answers between two outages: less than the supervisor's `STABLE_AFTER`, so a
/// restarted worker never runs long enough between outages to count as healthy again by itself.
const BETWEEN: Duration = Duration::from_secs(6);
/// `worker.redis_outage_grace_secs`: each outage is well within it, the whole string (the first
/// worker failure to the last, about 60 s) is not. A grace that added outages up would stop a
/// process.
const GRACE_SECS: u64 = 30;
const CARDS: usize = 24;
/// The cards whose status a callback sets (and the Gateway reports), the last ones.
const CALLBACK_CARDS: usize = 4;

/// A `cardworker run` process whose log goes to a file, shown when it exits.
struct Pod {
    name: &'static str,
    child: std::process::Child,
    log: PathBuf,
}

impl Pod {
    fn run(config: &Path, name: &'static str, dir: &Path) -> Self {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_cardworker"))
            .args(["run", "--config"])
            .arg(config)
            .env("CARDWORKER_POD_NAME", name)
            .env_remove("CARDWORKER_CONFIG")
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .expect("start cardworker run");
        Self { name, child, log }
    }

    /// Panics with the end of its log if it has exited.
    fn assert_running(&mut self, when: &str) {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "{} exited ({status}) {when}; the end of its log:\n{}",
                self.name,
                tail.join("\n")
            );
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config_file(dir: &Path, db: &str, redis: &str, gateway: &str) -> PathBuf {
    faults::config_file(
        dir,
        db,
        redis,
        gateway,
        &format!(
            r#"timeout_ms = 2000
[worker]
shutdown_grace_secs = 5
redis_outage_grace_secs = {GRACE_SECS}
[polling]
total_limit = 16
handler_timeout_secs = 4
lease_ttl_secs = 10
reconcile_cron = "0 0 0 1 1 *"
[polling.carddata]
limit = 8
interval_secs = 2
[polling.card_status]
limit = 8
interval_secs = 2
[payments]
recovery_after_secs = 10
recovery_cron = "*/2 * * * * *"
[telemetry]
listen = "127.0.0.1:0"
"#
        ),
    )
}

/// What the load generator handed over while the outages ran.
#[derive(Default)]
struct Handed {
    payments: Vec<uuid::Uuid>,
    callbacks: usize,
}

/// Submits a payment every 700 ms and delivers a callback every 1.5 s, each through the CLI's
/// path (PostgreSQL first, then Redis), until `stop` is set. An enqueue that Redis refuses or
/// times out is left to recovery, as in production.
async fn load(
    ctx: Arc<AppContext>,
    pool: PgPool,
    dir: PathBuf,
    handed: Arc<Mutex<Handed>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(700));
    let mut n = 0usize;
    let mut calls = tokio::task::JoinSet::new();
    while !stop.load(std::sync::atomic::Ordering::Acquire) {
        tick.tick().await;
        n += 1;
        let payment = insert_payment(&pool).await;
        handed.lock().expect("handed").payments.push(payment);
        let ctx2 = ctx.clone();
        calls.spawn(async move {
            let _ = cardworker::commands::payments::enqueue_payment(&ctx2, payment).await;
        });
        if n.is_multiple_of(2) {
            let card = format!("c-{:03}", CARDS - 1 - (n / 2) % CALLBACK_CARDS);
            let body = dir.join(format!("callback-{n}.json"));
            std::fs::write(
                &body,
                format!(r#"{{"type":"card.status","card_ref":"{card}","status":"frozen"}}"#),
            )
            .expect("body");
            handed.lock().expect("handed").callbacks += 1;
            let ctx2 = ctx.clone();
            calls.spawn(async move {
                let _ = cardworker::commands::payments::enqueue_callback(
                    &ctx2,
                    "chaos",
                    &format!("cb-{n}"),
                    &body,
                )
                .await;
            });
        }
        while calls.try_join_next().is_some() {}
    }
    while calls.join_next().await.is_some() {}
}

/// Waits up to `limit` until every card has unchanged polls of both tasks tallied in its chain
/// entries.
async fn every_card_polled(conn: &ConnectionManager, limit: Duration, what: &str) {
    wait_until(limit, what, || {
        let mut conn = conn.clone();
        async move {
            let mut all = true;
            for task in Task::ALL {
                all &= polls_per_card(&mut conn, task).await.len() == CARDS;
            }
            all
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_short_redis_outages_in_two_minutes_stop_no_process_lose_no_job_and_every_card_is_polled_again_within_45_s(
) {
    let (db, mut redis, sim, sim_handle) = services(0).await;
    let cards = insert_cards(&db.pool, CARDS).await;
    for card in &cards[CARDS - CALLBACK_CARDS..] {
        sim.set_card_status(card, CardStatus::Frozen);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = config_file(dir.path(), &db.url, &redis.url(), &sim_handle.base_url());
    let mut pods = [
        Pod::run(&file, "pod-a", dir.path()),
        Pod::run(&file, "pod-b", dir.path()),
    ];
    let ctx = faults::context_of(&file).await;
    faults::start_chains(&ctx).await;
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    every_card_polled(&conn, Duration::from_secs(60), "every card polled").await;

    let handed = Arc::new(Mutex::new(Handed::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let generator = tokio::spawn(load(
        ctx.clone(),
        db.pool.clone(),
        dir.path().to_owned(),
        handed.clone(),
        stop.clone(),
    ));

    let started = Instant::now();
    for (i, outage) in OUTAGES.into_iter().enumerate() {
        let answering = Instant::now();
        while answering.elapsed() < BETWEEN {
            for pod in &mut pods {
                pod.assert_running(&format!("before outage {}", i + 1));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let began = Instant::now();
        match outage {
            Outage::Pause(length) => redis.pause(length),
            Outage::EmptyRestart(_) => redis.stop(),
        }
        while began.elapsed() < outage.length() {
            for pod in &mut pods {
                pod.assert_running(&format!("in outage {} ({outage:?})", i + 1));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        if let Outage::EmptyRestart(_) = outage {
            redis.start();
        }
    }
    let last_ended = Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Release);
    generator.await.expect("load generator");

    // The last outage came back empty: a card tallied now has been polled since.
    let what = "every card polled again after the last outage";
    every_card_polled(&conn, Duration::from_secs(45), what).await;
    let healed = last_ended.elapsed();

    let Handed {
        payments,
        callbacks,
    } = std::mem::take(&mut *handed.lock().expect("handed"));
    assert!(!payments.is_empty() && callbacks > 0, "load ran");
    // No job lost: every payment settled (submitted exactly once), every callback applied.
    wait_until(
        Duration::from_secs(60),
        "every payment accepted and every callback applied",
        || async {
            for p in &payments {
                if payment_status(&db.pool, *p).await != "accepted" {
                    return false;
                }
            }
            count(
                &db.pool,
                "SELECT count(*) FROM inbound_callbacks WHERE state = 'applied'",
            )
            .await
                == callbacks as i64
        },
    )
    .await;
    for p in &payments {
        assert_eq!(sim.submissions(*p), 1, "payment {p}: one POST");
    }
    let mut conn = conn.clone();
    assert_one_chain_each(&mut conn, &cards).await;
    for pod in &mut pods {
        pod.assert_running("after the outages");
    }
    eprintln!(
        "{} outages in {:?}: every card polled again {healed:?} after the last; {} payments, {callbacks} callbacks",
        OUTAGES.len(),
        last_ended - started,
        payments.len()
    );
}
