//! The vocabulary of the value rules: what a key may hold ([`Rule`], written beside each field in
//! `types`), checked on the merged TOML table so that a value of the wrong type is refused naming
//! its key (serde would stop at the first one); and how a refused value is shown.

use std::net::SocketAddr;
use std::str::FromStr;

use toml::{Table, Value};
use url::Url;

use super::limit::{Limit, LimitError};
use super::secret::redact_url;

/// What a limit may be, as said in error messages.
pub(super) fn limit_allowed() -> String {
    LimitError::Refused.to_string()
}

/// How one leaf key is checked on the merged table.
#[derive(Debug, Clone, Copy)]
pub(super) enum Rule {
    /// A polling [`Limit`]; `note` adds the relations checked later.
    Limit {
        note: &'static str,
    },
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
    /// A section, with the rules of its own keys (named relative to it).
    Section(&'static [(&'static str, Rule)]),
}

/// The shortest admin token accepted.
pub const MIN_TOKEN_CHARS: usize = 16;

/// An integer in `lo..=hi`.
pub(super) const fn int(lo: i64, hi: i64) -> Rule {
    Rule::Int { lo, hi, note: "" }
}

/// An integer in `lo..=hi`; `note` names the relations checked later.
pub(super) const fn int_note(lo: i64, hi: i64, note: &'static str) -> Rule {
    Rule::Int { lo, hi, note }
}

impl Rule {
    /// What is allowed, for the error message.
    pub(super) fn allowed(self) -> String {
        match self {
            Rule::Limit { note } => format!("{}{note}", limit_allowed()),
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
            Rule::Section(_) => "must be a section".to_owned(),
        }
    }

    /// `Ok` when `v` satisfies the rule, else an optional detail for the message.
    pub(super) fn check(self, v: &Value) -> Result<(), Option<String>> {
        match (self, v) {
            (Rule::Limit { .. }, Value::Integer(i)) if Limit::try_from(*i).is_ok() => Ok(()),
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

/// Shows a value as given (TOML notation), with URL passwords redacted.
pub(super) fn show(rule: Option<Rule>, key: &str, v: &Value) -> String {
    match v {
        Value::String(s) if matches!(rule, Some(Rule::Url(_))) => show_str(&redact_url(s)),
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
