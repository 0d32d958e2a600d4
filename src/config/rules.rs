//! The value rules: one `Rule` per leaf key (`RULES`), checked on the merged TOML table so
//! that a value of the wrong type is refused naming its key (serde would stop at the first one);
//! and [`Config::validate`], which runs them and then the relations (see `relations`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::str::FromStr;

use toml::{Table, Value};
use url::Url;

use super::error::{ConfigError, Problem};
use super::secret::redact_url;
use super::source::{Source, Sources};
use super::types::TelemetryConfig;
use super::LIMIT_CEILING;

/// What a limit may be, as said in error messages.
pub(super) fn limit_allowed() -> String {
    format!("must be an integer in 1..={LIMIT_CEILING}")
}

/// Parses a polling limit written as plain decimal digits, in `1..=LIMIT_CEILING`.
///
/// Used for the config keys, the runtime override command (`budget set --limit N`) and when
/// reading overrides back from Redis. Refuses `0`, `-1`, `3.5`, `abc`, `inf`, `1e9`, `100000`
/// and the empty string with what is allowed (the caller names the key and the value given).
/// Surrounding whitespace is ignored.
pub fn parse_limit(raw: &str) -> Result<u32, String> {
    let refused = limit_allowed;
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
    /// A secret token accepted only from an env override (never from a file): empty (unset), or
    /// at least [`MIN_TOKEN_CHARS`] characters without whitespace.
    EnvOnlyToken,
}

/// The shortest admin token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

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
const PARKED_RETRY: Rule = int(1, 2_592_000);

/// Every leaf key of the configuration and how it is checked.
const RULES: &[(&str, Rule)] = &[
    ("database.url", Rule::Url(&["postgres", "postgresql"])),
    ("database.max_connections", int(1, 200)),
    ("redis.url", Rule::Url(&["redis", "rediss"])),
    ("redis.key_prefix", Rule::KeyPrefix),
    ("gateway.base_url", Rule::Url(&["http", "https"])),
    ("gateway.timeout_ms", int(100, 60_000)),
    ("worker.shutdown_grace_secs", int(1, 600)),
    ("worker.redis_outage_grace_secs", int(0, 3600)),
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
    ("polling.carddata.parked_retry_secs", PARKED_RETRY),
    ("polling.card_status.parked_retry_secs", PARKED_RETRY),
    ("polling.circuit.enabled", Rule::Bool),
    ("polling.circuit.window_calls", int(2, 10_000)),
    ("polling.circuit.window_secs", int(1, 3600)),
    (
        "polling.circuit.min_calls",
        int_note(1, 10_000, ", and at most polling.circuit.window_calls"),
    ),
    (
        "polling.circuit.min_failing_cards",
        int_note(1, 10_000, ", and at most polling.circuit.min_calls"),
    ),
    ("polling.circuit.failure_percent", int(1, 100)),
    ("polling.circuit.cooldown_secs", int(1, 3600)),
    (
        "polling.circuit.max_cooldown_secs",
        int_note(1, 3600, ", and at least polling.circuit.cooldown_secs"),
    ),
    ("polling.circuit.half_open_probes", int(1, 100)),
    ("payments.concurrency", int(1, 256)),
    ("payments.recovery_after_secs", int(10, 86_400)),
    ("payments.recovery_cron", Rule::Cron),
    ("approvals.concurrency", int(1, 256)),
    ("approvals.recovery_after_secs", int(10, 86_400)),
    ("approvals.review_query_secs", int(60, 86_400)),
    ("approvals.recovery_cron", Rule::Cron),
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
    ("telemetry.fleet_gauges_secs", int(1, 30)),
    ("telemetry.fleet_gauges_idle_secs", int(1, 3600)),
    ("console.listen", Rule::SocketAddr),
    ("console.admin_token", Rule::EnvOnlyToken),
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
            Rule::EnvOnlyToken => format!(
                "must be empty (read-only) or at least {MIN_TOKEN_CHARS} characters without \
                 whitespace, and must come from env CARDWORKER__CONSOLE__ADMIN_TOKEN (or a \
                 Secret mounted through it), never from a config file"
            ),
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
            (Rule::EnvOnlyToken, Value::String(s))
                if s.is_empty()
                    || (s.chars().count() >= MIN_TOKEN_CHARS
                        && !s.chars().any(char::is_whitespace)) =>
            {
                Ok(())
            }
            _ => Err(None),
        }
    }
}

/// Every key of the configuration, dotted (`polling.total_limit`).
pub(super) fn keys() -> impl Iterator<Item = &'static str> {
    RULES.iter().map(|(k, _)| *k)
}

pub(super) fn rule_for(key: &str) -> Option<Rule> {
    RULES.iter().find(|(k, _)| *k == key).map(|(_, r)| *r)
}

/// Checks every leaf of `root` against [`RULES`]; returns the problems (each naming where its
/// value came from, per `sources`) and the refused keys.
pub(super) fn check_values(
    root: &Table,
    sources: &Sources,
) -> (Vec<Problem>, BTreeSet<&'static str>) {
    let mut problems = Vec::new();
    let mut bad = BTreeSet::new();
    for (key, rule) in RULES {
        let Some(v) = lookup(root, key) else {
            problems.push(Problem::new(
                *key,
                "(missing)",
                sources.of(key),
                rule.allowed(),
            ));
            bad.insert(*key);
            continue;
        };
        // An empty token in a file sets nothing (`check-config` renders it so); any other is
        // refused there.
        let secret_in_file = matches!(rule, Rule::EnvOnlyToken)
            && matches!(sources.of(key), Source::File(_))
            && v.as_str() != Some("");
        if secret_in_file {
            problems.push(Problem::new(
                *key,
                show(key, v),
                sources.of(key),
                format!(
                    "{} (a secret in a config file ends up in a ConfigMap or a repository; \
                     set env CARDWORKER__CONSOLE__ADMIN_TOKEN instead)",
                    rule.allowed()
                ),
            ));
            bad.insert(*key);
            continue;
        }
        if let Err(detail) = rule.check(v) {
            let mut allowed = rule.allowed();
            if let Some(detail) = detail {
                allowed.push_str(&format!(" ({})", one_line(&detail)));
            }
            problems.push(Problem::new(*key, show(key, v), sources.of(key), allowed));
            bad.insert(*key);
        }
    }
    (problems, bad)
}

pub(super) fn join_key(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_owned()
    } else {
        format!("{prefix}.{k}")
    }
}

pub(super) fn lookup<'a>(root: &'a Table, key: &str) -> Option<&'a Value> {
    let mut parts = key.split('.');
    let mut v = root.get(parts.next()?)?;
    for part in parts {
        v = v.as_table()?.get(part)?;
    }
    Some(v)
}

impl TelemetryConfig {
    /// `listen` as a [`SocketAddr`] (validated at load time).
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            // Loading has checked the address, so only a config built in code gets here.
            ConfigError::Invalid(vec![Problem::new(
                "telemetry.listen",
                show_str(&self.listen),
                Source::Code,
                Rule::SocketAddr.allowed(),
            )])
        })
    }
}

/// Shows a value as given (TOML notation), with URL passwords redacted.
pub(super) fn show(key: &str, v: &Value) -> String {
    match v {
        Value::String(s) if matches!(rule_for(key), Some(Rule::Url(_))) => show_str(&redact_url(s)),
        Value::String(s) if is_secret_key(key) => show_str("***"),
        Value::Table(_) => "(a section)".to_owned(),
        Value::String(s) => show_str(s),
        other => {
            let text = one_line(&other.to_string());
            if is_secret_key(key) {
                "***".to_owned()
            } else if text.chars().count() > 120 {
                let cut: String = text.chars().take(117).collect();
                format!("{cut}...")
            } else {
                text
            }
        }
    }
}

/// Collapses a multi-line message (e.g. a parser's) so that a problem stays on one line.
pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A string in quotes, escaped so that it stays on one line.
pub(super) fn show_str(s: &str) -> String {
    format!("{s:?}")
}

/// An unknown key whose value should not be echoed.
fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "token"]
        .iter()
        .any(|w| k.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::types::Config;

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
}
