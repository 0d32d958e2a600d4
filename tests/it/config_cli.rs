//! `cardworker check-config` refuses every invalid form with exit status 2 and names the key,
//! the value and what is allowed; valid configurations print with secrets redacted.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_cardworker");

fn check_config(toml: &str, env: &[(&str, &str)]) -> Output {
    check_config_file(toml, env).0
}

/// Like [`check_config`], also returning the `--config` path as given, which messages name.
fn check_config_file(toml: &str, env: &[(&str, &str)]) -> (Output, String) {
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
    let out = cmd.output().expect("run cardworker");
    (out, path.display().to_string())
}

/// Stderr of a refused configuration, after checking the exit status.
fn refused(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    stderr
}

/// Checks `toml` as a config file (with the env pairs `env`): the stderr of the refusal, after
/// checking the exit status, and the file's path as the messages name it.
fn refused_file(toml: &str, env: &[(&str, &str)]) -> (String, String) {
    let (out, path) = check_config_file(toml, env);
    (refused(&out), path)
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

/// The error output of `check-config` with no file and the one env variable `var` = `value`,
/// which it refuses (exit status 2).
fn refused_env(var: &str, value: &str) -> String {
    refused(&check_config("", &[(var, value)]))
}

/// Asserts that the error output `stderr` contains `part`.
fn says(stderr: &str, part: &str) {
    assert!(stderr.contains(part), "{stderr}");
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
    says(&stderr, "polling.total_limit");
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

#[test]
fn an_env_override_that_is_not_a_number_names_the_env_variable_as_its_source() {
    let stderr = refused_env("CARDWORKER__POLLING__TOTAL_LIMIT", "abc");
    says(
        &stderr,
        "polling.total_limit = \"abc\" (from env CARDWORKER__POLLING__TOTAL_LIMIT): \
         must be an integer in 1..=256",
    );
}

#[test]
fn a_bad_value_in_the_file_names_the_file_as_given_on_the_command_line() {
    let (stderr, path) = refused_file("[polling]\ntotal_limit = 0\n", &[]);
    says(
        &stderr,
        &format!("polling.total_limit = 0 (from {path}): must be an integer in 1..=256"),
    );
}

#[test]
fn a_file_named_by_cardworker_config_is_named_as_written_there() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("conf")).expect("mkdir");
    std::fs::write(
        dir.path().join("conf/x.toml"),
        "[polling]\ntotal_limt = 4\n",
    )
    .expect("write");
    let out = Command::new(BIN)
        .arg("check-config")
        .current_dir(dir.path())
        .env("CARDWORKER_CONFIG", "conf/x.toml")
        .output()
        .expect("run");
    let stderr = refused(&out);
    says(
        &stderr,
        "polling.total_limt = 4 (from conf/x.toml): unknown key",
    );
}

#[test]
fn a_default_in_conflict_with_a_file_value_names_the_source_of_both_keys() {
    // card_status keeps its default limit of 4, above the file's total_limit of 3.
    let (stderr, path) = refused_file(
        "[polling]\ntotal_limit = 3\n[polling.carddata]\nlimit = 2\n",
        &[],
    );
    let line = stderr
        .lines()
        .find(|l| l.contains("polling.card_status.limit"))
        .unwrap_or_else(|| panic!("no line for polling.card_status.limit: {stderr}"));
    assert!(
        line.contains("polling.card_status.limit = 4 (from default): "),
        "{line}"
    );
    assert!(
        line.ends_with(&format!(
            "checked against polling.total_limit = 3 (from {path})"
        )),
        "{line}"
    );
}

#[test]
fn a_relation_between_a_file_value_and_an_env_value_names_the_source_of_each() {
    let (stderr, path) = refused_file(
        "[polling]\nhandler_timeout_secs = 10\n",
        &[("CARDWORKER__GATEWAY__TIMEOUT_MS", "20000")],
    );
    says(
        &stderr,
        &format!("polling.handler_timeout_secs = 10 (from {path}): "),
    );
    says(
        &stderr,
        "checked against gateway.timeout_ms = 20000 (from env CARDWORKER__GATEWAY__TIMEOUT_MS)",
    );
}

#[test]
fn an_unknown_env_override_names_the_env_variable_as_its_source() {
    let stderr = refused_env("CARDWORKER__POLLING__BOGUS", "1");
    says(
        &stderr,
        "polling.bogus = 1 (from env CARDWORKER__POLLING__BOGUS): unknown key",
    );
}

#[test]
fn every_line_of_a_report_with_several_problems_starts_the_same_way() {
    let (stderr, path) = refused_file(
        "[polling]\ntotal_limit = 0\nbogus = 1\n[gateway]\ntimeout_ms = 5\n",
        &[("CARDWORKER__POLLING__RECONCILE_CRON", "30 3 * * *")],
    );
    let mut lines = stderr.lines();
    assert_eq!(
        lines.next(),
        Some("error: invalid configuration (4 problems):"),
        "{stderr}"
    );
    let problems: Vec<&str> = lines.collect();
    assert_eq!(problems.len(), 4, "{stderr}");
    for line in &problems {
        assert!(line.starts_with("  - "), "{line:?} in {stderr}");
        assert!(line.contains(" (from "), "{line:?} names no source");
    }
    says(
        &stderr,
        &format!("  - polling.bogus = 1 (from {path}): unknown key"),
    );
    says(&stderr, "(from env CARDWORKER__POLLING__RECONCILE_CRON)");
}

#[test]
fn the_console_refuses_an_admin_token_from_a_config_file_with_exit_2_naming_key_and_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("console.toml");
    std::fs::write(
        &path,
        "[console]\nadmin_token = \"abcdefghijklmnop-secret\"\n",
    )
    .expect("write config");
    let out = Command::new(BIN)
        .args(["console", "--listen", "127.0.0.1:0", "--config"])
        .arg(&path)
        .env_remove("CARDWORKER_CONFIG")
        .env_remove("CARDWORKER__CONSOLE__ADMIN_TOKEN")
        .output()
        .expect("run cardworker console");
    let stderr = refused(&out);
    says(&stderr, "console.admin_token");
    assert!(
        stderr.contains(&format!("(from {})", path.display())),
        "{stderr}"
    );
    says(&stderr, "CARDWORKER__CONSOLE__ADMIN_TOKEN");
    assert!(
        !stderr.contains("abcdefghijklmnop"),
        "the token is not echoed: {stderr}"
    );
    // `check-config` shows a token set from the env only as ***.
    let out = check_config(
        "",
        &[(
            "CARDWORKER__CONSOLE__ADMIN_TOKEN",
            "abcdefghijklmnop-secret",
        )],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("admin_token = \"***\""), "{stdout}");
    assert!(!stdout.contains("abcdefghijklmnop"), "{stdout}");
}

#[test]
fn a_misspelled_override_with_one_underscore_exits_2_naming_it_and_the_valid_one() {
    let stderr = refused_env("CARDWORKER_POLLING__TOTAL_LIMIT", "abc");
    says(
        &stderr,
        "CARDWORKER_POLLING__TOTAL_LIMIT = \"abc\" (from env CARDWORKER_POLLING__TOTAL_LIMIT): \
         unknown variable; did you mean CARDWORKER__POLLING__TOTAL_LIMIT?",
    );
}
