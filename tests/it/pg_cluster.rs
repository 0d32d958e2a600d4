//! A private PostgreSQL cluster for one test or benchmark: `initdb` into a temporary directory,
//! a free port on 127.0.0.1, trust authentication, and the server settings the caller needs
//! (preloaded libraries, planner switches, logging). It is stopped and removed when the guard
//! drops, also when the test panics. The shared server (127.0.0.1:5432) is never reconfigured.
//!
//! The binaries come from `CARDWORKER_TEST_PG_BIN` (default `/usr/lib/postgresql/15/bin`).
//! PostgreSQL refuses to run as root, so as root every server command runs as the `postgres`
//! user (`runuser`), and the directory is handed to that user.

#![allow(dead_code)]

use std::fs;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{bail, Context as _};

/// The bootstrap superuser of a private cluster (trust authentication on 127.0.0.1 only).
pub const SUPERUSER: &str = "postgres";

/// Where the server binaries are.
pub fn pg_bin() -> PathBuf {
    std::env::var_os("CARDWORKER_TEST_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

/// A running private cluster; stopped and deleted on drop.
pub struct PrivateCluster {
    /// The temporary directory holding the data directory and the start log.
    dir: tempfile::TempDir,
    /// The data directory.
    data: PathBuf,
    /// The port on 127.0.0.1.
    port: u16,
    /// Whether the server still runs (so that drop stops it).
    running: bool,
}

impl PrivateCluster {
    /// Initialises and starts a cluster with `settings` appended to `postgresql.conf` (each value
    /// is quoted, so `("shared_preload_libraries", "auto_explain")` is written as
    /// `shared_preload_libraries = 'auto_explain'`). Durability is off (`fsync`,
    /// `synchronous_commit`, `full_page_writes`): the cluster is thrown away.
    pub fn start(settings: &[(&str, &str)]) -> anyhow::Result<Self> {
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
            let port = free_port()?;
            append(
                &cluster.data.join("postgresql.conf"),
                &format!("port = {port}\n"),
            )?;
            let out = cluster
                .server_command("pg_ctl")
                .arg("-D")
                .arg(&cluster.data)
                .arg("-l")
                .arg(cluster.dir.path().join("start.log"))
                .args(["-w", "-t", "60", "start"])
                .output()
                .context("running pg_ctl start")?;
            match check(&out, "pg_ctl start") {
                Ok(()) => {
                    cluster.port = port;
                    cluster.running = true;
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

    /// Stops the server (fast shutdown: sessions are ended, every log line is flushed).
    pub fn stop(&mut self) -> anyhow::Result<()> {
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

impl Drop for PrivateCluster {
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

fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
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
