//! The value rules (one per key) and the relations between keys, through the library: each
//! refused value names its key, the value given and its source, and for a relation the other
//! key and its source too.

use cardworker::config::{Config, Problem, Source};

use cardworker::limit::{Limit, LIMIT_CEILING};

use crate::config_support::{
    bundled, env_source, file_source, from_str, from_str_env, problem_for, problems, refused,
    refused_as, refused_with_env,
};

/// The problem of `polling.total_limit = value`, which names the value as given and the range.
fn total_limit_refused(value: &str) -> Problem {
    let p = refused(
        &format!("polling.total_limit = {value}"),
        "polling.total_limit",
    );
    assert_eq!(p.value, value);
    assert!(p.allowed.contains("integer in 1..=256"), "{p}");
    p
}

#[test]
fn total_limit_of_zero_is_refused_naming_the_key() {
    let p = refused("[polling]\ntotal_limit = 0", "polling.total_limit");
    assert_eq!(
        p.to_string(),
        "polling.total_limit = 0 (from test.toml): must be an integer in 1..=256"
    );
}

#[test]
fn negative_total_limit_is_refused_naming_the_key() {
    total_limit_refused("-1");
}

#[test]
fn fractional_total_limit_is_refused_naming_the_key() {
    total_limit_refused("3.5");
}

#[test]
fn non_numeric_total_limit_is_refused_naming_the_key() {
    total_limit_refused("\"abc\"");
}

#[test]
fn total_limit_above_the_ceiling_is_refused_naming_the_key() {
    let p = total_limit_refused("100000");
    assert_eq!(
        p.to_string(),
        "polling.total_limit = 100000 (from test.toml): must be an integer in 1..=256"
    );
}

#[test]
fn infinite_total_limit_is_refused_naming_the_key() {
    total_limit_refused("inf");
}

#[test]
fn total_limit_at_the_ceiling_is_accepted() {
    let c = from_str("polling.total_limit = 256").expect("valid");
    assert_eq!(c.polling.total_limit, LIMIT_CEILING);
}

#[test]
fn bad_cron_is_refused_naming_the_key() {
    refused_as(
        "polling.reconcile_cron = \"every ten minutes\"",
        "polling.reconcile_cron",
        "six or seven fields",
    );
    // Five fields (no seconds) is refused.
    refused(
        "maintenance.archive_cron = \"30 3 * * *\"",
        "maintenance.archive_cron",
    );
    from_str("payments.recovery_cron = \"*/30 * * * * *\"").expect("valid");
}

#[test]
fn urls_need_the_right_scheme() {
    let all = problems(from_str(
        "database.url = \"mysql://db/x\"\nredis.url = \"http://r\"\ngateway.base_url = \"ftp://g\"",
    ));
    let keys: Vec<&str> = all.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["database.url", "redis.url", "gateway.base_url"]);
    from_str(
        "database.url = \"postgresql://u:p@db/x\"\nredis.url = \"rediss://:p@r:6380/1\"\n\
         gateway.base_url = \"https://g.example\"",
    )
    .expect("valid");
}

#[test]
fn a_refused_database_url_does_not_echo_its_password() {
    let p = refused("database.url = \"mysql://u:hunter2@db/x\"", "database.url");
    assert!(!p.value.contains("hunter2"), "{p}");
}

#[test]
fn key_prefix_and_listen_are_checked() {
    let all = problems(from_str(
        "redis.key_prefix = \"{cw}:x\"\ntelemetry.listen = \"localhost\"",
    ));
    let keys: Vec<&str> = all.iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["redis.key_prefix", "telemetry.listen"]);
    refused("redis.key_prefix = \"\"", "redis.key_prefix");
    refused("telemetry.log_format = \"xml\"", "telemetry.log_format");
}

#[test]
fn the_console_admin_token_is_refused_from_a_file_and_accepted_from_the_env() {
    let p = refused(
        "[console]\nadmin_token = \"0123456789abcdef-secret\"",
        "console.admin_token",
    );
    assert_eq!(p.source, file_source());
    let text = p.to_string();
    assert!(!text.contains("0123456789abcdef-secret"), "{text}");
    assert!(
        text.contains("never from a config file")
            && text.contains("CARDWORKER__CONSOLE__ADMIN_TOKEN"),
        "{text}"
    );
    let c = from_str_env(
        "[console]\nlisten = \"127.0.0.1:9999\"",
        &[(
            "CARDWORKER__CONSOLE__ADMIN_TOKEN",
            "0123456789abcdef-secret",
        )],
    )
    .expect("a token from the env is accepted");
    assert_eq!(
        c.console.admin_token.expose(),
        Some("0123456789abcdef-secret")
    );
    assert!(!format!("{c:?}").contains("0123456789abcdef"));
    assert_eq!(Config::default().console.admin_token.expose(), None);
    let short = refused_with_env(
        "",
        ("CARDWORKER__CONSOLE__ADMIN_TOKEN", "short"),
        "console.admin_token",
    );
    assert_eq!(short.source, env_source("CARDWORKER__CONSOLE__ADMIN_TOKEN"));
    assert!(!short.to_string().contains("short\""), "{short}");
    refused("[console]\nlisten = \"localhost\"", "console.listen");
}

#[test]
fn a_limit_parses_only_from_plain_integers_in_range() {
    for (raw, want) in [
        ("1", 1),
        ("8", 8),
        ("256", 256),
        (" 4 ", 4),
        ("\t3\n", 3),
        ("007", 7),
    ] {
        assert_eq!(raw.parse::<Limit>().map(Limit::get), Ok(want), "{raw}");
    }
    for raw in [
        "0",
        "-1",
        "+1",
        "3.5",
        "abc",
        "inf",
        "NaN",
        "1e9",
        "257",
        "100000",
        "99999999999999999999",
        "",
        " ",
    ] {
        let err = raw.parse::<Limit>().expect_err(raw).to_string();
        assert!(
            err.contains("must be an integer in 1..=256"),
            "{raw}: {err}"
        );
    }
}

#[test]
fn a_value_from_the_file_names_the_file_as_its_source() {
    let p = refused("polling.total_limit = 0", "polling.total_limit");
    assert_eq!(p.source, file_source());
    assert!(p.to_string().contains("(from test.toml)"), "{p}");
}

#[test]
fn a_value_from_the_env_names_the_env_variable_as_its_source() {
    let p = refused_with_env(
        "polling.total_limit = 5",
        ("CARDWORKER__POLLING__TOTAL_LIMIT", "abc"),
        "polling.total_limit",
    );
    assert_eq!(
        p.to_string(),
        "polling.total_limit = \"abc\" (from env CARDWORKER__POLLING__TOTAL_LIMIT): \
         must be an integer in 1..=256"
    );
}

#[test]
fn a_nested_env_override_names_its_own_variable() {
    let p = refused_with_env(
        "",
        ("CARDWORKER__POLLING__CARDDATA__LIMIT", "0"),
        "polling.carddata.limit",
    );
    assert_eq!(p.source, env_source("CARDWORKER__POLLING__CARDDATA__LIMIT"));
}

#[test]
fn a_config_built_in_code_names_code_as_the_source() {
    let mut c = Config::default();
    c.polling.defer_delay_secs = 0;
    c.polling.lease_ttl_secs = 16;
    let err = c.validate().expect_err("invalid");
    let sources: Vec<&Source> = err.problems().iter().map(|p| &p.source).collect();
    assert_eq!(sources, [&Source::Code, &Source::Code], "{err}");
    assert!(err.to_string().contains("(from code)"), "{err}");
    let mut c = Config::default();
    c.telemetry.listen = "nowhere".to_owned();
    let err = c.validate().expect_err("invalid");
    assert_eq!(err.problems()[0].key, "telemetry.listen");
    assert_eq!(err.problems()[0].source, Source::Code);
}

#[test]
fn task_limit_above_the_total_is_refused() {
    let text = "[polling]\ntotal_limit = 3\n[polling.carddata]\nlimit = 4";
    let allowed = "at most polling.total_limit (3)";
    let p = refused_as(text, "polling.carddata.limit", allowed);
    assert_eq!(p.value, "4");
    // card_status keeps its default 4, also above 3.
    let all = problems(from_str("polling.total_limit = 3"));
    assert_eq!(all.len(), 2, "{all:?}");
}

#[test]
fn handler_timeout_must_exceed_gateway_timeout_plus_one_second() {
    // 5000 ms + 1 s = 6 s: 6 is refused, 7 accepted.
    refused_as(
        "polling.handler_timeout_secs = 6\npolling.lease_ttl_secs = 60",
        "polling.handler_timeout_secs",
        "at least 7",
    );
    from_str("polling.handler_timeout_secs = 7").expect("valid");
    // Raising the gateway timeout above the handler timeout is refused too.
    refused_as(
        "gateway.timeout_ms = 15000",
        "polling.handler_timeout_secs",
        "15000 ms",
    );
}

#[test]
fn lease_ttl_must_cover_handler_timeout_plus_five_seconds() {
    refused_as(
        "polling.handler_timeout_secs = 15\npolling.lease_ttl_secs = 19",
        "polling.lease_ttl_secs",
        "15 + 5 = 20",
    );
    from_str("polling.handler_timeout_secs = 15\npolling.lease_ttl_secs = 20").expect("valid");
    refused("polling.lease_ttl_secs = 3601", "polling.lease_ttl_secs");
}

#[test]
fn circuit_min_calls_above_the_window_is_refused_naming_both_keys() {
    let p = refused_as(
        "[polling.circuit]\nwindow_calls = 10\nmin_calls = 11",
        "polling.circuit.min_calls",
        "at most polling.circuit.window_calls (10)",
    );
    assert_eq!(p.value, "11");
    assert_eq!(p.related[0].key, "polling.circuit.window_calls");
    from_str("[polling.circuit]\nwindow_calls = 10\nmin_calls = 10").expect("valid");
    refused_as(
        "[polling.circuit]\nmin_calls = 4\nmin_failing_cards = 5",
        "polling.circuit.min_failing_cards",
        "at most polling.circuit.min_calls (4)",
    );
}

#[test]
fn circuit_max_cooldown_below_the_cooldown_is_refused() {
    refused_as(
        "polling.circuit.cooldown_secs = 30\npolling.circuit.max_cooldown_secs = 20",
        "polling.circuit.max_cooldown_secs",
        "at least polling.circuit.cooldown_secs (30)",
    );
    from_str("polling.circuit.cooldown_secs = 30\npolling.circuit.max_cooldown_secs = 30")
        .expect("valid");
}

#[test]
fn circuit_and_parked_retry_keys_are_range_checked_naming_the_key() {
    for (text, key) in [
        (
            "polling.circuit.window_calls = 1",
            "polling.circuit.window_calls",
        ),
        (
            "polling.circuit.window_secs = 0",
            "polling.circuit.window_secs",
        ),
        ("polling.circuit.min_calls = 0", "polling.circuit.min_calls"),
        (
            "polling.circuit.min_failing_cards = 0",
            "polling.circuit.min_failing_cards",
        ),
        (
            "polling.circuit.failure_percent = 101",
            "polling.circuit.failure_percent",
        ),
        (
            "polling.circuit.failure_percent = 0",
            "polling.circuit.failure_percent",
        ),
        (
            "polling.circuit.cooldown_secs = 0",
            "polling.circuit.cooldown_secs",
        ),
        (
            "polling.circuit.max_cooldown_secs = 3601",
            "polling.circuit.max_cooldown_secs",
        ),
        (
            "polling.circuit.half_open_probes = 0",
            "polling.circuit.half_open_probes",
        ),
        (
            "polling.circuit.enabled = \"yes\"",
            "polling.circuit.enabled",
        ),
        (
            "polling.carddata.parked_retry_secs = 0",
            "polling.carddata.parked_retry_secs",
        ),
        (
            "polling.card_status.parked_retry_secs = 2592001",
            "polling.card_status.parked_retry_secs",
        ),
        ("polling.circuit.nope = 1", "polling.circuit.nope"),
    ] {
        let p = problem_for(from_str(text), key);
        assert!(p.to_string().starts_with(key), "{text}: {p}");
    }
    let c = from_str(
        "polling.carddata.parked_retry_secs = 1\n[polling.circuit]\nenabled = false\n\
         failure_percent = 100\nhalf_open_probes = 100",
    )
    .expect("valid");
    assert_eq!(c.polling.carddata.parked_retry_secs, 1);
    assert!(!c.polling.circuit.enabled);
}

#[test]
fn defer_max_delay_below_defer_delay_is_refused() {
    refused(
        "polling.defer_delay_secs = 10\npolling.defer_max_delay_secs = 5",
        "polling.defer_max_delay_secs",
    );
}

#[test]
fn a_relation_names_the_source_of_both_keys() {
    // The handler timeout comes from the file, the gateway timeout from the env.
    let p = refused_with_env(
        "polling.handler_timeout_secs = 10",
        ("CARDWORKER__GATEWAY__TIMEOUT_MS", "20000"),
        "polling.handler_timeout_secs",
    );
    assert_eq!(p.source, file_source());
    assert_eq!(p.related.len(), 1, "{p}");
    assert_eq!(p.related[0].key, "gateway.timeout_ms");
    assert_eq!(p.related[0].value, "20000");
    assert_eq!(
        p.related[0].source,
        env_source("CARDWORKER__GATEWAY__TIMEOUT_MS")
    );
    let text = p.to_string();
    assert!(
        text.starts_with("polling.handler_timeout_secs = 10 (from test.toml): "),
        "{text}"
    );
    assert!(
        text.ends_with(
            "; checked against gateway.timeout_ms = 20000 \
             (from env CARDWORKER__GATEWAY__TIMEOUT_MS)"
        ),
        "{text}"
    );
}

#[test]
fn a_default_that_conflicts_with_a_file_value_names_both_sources() {
    // card_status keeps its default limit 4, above the file's total_limit 3.
    let p = problem_for(
        from_str(
            "polling.total_limit = 3
polling.carddata.limit = 2",
        ),
        "polling.card_status.limit",
    );
    assert_eq!(p.source, Source::Default);
    assert_eq!(p.related[0].key, "polling.total_limit");
    assert_eq!(p.related[0].source, file_source());
    assert!(
        p.to_string()
            .starts_with("polling.card_status.limit = 4 (from default): "),
        "{p}"
    );
    for (key, other) in [
        ("polling.lease_ttl_secs", "polling.handler_timeout_secs"),
        ("polling.defer_max_delay_secs", "polling.defer_delay_secs"),
    ] {
        let p = problem_for(
            from_str("polling.handler_timeout_secs = 60\npolling.defer_delay_secs = 40"),
            key,
        );
        assert_eq!(p.source, Source::Default, "{p}");
        assert_eq!(p.related[0].key, other, "{p}");
        assert_eq!(p.related[0].source, file_source(), "{p}");
    }
}

/// Every key of `config/default.toml`, dotted, with its value and its comment there (the comment
/// lines under it included).
fn documented_keys() -> Vec<(String, toml::Value, String)> {
    let text = std::fs::read_to_string(bundled("default.toml")).expect("default.toml");
    let values: toml::Table = toml::from_str(&text).expect("TOML");
    let (mut section, mut out) = (String::new(), Vec::<(String, toml::Value, String)>::new());
    for line in text.lines() {
        let (code, comment) = line.split_once('#').unwrap_or((line, ""));
        if let Some(name) = code.trim().strip_prefix('[') {
            section = name.trim_end_matches(']').to_owned();
        } else if let Some((key, _)) = code.split_once(" = ") {
            let key = format!("{section}.{}", key.trim());
            let value = section
                .split('.')
                .try_fold(&values, |t, s| t.get(s)?.as_table())
                .and_then(|t| t.get(key.rsplit('.').next()?))
                .expect("a value")
                .clone();
            out.push((key, value, comment.to_owned()));
        } else if let Some(last) = out.last_mut().filter(|_| code.trim().is_empty()) {
            last.2.push_str(comment);
        }
    }
    out
}

#[test]
fn every_key_refuses_a_wrong_value_naming_itself_and_its_source_and_default_toml_names_its_range() {
    let keys = documented_keys();
    let mut leaves = Vec::new();
    fn flatten(prefix: &str, t: &toml::Table, out: &mut Vec<String>) {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v.as_table() {
                Some(t) => flatten(&key, t, out),
                None => out.push(key),
            }
        }
    }
    flatten(
        "",
        &toml::Table::try_from(Config::default()).expect("renders"),
        &mut leaves,
    );
    let mut documented: Vec<String> = keys.iter().map(|(k, ..)| k.clone()).collect();
    documented.sort();
    leaves.sort();
    assert_eq!(documented, leaves, "every key is in config/default.toml");
    for (key, value, comment) in keys {
        let (section, leaf) = key.rsplit_once('.').expect("in a section");
        let wrong = if value.is_str() { "[1]" } else { "\"x\"" };
        let p = problem_for(from_str(&format!("[{section}]\n{leaf} = {wrong}")), &key);
        assert_eq!(p.source, file_source(), "{p}");
        let var = format!("CARDWORKER__{}", key.to_uppercase().replace('.', "__"));
        let p = problem_for(from_str_env("", &[(var.as_str(), "[1]")]), &key);
        assert_eq!(p.source, env_source(&var), "{p}");
        if let Some(range) = p.allowed.strip_prefix("must be an integer in ") {
            let range = range.split(',').next().expect("a range");
            assert!(
                comment.contains(range),
                "default.toml names {key}'s range {range}: {comment}"
            );
        }
    }
}
