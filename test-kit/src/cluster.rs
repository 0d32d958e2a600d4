//! A Redis Cluster of the test's own: three masters on loopback (`redis-server --cluster-enabled
//! yes`, joined by `redis-cli --cluster create`), no replicas, removed when it drops. For showing
//! that a script keeps to the cluster's rule: every key it touches is in `KEYS`, in one slot.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// One master of a [`PrivateCluster`].
struct Node {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

/// Three masters that share the 16,384 slots.
pub struct PrivateCluster {
    nodes: Vec<Node>,
}

/// A free port whose cluster bus port (the port + 10,000) is free too.
fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl PrivateCluster {
    /// Starts three masters, joins them and waits until the cluster says `ok` on each.
    pub fn start() -> Self {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            let port = free_cluster_port();
            let dir = tempfile::tempdir().expect("tempdir");
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server");
            nodes.push(Node {
                port,
                child,
                _dir: dir,
            });
            wait_for("a cluster node", Duration::from_secs(10), || {
                cli(port, &["PING"]).trim() == "PONG"
            });
        }
        let cluster = Self { nodes };
        let addrs: Vec<String> = cluster
            .ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for port in cluster.ports() {
            wait_for("the cluster's state ok", Duration::from_secs(30), || {
                cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok")
            });
        }
        cluster
    }

    /// The masters' ports.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The port of the master that serves `key`'s slot.
    pub fn node_for(&self, key: &str) -> u16 {
        let slot: u16 = cli(self.nodes[0].port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .expect("a slot");
        // `redis-cli`'s plain output of `CLUSTER SLOTS` is one value a line: for each range its
        // start and end, then its master's ip, port, id and (Redis 7) networking metadata.
        let lines: Vec<String> = cli(self.nodes[0].port, &["CLUSTER", "SLOTS"])
            .lines()
            .map(|l| l.trim().to_owned())
            .collect();
        for i in 0..lines.len().saturating_sub(3) {
            let (Ok(start), Ok(end)) = (lines[i].parse::<u16>(), lines[i + 1].parse::<u16>())
            else {
                continue;
            };
            if lines[i + 2] == "127.0.0.1" && (start..=end).contains(&slot) {
                return lines[i + 3].parse().expect("a port");
            }
        }
        panic!("no master serves slot {slot}: {lines:?}");
    }

    /// The URL of the master on `port`.
    pub fn url(port: u16) -> String {
        format!("redis://127.0.0.1:{port}/0")
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.child.kill();
            let _ = node.child.wait();
        }
    }
}
