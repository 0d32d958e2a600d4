//! Helpers of the config tests: load a TOML text (and env pairs) through the real layering, as
//! the file `test.toml`, and pick the problem of one key out of the result.

use std::path::{Path, PathBuf};

use cardworker::config::{Config, ConfigError, Problem, Source};

/// Env pairs as [`Config::load_from`] takes them.
pub fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// The path the test file of [`from_str_env`] is given as, as its problems name it.
pub const TEST_FILE: &str = "test.toml";

/// The source of a value from the test file.
pub fn file_source() -> Source {
    Source::File(PathBuf::from(TEST_FILE))
}

/// The source of a value from the env override `name`.
pub fn env_source(name: &str) -> Source {
    Source::Env(name.to_owned())
}

/// Layers `text` (as the file [`TEST_FILE`]) and `pairs` (as the env) over the defaults.
pub fn from_str_env(text: &str, pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load_str(Path::new(TEST_FILE), text, env(pairs))
}

/// Layers `text` (as the file) over the defaults.
pub fn from_str(text: &str) -> Result<Config, ConfigError> {
    from_str_env(text, &[])
}

/// The problems of an invalid configuration; panics on anything else.
pub fn problems(r: Result<Config, ConfigError>) -> Vec<Problem> {
    match r {
        Err(ConfigError::Invalid(p)) => p,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// The problem reported for `key`; panics if there is none.
pub fn problem_for(r: Result<Config, ConfigError>, key: &str) -> Problem {
    let all = problems(r);
    all.iter()
        .find(|p| p.key == key)
        .cloned()
        .unwrap_or_else(|| panic!("no problem for {key} in {all:?}"))
}

/// The problem of `key` when the test file reads `text` (the file refused, naming that key).
pub fn refused(text: &str, key: &str) -> Problem {
    problem_for(from_str(text), key)
}

/// The problem of `key` when the test file reads `text` and the one env variable `var` is set.
pub fn refused_with_env(text: &str, var: (&str, &str), key: &str) -> Problem {
    problem_for(from_str_env(text, &[var]), key)
}

/// [`refused`], whose problem says what is allowed in words that contain `allowed`.
pub fn refused_as(text: &str, key: &str, allowed: &str) -> Problem {
    let p = refused(text, key);
    assert!(p.allowed.contains(allowed), "{p}");
    p
}

/// A file of the repository's `config/` directory.
pub fn bundled(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config")
        .join(name)
}
