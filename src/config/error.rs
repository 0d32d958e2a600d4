//! How a refused configuration is reported: [`ConfigError`], one [`Problem`] per refused key,
//! each naming the [`Source`] of its value.

use std::fmt;
use std::path::PathBuf;

use serde::{Serialize, Serializer};

/// The layer a value came from, as a [`Problem`] names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The built-in defaults: shown as `default`.
    Default,
    /// The config file, its path as given (`--config FILE` or env `CARDWORKER_CONFIG`): shown as
    /// that path, e.g. `config/local.toml`.
    File(PathBuf),
    /// An env override, by its name: shown as `env CARDWORKER__POLLING__TOTAL_LIMIT`.
    Env(String),
    /// A [`Config`](super::Config) built in code and checked with
    /// [`Config::validate`](super::Config::validate), which has no layers: shown as `code`.
    Code,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Env(name) => write!(f, "env {name}"),
            Source::Code => f.write_str("code"),
        }
    }
}

/// Serialized as its display text, as in the message (`"env CARDWORKER__…"`).
impl Serialize for Source {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

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
    /// For a relation between keys, the other keys it was checked against: either side may be
    /// the one to change.
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
        let (key, value, allowed) = (key.into(), value.into(), allowed.into());
        let related = Vec::new();
        Self {
            key,
            value,
            source,
            allowed,
            related,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self;
        write!(
            f,
            "{} = {} (from {}): {}",
            p.key, p.value, p.source, p.allowed
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
    /// line, each starting with `  - ` (so that each stands out, and can be grepped, under the
    /// `error: ...` line the binary prints first).
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

fn display_problems(problems: &[Problem]) -> String {
    let s = if problems.len() == 1 { "" } else { "s" };
    let mut out = format!("invalid configuration ({} problem{s}):", problems.len());
    for p in problems {
        out.push_str(&format!("\n  - {p}"));
    }
    out
}
