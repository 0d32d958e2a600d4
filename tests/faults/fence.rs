//! A Redis data loss is fenced in Redis, on Redis's clock: after a `FLUSHALL`, or a restart from an
//! append-only file that missed its last writes, no budget script admits a poll until every poll
//! that may still be at the Gateway has ended (`Budget::fence_length`), whatever pod asks, and
//! then every card is polled again. The simulator counts a call in flight from its arrival to its
//! answer; its peak must never pass the total limit.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cardworker::budget::{Acquired, Budget, CallReport};
use cardworker::config::{Config, Limit, Task};
use cardworker::context::{self, AppContext};
use cardworker::polling::reconcile;
use cardworker::sim::{SimStats, Simulator};
use tokio::sync::oneshot;

use crate::harness::{start_in_process, wait_until, TestDb};
use crate::private::{free_port, PrivateRedis};

/// How long the simulator takes to answer a card read: within the client's timeout and the
/// handler's, and longer than an outage hold, so that the polls admitted before a loss are still
/// at the Gateway when new ones could be admitted.
const ANSWER_AFTER_MS: u64 = 6_000;
const CARDS: usize = 6;

/// A worker run in the test's process, stopped when dropped.
struct InProcess {
    ctx: Arc<AppContext>,
    stop: Option<oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(join) = self.join.take() {
            join.abort();
        }
    }
}

async fn start(config: Config) -> InProcess {
    let (ctx, _addr, stop, join) = start_in_process(config).await;
    InProcess {
        ctx,
        stop: Some(stop),
        join: Some(join),
    }
}

fn config(db: &TestDb, redis_url: &str, gateway: &str) -> Config {
    let mut config = Config::default();
    config.database.url = db.url.clone().into();
    config.redis.url = redis_url.to_owned().into();
    config.redis.key_prefix = "cw".to_owned();
    config.gateway.base_url = gateway.to_owned().into();
    config.gateway.timeout_ms = 7_000;
    config.polling.handler_timeout_secs = 9;
    config.polling.lease_ttl_secs = 20;
    config.polling.total_limit = Limit::new(2).expect("a limit");
    for task in [
        &mut config.polling.carddata,
        &mut config.polling.card_status,
    ] {
        task.limit = Limit::new(2).expect("a limit");
        task.interval_secs = 1;
    }
    config.polling.defer_delay_secs = 1;
    config.polling.defer_max_delay_secs = 2;
    config.telemetry.listen = "127.0.0.1:0".to_owned();
    config.worker.shutdown_grace_secs = 5;
    config.worker.redis_outage_grace_secs = 120;
    config.payments.recovery_cron = "0 0 0 1 1 *".to_owned();
    config.approvals.recovery_cron = "0 0 0 1 1 *".to_owned();
    config.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    config
}

fn card(i: usize) -> String {
    format!("c-{i:03}")
}

async fn insert_cards(db: &TestDb) {
    let cards: Vec<String> = (0..CARDS).map(card).collect();
    sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
        .bind(&cards)
        .execute(&db.pool)
        .await
        .expect("insert cards");
}

/// What a deployment that ran before holds on an intact Redis: its first start recorded long ago
/// in PostgreSQL, and the fence hash naming the redis-server that holds the budget's data. A pod
/// of it that starts now is not fenced, and a data loss from here on is.
async fn ran_before(db: &TestDb, redis_url: &str) {
    sqlx::query("INSERT INTO budget_deployment (started_at) VALUES (now() - interval '1 day')")
        .execute(&db.pool)
        .await
        .expect("the deployment's first start");
    let mut conn = context::connect_redis(redis_url).await.expect("redis");
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .expect("info");
    let run_id = info
        .lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .expect("run_id")
        .trim()
        .to_owned();
    let _: () = redis::cmd("HSET")
        .arg(cardworker::budget::fence_key("cw"))
        .arg("run_id")
        .arg(run_id)
        .arg("until")
        .arg(0)
        .query_async(&mut conn)
        .await
        .expect("the fence hash");
}

async fn sweep(ctx: &Arc<AppContext>) {
    for task in Task::ALL {
        reconcile::sweep(ctx, task).await.expect("start chains");
    }
}

fn assert_within_limits(stats: &SimStats, when: &str) {
    assert!(
        stats.peak_in_flight_polls <= 2,
        "{} polls at the Gateway at once {when}, total limit 2: {stats:?}",
        stats.peak_in_flight_polls
    );
}

/// Watches the simulator until every card has been at the Gateway again (both tasks) at some
/// moment at least `after` from now, asserting the limits on every look.
async fn every_card_polled_again(sim: &Simulator, after: Duration, limit: Duration) {
    let started = Instant::now();
    let from = started + after;
    let mut seen: HashSet<(String, String)> = HashSet::new();
    loop {
        let stats = sim.stats();
        assert_within_limits(&stats, "after the data loss");
        if Instant::now() >= from {
            for (card, kinds) in &stats.in_flight_per_card {
                for (kind, n) in kinds {
                    if *n > 0 {
                        seen.insert((card.clone(), kind.clone()));
                    }
                }
            }
        }
        let done = (0..CARDS).all(|i| {
            ["carddata", "card_status"]
                .iter()
                .all(|k| seen.contains(&(card(i), (*k).to_owned())))
        });
        if done {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "not every card polled again within {limit:?} (from {after:?} on): seen {seen:?}; {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pod of the test's own: admits polls of `cards` through the budget as a worker does and sends
/// each admitted one to the simulator, holding its tokens until the answer. Runs until `stop`.
fn pod(
    budget: Budget,
    gateway: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        let mut admitted = 0;
        let mut i = 0;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            i += 1;
            let (got, slot) = match budget.admit(Task::Carddata, &budget.new_lease_id()).await {
                Ok(answer) => answer,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if !matches!(got, Acquired::Acquired | Acquired::Probe { .. }) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            admitted += 1;
            let url = format!("{gateway}/v1/cards/{}/data", card(i % CARDS));
            let budget = budget.clone();
            let http = http.clone();
            tokio::spawn(async move {
                let _ = http
                    .get(url)
                    .send()
                    .await
                    .and_then(|r| r.error_for_status());
                budget.finish_poll(Task::Carddata, slot, CallReport::Ok, 0, "");
            });
        }
        admitted
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_flushall_no_pod_admits_a_poll_beside_those_at_the_gateway_until_they_are_over() {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(ANSWER_AFTER_MS, 0);
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    let config = config(&db, &redis.url(), &sim_handle.base_url());
    insert_cards(&db).await;
    ran_before(&db, &redis.url()).await;
    let worker = start(config.clone()).await;
    sweep(&worker.ctx).await;
    wait_until(
        Duration::from_secs(60),
        "two polls at the Gateway",
        || async { sim.stats().in_flight_polls == 2 },
    )
    .await;

    // Redis loses everything while both polls are at the Gateway. Another pod of the deployment
    // asks for tokens at once, and the worker's chains are restored as a reconcile would.
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .expect("flushall");
    let flushed = Instant::now();
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let other = Budget::new(conn, &config)
        .with_process_id("other-pod")
        .ran_before();
    let fence = other.fence_length();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let other_pod = pod(other, sim_handle.base_url(), stop.clone());
    sweep(&worker.ctx).await;

    // Nothing is admitted beside the two calls, by either pod, until they are over; then every
    // card is polled again.
    while flushed.elapsed() < Duration::from_millis(ANSWER_AFTER_MS + 2_000) {
        assert_within_limits(&sim.stats(), "after the FLUSHALL");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    let admitted = other_pod.await.expect("the other pod");
    // The Gateway is quick again: every chain gets its turn soon after the fence.
    sim.set_latency(200, 0);
    every_card_polled_again(
        &sim,
        fence.saturating_sub(flushed.elapsed()),
        fence + Duration::from_secs(60),
    )
    .await;
    assert!(
        !worker.join.as_ref().is_some_and(|j| j.is_finished()),
        "the worker rides out the loss"
    );
    eprintln!("the other pod was admitted {admitted} times");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_started_during_the_fence_admits_nothing_until_it_ends() {
    let db = TestDb::new().await;
    let redis = PrivateRedis::start_new(false);
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(ANSWER_AFTER_MS, 0);
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    let config = config(&db, &redis.url(), &sim_handle.base_url());
    insert_cards(&db).await;
    ran_before(&db, &redis.url()).await;
    let worker = start(config.clone()).await;
    sweep(&worker.ctx).await;
    wait_until(
        Duration::from_secs(60),
        "two polls at the Gateway",
        || async { sim.stats().in_flight_polls == 2 },
    )
    .await;
    let mut admin = context::connect_redis(&redis.url()).await.expect("redis");
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .expect("flushall");
    let flushed = Instant::now();

    // A second worker process starts while the calls are still at the Gateway, and the chains
    // are restored at once (its own reconcile, or any other).
    let second = start(config.clone()).await;
    sweep(&second.ctx).await;
    let fence = second.ctx.budget.fence_length();
    while flushed.elapsed() < Duration::from_millis(ANSWER_AFTER_MS + 2_000) {
        assert_within_limits(&sim.stats(), "with a pod started after the FLUSHALL");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The Gateway is quick again: every chain gets its turn soon after the fence.
    sim.set_latency(200, 0);
    every_card_polled_again(
        &sim,
        fence.saturating_sub(flushed.elapsed()),
        fence + Duration::from_secs(60),
    )
    .await;
    drop(second);
    drop(worker);
}

/// A redis-server of the test's own with an append-only file synced every second, killed with
/// SIGKILL and started again from that file.
struct AofRedis {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl AofRedis {
    fn start_new() -> Self {
        let mut redis = Self {
            port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
        };
        redis.start();
        redis
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn start(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let started = Instant::now();
        while !Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "PING"])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The append-only file the server writes to now (the incremental part of Redis 7's
    /// multi-part AOF, or the single file of older versions).
    fn aof(&self) -> PathBuf {
        let multi = self.dir.path().join("appendonlydir");
        if let Ok(entries) = std::fs::read_dir(&multi) {
            let mut incr: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.to_string_lossy().ends_with(".incr.aof"))
                .collect();
            incr.sort();
            if let Some(last) = incr.pop() {
                return last;
            }
        }
        self.dir.path().join("appendonly.aof")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for AofRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_an_append_only_file_that_missed_its_last_writes_admits_no_poll_beside_those_at_the_gateway(
) {
    let db = TestDb::new().await;
    let mut redis = AofRedis::start_new();
    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
    sim.set_latency(ANSWER_AFTER_MS, 0);
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(0.0);
    let config = config(&db, &redis.url(), &sim_handle.base_url());
    insert_cards(&db).await;
    ran_before(&db, &redis.url()).await;
    let worker = start(config.clone()).await;
    let fence = worker.ctx.budget.fence_length();
    let admin = context::connect_redis(&redis.url()).await.expect("redis");
    let epoch = cardworker::runner::redis_watch::epoch_key("cw");
    wait_until(Duration::from_secs(10), "the epoch marker", || {
        let mut admin = admin.clone();
        let epoch = epoch.clone();
        async move {
            redis::cmd("EXISTS")
                .arg(&epoch)
                .query_async::<i64>(&mut admin)
                .await
                .unwrap_or(0)
                == 1
        }
    })
    .await;
    // The file as it stands before any poll is admitted: what survives the crash below.
    let aof = redis.aof();
    let kept = std::fs::metadata(&aof).expect("the append-only file").len();
    sweep(&worker.ctx).await;
    wait_until(
        Duration::from_secs(60),
        "two polls at the Gateway",
        || async { sim.stats().in_flight_polls == 2 },
    )
    .await;

    // The host goes down with the writes since then unsynced: the server is killed and its file
    // loses its tail (the leases of the two polls and the chains' progress), then it starts again
    // from that file. The reconcile comes round and the chains are live again.
    tokio::task::block_in_place(|| {
        redis.kill();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&aof)
            .expect("open the append-only file");
        file.set_len(kept).expect("truncate the append-only file");
        drop(file);
        redis.start();
    });
    let restarted = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the chains restored after the restart",
        || async {
            let mut ok = true;
            for task in Task::ALL {
                ok &= reconcile::sweep(&worker.ctx, task).await.is_ok();
            }
            ok
        },
    )
    .await;
    while restarted.elapsed() < Duration::from_millis(ANSWER_AFTER_MS + 1_000) {
        assert_within_limits(&sim.stats(), "after the restart from the append-only file");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The Gateway is quick again: every chain gets its turn soon after the fence.
    sim.set_latency(200, 0);
    every_card_polled_again(
        &sim,
        fence.saturating_sub(restarted.elapsed()),
        fence + Duration::from_secs(60),
    )
    .await;
    assert!(
        !worker.join.as_ref().is_some_and(|j| j.is_finished()),
        "the worker rides out the restart"
    );
}
