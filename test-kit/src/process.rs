//! A `cardworker run` child process: spawned with a config file, its metrics address read from
//! its log, its warnings and errors kept. Used by the integration tests (`harness`) and, by path,
//! by `benches/bench_faults.rs`, so it depends on nothing of the test crate.

use std::io::BufRead as _;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// One `cardworker run` child process and the address of its metrics endpoint.
pub struct Worker {
    /// The process.
    pub child: Child,
    /// `host:port` of its `/metrics`.
    pub metrics: String,
    /// Its log lines at WARN or ERROR, in order.
    pub problems: Arc<Mutex<Vec<String>>>,
    /// Every line of its log, in order.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Worker {
    /// Starts `BINARY run --config CONFIG` and waits until it logs its metrics address.
    ///
    /// `BENCH_WORKER_THREADS=N` in this process's environment runs the child's runtime on `N`
    /// threads (`TOKIO_WORKER_THREADS`), as a pod's CPU limit does (the runtime sizes itself to
    /// the CPUs its cgroup allows): a benchmark's worker as deployed, on a machine with more
    /// cores, while the benchmark's own runtime keeps them.
    pub fn spawn(binary: &str, config: &std::path::Path) -> anyhow::Result<Self> {
        let mut command = Command::new(binary);
        command
            .arg("run")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info,apalis=warn,apalis_core=warn,sqlx=warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Ok(threads) = std::env::var("BENCH_WORKER_THREADS") {
            command.env("TOKIO_WORKER_THREADS", threads);
        }
        let mut child = command.spawn()?;
        let stderr = child
            .stderr
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stderr"))?;
        let (tx, rx) = mpsc::channel();
        let problems = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::new(Mutex::new(Vec::new()));
        let keep = problems.clone();
        let keep_all = log.clone();
        // Reads the log until the endpoint's address shows, then keeps draining it.
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.split("metrics at http://").nth(1) {
                    if let (Some(addr), Some(tx)) = (rest.split("/metrics").next(), tx.take()) {
                        let _ = tx.send(addr.to_owned());
                    }
                }
                if line.contains("\"WARN\"") || line.contains("\"ERROR\"") {
                    if let Ok(mut p) = keep.lock() {
                        p.push(line.clone());
                    }
                }
                if let Ok(mut all) = keep_all.lock() {
                    all.push(line);
                }
            }
        });
        let metrics = rx
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| anyhow::anyhow!("cardworker run did not log its metrics address"))?;
        Ok(Self {
            child,
            metrics,
            problems,
            log,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The text of its `/metrics` (empty when it does not answer).
    pub async fn metrics(&self) -> String {
        match reqwest::get(format!("http://{}/metrics", self.metrics)).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid().to_string())
            .status();
    }

    /// Its last ERROR line, if any.
    pub fn last_error(&self) -> Option<String> {
        self.problems
            .lock()
            .ok()
            .and_then(|p| p.iter().rev().find(|l| l.contains("\"ERROR\"")).cloned())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
