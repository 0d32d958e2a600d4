//! `cardworker check-config` refuses every invalid form with exit status 2 and names the key,
//! the value and what is allowed; valid configurations print with secrets redacted.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cardworker");

fn check_config(toml: &str, env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.toml");
    std::fs::write(&path, toml).expect("write config");
    let mut cmd = Command::new(BIN);
    cmd.arg("check-config").arg("--config").arg(&path);
    // The test process's own environment must not leak overrides in.
    cmd.env_remove("CARDWORKER_CONFIG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run cardworker")
}

fn assert_refused(toml: &str, key: &str, value: &str) {
    let out = check_config(toml, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "exit status for {toml:?}: {stderr}"
    );
    assert!(stderr.contains(key), "message names {key}: {stderr}");
    assert!(
        stderr.contains(value),
        "message names the value {value}: {stderr}"
    );
}

#[test]
fn a_total_limit_of_zero_is_refused_naming_the_key() {
    assert_refused("[polling]\ntotal_limit = 0\n", "polling.total_limit", "0");
}

#[test]
fn a_negative_total_limit_is_refused_naming_the_key() {
    assert_refused("[polling]\ntotal_limit = -1\n", "polling.total_limit", "-1");
}

#[test]
fn a_fractional_total_limit_is_refused_naming_the_key() {
    assert_refused(
        "[polling]\ntotal_limit = 3.5\n",
        "polling.total_limit",
        "3.5",
    );
}

#[test]
fn a_non_numeric_total_limit_is_refused_naming_the_key() {
    assert_refused(
        "[polling]\ntotal_limit = \"abc\"\n",
        "polling.total_limit",
        "abc",
    );
}

#[test]
fn a_total_limit_above_the_ceiling_is_refused_naming_the_key() {
    assert_refused(
        "[polling]\ntotal_limit = 100000\n",
        "polling.total_limit",
        "100000",
    );
}

#[test]
fn an_infinite_total_limit_is_refused_naming_the_key() {
    assert_refused(
        "[polling]\ntotal_limit = inf\n",
        "polling.total_limit",
        "inf",
    );
}

#[test]
fn a_task_limit_above_the_total_is_refused_naming_the_key() {
    assert_refused(
        "[polling]\ntotal_limit = 4\n[polling.carddata]\nlimit = 5\n",
        "polling.carddata.limit",
        "5",
    );
}

#[test]
fn an_unknown_key_is_refused_naming_it() {
    assert_refused("[polling]\ntotal_limt = 4\n", "polling.total_limt", "4");
}

#[test]
fn an_invalid_env_override_is_refused_like_the_file() {
    let out = check_config("", &[("CARDWORKER__POLLING__TOTAL_LIMIT", "0")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("polling.total_limit"), "{stderr}");
}

#[test]
fn every_problem_is_reported_at_once() {
    let out = check_config(
        "[polling]\ntotal_limit = 0\nreconcile_cron = \"30 3 * * *\"\n[gateway]\ntimeout_ms = 5\n",
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    for key in [
        "polling.total_limit",
        "polling.reconcile_cron",
        "gateway.timeout_ms",
    ] {
        assert!(stderr.contains(key), "{key} missing from: {stderr}");
    }
}

#[test]
fn a_valid_configuration_prints_with_passwords_redacted() {
    let out = check_config(
        "[database]\nurl = \"postgres://app:s3cret@db.internal:5432/cardworker\"\n",
        &[("CARDWORKER__POLLING__TOTAL_LIMIT", "6")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("s3cret"), "password leaked: {stdout}");
    assert!(stdout.contains("***"), "{stdout}");
    assert!(
        stdout.contains("total_limit = 6"),
        "env override applied: {stdout}"
    );
}

#[test]
fn check_config_json_prints_the_effective_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.toml");
    std::fs::write(&path, "[polling]\ntotal_limit = 7\n").expect("write");
    let out = Command::new(BIN)
        .args(["check-config", "--format", "json", "--config"])
        .arg(&path)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["polling"]["total_limit"], 7);
    assert_eq!(v["maintenance"]["enabled"], false);
}

#[test]
fn a_usage_error_exits_with_status_two() {
    let out = Command::new(BIN)
        .args(["enqueue", "carddata"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
}
