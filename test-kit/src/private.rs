//! Private services: a redis-server or a PostgreSQL cluster of the test's (or benchmark's) own,
//! on a free port, that it may configure, stop, restart or wipe. Never the shared ones. Each is
//! removed when its guard drops, also when the test panics.
//!
//! The PostgreSQL binaries come from `CARDWORKER_TEST_PG_BIN` (default
//! `/usr/lib/postgresql/15/bin`). PostgreSQL refuses to run as root, so as root every server
//! command runs as the `postgres` user (`runuser`), and the directory is handed to that user.

use std::fs;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

pub use crate::free_port;

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
    /// When the append-only file is synced to disk (`appendfsync`): `always`, or `everysec`
    /// (what a [`PrivateRedis::kill`] may lose the last writes of).
    fsync: &'static str,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Starts one; `persistent` keeps its data across [`PrivateRedis::stop`] and
    /// [`PrivateRedis::start`].
    pub fn start_new(persistent: bool) -> Self {
        Self::started(persistent, "always")
    }

    /// Starts a persistent one whose append-only file is synced once a second, as a production
    /// server's is: the writes of the last second are in [`PrivateRedis::aof`] only once synced,
    /// so a [`PrivateRedis::kill`] (or a cut of the file) loses them.
    pub fn start_synced_each_second() -> Self {
        Self::started(true, "everysec")
    }

    fn started(persistent: bool, fsync: &'static str) -> Self {
        let mut redis = Self {
            port: free_port(),
            persistent,
            fsync,
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
                self.fsync,
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
    /// in between, so it comes back empty even when persistent.
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
    /// Kills the server (SIGKILL: nothing is written on the way out) and waits for it; a
    /// [`PrivateRedis::start`] brings back what its append-only file holds.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The append-only file the server writes to now: the incremental part of Redis 7's
    /// multi-part AOF (its last), or the single file of older versions.
    pub fn aof(&self) -> PathBuf {
        let multi = self.dir.path().join("appendonlydir");
        if let Ok(entries) = fs::read_dir(&multi) {
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

    /// Suspends every client's commands for `length` (`CLIENT PAUSE … ALL`): the server runs and
    /// keeps its data, but answers nobody until the pause ends.
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
        self.kill();
    }
}

/// The bootstrap superuser of a private cluster (trust authentication on 127.0.0.1 only).
pub const SUPERUSER: &str = "postgres";

/// Where the server binaries are.
pub fn pg_bin() -> PathBuf {
    std::env::var_os("CARDWORKER_TEST_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

/// A PostgreSQL cluster of the test's own (`initdb` + `pg_ctl`, trust authentication on
/// 127.0.0.1 only); stopped and deleted on drop.
pub struct PrivatePg {
    /// The temporary directory holding the data directory and the start log.
    dir: tempfile::TempDir,
    /// The data directory.
    data: PathBuf,
    /// The port on 127.0.0.1.
    port: u16,
    /// Whether the server still runs (so that drop stops it).
    running: bool,
}

impl PrivatePg {
    /// Initialises and starts a cluster with the default settings; panics when it cannot.
    pub fn start_new() -> Self {
        Self::start_with(&[]).expect("start a private PostgreSQL cluster")
    }

    /// Initialises and starts a cluster with `settings` appended to `postgresql.conf` (each value
    /// is quoted, so `("shared_preload_libraries", "auto_explain")` is written as
    /// `shared_preload_libraries = 'auto_explain'`). Durability is off (`fsync`,
    /// `synchronous_commit`, `full_page_writes`): the cluster is thrown away.
    pub fn start_with(settings: &[(&str, &str)]) -> anyhow::Result<Self> {
        let bin = pg_bin();
        if !bin.join("initdb").exists() {
            bail!(
                "no PostgreSQL server binaries at {} (set CARDWORKER_TEST_PG_BIN)",
                bin.display()
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("cardworker-pg-")
            .tempdir()
            .context("creating the cluster directory")?;
        if running_as_root() {
            let (uid, gid) = postgres_user()?;
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .context("handing the cluster directory to the postgres user")?;
        }
        let data = dir.path().join("data");
        let mut cluster = Self {
            dir,
            data,
            port: 0,
            running: false,
        };
        let out = cluster
            .server_command("initdb")
            .arg("-D")
            .arg(&cluster.data)
            .args(["-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-locale"])
            .arg("--no-sync")
            .output()
            .context("running initdb")?;
        check(&out, "initdb")?;

        let mut conf = String::from("\n# cardworker private cluster\n");
        let socket_dir = cluster.dir.path().display().to_string();
        let fixed = [
            ("listen_addresses", "127.0.0.1"),
            ("unix_socket_directories", socket_dir.as_str()),
            ("fsync", "off"),
            ("synchronous_commit", "off"),
            ("full_page_writes", "off"),
        ];
        for (key, value) in fixed.iter().chain(settings) {
            conf.push_str(&format!("{key} = '{}'\n", value.replace('\'', "''")));
        }
        append(&cluster.data.join("postgresql.conf"), &conf)?;

        // A free port can be taken between asking and binding: try a few.
        let mut last_error = None;
        for _ in 0..5 {
            let port = free_port();
            append(
                &cluster.data.join("postgresql.conf"),
                &format!("port = {port}\n"),
            )?;
            match cluster.pg_ctl_start() {
                Ok(()) => {
                    cluster.port = port;
                    return Ok(cluster);
                }
                Err(e) => last_error = Some(e),
            }
        }
        let log = fs::read_to_string(cluster.dir.path().join("start.log")).unwrap_or_default();
        Err(last_error
            .unwrap_or_else(|| anyhow::anyhow!("pg_ctl start failed"))
            .context(format!("starting the private cluster; start log:\n{log}")))
    }

    /// The port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Starts the cluster again after [`PrivatePg::stop`], on the same port and data, and waits
    /// until it accepts connections; panics when it cannot.
    pub fn start(&mut self) {
        assert!(!self.running, "already running");
        if let Err(e) = self.pg_ctl_start() {
            panic!("restarting the private cluster: {e:#}");
        }
    }

    fn pg_ctl_start(&mut self) -> anyhow::Result<()> {
        let out = self
            .server_command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(self.dir.path().join("start.log"))
            .args(["-w", "-t", "60", "start"])
            .output()
            .context("running pg_ctl start")?;
        check(&out, "pg_ctl start")?;
        self.running = true;
        Ok(())
    }

    /// The admin URL (database `postgres`), for `harness::spawn_app_on` and `TestDb::new_on`.
    pub fn admin_url(&self) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/postgres", self.port)
    }

    /// The URL of database `name` on this cluster.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{name}", self.port)
    }

    /// The server's log directory (`log_directory = 'log'`, the default, with
    /// `logging_collector = on`).
    pub fn log_dir(&self) -> PathBuf {
        self.data.join("log")
    }

    /// Every file in the log directory whose name ends in `suffix` (`.json` for `jsonlog`),
    /// concatenated in name order.
    pub fn read_logs(&self, suffix: &str) -> anyhow::Result<String> {
        let mut files: Vec<PathBuf> = fs::read_dir(self.log_dir())
            .context("reading the log directory")?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .collect();
        files.sort();
        let mut out = String::new();
        for f in files {
            out.push_str(&fs::read_to_string(&f).with_context(|| format!("reading {f:?}"))?);
        }
        Ok(out)
    }

    /// Stops the server (fast shutdown: open sessions are ended), whatever `pg_ctl` answers:
    /// a fault test goes on with a server that is down.
    pub fn stop(&mut self) {
        let _ = self.try_stop();
        self.running = false;
    }

    /// Stops the server (fast shutdown: sessions are ended, every log line is flushed), or says
    /// why it did not stop.
    pub fn try_stop(&mut self) -> anyhow::Result<()> {
        if !self.running {
            return Ok(());
        }
        let out = self
            .server_command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "fast", "-w", "-t", "60", "stop"])
            .output()
            .context("running pg_ctl stop")?;
        check(&out, "pg_ctl stop")?;
        self.running = false;
        Ok(())
    }

    /// A server binary, run as the `postgres` user when this process is root.
    fn server_command(&self, program: &str) -> Command {
        let path = pg_bin().join(program);
        if running_as_root() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(path);
            cmd
        } else {
            Command::new(path)
        }
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        if self.running {
            // Immediate: nothing of a thrown-away cluster needs to be written.
            let _ = self
                .server_command("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-m", "immediate", "-w", "-t", "30", "stop"])
                .output();
        }
        // The TempDir removes the directory after this.
    }
}

fn running_as_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// (uid, gid) of the `postgres` user, from /etc/passwd.
fn postgres_user() -> anyhow::Result<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").context("reading /etc/passwd")?;
    for line in passwd.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.first() == Some(&"postgres") && f.len() > 3 {
            return Ok((f[2].parse()?, f[3].parse()?));
        }
    }
    bail!("running as root, but there is no postgres user to run the server as")
}

fn append(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(path)
        .with_context(|| format!("opening {path:?}"))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {path:?}"))
}

fn check(out: &Output, what: &str) -> anyhow::Result<()> {
    if out.status.success() {
        return Ok(());
    }
    bail!(
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
