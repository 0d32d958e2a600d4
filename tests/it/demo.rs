//! `make reset-demo` (`deploy/local/demo.sh reset`): it drops the demo's database and the keys
//! under the demo's prefix, and nothing else: not a neighbouring prefix, not another deployment's
//! entry in apalis's global queue list.

use std::path::Path;
use std::time::Duration;

use redis::AsyncCommands as _;

use crate::harness::{admin_url, redis_url, TestDb, TestRedis};

const GLOBAL_QUEUES: &str = "core:apalis:queues:list";

#[tokio::test]
async fn reset_demo_drops_the_demo_database_and_prefix_and_leaves_every_other_key_alone() {
    let db = TestDb::new().await;
    // The demo is stopped: nothing holds a connection to its database.
    db.pool.close().await;
    let ours = TestRedis::new().await;
    // A prefix that starts like ours: `ours:*` must not match it.
    let neighbour = TestRedis {
        prefix: format!("{}-x", ours.prefix),
        conn: ours.conn.clone(),
    };
    let mut conn = ours.conn.clone();
    for prefix in [&ours.prefix, &neighbour.prefix] {
        let _: () = conn
            .set(format!("{prefix}:chain:carddata"), "x")
            .await
            .unwrap();
        let _: () = conn
            .hset(format!("{prefix}:q:carddata:data"), "id", "job")
            .await
            .unwrap();
        let _: () = conn
            .zadd(GLOBAL_QUEUES, format!("{prefix}:q:carddata:workers"), 1)
            .await
            .unwrap();
    }

    // Ours: the two above and whatever the harness itself keeps under the prefix.
    let ours_before = ours.keys().await.len();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("bash")
        .arg(root.join("deploy/local/demo.sh"))
        .arg("reset")
        .arg(env!("CARGO_BIN_EXE_cardworker"))
        .arg(root.join("config/local.toml"))
        .env("CARDWORKER__DATABASE__URL", &db.url)
        .env("CARDWORKER__REDIS__URL", redis_url())
        .env("CARDWORKER__REDIS__KEY_PREFIX", &ours.prefix)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .expect("run demo.sh");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{ours_before} keys deleted")),
        "{ours_before}: {text}"
    );

    let admin = sqlx::PgPool::connect(&admin_url()).await.unwrap();
    let exists: Option<i32> = sqlx::query_scalar("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(&db.name)
        .fetch_optional(&admin)
        .await
        .unwrap();
    admin.close().await;
    assert_eq!(exists, None, "the demo database is gone");
    assert!(ours.keys().await.is_empty(), "{:?}", ours.keys().await);
    let mut left = neighbour.keys().await;
    left.sort();
    assert_eq!(
        left,
        [
            format!("{}:chain:carddata", neighbour.prefix),
            format!("{}:q:carddata:data", neighbour.prefix),
        ]
    );
    let queues: Vec<String> = conn.zrange(GLOBAL_QUEUES, 0, -1).await.unwrap();
    assert!(!queues.contains(&format!("{}:q:carddata:workers", ours.prefix)));
    assert!(queues.contains(&format!("{}:q:carddata:workers", neighbour.prefix)));
}

/// The `grep '…' run.log` commands of the README's "first two minutes", as written there.
fn readme_greps() -> Vec<String> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let mut out = Vec::new();
    let mut rest = readme.as_str();
    while let Some(at) = rest.find("grep '") {
        rest = &rest[at + "grep '".len()..];
        let Some(end) = rest.find('\'') else { break };
        if rest[end..].starts_with("' run.log") {
            out.push(rest[..end].to_owned());
        }
        rest = &rest[end..];
    }
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Whether `grep PATTERN FILE` finds a line, as the README's reader runs it.
fn grep_finds(pattern: &str, file: &Path) -> bool {
    std::process::Command::new("grep")
        .arg("-q")
        .arg(pattern)
        .arg(file)
        .status()
        .expect("grep")
        .success()
}

/// Sends `signal` to every process of the group `group` (the demo's script and its children).
fn signal_group(signal: &str, group: u32) -> bool {
    std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{group}"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn make_runs_log_redirected_to_a_file_is_plain_text_the_readmes_greps_find_and_a_clean_start_warns_of_nothing(
) {
    let greps = readme_greps();
    assert!(
        greps.len() >= 3 && greps.iter().any(|g| g == "change=data ready"),
        "the README's grep strings: {greps:?}"
    );
    // A demo of its own (as the README's "another demo next to this one"), on a fresh database
    // and prefix: a clean first start. Ten cards, each read changing a card with odds 0.3, so
    // cards turn ready within a few polls and chains keep polling for a while (about two calls a
    // second); one call in ten fails, so failures are logged too (too few to open a circuit).
    let db = TestDb::new().await;
    let redis = TestRedis::new().await;
    // An empty prefix, as on a first start: no epoch marker either.
    let _: () = redis::cmd("DEL")
        .arg(cardworker::runner::redis_watch::epoch_key(&redis.prefix))
        .query_async(&mut redis.conn.clone())
        .await
        .expect("del the epoch marker");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("tmp");
    let log = dir.path().join("run.log");
    let out = std::fs::File::create(&log).expect("run.log");
    let mut demo = tokio::process::Command::new("bash");
    demo.arg(root.join("deploy/local/demo.sh"))
        .arg("run")
        .arg(env!("CARGO_BIN_EXE_cardworker"))
        .arg(root.join("config/local.toml"))
        .current_dir(root)
        .env_remove("CARDWORKER_CONFIG")
        .env_remove("RUST_LOG")
        .env("CARDWORKER__DATABASE__URL", &db.url)
        .env("CARDWORKER__REDIS__URL", redis_url())
        .env("CARDWORKER__REDIS__KEY_PREFIX", &redis.prefix)
        .env(
            "CARDWORKER__GATEWAY__BASE_URL",
            format!("http://127.0.0.1:{}", free_port()),
        )
        .env("CARDWORKER__TELEMETRY__LISTEN", "127.0.0.1:0")
        .env("CONSOLE_LISTEN", format!("127.0.0.1:{}", free_port()))
        .env("DEMO_CARDS", "10")
        .env(
            "DEMO_SIM_ARGS",
            "--latency-ms 5 --change-rate 0.3 --error-rate 0.1 --garbage-rate 0",
        )
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(out)
        .process_group(0)
        .kill_on_drop(true);
    let mut child = demo.spawn().expect("start the demo");
    let group = child.id().expect("the demo's pid");
    let all_found = || greps.iter().all(|g| grep_finds(g, &log));
    let started = std::time::Instant::now();
    while !all_found() && started.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let found = all_found();
    // Ctrl-C, as the README says: SIGINT to the whole process group.
    assert!(signal_group("INT", group), "kill -INT the demo's group");
    let stopped = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
    if stopped.is_err() {
        signal_group("KILL", group);
        let _ = child.wait().await;
    }
    let text = std::fs::read_to_string(&log).expect("read run.log");
    assert!(
        found,
        "not every README grep of {greps:?} found a line in:\n{text}"
    );
    assert!(stopped.is_ok(), "Ctrl-C stopped the demo:\n{text}");
    assert!(
        !text.contains('\u{1b}'),
        "a redirected log holds no colour codes:\n{text}"
    );
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" WARN "))
        .filter(|l| !l.contains("poll failed; recorded"))
        .collect();
    assert!(
        warnings.is_empty(),
        "a clean first start logs no WARN but the simulated failures: {warnings:#?}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains(" INFO ") && l.contains("Redis holds no epoch marker at start-up")),
        "the empty Redis of a first start is noted at INFO:\n{text}"
    );
}
