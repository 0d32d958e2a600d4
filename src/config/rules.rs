//! The value rules: one `Rule` per leaf key (`RULES`), checked on the merged TOML table so
//! that a value of the wrong type is refused naming its key (serde would stop at the first one),
//! then the relations between keys, checked on the deserialized [`Config`].

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::str::FromStr;

use toml::{Table, Value};
use url::Url;

use super::error::{one_line, show, ConfigError, Problem};
use super::load::lookup;
use super::types::{Config, Task};
use super::LIMIT_CEILING;

/// What a limit may be, as said in error messages.
fn limit_allowed() -> String {
    format!("must be an integer in 1..={LIMIT_CEILING}")
}

/// Parses a polling limit written as plain decimal digits, in `1..=LIMIT_CEILING`.
///
/// Used for the config keys, the runtime override command (`budget set --limit N`) and when
/// reading overrides back from Redis. Refuses `0`, `-1`, `3.5`, `abc`, `inf`, `1e9`, `100000`
/// and the empty string, with a message saying what is allowed. Surrounding whitespace is
/// ignored.
pub fn parse_limit(raw: &str) -> Result<u32, String> {
    let refused = || format!("limit {raw:?} is not allowed: {}", limit_allowed());
    let digits = raw.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refused());
    }
    match digits.parse::<u32>() {
        Ok(n) if (1..=LIMIT_CEILING).contains(&n) => Ok(n),
        _ => Err(refused()),
    }
}

/// How one leaf key is checked on the merged table.
#[derive(Debug, Clone, Copy)]
pub(super) enum Rule {
    /// An integer in `lo..=hi`; `note` adds the relations checked later.
    Int {
        lo: i64,
        hi: i64,
        note: &'static str,
    },
    Bool,
    Url(&'static [&'static str]),
    Cron,
    KeyPrefix,
    SocketAddr,
    LogFormat,
}

const fn int(lo: i64, hi: i64) -> Rule {
    Rule::Int { lo, hi, note: "" }
}

const fn int_note(lo: i64, hi: i64, note: &'static str) -> Rule {
    Rule::Int { lo, hi, note }
}

// `as` is a lossless widening here (u32 -> i64); `From` is not const.
const LIMIT_HI: i64 = LIMIT_CEILING as i64;
const TASK_LIMIT: Rule = int_note(1, LIMIT_HI, ", and at most polling.total_limit");
const INTERVAL: Rule = int(1, 86_400);
const MAX_FAILURES: Rule = int(1, 1000);

/// Every leaf key of the configuration and how it is checked.
const RULES: &[(&str, Rule)] = &[
    ("database.url", Rule::Url(&["postgres", "postgresql"])),
    ("database.max_connections", int(1, 200)),
    ("redis.url", Rule::Url(&["redis", "rediss"])),
    ("redis.key_prefix", Rule::KeyPrefix),
    ("gateway.base_url", Rule::Url(&["http", "https"])),
    ("gateway.timeout_ms", int(100, 60_000)),
    ("worker.shutdown_grace_secs", int(1, 600)),
    ("polling.total_limit", int(1, LIMIT_HI)),
    (
        "polling.handler_timeout_secs",
        int_note(
            1,
            3595,
            ", and greater than (gateway.timeout_ms + 1000 ms) in seconds",
        ),
    ),
    (
        "polling.lease_ttl_secs",
        int_note(6, 3600, ", and at least polling.handler_timeout_secs + 5"),
    ),
    ("polling.defer_delay_secs", int(1, 60)),
    (
        "polling.defer_max_delay_secs",
        int_note(1, 600, ", and at least polling.defer_delay_secs"),
    ),
    ("polling.reconcile_cron", Rule::Cron),
    ("polling.reconcile_batch", int(1, 100_000)),
    ("polling.carddata.limit", TASK_LIMIT),
    ("polling.carddata.interval_secs", INTERVAL),
    ("polling.carddata.max_consecutive_failures", MAX_FAILURES),
    ("polling.card_status.limit", TASK_LIMIT),
    ("polling.card_status.interval_secs", INTERVAL),
    ("polling.card_status.max_consecutive_failures", MAX_FAILURES),
    ("payments.concurrency", int(1, 256)),
    ("payments.recovery_after_secs", int(10, 86_400)),
    ("payments.recovery_cron", Rule::Cron),
    ("maintenance.enabled", Rule::Bool),
    ("maintenance.cleanup_enabled", Rule::Bool),
    ("maintenance.archive_cron", Rule::Cron),
    ("maintenance.retention_cron", Rule::Cron),
    ("maintenance.archive_after_days", int(1, 3650)),
    ("maintenance.retention_days", int(1, 36_500)),
    ("maintenance.batch_size", int(1, 100_000)),
    ("maintenance.statement_timeout_ms", int(100, 600_000)),
    ("telemetry.listen", Rule::SocketAddr),
    ("telemetry.log_format", Rule::LogFormat),
];

impl Rule {
    /// What is allowed, for the error message.
    pub(super) fn allowed(self) -> String {
        match self {
            Rule::Int { lo, hi, note } => format!("must be an integer in {lo}..={hi}{note}"),
            Rule::Bool => "must be true or false".to_owned(),
            Rule::Url(schemes) => format!("must be a URL with scheme {}", schemes.join(" or ")),
            Rule::Cron => "must be a cron expression with six or seven fields, seconds first \
                           (e.g. \"0 */10 * * * *\")"
                .to_owned(),
            Rule::KeyPrefix => "must be non-empty and use only A-Z a-z 0-9 _ . - \
                                (no braces, colons or spaces)"
                .to_owned(),
            Rule::SocketAddr => "must be a socket address such as \"0.0.0.0:9464\"".to_owned(),
            Rule::LogFormat => "must be \"json\" or \"pretty\"".to_owned(),
        }
    }

    /// `Ok` when `v` satisfies the rule, else an optional detail for the message.
    fn check(self, v: &Value) -> Result<(), Option<String>> {
        match (self, v) {
            (Rule::Int { lo, hi, .. }, Value::Integer(i)) if (lo..=hi).contains(i) => Ok(()),
            (Rule::Bool, Value::Boolean(_)) => Ok(()),
            (Rule::Url(schemes), Value::String(s)) => match Url::parse(s) {
                Ok(u) if schemes.contains(&u.scheme()) => Ok(()),
                Ok(u) => Err(Some(format!("scheme is {:?}", u.scheme()))),
                Err(e) => Err(Some(e.to_string())),
            },
            (Rule::Cron, Value::String(s)) => cron::Schedule::from_str(s)
                .map(|_| ())
                .map_err(|e| Some(e.to_string())),
            (Rule::KeyPrefix, Value::String(s))
                if !s.is_empty()
                    && s.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')) =>
            {
                Ok(())
            }
            (Rule::SocketAddr, Value::String(s)) if s.parse::<SocketAddr>().is_ok() => Ok(()),
            (Rule::LogFormat, Value::String(s)) if s == "json" || s == "pretty" => Ok(()),
            _ => Err(None),
        }
    }
}

pub(super) fn rule_for(key: &str) -> Option<Rule> {
    RULES.iter().find(|(k, _)| *k == key).map(|(_, r)| *r)
}

/// Checks every leaf of `root` against [`RULES`]; returns the problems and the refused keys.
pub(super) fn check_values(root: &Table) -> (Vec<Problem>, BTreeSet<&'static str>) {
    let mut problems = Vec::new();
    let mut bad = BTreeSet::new();
    for (key, rule) in RULES {
        let Some(v) = lookup(root, key) else {
            problems.push(Problem {
                key: (*key).to_owned(),
                value: "(missing)".to_owned(),
                allowed: rule.allowed(),
            });
            bad.insert(*key);
            continue;
        };
        if let Err(detail) = rule.check(v) {
            let mut allowed = rule.allowed();
            if let Some(detail) = detail {
                allowed.push_str(&format!(" ({})", one_line(&detail)));
            }
            problems.push(Problem {
                key: (*key).to_owned(),
                value: show(key, v),
                allowed,
            });
            bad.insert(*key);
        }
    }
    (problems, bad)
}

/// Checks the relations between keys; a key already refused is not checked again.
pub(super) fn check_relations(c: &Config, bad: &BTreeSet<&'static str>) -> Vec<Problem> {
    let ok = |keys: &[&str]| keys.iter().all(|k| !bad.contains(k));
    let mut problems = Vec::new();
    let p = &c.polling;

    for task in Task::ALL {
        let key = format!("polling.{}.limit", task.label());
        let limit = p.task(task).limit;
        if ok(&[key.as_str(), "polling.total_limit"]) && limit > p.total_limit {
            problems.push(Problem {
                value: limit.to_string(),
                allowed: format!(
                    "{}, and at most polling.total_limit ({})",
                    limit_allowed(),
                    p.total_limit
                ),
                key,
            });
        }
    }

    let gateway_plus_one = c.gateway.timeout_ms.saturating_add(1000);
    if ok(&["polling.handler_timeout_secs", "gateway.timeout_ms"])
        && p.handler_timeout_secs.saturating_mul(1000) <= gateway_plus_one
    {
        problems.push(Problem {
            key: "polling.handler_timeout_secs".to_owned(),
            value: p.handler_timeout_secs.to_string(),
            allowed: format!(
                "must be greater than gateway.timeout_ms + 1 s ({} ms + 1000 ms), i.e. at least {}",
                c.gateway.timeout_ms,
                gateway_plus_one / 1000 + 1
            ),
        });
    }

    let lease_min = p.handler_timeout_secs.saturating_add(5);
    if ok(&["polling.lease_ttl_secs", "polling.handler_timeout_secs"])
        && p.lease_ttl_secs < lease_min
    {
        problems.push(Problem {
            key: "polling.lease_ttl_secs".to_owned(),
            value: p.lease_ttl_secs.to_string(),
            allowed: format!(
                "must be at least polling.handler_timeout_secs + 5 ({} + 5 = {lease_min}) \
                 and at most 3600",
                p.handler_timeout_secs
            ),
        });
    }

    if ok(&["polling.defer_max_delay_secs", "polling.defer_delay_secs"])
        && p.defer_max_delay_secs < p.defer_delay_secs
    {
        problems.push(Problem {
            key: "polling.defer_max_delay_secs".to_owned(),
            value: p.defer_max_delay_secs.to_string(),
            allowed: format!(
                "must be at least polling.defer_delay_secs ({}) and at most 600",
                p.defer_delay_secs
            ),
        });
    }
    problems
}

impl Config {
    /// Validates a configuration built in code (loading already does this); reports every
    /// problem at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let table = Table::try_from(self)?;
        let (mut problems, bad) = check_values(&table);
        problems.extend(check_relations(self, &bad));
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load::join_key;
    use crate::config::test_support::{from_str, problem_for, problems};

    #[test]
    fn every_leaf_key_has_exactly_one_rule() {
        let table = Table::try_from(Config::default()).expect("serializes");
        fn leaves(prefix: &str, t: &Table, out: &mut Vec<String>) {
            for (k, v) in t {
                let key = join_key(prefix, k);
                match v {
                    Value::Table(t) => leaves(&key, t, out),
                    _ => out.push(key),
                }
            }
        }
        let mut keys = Vec::new();
        leaves("", &table, &mut keys);
        keys.sort();
        let mut ruled: Vec<String> = RULES.iter().map(|(k, _)| (*k).to_owned()).collect();
        ruled.sort();
        assert_eq!(keys, ruled);
    }

    #[test]
    fn total_limit_of_zero_is_refused_naming_the_key() {
        let p = problem_for(
            from_str("[polling]\ntotal_limit = 0"),
            "polling.total_limit",
        );
        assert_eq!(
            p.to_string(),
            "polling.total_limit = 0: must be an integer in 1..=256"
        );
    }

    #[test]
    fn negative_total_limit_is_refused_naming_the_key() {
        let p = problem_for(from_str("polling.total_limit = -1"), "polling.total_limit");
        assert_eq!(p.value, "-1");
        assert!(p.allowed.contains("1..=256"));
    }

    #[test]
    fn fractional_total_limit_is_refused_naming_the_key() {
        let p = problem_for(from_str("polling.total_limit = 3.5"), "polling.total_limit");
        assert_eq!(p.value, "3.5");
        assert!(p.allowed.contains("integer in 1..=256"));
    }

    #[test]
    fn non_numeric_total_limit_is_refused_naming_the_key() {
        let p = problem_for(
            from_str("polling.total_limit = \"abc\""),
            "polling.total_limit",
        );
        assert_eq!(p.value, "\"abc\"");
        assert!(p.allowed.contains("integer in 1..=256"));
    }

    #[test]
    fn total_limit_above_the_ceiling_is_refused_naming_the_key() {
        let p = problem_for(
            from_str("polling.total_limit = 100000"),
            "polling.total_limit",
        );
        assert_eq!(
            p.to_string(),
            "polling.total_limit = 100000: must be an integer in 1..=256"
        );
    }

    #[test]
    fn infinite_total_limit_is_refused_naming_the_key() {
        let p = problem_for(from_str("polling.total_limit = inf"), "polling.total_limit");
        assert_eq!(p.value, "inf");
        assert!(p.allowed.contains("integer in 1..=256"));
    }

    #[test]
    fn total_limit_at_the_ceiling_is_accepted() {
        let c = from_str("polling.total_limit = 256").expect("valid");
        assert_eq!(c.polling.total_limit, LIMIT_CEILING);
    }

    #[test]
    fn task_limit_above_the_total_is_refused() {
        let p = problem_for(
            from_str("[polling]\ntotal_limit = 3\n[polling.carddata]\nlimit = 4"),
            "polling.carddata.limit",
        );
        assert_eq!(p.value, "4");
        assert!(p.allowed.contains("at most polling.total_limit (3)"), "{p}");
        // card_status keeps its default 4, also above 3.
        let all = problems(from_str("polling.total_limit = 3"));
        assert_eq!(all.len(), 2, "{all:?}");
    }

    #[test]
    fn handler_timeout_must_exceed_gateway_timeout_plus_one_second() {
        // 5000 ms + 1 s = 6 s: 6 is refused, 7 accepted.
        let p = problem_for(
            from_str("polling.handler_timeout_secs = 6\npolling.lease_ttl_secs = 60"),
            "polling.handler_timeout_secs",
        );
        assert!(p.allowed.contains("at least 7"), "{p}");
        from_str("polling.handler_timeout_secs = 7").expect("valid");
        // Raising the gateway timeout above the handler timeout is refused too.
        let p = problem_for(
            from_str("gateway.timeout_ms = 15000"),
            "polling.handler_timeout_secs",
        );
        assert!(p.allowed.contains("15000 ms"), "{p}");
    }

    #[test]
    fn lease_ttl_must_cover_handler_timeout_plus_five_seconds() {
        let p = problem_for(
            from_str("polling.handler_timeout_secs = 15\npolling.lease_ttl_secs = 19"),
            "polling.lease_ttl_secs",
        );
        assert!(p.allowed.contains("15 + 5 = 20"), "{p}");
        from_str("polling.handler_timeout_secs = 15\npolling.lease_ttl_secs = 20").expect("valid");
        problem_for(
            from_str("polling.lease_ttl_secs = 3601"),
            "polling.lease_ttl_secs",
        );
    }

    #[test]
    fn defer_max_delay_below_defer_delay_is_refused() {
        problem_for(
            from_str("polling.defer_delay_secs = 10\npolling.defer_max_delay_secs = 5"),
            "polling.defer_max_delay_secs",
        );
    }

    #[test]
    fn bad_cron_is_refused_naming_the_key() {
        let p = problem_for(
            from_str("polling.reconcile_cron = \"every ten minutes\""),
            "polling.reconcile_cron",
        );
        assert!(p.allowed.contains("six or seven fields"), "{p}");
        // Five fields (no seconds) is refused.
        problem_for(
            from_str("maintenance.archive_cron = \"30 3 * * *\""),
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
        let p = problem_for(
            from_str("database.url = \"mysql://u:hunter2@db/x\""),
            "database.url",
        );
        assert!(!p.value.contains("hunter2"), "{p}");
    }

    #[test]
    fn key_prefix_and_listen_are_checked() {
        let all = problems(from_str(
            "redis.key_prefix = \"{cw}:x\"\ntelemetry.listen = \"localhost\"",
        ));
        let keys: Vec<&str> = all.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["redis.key_prefix", "telemetry.listen"]);
        problem_for(from_str("redis.key_prefix = \"\""), "redis.key_prefix");
        problem_for(
            from_str("telemetry.log_format = \"xml\""),
            "telemetry.log_format",
        );
    }

    #[test]
    fn parse_limit_accepts_only_plain_integers_in_range() {
        for (raw, want) in [("1", 1), ("8", 8), ("256", 256), (" 4 ", 4), ("007", 7)] {
            assert_eq!(parse_limit(raw), Ok(want), "{raw}");
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
            let err = parse_limit(raw).expect_err(raw);
            assert!(
                err.contains("must be an integer in 1..=256"),
                "{raw}: {err}"
            );
        }
    }
}
