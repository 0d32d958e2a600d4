//! What the operator commands say (issue 13): a pause of maintenance while it is off says so,
//! a restart of a live chain names the chain it replaced, and every output spells a task the one
//! way (`card_status`).

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::harness::{redis_url, spawn_app, TestDb, TestRedis};

fn cardworker(args: &[&str], config: &Path) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .expect("run cardworker")
}

fn stdout(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A config on the test's own Redis prefix and migrated database: a maintenance brake writes its
/// `operator.maintenance_*` audit event in PostgreSQL, or is not carried out.
fn config_file(
    dir: &tempfile::TempDir,
    prefix: &str,
    db: &TestDb,
    maintenance_enabled: bool,
) -> PathBuf {
    let path = dir
        .path()
        .join(format!("cardworker-{maintenance_enabled}.toml"));
    std::fs::write(
        &path,
        format!(
            "[database]\nurl = \"{}\"\n\n[redis]\nurl = \"{}\"\nkey_prefix = \"{prefix}\"\n\n[maintenance]\nenabled = {maintenance_enabled}\n",
            db.url,
            redis_url()
        ),
    )
    .unwrap();
    path
}

#[tokio::test]
async fn maintenance_pause_and_resume_say_so_when_maintenance_is_disabled_and_only_then() {
    let r = TestRedis::new().await;
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let off = config_file(&dir, &r.prefix, &db, false);
    for verb in ["pause", "resume"] {
        let text = stdout(&cardworker(&["maintenance", verb], &off));
        assert!(
            text.contains("maintenance.enabled is false") && text.contains("do not run anyway"),
            "{verb}: {text}"
        );
    }
    let on = config_file(&dir, &r.prefix, &db, true);
    let text = stdout(&cardworker(&["maintenance", "pause"], &on));
    assert!(text.starts_with("maintenance paused"), "{text}");
    assert!(!text.contains("maintenance.enabled"), "{text}");
}

/// What `enqueue` did, in `card_status chain <what> … for card …`.
fn chain_verb(text: &str) -> &str {
    text.strip_prefix("card_status chain ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no verb in {text:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_on_a_polled_card_says_it_restarted_the_chain_and_spells_the_task_card_status() {
    let app = spawn_app().await;
    app.insert_card("c-1").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cardworker.toml");
    std::fs::write(&path, app.ctx.config.to_toml_string().unwrap()).unwrap();

    // The hyphenated spelling is accepted; the output uses the one spelling.
    let first = stdout(&cardworker(
        &["enqueue", "card-status", "--card-ref", "c-1"],
        &path,
    ));
    assert_eq!(chain_verb(&first), "started", "{first}");

    let second = stdout(&cardworker(
        &["enqueue", "card_status", "--card-ref", "c-1"],
        &path,
    ));
    assert_eq!(chain_verb(&second), "restarted", "{second}");
    assert!(second.contains("for card c-1"), "{second}");
    for text in [&first, &second] {
        assert!(!text.contains("card-status"), "{text}");
    }

    let show = stdout(&cardworker(&["budget", "show"], &path));
    assert!(show.contains("card_status"), "{show}");
    assert!(!show.contains("card-status"), "{show}");
}
