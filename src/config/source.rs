//! Where each value of the configuration came from, so that a refused value names the layer to
//! fix: a built-in default, the file (its path as given) or an env override (its name).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Serialize, Serializer};

/// The layer a value came from, as named in a [`Problem`](super::Problem).
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

/// The source of every leaf key (dotted) that a layer set; any other key has the fallback
/// (the defaults when layering, [`Source::Code`] for [`Config::validate`](super::Config::validate)).
#[derive(Debug, Clone)]
pub(super) struct Sources {
    set: BTreeMap<String, Source>,
    fallback: Source,
}

impl Sources {
    /// Every key from `fallback`, until a layer sets it.
    pub(super) fn all_from(fallback: Source) -> Self {
        Self {
            set: BTreeMap::new(),
            fallback,
        }
    }

    /// Records that a layer set `key` (a later layer overwrites an earlier one, as its value did).
    pub(super) fn set(&mut self, key: &str, source: &Source) {
        self.set.insert(key.to_owned(), source.clone());
    }

    /// Where the current value of `key` came from.
    pub(super) fn of(&self, key: &str) -> Source {
        self.set.get(key).unwrap_or(&self.fallback).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_no_layer_set_has_the_fallback_and_the_last_layer_wins() {
        let file = Source::File(PathBuf::from("c.toml"));
        let env = Source::Env("CARDWORKER__POLLING__TOTAL_LIMIT".to_owned());
        let mut s = Sources::all_from(Source::Default);
        assert_eq!(s.of("polling.total_limit"), Source::Default);
        s.set("polling.total_limit", &file);
        assert_eq!(s.of("polling.total_limit"), file);
        s.set("polling.total_limit", &env);
        assert_eq!(s.of("polling.total_limit"), env);
        assert_eq!(s.of("polling.lease_ttl_secs"), Source::Default);
    }
}
