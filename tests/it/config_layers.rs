//! The layering of the configuration, through the library: defaults, then the file, then the
//! `CARDWORKER__SECTION__KEY` env overrides; unknown keys and misspelled overrides; the source
//! each problem names; every problem at once.

use std::path::PathBuf;

use cardworker::config::{Config, ConfigError, LogFormat, Source, CONFIG_PATH_ENV};

use crate::config_support::{
    bundled, env, file_source, from_str, from_str_env, problem_for, refused, refused_as,
    refused_with_env,
};

#[test]
fn each_source_is_shown_as_the_message_names_it() {
    assert_eq!(Source::Default.to_string(), "default");
    assert_eq!(
        Source::File(PathBuf::from("config/x.toml")).to_string(),
        "config/x.toml"
    );
    assert_eq!(
        Source::Env("CARDWORKER__POLLING__TOTAL_LIMIT".to_owned()).to_string(),
        "env CARDWORKER__POLLING__TOTAL_LIMIT"
    );
    assert_eq!(Source::Code.to_string(), "code");
    assert_eq!(
        serde_json::to_string(&Source::Env("CARDWORKER__X".to_owned())).expect("json"),
        "\"env CARDWORKER__X\""
    );
}

#[test]
fn unknown_key_is_refused_naming_the_dotted_key() {
    let p = refused("[polling]\nbogus = 1", "polling.bogus");
    assert_eq!(p.value, "1");
    assert!(p.allowed.starts_with("unknown key"), "{p}");
    assert!(p.allowed.contains("total_limit"), "{p}");
    refused("[polling.carddata]\nlimitt = 2", "polling.carddata.limitt");
}

#[test]
fn unknown_section_is_refused_naming_the_dotted_key() {
    let p = refused("[polling.foo]\nlimit = 1", "polling.foo");
    assert!(p.allowed.starts_with("unknown key"), "{p}");
    refused_as("[bogus]\nx = 1", "bogus", "the top level");
}

#[test]
fn a_value_where_a_section_is_due_is_refused() {
    refused_as("polling = 3", "polling", "section");
    refused("[polling.total_limit]\nx = 1", "polling.total_limit");
}

#[test]
fn env_overrides_win_over_the_file() {
    let c = from_str_env(
        "[polling]\ntotal_limit = 10\n[polling.carddata]\nlimit = 5",
        &[
            ("CARDWORKER__POLLING__TOTAL_LIMIT", "6"),
            ("CARDWORKER__POLLING__CARDDATA__LIMIT", "2"),
            ("CARDWORKER__TELEMETRY__LOG_FORMAT", "pretty"),
            ("CARDWORKER__MAINTENANCE__ENABLED", "true"),
            ("CARDWORKER__REDIS__KEY_PREFIX", "123"),
            ("UNRELATED", "x"),
        ],
    )
    .expect("valid");
    assert_eq!(c.polling.total_limit, 6);
    assert_eq!(c.polling.carddata.limit, 2);
    assert_eq!(c.telemetry.log_format, LogFormat::Pretty);
    assert!(c.maintenance.enabled);
    assert_eq!(c.redis.key_prefix, "123");
}

#[test]
fn env_override_of_the_wrong_type_is_refused_naming_the_key() {
    for raw in ["abc", "0", "-1", "3.5", "inf", "1e9", "100000", ""] {
        let p = problem_for(
            from_str_env("", &[("CARDWORKER__POLLING__TOTAL_LIMIT", raw)]),
            "polling.total_limit",
        );
        assert!(p.allowed.contains("integer in 1..=256"), "{raw}: {p}");
    }
}

#[test]
fn unknown_env_override_is_refused_naming_the_dotted_key() {
    let p = refused_with_env("", ("CARDWORKER__POLLING__BOGUS", "1"), "polling.bogus");
    assert_eq!(
        p.source,
        Source::Env("CARDWORKER__POLLING__BOGUS".to_owned()),
        "{p}"
    );
    assert!(
        p.to_string()
            .starts_with("polling.bogus = 1 (from env CARDWORKER__POLLING__BOGUS): unknown key"),
        "{p}"
    );
    let p = refused_with_env("", ("CARDWORKER__POLLING__", "1"), "CARDWORKER__POLLING__");
    assert_eq!(p.source, Source::Env("CARDWORKER__POLLING__".to_owned()));
}

#[test]
fn a_misspelled_override_is_refused_naming_it_and_the_closest_valid_variable() {
    let p = refused_with_env(
        "",
        ("CARDWORKER_POLLING__TOTAL_LIMIT", "abc"),
        "CARDWORKER_POLLING__TOTAL_LIMIT",
    );
    assert_eq!(
        p.source,
        Source::Env("CARDWORKER_POLLING__TOTAL_LIMIT".to_owned())
    );
    assert!(
        p.to_string().starts_with(
            "CARDWORKER_POLLING__TOTAL_LIMIT = \"abc\" (from env \
             CARDWORKER_POLLING__TOTAL_LIMIT): unknown variable; did you mean \
             CARDWORKER__POLLING__TOTAL_LIMIT?"
        ),
        "{p}"
    );
    let p = refused_with_env("", ("CARDWORKER_OPERATR", "ann"), "CARDWORKER_OPERATR");
    assert!(
        p.allowed.contains("did you mean CARDWORKER_OPERATOR?"),
        "{p}"
    );
}

#[test]
fn the_products_own_variables_and_the_harness_variables_are_not_overrides() {
    let c = from_str_env(
        "",
        &[
            ("CARDWORKER_OPERATOR", "ann"),
            ("CARDWORKER_POD_NAME", "pod-1"),
            ("CARDWORKER_REQUIRE_BROWSER", "1"),
            ("CARDWORKER_TEST_REDIS", "redis://127.0.0.1:6379/0"),
            ("CARDWORKER_BENCH_REDIS", "1"),
            ("CARDWORKERX", "not ours"),
        ],
    );
    assert!(c.is_ok(), "{c:?}");
}

#[test]
fn all_problems_are_reported_at_once() {
    let err = from_str(
        "[database]\nmax_connections = 0\n[polling]\ntotal_limit = \"abc\"\nbogus = 1\n\
         reconcile_cron = \"nope\"\n[polling.card_status]\nlimit = 300\n\
         [telemetry]\nlog_format = \"xml\"",
    )
    .expect_err("invalid");
    let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
    for key in [
        "database.max_connections",
        "polling.total_limit",
        "polling.bogus",
        "polling.reconcile_cron",
        "polling.card_status.limit",
        "telemetry.log_format",
    ] {
        assert!(keys.contains(&key), "{key} missing from {keys:?}");
    }
    let text = err.to_string();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some(format!("invalid configuration ({} problems):", keys.len()).as_str())
    );
    // Every other line is one problem, and each starts the same way.
    assert_eq!(lines.clone().count(), err.problems().len(), "{text}");
    assert!(lines.all(|l| l.starts_with("  - ")), "{text}");
    assert!(text.contains(
        "  - polling.total_limit = \"abc\" (from test.toml): must be an integer in 1..=256"
    ));
    assert_eq!(err.exit_status(), 2);
}

#[test]
fn file_path_comes_from_the_argument_or_the_env() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("c.toml");
    std::fs::write(&path, "[polling]\ntotal_limit = 5\n").expect("write");
    let c = Config::load_from(Some(&path), vec![]).expect("valid");
    assert_eq!(c.polling.total_limit, 5);
    let c = Config::load_from(
        None,
        env(&[(CONFIG_PATH_ENV, path.to_str().expect("utf-8 path"))]),
    )
    .expect("valid");
    assert_eq!(c.polling.total_limit, 5);
    assert_eq!(
        Config::load_from(None, vec![]).expect("valid"),
        Config::default()
    );
}

#[test]
fn unreadable_file_and_bad_syntax_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.toml");
    assert!(matches!(
        Config::load_from(Some(&missing), vec![]),
        Err(ConfigError::Read { .. })
    ));
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[polling\ntotal_limit = ").expect("write");
    let err = Config::load_from(Some(&bad), vec![]).expect_err("syntax");
    assert!(matches!(err, ConfigError::Syntax { .. }), "{err}");
    assert_eq!(err.exit_status(), 2);
}

#[test]
fn bundled_default_file_equals_the_built_in_defaults() {
    let c = Config::load_from(Some(&bundled("default.toml")), vec![]).expect("valid");
    assert_eq!(c, Config::default());
}

#[test]
fn bundled_local_file_is_valid() {
    let c = Config::load_from(Some(&bundled("local.toml")), vec![]).expect("valid");
    c.validate().expect("valid");
    assert_eq!(c.telemetry.log_format, LogFormat::Pretty);
    assert_eq!(c.polling.carddata.interval_secs, 10);
    assert_eq!(c.polling.card_status.interval_secs, 10);
    // The demo is busy on purpose: both tasks at their limit want more than the total, so
    // deferrals happen (README, "What you should see in the first two minutes").
    assert!(
        c.polling.total_limit < c.polling.carddata.limit.get() + c.polling.card_status.limit.get()
    );
    assert_eq!(c.telemetry.listen, "127.0.0.1:9464");
}

#[test]
fn bundled_production_file_is_valid() {
    let c = Config::load_from(Some(&bundled("production.toml")), vec![]).expect("valid");
    c.validate().expect("valid");
    assert!(!c.maintenance.enabled);
    assert_eq!(
        c.polling.total_limit, 4,
        "the rollout starts with conservative budgets"
    );
    // Credentials come from env, layered over the file.
    let c = Config::load_from(
        Some(&bundled("production.toml")),
        env(&[
            (
                "CARDWORKER__DATABASE__URL",
                "postgres://cw:pw@pg:5432/cw?sslmode=verify-full",
            ),
            ("CARDWORKER__REDIS__URL", "rediss://:pw@redis:6380/0"),
        ]),
    )
    .expect("valid");
    assert!(c.redis.url.expose().starts_with("rediss://"));
}

#[test]
fn an_unknown_key_in_the_file_names_the_file() {
    for (text, key) in [
        ("[polling]\nbogus = 1", "polling.bogus"),
        ("[polling.foo]\nlimit = 1", "polling.foo"),
        ("polling = 3", "polling"),
        ("[polling.total_limit]\nx = 1", "polling.total_limit"),
    ] {
        let p = problem_for(from_str(text), key);
        assert_eq!(p.source, file_source(), "{p}");
    }
}

#[test]
fn the_env_wins_over_the_file_and_is_named_as_the_source() {
    let p = refused_with_env(
        "[polling.carddata]\nlimit = 2",
        ("CARDWORKER__POLLING__CARDDATA__LIMIT", "300"),
        "polling.carddata.limit",
    );
    assert_eq!(p.value, "300");
    assert_eq!(
        p.source,
        Source::Env("CARDWORKER__POLLING__CARDDATA__LIMIT".to_owned())
    );
}

#[test]
fn a_key_set_only_by_the_defaults_is_named_as_default() {
    // The file sets other keys of [polling]; lease_ttl_secs keeps its default 60, which
    // the file's handler timeout of 58 makes too short.
    let p = refused(
        "[polling]\nhandler_timeout_secs = 58\ntotal_limit = 8",
        "polling.lease_ttl_secs",
    );
    assert_eq!(p.source, Source::Default);
    assert_eq!(p.related[0].source, file_source());
}

#[test]
fn a_file_is_named_by_the_path_as_given() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("given.toml");
    std::fs::write(&path, "polling.total_limit = 0\n").expect("write");
    let p = problem_for(
        Config::load_from(Some(&path), vec![]),
        "polling.total_limit",
    );
    assert_eq!(p.source, Source::File(path.clone()));
    // The same when the path comes from CARDWORKER_CONFIG.
    let raw = path.to_str().expect("utf-8 path");
    let p = problem_for(
        Config::load_from(None, env(&[(CONFIG_PATH_ENV, raw)])),
        "polling.total_limit",
    );
    assert!(p.to_string().contains(&format!("(from {raw})")), "{p}");
}

#[test]
fn a_single_problem_is_reported_under_the_same_heading() {
    let err = from_str("polling.total_limit = 0").expect_err("invalid");
    assert_eq!(
        err.to_string(),
        "invalid configuration (1 problem):\n  - polling.total_limit = 0 (from test.toml): \
         must be an integer in 1..=256"
    );
}
