//! The layering: built-in defaults, then the TOML file, then `CARDWORKER__SECTION__KEY` env
//! overrides, merged into one `toml::Value` table shaped by the defaults; then validation (see
//! `rules`) and deserialization into [`Config`].
//!
//! The merge is done on TOML values rather than through serde so that an unknown key is refused
//! naming its dotted key, a refused value can be put back to its default to keep checking the
//! rest, and every problem is collected instead of stopping at the first.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use toml::{Table, Value};

use super::error::{ConfigError, Problem};
use super::relations::check_relations;
use super::rules::{join_key, lookup, one_line, show, show_str, Rule};
use super::source::{Source, Sources};
use super::types::Config;
use super::{CONFIG_PATH_ENV, ENV_PREFIX};

/// Every leaf key of the configuration, dotted (`polling.total_limit`), with its rule: the
/// `RULES` of each section, flattened.
fn leaf_rules() -> &'static [(String, Rule)] {
    fn flatten(prefix: &str, rules: &[(&str, Rule)], out: &mut Vec<(String, Rule)>) {
        for (k, rule) in rules {
            match rule {
                Rule::Section(inner) => flatten(&join_key(prefix, k), inner, out),
                leaf => out.push((join_key(prefix, k), *leaf)),
            }
        }
    }
    static LEAVES: LazyLock<Vec<(String, Rule)>> = LazyLock::new(|| {
        let mut out = Vec::new();
        flatten("", Config::RULES, &mut out);
        out
    });
    &LEAVES
}

/// Every key of the configuration, dotted.
fn keys() -> impl Iterator<Item = &'static str> {
    leaf_rules().iter().map(|(k, _)| k.as_str())
}

fn rule_for(key: &str) -> Option<Rule> {
    leaf_rules().iter().find(|(k, _)| k == key).map(|(_, r)| *r)
}

/// Checks every leaf of `root` against its rule; returns the problems (each naming where its
/// value came from, per `sources`) and the refused keys.
fn check_values(root: &Table, sources: &Sources) -> (Vec<Problem>, BTreeSet<&'static str>) {
    let mut problems = Vec::new();
    let mut bad = BTreeSet::new();
    for (key, rule) in leaf_rules() {
        let (key, source) = (key.as_str(), sources.of(key));
        let refused = match lookup(root, key) {
            None => Some(("(missing)".to_owned(), rule.allowed())),
            // An empty token in a file sets nothing (`check-config` renders it so); any other is
            // refused there.
            Some(v)
                if matches!(rule, Rule::EnvOnlyToken)
                    && matches!(source, Source::File(_))
                    && v.as_str() != Some("") =>
            {
                let allowed = format!(
                    "{} (a secret in a config file ends up in a ConfigMap or a repository; \
                     set env CARDWORKER__CONSOLE__ADMIN_TOKEN instead)",
                    rule.allowed()
                );
                Some((show(Some(*rule), key, v), allowed))
            }
            Some(v) => rule.check(v).err().map(|detail| {
                let allowed = match detail {
                    Some(detail) => format!("{} ({})", rule.allowed(), one_line(&detail)),
                    None => rule.allowed(),
                };
                (show(Some(*rule), key, v), allowed)
            }),
        };
        if let Some((value, allowed)) = refused {
            problems.push(Problem::new(key, value, source, allowed));
            bad.insert(key);
        }
    }
    (problems, bad)
}

impl Config {
    /// Validates a configuration built in code (loading already does this); reports every
    /// problem at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let table = Table::try_from(self)?;
        // A config built in code has no layers to point at.
        let sources = Sources::all_from(Source::Code);
        let (mut problems, bad) = check_values(&table, &sources);
        problems.extend(check_relations(self, &bad, &sources));
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// Separator between the segments of an env override name.
const ENV_SEPARATOR: &str = "__";

/// What every variable of the product's own starts with.
const VAR_PREFIX: &str = "CARDWORKER_";

/// The product's variables that are not overrides.
const PRODUCT_VARS: &[&str] = &[
    CONFIG_PATH_ENV,
    "CARDWORKER_OPERATOR",
    "CARDWORKER_POD_NAME",
];

/// Variables of the project's test and benchmark harness, which start the binary with their
/// environment: accepted, never suggested.
const HARNESS_VARS: &[&str] = &[
    "CARDWORKER_BIN",
    "CARDWORKER_REQUIRE_BROWSER",
    "CARDWORKER_CONSOLE_SCREENSHOTS",
    "CARDWORKER_KEY_LOG",
    "CARDWORKER_PLAN_GUARD_LOG",
];

/// Prefixes of the harness's other variables (`CARDWORKER_TEST_REDIS`, `CARDWORKER_BENCH_…`).
const HARNESS_PREFIXES: &[&str] = &["CARDWORKER_TEST_", "CARDWORKER_BENCH_"];

/// A `CARDWORKER_…` variable that is neither an override (`CARDWORKER__…`) nor a variable the
/// product or its harness reads: a misspelled override such as `CARDWORKER_POLLING__TOTAL_LIMIT`
/// (one underscore), which would otherwise be ignored without a word.
fn unknown_variable(name: &str) -> bool {
    name.starts_with(VAR_PREFIX)
        && !name.starts_with(ENV_PREFIX)
        && !PRODUCT_VARS.contains(&name)
        && !HARNESS_VARS.contains(&name)
        && !HARNESS_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Every `CARDWORKER_…` variable that is not ours, refused naming the closest valid one.
fn unknown_variables(env: &[(String, String)]) -> Vec<Problem> {
    let mut unknown: Vec<&(String, String)> =
        env.iter().filter(|(k, _)| unknown_variable(k)).collect();
    unknown.sort();
    unknown
        .into_iter()
        .map(|(name, raw)| {
            let allowed = format!(
                "unknown variable; did you mean {}? (overrides are CARDWORKER__SECTION__KEY, \
                 two underscores between parts)",
                closest_variable(name)
            );
            Problem::new(name, show_str(raw), Source::Env(name.clone()), allowed)
        })
        .collect()
}

/// The env override of the dotted `key`: `polling.total_limit` -> `CARDWORKER__POLLING__TOTAL_LIMIT`.
fn override_name(key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}",
        key.split('.')
            .map(str::to_uppercase)
            .collect::<Vec<_>>()
            .join(ENV_SEPARATOR)
    )
}

/// The valid variable nearest to `name` (fewest single-character edits): every override and
/// the product's other variables.
fn closest_variable(name: &str) -> String {
    keys()
        .map(override_name)
        .chain(PRODUCT_VARS.iter().map(|v| (*v).to_owned()))
        .min_by_key(|candidate| edit_distance(name, candidate))
        .unwrap_or_else(|| CONFIG_PATH_ENV.to_owned())
}

/// Levenshtein distance between two names, by characters (clap's `strsim`, already in the
/// tree for its own suggestions).
fn edit_distance(a: &str, b: &str) -> usize {
    strsim::levenshtein(a, b)
}

impl Config {
    /// Loads the configuration from the process environment: defaults, then the file (`path`,
    /// else env `CARDWORKER_CONFIG`, else none), then `CARDWORKER__SECTION__KEY` env overrides;
    /// then validates it.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let env = std::env::vars_os().map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        });
        Self::load_from(path, env)
    }

    /// Like [`Config::load`], with the environment given explicitly (for tests). `env` is also
    /// where `CARDWORKER_CONFIG` is looked up when `path` is `None`.
    pub fn load_from<I>(path: Option<&Path>, env: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (String, String)>,
    {
        let env: Vec<(String, String)> = env.into_iter().collect();
        let path: Option<PathBuf> = match path {
            Some(p) => Some(p.to_path_buf()),
            None => env
                .iter()
                .find(|(k, v)| k == CONFIG_PATH_ENV && !v.trim().is_empty())
                .map(|(_, v)| PathBuf::from(v)),
        };
        let Some(path) = path else {
            return Self::build(None, env);
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        Self::load_str(&path, &text, env)
    }

    /// Like [`Config::load_from`], with the file's text given: `path` is the name every problem
    /// of a value from the file gives as its source.
    pub fn load_str<I>(path: &Path, text: &str, env: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (String, String)>,
    {
        let table = toml::from_str::<Table>(text).map_err(|source| ConfigError::Syntax {
            path: path.to_path_buf(),
            source: Box::new(source),
        })?;
        Self::build(Some((path.to_path_buf(), table)), env.into_iter().collect())
    }

    /// Layers `file` (its path as given, and its table) and `env` over the defaults and
    /// validates the result, naming the source of every refused value.
    fn build(
        file: Option<(PathBuf, Table)>,
        env: Vec<(String, String)>,
    ) -> Result<Config, ConfigError> {
        let defaults = Table::try_from(Config::default())?;
        let mut merged = defaults.clone();
        let mut sources = Sources::all_from(Source::Default);
        let mut problems = Vec::new();

        if let Some((path, file)) = file {
            let mut layer = Layer {
                source: Source::File(path),
                sources: &mut sources,
                problems: &mut problems,
            };
            layer.merge(&mut merged, file, "");
        }

        problems.extend(unknown_variables(&env));

        let mut overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        overrides.sort();
        for (name, raw) in overrides {
            let mut layer = Layer {
                source: Source::Env(name.clone()),
                sources: &mut sources,
                problems: &mut problems,
            };
            layer.apply_env(&mut merged, &defaults, &name, &raw);
        }

        let (mut value_problems, bad) = check_values(&merged, &sources);
        problems.append(&mut value_problems);

        // Put the defaults back where a value was refused, so that the rest still deserializes
        // and every other problem is reported too.
        for key in &bad {
            if let (Some(slot), Some(default)) =
                (lookup_mut(&mut merged, key), lookup(&defaults, key))
            {
                *slot = default.clone();
            }
        }
        let config = match Value::Table(merged).try_into::<Config>() {
            Ok(config) => config,
            Err(e) => {
                // Not expected: the rules have checked every type already. No one layer is to
                // blame; the merged table is built on the defaults.
                problems.push(Problem::new(
                    "(config)",
                    "",
                    Source::Default,
                    one_line(&e.to_string()),
                ));
                return Err(ConfigError::Invalid(problems));
            }
        };
        problems.extend(check_relations(&config, &bad, &sources));

        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

fn lookup_mut<'a>(root: &'a mut Table, key: &str) -> Option<&'a mut Value> {
    let mut parts = key.split('.');
    let mut v = root.get_mut(parts.next()?)?;
    for part in parts {
        v = v.as_table_mut()?.get_mut(part)?;
    }
    Some(v)
}

/// One layer being merged: where its values come from, and where the merge records them.
struct Layer<'a> {
    /// The file or the env var of this layer.
    source: Source,
    /// The source of every leaf key set so far; this layer's keys are recorded as they merge.
    sources: &'a mut Sources,
    /// Unknown keys and misplaced sections, each naming this layer's source.
    problems: &'a mut Vec<Problem>,
}

impl Layer<'_> {
    /// Merges `over` into `base` (shaped by the defaults): unknown keys and a value where a
    /// section is due (or the reverse) are reported, not merged.
    fn merge(&mut self, base: &mut Table, over: Table, prefix: &str) {
        for (k, v) in over {
            let key = join_key(prefix, &k);
            match base.get_mut(&k) {
                None => {
                    let known: Vec<&str> = base.keys().map(String::as_str).collect();
                    let section = if prefix.is_empty() {
                        "the top level".to_owned()
                    } else {
                        format!("[{prefix}]")
                    };
                    let allowed = format!("unknown key; {section} accepts: {}", known.join(", "));
                    self.refuse(key, &v, allowed);
                }
                Some(Value::Table(section)) => match v {
                    Value::Table(t) => self.merge(section, t, &key),
                    other => {
                        let keys: Vec<&str> = section.keys().map(String::as_str).collect();
                        let allowed =
                            format!("must be a section [{key}] with keys: {}", keys.join(", "));
                        self.refuse(key, &other, allowed);
                    }
                },
                Some(slot) => match v {
                    Value::Table(_) => {
                        let allowed = rule_for(&key)
                            .map(Rule::allowed)
                            .unwrap_or_else(|| "must be a value, not a section".to_owned());
                        self.refuse(key, &v, allowed);
                    }
                    other => {
                        *slot = other;
                        self.sources.set(&key, &self.source);
                    }
                },
            }
        }
    }

    /// Reports `key = v` of this layer as refused (and leaves the merged value alone).
    fn refuse(&mut self, key: String, v: &Value, allowed: String) {
        let value = show(rule_for(&key), &key, v);
        self.problems
            .push(Problem::new(key, value, self.source.clone(), allowed));
    }

    /// Applies one `CARDWORKER__SECTION__KEY=raw` override.
    fn apply_env(&mut self, merged: &mut Table, defaults: &Table, name: &str, raw: &str) {
        let rest = name.strip_prefix(ENV_PREFIX).unwrap_or(name);
        let segments: Vec<String> = rest.split(ENV_SEPARATOR).map(str::to_lowercase).collect();
        if segments.iter().any(|s| s.is_empty()) {
            self.problems.push(Problem::new(
                name,
                show_str(raw),
                self.source.clone(),
                "not a valid override name: use CARDWORKER__SECTION__KEY, \
                 e.g. CARDWORKER__POLLING__TOTAL_LIMIT",
            ));
            return;
        }
        let key = segments.join(".");
        let value = match lookup(defaults, &key) {
            Some(Value::String(_)) => Value::String(raw.to_owned()),
            _ => parse_env_scalar(raw),
        };
        // Nest the value as `{a = {b = {c = value}}}` and merge it like a file.
        let mut nested = value;
        for segment in segments.iter().rev() {
            let mut t = Table::new();
            t.insert(segment.clone(), nested);
            nested = Value::Table(t);
        }
        if let Value::Table(t) = nested {
            self.merge(merged, t, "");
        }
    }
}

/// Reads an env value as a TOML integer, float or boolean when it is one, else as a string.
fn parse_env_scalar(raw: &str) -> Value {
    let doc = format!("v = {raw}");
    if let Ok(mut t) = toml::from_str::<Table>(&doc) {
        if t.len() == 1 {
            if let Some(v @ (Value::Integer(_) | Value::Float(_) | Value::Boolean(_))) =
                t.remove("v")
            {
                return v;
            }
        }
    }
    Value::String(raw.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut ruled: Vec<String> = leaf_rules().iter().map(|(k, _)| k.clone()).collect();
        ruled.sort();
        assert_eq!(keys, ruled);
    }

    #[test]
    fn edit_distance_counts_single_character_edits() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("abc", "abc"), 0);
        assert_eq!(edit_distance("A_B", "A__B"), 1);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "ab"), 2);
    }
}
