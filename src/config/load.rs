//! The layering: built-in defaults, then the TOML file, then `CARDWORKER__SECTION__KEY` env
//! overrides, merged into one `toml::Value` table shaped by the defaults, recording the
//! [`Source`] of every key a layer sets; then the check of every value against its rule and of
//! every relation, and deserialization into [`Config`].
//!
//! The merge is done on TOML values rather than through serde so that an unknown key is refused
//! naming its dotted key and every problem is collected instead of stopping at the first.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use toml::{Table, Value};

use super::error::{ConfigError, Problem, Related, Source};
use super::rules::{join_key, lookup, one_line, show, show_str, Rule, RELATIONS};
use super::types::Config;
use super::{CONFIG_PATH_ENV, ENV_PREFIX};

/// The source of every leaf key (dotted) a layer set; the others have the defaults' (or, in
/// [`Config::validate`], [`Source::Code`]).
type Sources = BTreeMap<String, Source>;

/// A leaf key of the configuration: its dotted name, its rule, and what it allows (the rule's
/// words and the relations it is part of).
struct Leaf {
    key: String,
    rule: Rule,
    allowed: String,
}

/// Every leaf key, from the `RULES` of each section, flattened.
fn leaves() -> &'static [Leaf] {
    fn flatten(prefix: &str, rules: &[(&str, Rule)], out: &mut Vec<Leaf>) {
        for (k, rule) in rules {
            let key = join_key(prefix, k);
            if let Rule::Section(inner) = rule {
                flatten(&key, inner, out);
                continue;
            }
            let relation = RELATIONS.iter().find(|(k, ..)| *k == key);
            let note = relation.map(|(_, bound, other)| bound.note(other));
            let (rule, allowed) = (*rule, rule.allowed() + &note.unwrap_or_default());
            out.push(Leaf { key, rule, allowed });
        }
    }
    static LEAVES: LazyLock<Vec<Leaf>> = LazyLock::new(|| {
        let mut out = Vec::new();
        if let Rule::Section(rules) = Config::RULE {
            flatten("", rules, &mut out);
        }
        out
    });
    &LEAVES
}

fn leaf(key: &str) -> Option<&'static Leaf> {
    leaves().iter().find(|l| l.key == key)
}

fn source_of(sources: &Sources, key: &str) -> Source {
    sources.get(key).cloned().unwrap_or(Source::Default)
}

/// Checks every leaf of `root` against its rule, then every relation whose keys both passed;
/// each problem names where its value came from, per `sources`.
fn check(root: &Table, sources: &Sources) -> Vec<Problem> {
    let mut problems = Vec::new();
    let mut bad = BTreeSet::new();
    for Leaf { key, rule, allowed } in leaves() {
        let source = source_of(sources, key);
        let refused = match lookup(root, key) {
            None => Some(("(missing)".to_owned(), allowed.clone())),
            // An empty token in a file sets nothing (`check-config` renders it so); any other is
            // refused there.
            Some(v)
                if matches!(rule, Rule::EnvOnlyToken)
                    && matches!(source, Source::File(_))
                    && v.as_str() != Some("") =>
            {
                let why = "a secret in a config file ends up in a ConfigMap or a repository; \
                           set env CARDWORKER__CONSOLE__ADMIN_TOKEN instead";
                Some((show(Some(*rule), key, v), format!("{allowed} ({why})")))
            }
            Some(v) => rule.check(v).err().map(|detail| {
                let allowed = match detail {
                    Some(detail) => format!("{allowed} ({})", one_line(&detail)),
                    None => allowed.clone(),
                };
                (show(Some(*rule), key, v), allowed)
            }),
        };
        if let Some((value, allowed)) = refused {
            problems.push(Problem::new(key, value, source, allowed));
            bad.insert(key.as_str());
        }
    }
    let int = |key| u64::try_from(lookup(root, key)?.as_integer()?).ok();
    for &(key, bound, other) in RELATIONS {
        let (Some(value), Some(o), Some(l)) = (int(key), int(other), leaf(key)) else {
            continue;
        };
        let refused = bound.refuses(value, l.rule, other, o);
        if let Some(allowed) = refused.filter(|_| !bad.contains(key) && !bad.contains(other)) {
            let mut p = Problem::new(key, value.to_string(), source_of(sources, key), allowed);
            let (value, source) = (o.to_string(), source_of(sources, other));
            p.related.push(Related {
                key: other.to_owned(),
                value,
                source,
            });
            problems.push(p);
        }
    }
    problems
}

impl Config {
    /// Validates a configuration built in code (loading already does this); reports every
    /// problem at once, each from [`Source::Code`].
    pub fn validate(&self) -> Result<(), ConfigError> {
        let sources = leaves()
            .iter()
            .map(|l| (l.key.clone(), Source::Code))
            .collect();
        let problems = check(&Table::try_from(self)?, &sources);
        problems
            .is_empty()
            .then_some(())
            .ok_or(ConfigError::Invalid(problems))
    }

    /// Loads the configuration from the process environment: defaults, then the file (`path`,
    /// else env `CARDWORKER_CONFIG`, else none), then `CARDWORKER__SECTION__KEY` env overrides;
    /// then validates it.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let lossy = |s: std::ffi::OsString| s.to_string_lossy().into_owned();
        Self::load_from(path, std::env::vars_os().map(|(k, v)| (lossy(k), lossy(v))))
    }

    /// Like [`Config::load`], with the environment given explicitly (for tests). `env` is also
    /// where `CARDWORKER_CONFIG` is looked up when `path` is `None`.
    pub fn load_from<I>(path: Option<&Path>, env: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (String, String)>,
    {
        let env: Vec<(String, String)> = env.into_iter().collect();
        let from_env = || {
            let (_, v) = env
                .iter()
                .find(|(k, v)| k == CONFIG_PATH_ENV && !v.trim().is_empty())?;
            Some(PathBuf::from(v))
        };
        let Some(path) = path.map(Path::to_path_buf).or_else(from_env) else {
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
        let (mut sources, mut problems) = (Sources::new(), Vec::new());
        if let Some((path, file)) = file {
            Layer(Source::File(path), &mut sources, &mut problems).merge(&mut merged, file, "");
        }
        problems.extend(unknown_variables(&env));
        let mut overrides: Vec<&(String, String)> = env
            .iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        overrides.sort();
        for (name, raw) in overrides {
            let layer = Layer(Source::Env(name.clone()), &mut sources, &mut problems);
            layer.apply_env(&mut merged, &defaults, name, raw);
        }
        problems.extend(check(&merged, &sources));
        if !problems.is_empty() {
            return Err(ConfigError::Invalid(problems));
        }
        Value::Table(merged).try_into::<Config>().map_err(|e| {
            // Not expected: the rules have checked every type already.
            let p = Problem::new("(config)", "", Source::Default, one_line(&e.to_string()));
            ConfigError::Invalid(vec![p])
        })
    }
}

/// One layer being merged: where its values come from, the source of every leaf key set so far
/// (this layer's keys are recorded as they merge), and the problems (unknown keys, misplaced
/// sections), each naming this layer's source.
struct Layer<'a>(Source, &'a mut Sources, &'a mut Vec<Problem>);

impl Layer<'_> {
    /// Merges `over` into `base` (shaped by the defaults): unknown keys and a value where a
    /// section is due (or the reverse) are reported, not merged.
    fn merge(&mut self, base: &mut Table, over: Table, prefix: &str) {
        for (k, v) in over {
            let key = join_key(prefix, &k);
            let known = |t: &Table| t.keys().map(String::as_str).collect::<Vec<_>>().join(", ");
            let allowed = match (base.get_mut(&k), v) {
                (Some(Value::Table(section)), Value::Table(t)) => {
                    self.merge(section, t, &key);
                    continue;
                }
                (Some(slot), v) if !slot.is_table() && !v.is_table() => {
                    *slot = v;
                    self.1.insert(key, self.0.clone());
                    continue;
                }
                (None, v) if prefix.is_empty() => (
                    v,
                    format!("unknown key; the top level accepts: {}", known(base)),
                ),
                (None, v) => (
                    v,
                    format!("unknown key; [{prefix}] accepts: {}", known(base)),
                ),
                (Some(Value::Table(section)), v) => {
                    let allowed =
                        format!("must be a section [{key}] with keys: {}", known(section));
                    (v, allowed)
                }
                (Some(_), v) => {
                    let allowed = leaf(&key).map(|l| l.allowed.clone());
                    (
                        v,
                        allowed.unwrap_or_else(|| "must be a value, not a section".to_owned()),
                    )
                }
            };
            let (v, allowed) = allowed;
            let value = show(leaf(&key).map(|l| l.rule), &key, &v);
            self.2
                .push(Problem::new(key, value, self.0.clone(), allowed));
        }
    }

    /// Applies one `CARDWORKER__SECTION__KEY=raw` override, merged like a file of one key.
    fn apply_env(mut self, merged: &mut Table, defaults: &Table, name: &str, raw: &str) {
        let rest = name.strip_prefix(ENV_PREFIX).unwrap_or(name);
        let segments: Vec<String> = rest.split(ENV_SEPARATOR).map(str::to_lowercase).collect();
        if segments.iter().any(String::is_empty) {
            let allowed = "not a valid override name: use CARDWORKER__SECTION__KEY, \
                           e.g. CARDWORKER__POLLING__TOTAL_LIMIT";
            self.2
                .push(Problem::new(name, show_str(raw), self.0, allowed));
            return;
        }
        let value = match lookup(defaults, &segments.join(".")) {
            Some(Value::String(_)) => Value::String(raw.to_owned()),
            _ => parse_env_scalar(raw),
        };
        let nest =
            |inner, segment: &String| Value::Table(Table::from_iter([(segment.clone(), inner)]));
        if let Value::Table(t) = segments.iter().rev().fold(value, nest) {
            self.merge(merged, t, "");
        }
    }
}

/// Reads an env value as a TOML integer, float or boolean when it is one, else as a string.
fn parse_env_scalar(raw: &str) -> Value {
    match toml::from_str::<Table>(&format!("v = {raw}")).map(|mut t| (t.len(), t.remove("v"))) {
        Ok((1, Some(v @ (Value::Integer(_) | Value::Float(_) | Value::Boolean(_))))) => v,
        _ => Value::String(raw.to_owned()),
    }
}

/// Separator between the segments of an env override name.
const ENV_SEPARATOR: &str = "__";

/// The product's variables that are not overrides.
const PRODUCT_VARS: &[&str] = &[
    CONFIG_PATH_ENV,
    "CARDWORKER_OPERATOR",
    "CARDWORKER_POD_NAME",
];

/// Variables of the project's test and benchmark harness, which start the binary with their
/// environment, and the prefixes of its other ones: accepted, never suggested.
const HARNESS_VARS: &[&str] = &[
    "CARDWORKER_BIN",
    "CARDWORKER_REQUIRE_BROWSER",
    "CARDWORKER_CONSOLE_SCREENSHOTS",
    "CARDWORKER_KEY_LOG",
    "CARDWORKER_PLAN_GUARD_LOG",
];
const HARNESS_PREFIXES: &[&str] = &["CARDWORKER_TEST_", "CARDWORKER_BENCH_"];

/// Every `CARDWORKER_…` variable that is neither an override (`CARDWORKER__…`) nor one the
/// product or its harness reads: a misspelled override such as `CARDWORKER_POLLING__TOTAL_LIMIT`
/// (one underscore), which would otherwise be ignored without a word. Each is refused naming
/// the closest valid variable (fewest single-character edits).
fn unknown_variables(env: &[(String, String)]) -> Vec<Problem> {
    let unknown = |name: &str| {
        name.starts_with("CARDWORKER_")
            && !name.starts_with(ENV_PREFIX)
            && !PRODUCT_VARS.contains(&name)
            && !HARNESS_VARS.contains(&name)
            && !HARNESS_PREFIXES.iter().any(|p| name.starts_with(p))
    };
    let override_name = |key: &str| {
        let segments: Vec<String> = key.split('.').map(str::to_uppercase).collect();
        format!("{ENV_PREFIX}{}", segments.join(ENV_SEPARATOR))
    };
    let valid = leaves().iter().map(|l| override_name(&l.key));
    let valid: Vec<String> = valid
        .chain(PRODUCT_VARS.iter().map(|v| (*v).to_owned()))
        .collect();
    let mut unknown: Vec<&(String, String)> = env.iter().filter(|(k, _)| unknown(k)).collect();
    unknown.sort();
    let problem = |(name, raw): &(String, String)| {
        let closest = valid.iter().min_by_key(|v| strsim::levenshtein(name, v));
        let allowed = format!(
            "unknown variable; did you mean {}? (overrides are CARDWORKER__SECTION__KEY, \
             two underscores between parts)",
            closest.map_or(CONFIG_PATH_ENV, String::as_str)
        );
        Problem::new(name, show_str(raw), Source::Env(name.clone()), allowed)
    };
    unknown.into_iter().map(problem).collect()
}
