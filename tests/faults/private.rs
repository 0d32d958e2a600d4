//! Private services for fault injection: a redis-server or a PostgreSQL cluster of the test's
//! own, on a free port, that the test may stop, restart or wipe. Never the shared ones. Each is
//! removed when its guard drops, also when the test panics.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound once and released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A redis-server of the test's own.
pub struct PrivateRedis {
    /// Its port.
    pub port: u16,
    /// With an append-only file, so that a restart brings the data back.
    pub persistent: bool,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Starts one; `persistent` keeps its data across [`PrivateRedis::stop`] and
    /// [`PrivateRedis::start`].
    pub fn start_new(persistent: bool) -> Self {
        let mut redis = Self {
            port: free_port(),
            persistent,
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
        };
        redis.start();
        redis
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// (Re)starts the server on the same port and directory, and waits until it answers.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "already running");
        let appendonly = if self.persistent { "yes" } else { "no" };
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                appendonly,
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let port = self.port;
        wait_for("the private redis-server", Duration::from_secs(10), || {
            redis_ping(port)
        });
    }

    /// Stops the server and starts it again with nothing: every file of its directory is removed
    /// in between, so it comes back empty even when persistent. (The chaos run uses it.)
    #[allow(dead_code)]
    pub fn restart_empty(&mut self) {
        self.stop();
        if let Ok(entries) = std::fs::read_dir(self.dir.path()) {
            for entry in entries.flatten() {
                let path = entry.path();
                let _ = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
            }
        }
        self.start();
    }

    /// Stops the server: gracefully (SIGTERM: a persistent one writes its data) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let start = Instant::now();
            while child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(10) {
                    let _ = child.kill();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl PrivateRedis {
    /// Suspends every client's commands for `length` (`CLIENT PAUSE … ALL`): the server runs and
    /// keeps its data, but answers nobody until the pause ends. (The chaos run pauses through a
    /// connection of its own.)
    #[allow(dead_code)]
    pub fn pause(&self, length: Duration) {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "CLIENT", "PAUSE"])
            .arg(length.as_millis().to_string())
            .arg("ALL")
            .output()
            .expect("run redis-cli CLIENT PAUSE");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "OK",
            "CLIENT PAUSE: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn redis_ping(port: u16) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string(), "PING"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "PONG")
        .unwrap_or(false)
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A PostgreSQL cluster of the test's own (initdb + pg_ctl, run as the `postgres` user when the
/// test runs as root, since PostgreSQL refuses to run as root).
pub struct PrivatePg {
    /// Its port.
    pub port: u16,
    data: PathBuf,
    _root: tempfile::TempDir,
    running: bool,
}

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

fn as_postgres(program: &str) -> Command {
    let path = format!("{PG_BIN}/{program}");
    let root = std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--", &path]);
        c
    } else {
        Command::new(path)
    }
}

impl PrivatePg {
    /// initdb (superuser `root`, trust on the loopback) and start.
    pub fn start_new() -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let _ = Command::new("chmod").arg("777").arg(root.path()).status();
        let data = root.path().join("data");
        let out = as_postgres("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "root", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = Self {
            port: free_port(),
            data,
            _root: root,
            running: false,
        };
        pg.start();
        pg
    }

    /// The URL of database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://root@127.0.0.1:{}/{db}", self.port)
    }

    /// Starts the cluster and waits until it accepts connections.
    pub fn start(&mut self) {
        let log = self.data.parent().expect("root").join("pg.log");
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off",
            self.port
        );
        let out = as_postgres("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-o", &opts, "-l"])
            .arg(&log)
            .args(["-w", "start"])
            .output()
            .expect("run pg_ctl start");
        assert!(
            out.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.running = true;
    }

    /// Stops the cluster (fast: open sessions are ended).
    pub fn stop(&mut self) {
        if self.running {
            let _ = as_postgres("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "fast", "-w", "stop"])
                .output();
            self.running = false;
        }
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        if self.running {
            let _ = as_postgres("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "-w", "stop"])
                .output();
        }
    }
}
