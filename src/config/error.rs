//! How a refused configuration is reported: [`ConfigError`], one [`Problem`] per refused key,
//! and how a refused value is shown (TOML notation, one line, secrets redacted).

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

use super::source::Source;

/// One thing wrong with the configuration, shown on one line as
/// `polling.total_limit = "abc" (from env CARDWORKER__POLLING__TOTAL_LIMIT): must be an integer
/// in 1..=256`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Dotted key, e.g. `polling.total_limit`.
    pub key: String,
    /// The value as given (TOML notation; secrets redacted).
    pub value: String,
    /// Where the value came from: the layer to fix.
    pub source: Source,
    /// What is allowed, e.g. `must be an integer in 1..=256`.
    pub allowed: String,
    /// For a relation between keys, the other keys it was checked against, each with its value
    /// and source: either side may be the one to change.
    pub related: Vec<Related>,
}

/// Another key a relation [`Problem`] depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Related {
    /// Dotted key, e.g. `gateway.timeout_ms`.
    pub key: String,
    /// Its value (TOML notation).
    pub value: String,
    /// Where that value came from.
    pub source: Source,
}

impl Problem {
    /// A problem with one key and no related keys.
    pub(super) fn new(
        key: impl Into<String>,
        value: impl Into<String>,
        source: Source,
        allowed: impl Into<String>,
    ) -> Self {
        Self {
            key: key.into(),
            value: value.into(),
            source,
            allowed: allowed.into(),
            related: Vec::new(),
        }
    }

    /// Adds a key the relation was checked against.
    pub(super) fn checked_against(
        mut self,
        key: impl Into<String>,
        value: impl fmt::Display,
        source: Source,
    ) -> Self {
        self.related.push(Related {
            key: key.into(),
            value: value.to_string(),
            source,
        });
        self
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} = {} (from {}): {}",
            self.key, self.value, self.source, self.allowed
        )?;
        for (i, r) in self.related.iter().enumerate() {
            let sep = if i == 0 { "; checked against" } else { "," };
            write!(f, "{sep} {} = {} (from {})", r.key, r.value, r.source)?;
        }
        Ok(())
    }
}

/// Why the configuration could not be loaded. Every variant means exit status 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid TOML.
    #[error("config file {} is not valid TOML: {source}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's error (with line and column).
        #[source]
        source: Box<toml::de::Error>,
    },
    /// One or more keys are unknown, mistyped or out of range: a heading, then one problem per
    /// line, each starting with `  - `.
    #[error("{}", display_problems(.0))]
    Invalid(Vec<Problem>),
    /// The configuration could not be rendered as TOML (not expected to happen).
    #[error("cannot render the configuration as TOML: {0}")]
    Render(#[from] toml::ser::Error),
}

impl ConfigError {
    /// The process exit status for this error: always 2 (invalid configuration or usage).
    pub const fn exit_status(&self) -> i32 {
        2
    }

    /// The problems of an [`ConfigError::Invalid`], else an empty slice.
    pub fn problems(&self) -> &[Problem] {
        match self {
            ConfigError::Invalid(problems) => problems,
            _ => &[],
        }
    }
}

/// What starts every problem line of [`ConfigError::Invalid`], so that each one stands out (and
/// can be grepped) under the `error: ...` line the binary prints first.
pub(super) const PROBLEM_PREFIX: &str = "  - ";

fn display_problems(problems: &[Problem]) -> String {
    let count = match problems.len() {
        1 => "1 problem".to_owned(),
        n => format!("{n} problems"),
    };
    let mut out = format!("invalid configuration ({count}):");
    for p in problems {
        out.push('\n');
        out.push_str(PROBLEM_PREFIX);
        out.push_str(&p.to_string());
    }
    out
}
