//! What a key may hold: a [`Rule`] per key (written beside each field in `types`), checked on the
//! merged TOML table so that a value of the wrong type is refused naming its key; the
//! [`RELATIONS`] between keys; and how a refused value is shown.

use std::net::SocketAddr;
use std::str::FromStr;

use toml::{Table, Value};
use url::Url;

use crate::limit::{Limit, LimitError};
use crate::secret::redact_url;
use Bound::{AboveMsPlusOneSecond, AtLeast, AtMost};

/// How one leaf key is checked on the merged table.
#[derive(Debug, Clone, Copy)]
pub(super) enum Rule {
    /// A polling [`Limit`].
    Limit,
    /// An integer in `lo..=hi`.
    Int(i64, i64),
    Bool,
    Url(&'static [&'static str]),
    Cron,
    KeyPrefix,
    SocketAddr,
    LogFormat,
    /// A secret token accepted only from an env override (never from a file): empty (unset), or
    /// at least [`MIN_TOKEN_CHARS`] characters without whitespace.
    EnvOnlyToken,
    /// A section, with the rules of its own keys (named relative to it).
    Section(&'static [(&'static str, Rule)]),
}

/// The shortest admin token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

impl Rule {
    /// What is allowed, for the error message.
    pub(super) fn allowed(self) -> String {
        let text = match self {
            Rule::Limit => return LimitError::Refused.to_string(),
            Rule::Int(lo, hi) => return format!("must be an integer in {lo}..={hi}"),
            Rule::Url(schemes) => {
                return format!("must be a URL with scheme {}", schemes.join(" or "))
            }
            Rule::EnvOnlyToken => {
                return format!(
                    "must be empty (read-only) or at least {MIN_TOKEN_CHARS} characters without \
                     whitespace, and must come from env CARDWORKER__CONSOLE__ADMIN_TOKEN (or a \
                     Secret mounted through it), never from a config file"
                )
            }
            Rule::Bool => "must be true or false",
            Rule::Cron => {
                "must be a cron expression with six or seven fields, seconds first \
                           (e.g. \"0 */10 * * * *\")"
            }
            Rule::KeyPrefix => {
                "must be non-empty and use only A-Z a-z 0-9 _ . - \
                                (no braces, colons or spaces)"
            }
            Rule::SocketAddr => "must be a socket address such as \"0.0.0.0:9464\"",
            Rule::LogFormat => "must be \"json\" or \"pretty\"",
            Rule::Section(_) => "must be a section",
        };
        text.to_owned()
    }

    /// `Ok` when `v` satisfies the rule, else an optional detail for the message.
    pub(super) fn check(self, v: &Value) -> Result<(), Option<String>> {
        let ok = match (self, v) {
            (Rule::Limit, Value::Integer(i)) => Limit::try_from(*i).is_ok(),
            (Rule::Int(lo, hi), Value::Integer(i)) => (lo..=hi).contains(i),
            (Rule::Bool, Value::Boolean(_)) => true,
            (Rule::Url(schemes), Value::String(s)) => {
                let u = Url::parse(s).map_err(|e| Some(e.to_string()))?;
                return match schemes.contains(&u.scheme()) {
                    true => Ok(()),
                    false => Err(Some(format!("scheme is {:?}", u.scheme()))),
                };
            }
            (Rule::Cron, Value::String(s)) => {
                return cron::Schedule::from_str(s)
                    .map(drop)
                    .map_err(|e| Some(e.to_string()))
            }
            (Rule::KeyPrefix, Value::String(s)) => {
                let allowed = |b: u8| b.is_ascii_alphanumeric() || b"_.-".contains(&b);
                !s.is_empty() && s.bytes().all(allowed)
            }
            (Rule::SocketAddr, Value::String(s)) => s.parse::<SocketAddr>().is_ok(),
            (Rule::LogFormat, Value::String(s)) => s == "json" || s == "pretty",
            (Rule::EnvOnlyToken, Value::String(s)) => {
                s.is_empty()
                    || (s.chars().count() >= MIN_TOKEN_CHARS && !s.contains(char::is_whitespace))
            }
            _ => false,
        };
        ok.then_some(()).ok_or(None)
    }
}

/// The bound a relation puts on a key, given the value `o` of the other key: what keeps a token
/// lease from expiring under a running poll, a budget from promising more than the total, or a
/// circuit from being unable to open.
#[derive(Debug, Clone, Copy)]
pub(super) enum Bound {
    /// At most `o`; the text says why.
    AtMost(&'static str),
    /// At least `o` plus this.
    AtLeast(u64),
    /// Seconds greater than `o` milliseconds plus one second.
    AboveMsPlusOneSecond,
}

/// Every relation, `(key, bound, other key)`, in the order its problems are reported. It is
/// checked once both keys have passed their own rule.
pub(super) const RELATIONS: &[(&str, Bound, &str)] = &[
    ("polling.carddata.limit", AtMost(""), "polling.total_limit"),
    (
        "polling.card_status.limit",
        AtMost(""),
        "polling.total_limit",
    ),
    (
        "polling.handler_timeout_secs",
        AboveMsPlusOneSecond,
        "gateway.timeout_ms",
    ),
    (
        "polling.lease_ttl_secs",
        AtLeast(5),
        "polling.handler_timeout_secs",
    ),
    (
        "polling.defer_max_delay_secs",
        AtLeast(0),
        "polling.defer_delay_secs",
    ),
    (
        "polling.circuit.max_cooldown_secs",
        AtLeast(0),
        "polling.circuit.cooldown_secs",
    ),
    (
        "polling.circuit.min_calls",
        AtMost(NEVER_OPENS),
        "polling.circuit.window_calls",
    ),
    (
        "polling.circuit.min_failing_cards",
        AtMost(""),
        "polling.circuit.min_calls",
    ),
];

const NEVER_OPENS: &str = ": the window could never hold enough calls to open the circuit";

impl Bound {
    /// What the key's own rule adds to its message, naming the relation with `other`.
    pub(super) fn note(self, other: &str) -> String {
        match self {
            AtMost(_) => format!(", and at most {other}"),
            AtLeast(0) => format!(", and at least {other}"),
            AtLeast(plus) => format!(", and at least {other} + {plus}"),
            AboveMsPlusOneSecond => format!(", and greater than ({other} + 1000 ms) in seconds"),
        }
    }

    /// What is allowed when `value`, a key checked by `rule`, breaks the relation with
    /// `other = o`; `None` when it holds.
    pub(super) fn refuses(self, value: u64, rule: Rule, other: &str, o: u64) -> Option<String> {
        let hi = if let Rule::Int(_, hi) = rule { hi } else { 0 };
        let least = match self {
            AtMost(_) if value <= o => return None,
            AtMost(why) if matches!(rule, Rule::Limit) => {
                return Some(format!(
                    "{}, and at most {other} ({o}){why}",
                    rule.allowed()
                ))
            }
            AtMost(why) => return Some(format!("must be at most {other} ({o}){why}")),
            AtLeast(plus) => o.saturating_add(plus),
            AboveMsPlusOneSecond => o.saturating_add(1000) / 1000 + 1,
        };
        (value < least).then(|| match self {
            AtLeast(0) => format!("must be at least {other} ({o}) and at most {hi}"),
            AtLeast(plus) => {
                format!(
                    "must be at least {other} + {plus} ({o} + {plus} = {least}) and at most {hi}"
                )
            }
            _ => format!(
                "must be greater than {other} + 1 s ({o} ms + 1000 ms), i.e. at least {least}"
            ),
        })
    }
}

pub(super) fn join_key(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_owned()
    } else {
        format!("{prefix}.{k}")
    }
}

pub(super) fn lookup<'a>(root: &'a Table, key: &str) -> Option<&'a Value> {
    let (section, leaf) = key.rsplit_once('.').unwrap_or(("", key));
    let mut parts = section.split('.').filter(|s| !s.is_empty());
    parts
        .try_fold(root, |t, part| t.get(part)?.as_table())?
        .get(leaf)
}

/// Shows a value as given (TOML notation, one line), with URL passwords redacted and the value
/// of an unknown secret-looking key hidden.
pub(super) fn show(rule: Option<Rule>, key: &str, v: &Value) -> String {
    let k = key.to_ascii_lowercase();
    let secret = ["password", "secret", "token"]
        .iter()
        .any(|w| k.contains(w));
    match v {
        Value::String(s) if matches!(rule, Some(Rule::Url(_))) => show_str(&redact_url(s)),
        Value::String(_) if secret => show_str("***"),
        Value::Table(_) => "(a section)".to_owned(),
        Value::String(s) => show_str(s),
        _ if secret => "***".to_owned(),
        other => {
            let text = one_line(&other.to_string());
            match text.chars().count() > 120 {
                true => format!("{}...", text.chars().take(117).collect::<String>()),
                false => text,
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
