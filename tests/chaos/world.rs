//! The chaos run's own world: a private redis-server and PostgreSQL cluster on free ports, the
//! Gateway simulator (in this process, behind the journal's middleware), three `cardworker run`
//! processes under a [`Supervisor`] that restarts a worker that exits, as Kubernetes would, and
//! the operator's CLI.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use cardworker::sim::{SimConfig, Simulator};
use tokio::process::Command;

use crate::journal::{self, Journal};
use crate::private::{free_port, PrivatePg, PrivateRedis};
use crate::proxy::Proxy;

/// The key prefix of the run's Redis keys.
pub const PREFIX: &str = "chaos";

/// The services: Redis and PostgreSQL of the run's own, each behind a lock that serialises the
/// faults injected into it.
///
/// Nobody reaches Redis directly. Each worker slot has a [`Proxy`] of its own, so one worker can
/// be cut off from Redis; the harness (the CLI, the checker, the faults' own commands) goes
/// through `front`. A replica follows the primary through `link`, which a failover cuts first
/// (the replica lags), then promotes the replica and routes every proxy to it.
pub struct Services {
    /// The primary: the server every proxy routes to.
    pub redis: tokio::sync::Mutex<PrivateRedis>,
    /// The replica, following the primary through `link`. A failover swaps the two.
    pub replica: tokio::sync::Mutex<PrivateRedis>,
    pub link: Proxy,
    /// The harness's way to Redis.
    pub front: Proxy,
    /// Each worker slot's way to Redis.
    pub slots: Vec<Proxy>,
    /// Serialises the faults that reroute the network (a worker cut off, a failover).
    pub network: tokio::sync::Mutex<()>,
    pub pg: tokio::sync::Mutex<PrivatePg>,
    /// The harness's Redis URL (through `front`).
    pub redis_url: String,
    pub db_url: String,
}

impl Services {
    pub async fn start(workers: usize) -> anyhow::Result<Self> {
        let (redis, replica, pg) = tokio::task::spawn_blocking(|| {
            (
                PrivateRedis::start_new(true),
                PrivateRedis::start_new(true),
                PrivatePg::start_new(),
            )
        })
        .await
        .context("starting the private services")?;
        let admin = sqlx::PgPool::connect(&pg.url("postgres")).await?;
        sqlx::query("CREATE DATABASE chaos").execute(&admin).await?;
        admin.close().await;
        let link = Proxy::start(redis.port).await;
        follow(&replica, &link).await?;
        let front = Proxy::start(redis.port).await;
        let mut slots = Vec::with_capacity(workers);
        for _ in 0..workers {
            slots.push(Proxy::start(redis.port).await);
        }
        Ok(Self {
            redis_url: front.url(),
            db_url: pg.url("chaos"),
            redis: tokio::sync::Mutex::new(redis),
            replica: tokio::sync::Mutex::new(replica),
            link,
            front,
            slots,
            network: tokio::sync::Mutex::default(),
            pg: tokio::sync::Mutex::new(pg),
        })
    }

    /// Each worker slot's Redis URL.
    pub fn slot_urls(&self) -> Vec<String> {
        self.slots.iter().map(Proxy::url).collect()
    }

    /// Routes the harness and every worker slot that is not cut off to the server on `port`.
    pub fn route_all(&self, port: u16) {
        self.front.route_to(port);
        for slot in &self.slots {
            if !slot.is_cut() {
                slot.route_to(port);
            }
        }
    }
}

/// Makes `replica` follow the server behind `link` (`REPLICAOF` the link's port).
pub async fn follow(replica: &PrivateRedis, link: &Proxy) -> anyhow::Result<()> {
    let mut conn = cardworker::context::connect_redis(&replica.url()).await?;
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(link.port)
        .query_async(&mut conn)
        .await
        .context("REPLICAOF")?;
    Ok(())
}

/// The simulator, serving on a free port behind the journal.
pub struct Gateway {
    pub sim: Simulator,
    pub base_url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Gateway {
    pub async fn start(journal: &Journal, config: SimConfig) -> anyhow::Result<Self> {
        config.validate()?;
        let sim = Simulator::new(config);
        let app = sim.router().layer(axum::middleware::from_fn_with_state(
            journal.clone(),
            journal::record,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self {
            sim,
            base_url,
            stop: Some(stop),
        })
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A signal the schedule sends to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kill {
    Term,
    Kill9,
}

/// One exit of a worker process.
#[derive(Debug, Clone)]
pub struct Exit {
    pub slot: usize,
    pub at_ms: u64,
    /// The exit code, or `None` when a signal ended it.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The signal the schedule sent just before, if any.
    pub expected: Option<Kill>,
    /// The error a process that never got going printed: `cardworker run` exits 1 when it
    /// cannot connect to PostgreSQL or Redis at start (spec section 2: an unreachable database
    /// is exit status 1), and the supervisor starts it again.
    pub startup_error: Option<String>,
    /// How long the process ran.
    pub lived_ms: u64,
}

impl Exit {
    /// Whether this exit is one the schedule made: a SIGKILL that killed, or a SIGTERM answered
    /// with a clean exit 0.
    pub fn as_scheduled(&self) -> bool {
        if self.startup_error.is_some() {
            return true;
        }
        match self.expected {
            Some(Kill::Kill9) => self.signal == Some(9),
            // A process signalled in its first seconds may not have installed its handler yet.
            Some(Kill::Term) => {
                self.code == Some(0) || (self.signal == Some(15) && self.lived_ms < 3_000)
            }
            None => false,
        }
    }

    pub fn describe(&self) -> String {
        let how = match (self.code, self.signal) {
            (Some(c), _) => format!("exit {c}"),
            (None, Some(s)) => format!("signal {s}"),
            (None, None) => "unknown".to_owned(),
        };
        format!(
            "worker {} at {:.1}s: {how} (schedule sent {:?})",
            self.slot,
            self.at_ms as f64 / 1000.0,
            self.expected
        )
    }
}

#[derive(Debug, Default)]
struct SlotState {
    pid: Option<u32>,
    expected: Option<Kill>,
    starts: u64,
}

#[derive(Debug, Default)]
struct SupState {
    slots: Vec<SlotState>,
    exits: Vec<Exit>,
    stopping: bool,
}

/// Keeps `n` `cardworker run` processes running: restarts one that exits (after 1 s) and counts
/// each exit with its status.
#[derive(Clone)]
pub struct Supervisor {
    state: Arc<Mutex<SupState>>,
    /// The metrics port of each slot.
    pub ports: Vec<u16>,
    /// Each slot's log file (every generation appends to it).
    pub logs: Vec<PathBuf>,
    /// Each slot's Redis URL (its own proxy), set over the config file's.
    redis_urls: Vec<String>,
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Supervisor {
    /// Starts one worker per URL of `redis_urls`, each reaching Redis at its own.
    pub fn start(
        redis_urls: Vec<String>,
        binary: &str,
        config: &Path,
        dir: &Path,
        journal: &Journal,
    ) -> Self {
        let n = redis_urls.len();
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let logs: Vec<PathBuf> = (0..n)
            .map(|i| dir.join(format!("worker-{i}.log")))
            .collect();
        let sup = Self {
            state: Arc::new(Mutex::new(SupState {
                slots: (0..n).map(|_| SlotState::default()).collect(),
                ..SupState::default()
            })),
            ports,
            logs,
            redis_urls,
            tasks: Arc::default(),
        };
        for slot in 0..n {
            let (sup2, binary, config, journal) = (
                sup.clone(),
                binary.to_owned(),
                config.to_owned(),
                journal.clone(),
            );
            let task = tokio::spawn(async move {
                sup2.keep_running(slot, &binary, &config, &journal).await;
            });
            sup.tasks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(task);
        }
        sup
    }

    fn lock(&self) -> MutexGuard<'_, SupState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn keep_running(&self, slot: usize, binary: &str, config: &Path, journal: &Journal) {
        loop {
            let generation = {
                let mut st = self.lock();
                if st.stopping {
                    return;
                }
                st.slots[slot].starts += 1;
                st.slots[slot].starts
            };
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.logs[slot]);
            let Ok(log) = log else {
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            };
            let child = Command::new(binary)
                .arg("run")
                .arg("--config")
                .arg(config)
                .env("CARDWORKER_POD_NAME", format!("w{slot}-{generation}"))
                .env("CARDWORKER__REDIS__URL", &self.redis_urls[slot])
                .env(
                    "CARDWORKER__TELEMETRY__LISTEN",
                    format!("127.0.0.1:{}", self.ports[slot]),
                )
                .env(
                    "RUST_LOG",
                    std::env::var("CHAOS_WORKER_LOG")
                        .unwrap_or_else(|_| "info,apalis=warn,apalis_core=warn,sqlx=warn".into()),
                )
                .env_remove("CARDWORKER_CONFIG")
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .kill_on_drop(true)
                .spawn();
            let mut child = match child {
                Ok(c) => c,
                Err(e) => {
                    journal.note(format!("worker {slot}: could not start: {e}"));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            self.lock().slots[slot].pid = child.id();
            let started = tokio::time::Instant::now();
            let log_from = std::fs::metadata(&self.logs[slot]).map_or(0, |m| m.len());
            let status = child.wait().await;
            let startup_error = if started.elapsed() < Duration::from_secs(30) {
                start_failure(&self.logs[slot], log_from)
            } else {
                None
            };
            let at_ms = journal.now_ms();
            let stopping = {
                let mut st = self.lock();
                let expected = st.slots[slot].expected.take();
                st.slots[slot].pid = None;
                if let Ok(status) = status {
                    st.exits.push(Exit {
                        slot,
                        at_ms,
                        code: status.code(),
                        signal: status.signal(),
                        expected,
                        startup_error,
                        lived_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                    });
                }
                st.stopping
            };
            if stopping {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Sends `kill` to the worker of `slot`, marking its exit as expected. Returns false when
    /// the slot has no running process.
    pub fn signal(&self, slot: usize, kill: Kill) -> bool {
        let pid = {
            let mut st = self.lock();
            let Some(pid) = st.slots[slot].pid else {
                return false;
            };
            st.slots[slot].expected = Some(kill);
            pid
        };
        let sig = match kill {
            Kill::Term => "-TERM",
            Kill::Kill9 => "-KILL",
        };
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    pub fn exits(&self) -> Vec<Exit> {
        self.lock().exits.clone()
    }

    /// How many times each slot was started.
    pub fn starts(&self) -> Vec<u64> {
        self.lock().slots.iter().map(|s| s.starts).collect()
    }

    /// Stops restarting, sends SIGTERM to every worker and waits for them (at most `limit`).
    pub async fn stop_all(&self, limit: Duration) {
        let n = {
            let mut st = self.lock();
            st.stopping = true;
            st.slots.len()
        };
        for slot in 0..n {
            self.signal(slot, Kill::Term);
        }
        let tasks: Vec<_> =
            std::mem::take(&mut *self.tasks.lock().unwrap_or_else(PoisonError::into_inner));
        let _ = tokio::time::timeout(limit, futures::future::join_all(tasks)).await;
    }

    /// The text of each running worker's `/metrics` (slots that do not answer are left out).
    pub async fn metrics(&self) -> BTreeMap<usize, String> {
        let client = reqwest::Client::new();
        let mut out = BTreeMap::new();
        for (slot, port) in self.ports.iter().enumerate() {
            let r = client
                .get(format!("http://127.0.0.1:{port}/metrics"))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if let Ok(r) = r {
                if let Ok(text) = r.text().await {
                    out.insert(slot, text);
                }
            }
        }
        out
    }
}

/// The "could not connect" error a process printed after `from` in its log, if it failed so.
fn start_failure(log: &Path, from: u64) -> Option<String> {
    let text = std::fs::read(log).ok()?;
    let tail = String::from_utf8_lossy(text.get(usize::try_from(from).ok()?..)?).into_owned();
    tail.lines()
        .find(|l| l.starts_with("error: connecting to"))
        .map(str::to_owned)
}

/// The sum of the samples of `name` whose labels include every one of `labels`.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if !labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// The operator's command line, run against the run's config.
#[derive(Clone)]
pub struct Cli {
    pub binary: String,
    pub config: PathBuf,
    pub dir: PathBuf,
}

/// What one CLI run gave.
#[derive(Debug)]
pub struct CliOutcome {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Cli {
    /// Runs `cardworker ARGS --config FILE` (killed after 60 s).
    pub async fn run(&self, args: &[&str]) -> CliOutcome {
        let child = Command::new(&self.binary)
            .args(args)
            .arg("--config")
            .arg(&self.config)
            .env("CARDWORKER_OPERATOR", "chaos")
            .env("RUST_LOG", "warn")
            .env_remove("CARDWORKER_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(Duration::from_secs(60), child).await {
            Ok(Ok(out)) => CliOutcome {
                code: out.status.code().unwrap_or(-1),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            },
            Ok(Err(e)) => CliOutcome {
                code: -1,
                stdout: String::new(),
                stderr: e.to_string(),
            },
            Err(_) => CliOutcome {
                code: -1,
                stdout: String::new(),
                stderr: "timed out after 60 s".to_owned(),
            },
        }
    }

    /// Runs until it exits 0, at most `tries` times, 2 s apart.
    pub async fn run_until_ok(&self, args: &[&str], tries: u32) -> Option<CliOutcome> {
        for _ in 0..tries {
            let out = self.run(args).await;
            if out.code == 0 {
                return Some(out);
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        None
    }
}
