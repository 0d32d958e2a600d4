//! The project's alert rules on a real Prometheus server, scraping a real `cardworker run`.
//!
//! `promtool test rules` (deploy/prometheus/rules_test.yml) proves the expressions against series
//! written by hand; these tests prove them against the metrics the binary really exports, with
//! the scrape a real Prometheus makes. Each test starts a Prometheus of its own (Debian's
//! `prometheus` package, `make prometheus`) on a free port, with a throw-away storage, a scrape of
//! the worker every 2 s with a 2 s timeout, rule evaluation every second, and a copy of
//! deploy/prometheus/rules.yml in which every `for:` is [`FOR`] and two thresholds are lowered
//! (parked chains, the fleet-wide gauges' age), so that a test takes seconds, not hours. The
//! worker runs as a child process on a private redis-server, a fresh database, and the Gateway
//! simulator in the test's process; the tests wait on what Prometheus reports
//! (`/api/v1/alerts`, `/api/v1/query`), never on a fixed sleep.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cardworker::sim::{SimHandle, Simulator};
use serde_json::Value;

use crate::faults;
use crate::harness::{TestDb, Worker};
use crate::private::{free_port, PrivateRedis};

/// Every `for:` of the rules copy.
const FOR: &str = "4s";
/// `CardworkerParkedChainsHigh`'s threshold in the copy (100 in the product's rules).
const PARKED_THRESHOLD: u32 = 3;
/// `CardworkerFleetGaugesStale`'s threshold in the copy, seconds (60 in the product's rules).
const STALE_THRESHOLD: u32 = 10;
/// The cards the worker polls.
const CARDS: usize = 30;
/// Each task's polling interval in the rig, seconds: the copy's `cardworker:poll_interval_seconds`.
const INTERVAL_SECS: u32 = 2;
/// The `namespace` label the test's Prometheus puts on every series, as the Prometheus Operator
/// does in a cluster (prometheus-adapter's rule matches on it).
const NAMESPACE: &str = "cardworker";

/// The product's rules with every `for:` set to [`FOR`], the two thresholds lowered and the
/// recorded polling intervals set to the rig's ([`INTERVAL_SECS`]). Panics when a rule it rewrites
/// is not there as written, so that a change to the rules shows here.
fn rules_copy() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/rules.yml");
    let rules = std::fs::read_to_string(&path).expect("read deploy/prometheus/rules.yml");
    let mut fors = 0;
    let mut out: String = rules
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            if trimmed.starts_with("for: ") {
                fors += 1;
                format!("{}for: {FOR}\n", &line[..line.len() - trimmed.len()])
            } else {
                format!("{line}\n")
            }
        })
        .collect();
    assert!(fors >= 10, "only {fors} `for:` lines in rules.yml");
    for (from, to) in [
        (
            "max by (task) (cardworker_parked_chains) > 100".to_owned(),
            format!("max by (task) (cardworker_parked_chains) > {PARKED_THRESHOLD}"),
        ),
        (
            "(max by (instance) (cardworker_fleet_gauges_age_seconds) > 60)".to_owned(),
            format!(
                "(max by (instance) (cardworker_fleet_gauges_age_seconds) > {STALE_THRESHOLD})"
            ),
        ),
        (
            r#"label_replace(vector(30), "task", "carddata", "", "")"#.to_owned(),
            format!(r#"label_replace(vector({INTERVAL_SECS}), "task", "carddata", "", "")"#),
        ),
        (
            r#"label_replace(vector(300), "task", "card_status", "", "")"#.to_owned(),
            format!(r#"label_replace(vector({INTERVAL_SECS}), "task", "card_status", "", "")"#),
        ),
    ] {
        assert_eq!(
            out.matches(&from).count(),
            1,
            "rules.yml holds `{from}` once"
        );
        out = out.replace(&from, &to);
    }
    out
}

/// A Prometheus server of the test's own, scraping one target as job `cardworker`.
struct Prometheus {
    child: Child,
    url: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts one on a free port and waits until it is ready.
    async fn start(target: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("rules.yml"), rules_copy()).expect("write the rules");
        // honor_labels as in deploy/prometheus/prometheus.yml: the maintenance metrics carry a
        // `job` label of their own.
        std::fs::write(
            dir.path().join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 2s\n  scrape_timeout: 2s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - rules.yml\n\
                 scrape_configs:\n  - job_name: cardworker\n    honor_labels: true\n    \
                 static_configs:\n      - targets: ['{target}']\n        \
                 labels:\n          namespace: {NAMESPACE}\n"
            ),
        )
        .expect("write the config");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new(prometheus_binary())
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus (make prometheus installs it)");
        let prometheus = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("http client"),
            _dir: dir,
        };
        prometheus
            .wait(
                "Prometheus to be ready",
                Duration::from_secs(30),
                || async {
                    prometheus
                        .http
                        .get(format!("{}/-/ready", prometheus.url))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success())
                },
            )
            .await;
        prometheus
    }

    /// Its log, for a failure message.
    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let body: Value = self
            .http
            .get(format!("{}{path}", self.url))
            .query(query)
            .send()
            .await
            .expect("Prometheus answers")
            .json()
            .await
            .expect("Prometheus answers JSON");
        assert_eq!(body["status"], "success", "{path} {query:?}: {body}");
        body["data"].clone()
    }

    /// The active alerts (pending and firing): (name, state, labels).
    async fn alerts(&self) -> Vec<(String, String, Value)> {
        let data = self.api("/api/v1/alerts", &[]).await;
        data["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap_or("").to_owned(),
                    a["state"].as_str().unwrap_or("").to_owned(),
                    a["labels"].clone(),
                )
            })
            .collect()
    }

    /// Whether alert `name` is firing with every label of `labels`.
    async fn firing(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.alerts().await.iter().any(|(n, state, l)| {
            n == name && state == "firing" && labels.iter().all(|(k, v)| l[*k] == *v)
        })
    }

    /// The samples of an instant query: (labels, value).
    async fn query(&self, promql: &str) -> Vec<(Value, f64)> {
        let data = self.api("/api/v1/query", &[("query", promql)]).await;
        data["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|s| {
                let value = s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f64::NAN);
                (s["metric"].clone(), value)
            })
            .collect()
    }

    /// The value of a query that yields one sample (`None` when it yields none).
    async fn scalar(&self, promql: &str) -> Option<f64> {
        let samples = self.query(promql).await;
        assert!(samples.len() <= 1, "{promql}: {samples:?}");
        samples.first().map(|(_, v)| *v)
    }

    /// Prometheus's clock, unix seconds.
    async fn now(&self) -> f64 {
        self.scalar("vector(time())").await.expect("time()")
    }

    /// Waits until `check` holds, asking every 250 ms, up to `limit`; panics with the active
    /// alerts and Prometheus's log.
    async fn wait<F, Fut>(&self, what: &str, limit: Duration, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let start = Instant::now();
        while !check().await {
            if start.elapsed() > limit {
                let alerts = match self
                    .http
                    .get(format!("{}/api/v1/alerts", self.url))
                    .send()
                    .await
                {
                    Ok(r) => r.text().await.unwrap_or_default(),
                    Err(e) => e.to_string(),
                };
                panic!(
                    "timed out after {limit:?} waiting for {what}\nalerts: {alerts}\nprometheus log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until alert `name` fires with `labels`.
    async fn wait_firing(&self, name: &str, labels: &[(&str, &str)], limit: Duration) {
        self.wait(&format!("{name} {labels:?} to fire"), limit, || {
            self.firing(name, labels)
        })
        .await;
    }

    /// Waits until alert `name` is neither pending nor firing any more.
    async fn wait_cleared(&self, name: &str, limit: Duration) {
        self.wait(&format!("{name} to clear"), limit, || async {
            !self.alerts().await.iter().any(|(n, _, _)| n == name)
        })
        .await;
    }

    /// Waits until Prometheus has scraped the worker `n` more times after Prometheus time `since`.
    async fn wait_scrapes(&self, since: f64, n: u32) {
        self.wait(
            &format!("{n} scrapes after {since}"),
            Duration::from_secs(4 * u64::from(n) + 30),
            || async {
                let window = (self.now().await - since).max(1.0).floor();
                self.scalar(&format!(
                    "count_over_time(up{{job=\"cardworker\"}}[{window}s])"
                ))
                .await
                .is_some_and(|c| c >= f64::from(n))
            },
        )
        .await;
    }

    /// The alerts that fired at some evaluation since Prometheus time `since` (the `ALERTS`
    /// series Prometheus writes for every firing alert).
    async fn fired_since(&self, since: f64) -> Vec<String> {
        let window = (self.now().await - since).max(1.0).floor();
        let mut names: Vec<String> = self
            .query(&format!(
                "max_over_time(ALERTS{{alertstate=\"firing\"}}[{window}s])"
            ))
            .await
            .into_iter()
            .map(|(labels, _)| labels.to_string())
            .collect();
        names.sort();
        names
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn prometheus_binary() -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let path = Path::new(dir).join("prometheus");
        if path.is_file() {
            return path;
        }
    }
    panic!(
        "no `prometheus` binary on PATH: `make prometheus` installs Debian's prometheus package"
    );
}

/// A worker on a private redis-server and a fresh database, polling [`CARDS`] cards (both tasks
/// every [`INTERVAL_SECS`], limits 8 total and 4 per task, as the budget's defaults) at the
/// simulator, and a Prometheus scraping it.
struct Rig {
    prometheus: Prometheus,
    worker: Worker,
    sim: Simulator,
    db: TestDb,
    redis: PrivateRedis,
    config: PathBuf,
    _sim_handle: SimHandle,
    _dir: tempfile::TempDir,
}

impl Rig {
    async fn start() -> Self {
        let redis = PrivateRedis::start_new(false);
        let db = TestDb::new().await;
        let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await.expect("simulator");
        sim.set_latency(5, 5);
        sim.set_error_rate(0.0);
        sim.set_garbage_rate(0.0);
        faults::insert_cards(&db.pool, CARDS).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("cardworker.toml");
        // The chains start by themselves: the worker's first probe finds the fresh Redis without
        // its epoch marker and enqueues a full reconcile.
        std::fs::write(
            &config,
            format!(
                "[database]\nurl = \"{db}\"\nmax_connections = 5\n\n\
                 [redis]\nurl = \"{redis}\"\nkey_prefix = \"cw\"\n\n\
                 [gateway]\nbase_url = \"{gateway}\"\n\n\
                 [worker]\nshutdown_grace_secs = 5\nredis_outage_grace_secs = 600\n\n\
                 [polling]\ntotal_limit = 8\nreconcile_cron = \"0 0 0 1 1 *\"\n\n\
                 [polling.carddata]\nlimit = 4\ninterval_secs = {INTERVAL_SECS}\nmax_consecutive_failures = 2\n\n\
                 [polling.card_status]\nlimit = 4\ninterval_secs = {INTERVAL_SECS}\nmax_consecutive_failures = 2\n\n\
                 [payments]\nrecovery_cron = \"0 0 0 1 1 *\"\n\n\
                 [telemetry]\nlisten = \"127.0.0.1:0\"\nlog_format = \"json\"\nfleet_gauges_secs = 1\n",
                db = db.url,
                redis = redis.url(),
                gateway = sim_handle.base_url(),
            ),
        )
        .expect("write the worker config");
        let worker =
            Worker::spawn(env!("CARGO_BIN_EXE_cardworker"), &config).expect("start cardworker run");
        let prometheus = Prometheus::start(&worker.metrics).await;
        let rig = Self {
            prometheus,
            worker,
            sim,
            db,
            redis,
            config,
            _sim_handle: sim_handle,
            _dir: dir,
        };
        // Up, polling both tasks, and past Prometheus's own start: CardworkerAbsent, whose `for:`
        // the copy shortens below the time to the first scrape, fires before it and resolves.
        let p = &rig.prometheus;
        p.wait(
            "the worker scraped and polling, CardworkerAbsent resolved",
            Duration::from_secs(90),
            || async {
                p.query("sum by (task) (cardworker_poll_outcomes_total{outcome=\"skipped_unchanged\"}) > 0")
                    .await
                    .len()
                    == 2
                    && p.scalar("count_over_time(up{job=\"cardworker\"}[1m])").await >= Some(3.0)
                    && p.alerts().await.iter().all(|(name, _, _)| name != "CardworkerAbsent")
            },
        )
        .await;
        rig
    }

    /// `cardworker budget set`: `task`'s limit becomes `limit`, for `reason`.
    fn set_limit(&self, task: &str, limit: &str, reason: &str) {
        let args = ["budget", "set", "--task", task, "--limit", limit];
        self.cli(&[&args[..], &["--reason", reason]].concat());
    }

    /// Runs `cardworker ARGS --config …` to its end and checks it succeeded.
    fn cli(&self, args: &[&str]) {
        let out = Command::new(env!("CARGO_BIN_EXE_cardworker"))
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .env("CARDWORKER_OPERATOR", "alert-test")
            .output()
            .expect("run cardworker");
        assert!(
            out.status.success(),
            "cardworker {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_a_healthy_worker_fires_nothing() {
    let rig = Rig::start().await;
    let p = &rig.prometheus;
    // A healthy worker, watched for 20 rule evaluations (5 times every `for:`): nothing fires,
    // CardworkerPollTokensAtLimit included. It pages on a budget saturated by running polls, and
    // this one's polls take milliseconds: its slots are mostly kept idle between polls.
    let from = p.now().await;
    let polls_before = p
        .scalar("sum(cardworker_poll_outcomes_total)")
        .await
        .unwrap_or(0.0);
    p.wait(
        "20 evaluations of the utilisation rule",
        Duration::from_secs(90),
        || async {
            let window = (p.now().await - from).floor().max(1.0);
            p.scalar(&format!(
                "count_over_time(cardworker:poll_tokens:utilisation{{scope=\"total\"}}[{window}s])"
            ))
            .await
            .is_some_and(|n| n >= 20.0)
        },
    )
    .await;
    let polls = p
        .scalar("sum(cardworker_poll_outcomes_total)")
        .await
        .unwrap_or(0.0)
        - polls_before;
    assert!(polls >= 100.0, "the worker polled meanwhile: {polls} polls");
    let tokens = p
        .query("max by (scope) (cardworker_poll_tokens_in_use + cardworker_poll_tokens_kept)")
        .await;
    assert_eq!(
        p.fired_since(from).await,
        Vec::<String>::new(),
        "a healthy worker fires nothing (leases, in use + kept, at the end: {tokens:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_budget_pause_fires_poll_task_paused_for_the_paused_task_only() {
    let rig = Rig::start().await;
    let p = &rig.prometheus;
    rig.cli(&[
        "budget",
        "pause",
        "--task",
        "carddata",
        "--reason",
        "alert test",
    ]);
    p.wait_firing(
        "CardworkerPollTaskPaused",
        &[("task", "carddata")],
        Duration::from_secs(60),
    )
    .await;
    assert!(
        !p.firing("CardworkerPollTaskPaused", &[("task", "card_status")])
            .await,
        "only the paused task"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_a_gateway_outage_fires_gateway_circuit_open() {
    let rig = Rig::start().await;
    rig.sim.set_error_rate(1.0);
    // card_status opens first, within 90 s; carddata follows within 30 s.
    for (task, limit) in [("card_status", 90), ("carddata", 30)] {
        let labels = [("task", task)];
        let limit = Duration::from_secs(limit);
        rig.prometheus
            .wait_firing("CardworkerGatewayCircuitOpen", &labels, limit)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_a_redis_stop_fires_redis_down_and_every_scrape_of_the_pod_succeeds() {
    let mut rig = Rig::start().await;
    let p = &rig.prometheus;
    let stopped_at = p.now().await;
    rig.redis.stop();
    p.wait_firing("CardworkerRedisDown", &[], Duration::from_secs(90))
        .await;
    // A few more scrapes into the outage, then: not one scrape failed or timed out (2 s) since
    // Redis stopped, so CardworkerTargetDown and CardworkerAbsent never even went pending.
    p.wait_scrapes(stopped_at, 10).await;
    let window = (p.now().await - stopped_at).floor();
    assert_eq!(
        p.scalar(&format!(
            "min_over_time(up{{job=\"cardworker\"}}[{window}s])"
        ))
        .await,
        Some(1.0),
        "every scrape during the outage succeeded; scrape durations: {:?}",
        p.query(&format!(
            "max_over_time(scrape_duration_seconds{{job=\"cardworker\"}}[{window}s])"
        ))
        .await
    );
    let target_down = p
        .query(&format!(
            "max_over_time(ALERTS{{alertname=~\"CardworkerTargetDown|CardworkerAbsent\"}}[{window}s])"
        ))
        .await;
    assert!(target_down.is_empty(), "{target_down:?}");
    assert!(
        rig.worker.child.try_wait().ok().flatten().is_none(),
        "the worker rides out the outage"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_a_parked_chain_flood_fires_parked_chains_high() {
    let rig = Rig::start().await;
    // A few cards failing on their own while the Gateway answers for the others: their chains
    // park after 2 failures (too few failures to open the circuit).
    let failing = usize::try_from(PARKED_THRESHOLD).expect("small") + 2;
    for i in 0..failing {
        rig.sim.fail_card(&format!("c-{i:03}"));
    }
    rig.prometheus
        .wait_firing(
            "CardworkerParkedChainsHigh",
            &[("task", "card_status")],
            Duration::from_secs(90),
        )
        .await;
    assert!(
        !rig.prometheus
            .firing("CardworkerGatewayCircuitOpen", &[])
            .await,
        "cards failing on their own do not open the circuit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_a_stalled_fleet_gauge_refresh_fires_fleet_gauges_stale_and_it_clears_once_the_reads_answer(
) {
    let rig = Rig::start().await;
    let p = &rig.prometheus;
    // A session holding a lock on `cards` (a migration, say): the parked-chain counts hang while
    // Redis answers and the pod answers its scrapes.
    let mut lock = rig.db.pool.begin().await.expect("begin");
    sqlx::query("LOCK TABLE cards IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .expect("lock cards");
    p.wait_firing("CardworkerFleetGaugesStale", &[], Duration::from_secs(90))
        .await;
    assert_eq!(
        p.scalar("min(cardworker_redis_up)").await,
        Some(1.0),
        "Redis answered throughout"
    );
    lock.rollback().await.expect("release the lock");
    p.wait_cleared("CardworkerFleetGaugesStale", Duration::from_secs(60))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_polling_behind_fires_when_the_budget_is_too_low_for_the_cards_and_clears_when_it_is_raised(
) {
    let rig = Rig::start().await;
    let p = &rig.prometheus;
    // 30 cards every 2 s want 15 polls a second per task. At 100 ms a call, one token carries
    // 10 a second: carddata falls behind. card_status keeps its 4 tokens (40 a second).
    rig.sim.set_latency(100, 0);
    rig.set_limit("carddata", "1", "alert test: too low");
    p.wait_firing(
        "CardworkerPollingBehind",
        &[("task", "carddata")],
        Duration::from_secs(120),
    )
    .await;
    let due = p
        .scalar("max(cardworker_poll_due_now{task=\"carddata\"})")
        .await
        .unwrap_or(0.0);
    assert!(due > 0.0, "polls wait while carddata is behind: {due}");
    assert!(
        !p.firing("CardworkerPollingBehind", &[("task", "card_status")])
            .await,
        "card_status keeps up"
    );

    rig.set_limit("carddata", "4", "alert test: raised");
    p.wait_cleared("CardworkerPollingBehind", Duration::from_secs(120))
        .await;
    let overdue = p
        .scalar("max(cardworker_poll_overdue_seconds{task=\"carddata\"})")
        .await
        .unwrap_or(f64::NAN);
    assert!(
        overdue <= f64::from(INTERVAL_SECS),
        "carddata keeps up again: {overdue} s overdue"
    );
}

/// The external metric the HorizontalPodAutoscaler scales on, as prometheus-adapter asks
/// Prometheus for it: the rule's `metricsQuery` with `<<.Series>>` the series of its
/// `seriesQuery` and `<<.LabelMatchers>>` the HPA's namespace and selector.
fn adapter_query(task: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/k8s/autoscaling/prometheus-adapter-rules.yaml");
    let rules = std::fs::read_to_string(&path).expect("read the prometheus-adapter rule");
    let quoted = |key: &str| -> String {
        let line = rules
            .lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("no {key} in {}", path.display()));
        let value = line.split_once(key).expect("key").1.trim();
        value.trim_matches('\'').to_owned()
    };
    let series = quoted("- seriesQuery:");
    let series = series.split('{').next().expect("a series name").to_owned();
    quoted("metricsQuery:")
        .replace("<<.Series>>", &series)
        .replace(
            "<<.LabelMatchers>>",
            &format!("namespace=\"{NAMESPACE}\",task=\"{task}\""),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_prometheus_the_autoscaler_s_adapter_query_returns_one_value_for_each_task() {
    let rig = Rig::start().await;
    let p = &rig.prometheus;
    for task in ["carddata", "card_status"] {
        let query = adapter_query(task);
        let samples = p.query(&query).await;
        assert_eq!(samples.len(), 1, "{query}: {samples:?}");
        assert!(samples[0].1 >= 0.0, "{query}: {samples:?}");
    }
    // The selector selects: a task that does not exist yields nothing.
    assert!(p.query(&adapter_query("no_such_task")).await.is_empty());
}
