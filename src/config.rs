//! Typed, layered configuration.
//!
//! The effective configuration is built from three layers, each one overriding the one before:
//!
//! 1. the built-in defaults ([`Config::default`], the values of the spec, mirrored by
//!    `config/default.toml`);
//! 2. a TOML file: the path given on the command line (`--config FILE`), else the path in env
//!    `CARDWORKER_CONFIG`, else no file;
//! 3. env overrides `CARDWORKER__SECTION__KEY`, for example
//!    `CARDWORKER__POLLING__TOTAL_LIMIT=6`; nested sections take more `__`, for example
//!    `CARDWORKER__POLLING__CARDDATA__LIMIT=2`. Segments are lowercased. A value for a string key
//!    is taken verbatim; any other value is read as a TOML scalar (integer, float, boolean) when
//!    it parses as one, else as a string (and then refused by validation if a number was due).
//!
//! The layers are merged as one `toml::Value` table shaped by the defaults, so that an unknown key
//! or section anywhere is refused naming its dotted key. Validation then runs once, over the
//! merged table (types, ranges, URL schemes, cron expressions, ...) and over the deserialized
//! [`Config`] (relations between keys), and collects every problem instead of stopping at the
//! first: [`ConfigError::Invalid`] lists them all, one per line, as
//! `polling.total_limit = 0: must be an integer in 1..=256`. Every [`ConfigError`] maps to exit
//! status 2.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::{Table, Value};
use url::Url;

/// Hard ceiling for every polling limit (`total_limit`, a task's `limit`, a runtime override).
pub const LIMIT_CEILING: u32 = 256;

/// Env var naming the config file when `--config` is not given.
pub const CONFIG_PATH_ENV: &str = "CARDWORKER_CONFIG";

/// Prefix of env overrides: `CARDWORKER__SECTION__KEY`.
pub const ENV_PREFIX: &str = "CARDWORKER__";

/// Separator between the segments of an env override name.
const ENV_SEPARATOR: &str = "__";

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

/// A polling task: each has its own budget section, metric label and job chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Polls `GET /v1/cards/{card_ref}/data` until the card data is ready.
    Carddata,
    /// Polls `GET /v1/cards/{card_ref}/status` until the status is final.
    #[serde(alias = "card-status")]
    CardStatus,
}

impl Task {
    /// Every polling task, in a fixed order.
    pub const ALL: [Task; 2] = [Task::Carddata, Task::CardStatus];

    /// The name used in config sections and metric labels: `carddata` or `card_status`.
    pub const fn label(self) -> &'static str {
        match self {
            Task::Carddata => "carddata",
            Task::CardStatus => "card_status",
        }
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for Task {
    type Err = String;

    /// Accepts `carddata`, `card-status` and its synonym `card_status`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "carddata" => Ok(Task::Carddata),
            "card-status" | "card_status" => Ok(Task::CardStatus),
            other => Err(format!(
                "unknown task {other:?}: must be carddata or card-status (card_status)"
            )),
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// One JSON object per line (production).
    #[default]
    Json,
    /// Human-readable lines (local runs).
    Pretty,
}

/// The whole configuration; see the module docs for how it is layered and validated.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// `[database]`: PostgreSQL.
    pub database: DatabaseConfig,
    /// `[redis]`: Redis (queues, budgets, runtime brakes).
    pub redis: RedisConfig,
    /// `[gateway]`: the card/payment Gateway.
    pub gateway: GatewayConfig,
    /// `[worker]`: process lifecycle.
    pub worker: WorkerConfig,
    /// `[polling]`: polling budgets and chains.
    pub polling: PollingConfig,
    /// `[payments]`: payment submission and recovery.
    pub payments: PaymentsConfig,
    /// `[maintenance]`: archive and retention.
    pub maintenance: MaintenanceConfig,
    /// `[telemetry]`: HTTP endpoint and logs.
    pub telemetry: TelemetryConfig,
}

/// `[database]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `postgres://` or `postgresql://` URL; may carry a password (redacted when shown).
    pub url: String,
    /// Pool size, 1..=200.
    pub max_connections: u32,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: "postgres://root@127.0.0.1:5432/cardworker".to_owned(),
            max_connections: 10,
        }
    }
}

/// `[redis]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` URL; may carry a password (redacted when shown).
    pub url: String,
    /// Every Redis key and queue of this deployment lives under it. Non-empty,
    /// `[A-Za-z0-9_.-]` only.
    pub key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/0".to_owned(),
            key_prefix: "cardworker".to_owned(),
        }
    }
}

/// `[gateway]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// `http://` or `https://` base URL of the Gateway.
    pub base_url: String,
    /// Timeout of one Gateway call in milliseconds, 100..=60000.
    pub timeout_ms: u64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8089".to_owned(),
            timeout_ms: 5000,
        }
    }
}

impl GatewayConfig {
    /// `timeout_ms` as a [`Duration`].
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// `[worker]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerConfig {
    /// Time in-flight jobs get to finish on shutdown, 1..=600 s.
    pub shutdown_grace_secs: u64,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            shutdown_grace_secs: 30,
        }
    }
}

impl WorkerConfig {
    /// `shutdown_grace_secs` as a [`Duration`].
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_secs)
    }
}

/// `[polling]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PollingConfig {
    /// Tokens for all polling tasks together, fleet-wide, 1..=[`LIMIT_CEILING`].
    pub total_limit: u32,
    /// Hard limit on one poll in seconds; greater than the gateway timeout + 1 s.
    pub handler_timeout_secs: u64,
    /// Token lease in seconds; `>= handler_timeout_secs + 5`, `<= 3600`.
    pub lease_ttl_secs: u64,
    /// First delay for a job deferred for lack of tokens, 1..=60 s.
    pub defer_delay_secs: u64,
    /// Cap of the (jittered, growing) defer delay; `>= defer_delay_secs`, `<= 600`.
    pub defer_max_delay_secs: u64,
    /// Cron of the scheduled reconcile (six or seven fields, seconds first; Asia/Shanghai).
    pub reconcile_cron: String,
    /// Cards examined per scheduled reconcile run, 1..=100000.
    pub reconcile_batch: u32,
    /// `[polling.carddata]`
    pub carddata: TaskConfig,
    /// `[polling.card_status]`
    pub card_status: TaskConfig,
}

impl Default for PollingConfig {
    fn default() -> Self {
        Self {
            total_limit: 8,
            handler_timeout_secs: 15,
            lease_ttl_secs: 60,
            defer_delay_secs: 2,
            defer_max_delay_secs: 30,
            reconcile_cron: "0 */10 * * * *".to_owned(),
            reconcile_batch: 2000,
            carddata: TaskConfig {
                interval_secs: 30,
                ..TaskConfig::default()
            },
            card_status: TaskConfig {
                interval_secs: 300,
                ..TaskConfig::default()
            },
        }
    }
}

impl PollingConfig {
    /// The section of one task.
    pub fn task(&self, t: Task) -> &TaskConfig {
        match t {
            Task::Carddata => &self.carddata,
            Task::CardStatus => &self.card_status,
        }
    }

    /// `handler_timeout_secs` as a [`Duration`].
    pub fn handler_timeout(&self) -> Duration {
        Duration::from_secs(self.handler_timeout_secs)
    }

    /// `lease_ttl_secs` as a [`Duration`].
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// `defer_delay_secs` as a [`Duration`].
    pub fn defer_delay(&self) -> Duration {
        Duration::from_secs(self.defer_delay_secs)
    }

    /// `defer_max_delay_secs` as a [`Duration`].
    pub fn defer_max_delay(&self) -> Duration {
        Duration::from_secs(self.defer_max_delay_secs)
    }
}

/// `[polling.carddata]` and `[polling.card_status]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TaskConfig {
    /// Per-task token limit, 1..=[`LIMIT_CEILING`] and `<= total_limit`; `budget set`
    /// overrides it at run time.
    pub limit: u32,
    /// Delay between two polls of one card, 1..=86400 s.
    pub interval_secs: u64,
    /// Consecutive failed polls after which the chain is parked, 1..=1000.
    pub max_consecutive_failures: u32,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            limit: 4,
            interval_secs: 30,
            max_consecutive_failures: 10,
        }
    }
}

impl TaskConfig {
    /// `interval_secs` as a [`Duration`].
    pub fn interval(&self) -> Duration {
        Duration::from_secs(self.interval_secs)
    }
}

/// `[payments]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PaymentsConfig {
    /// Worker concurrency for payment submission (not a polling budget), 1..=256.
    pub concurrency: u32,
    /// A payment still pending/unknown after this many seconds is reconciled, 10..=86400.
    pub recovery_after_secs: u64,
    /// Cron of payment recovery (Asia/Shanghai); not gated by `maintenance.enabled`.
    pub recovery_cron: String,
}

impl Default for PaymentsConfig {
    fn default() -> Self {
        Self {
            concurrency: 4,
            recovery_after_secs: 300,
            recovery_cron: "0 * * * * *".to_owned(),
        }
    }
}

impl PaymentsConfig {
    /// `recovery_after_secs` as a [`Duration`].
    pub fn recovery_after(&self) -> Duration {
        Duration::from_secs(self.recovery_after_secs)
    }
}

/// `[maintenance]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MaintenanceConfig {
    /// Master switch for archive and retention; off by default.
    pub enabled: bool,
    /// Physical deletion in retention (AuditRetentionCleanupEnabled).
    pub cleanup_enabled: bool,
    /// Cron of the archive run (Asia/Shanghai).
    pub archive_cron: String,
    /// Cron of the retention run (Asia/Shanghai).
    pub retention_cron: String,
    /// Day D is due for archive when D + this < today (Shanghai), 1..=3650.
    pub archive_after_days: u32,
    /// Retention horizon in days, 1..=36500.
    pub retention_days: u32,
    /// Rows per transaction, 1..=100000.
    pub batch_size: u32,
    /// Statement timeout for maintenance statements, 100..=600000 ms.
    pub statement_timeout_ms: u64,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            cleanup_enabled: false,
            archive_cron: "0 30 3 * * *".to_owned(),
            retention_cron: "0 0 4 * * *".to_owned(),
            archive_after_days: 30,
            retention_days: 180,
            batch_size: 1000,
            statement_timeout_ms: 5000,
        }
    }
}

impl MaintenanceConfig {
    /// `statement_timeout_ms` as a [`Duration`].
    pub fn statement_timeout(&self) -> Duration {
        Duration::from_millis(self.statement_timeout_ms)
    }
}

/// `[telemetry]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Listen address of `/metrics`, `/healthz`, `/readyz`; a socket address.
    pub listen: String,
    /// `json` or `pretty`.
    pub log_format: LogFormat,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:9464".to_owned(),
            log_format: LogFormat::Json,
        }
    }
}

impl TelemetryConfig {
    /// `listen` as a [`SocketAddr`] (validated at load time).
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            ConfigError::Invalid(vec![Problem {
                key: "telemetry.listen".to_owned(),
                value: show_str(&self.listen),
                allowed: Rule::SocketAddr.allowed(),
            }])
        })
    }
}

/// One thing wrong with the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// Dotted key, e.g. `polling.total_limit`.
    pub key: String,
    /// The value as given (TOML notation; secrets redacted).
    pub value: String,
    /// What is allowed, e.g. `must be an integer in 1..=256`.
    pub allowed: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = {}: {}", self.key, self.value, self.allowed)
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
    /// One or more keys are unknown, mistyped or out of range; one problem per line.
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
    problems
        .iter()
        .map(Problem::to_string)
        .collect::<Vec<_>>()
        .join("\n")
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
        let file = match path {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                let table =
                    toml::from_str::<Table>(&text).map_err(|source| ConfigError::Syntax {
                        path,
                        source: Box::new(source),
                    })?;
                Some(table)
            }
        };
        Self::build(file, env)
    }

    /// Layers `file` and `env` over the defaults and validates the result.
    fn build(file: Option<Table>, env: Vec<(String, String)>) -> Result<Config, ConfigError> {
        let defaults = Table::try_from(Config::default())?;
        let mut merged = defaults.clone();
        let mut problems = Vec::new();

        if let Some(file) = file {
            merge(&mut merged, file, "", None, &mut problems);
        }

        let mut overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        overrides.sort();
        for (name, raw) in overrides {
            apply_env(&mut merged, &defaults, &name, &raw, &mut problems);
        }

        let (mut value_problems, bad) = check_values(&merged);
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
                problems.push(Problem {
                    key: "(config)".to_owned(),
                    value: String::new(),
                    allowed: one_line(&e.to_string()),
                });
                return Err(ConfigError::Invalid(problems));
            }
        };
        problems.extend(check_relations(&config, &bad));

        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

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

    /// A copy with the passwords in `database.url`, `redis.url` and `gateway.base_url` (user
    /// info and a `password` query parameter) replaced by `***`.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        c.database.url = redact_url(&c.database.url);
        c.redis.url = redact_url(&c.redis.url);
        c.gateway.base_url = redact_url(&c.gateway.base_url);
        c
    }

    /// The configuration as a TOML document (call [`Config::redacted`] first before showing it).
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        Ok(toml::to_string_pretty(self)?)
    }
}

/// Replaces the password of a URL by `***`. A URL that does not parse is replaced entirely.
fn redact_url(raw: &str) -> String {
    let Ok(mut url) = Url::parse(raw) else {
        return if raw.is_empty() {
            String::new()
        } else {
            "***".to_owned()
        };
    };
    let mut changed = false;
    if url.password().is_some() {
        if url.set_password(Some("***")).is_err() {
            return "***".to_owned();
        }
        changed = true;
    }
    let secret_param = |k: &str| k.eq_ignore_ascii_case("password");
    if url.query_pairs().any(|(k, _)| secret_param(&k)) {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret_param(&k) {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
        changed = true;
    }
    if changed {
        url.to_string()
    } else {
        raw.to_owned()
    }
}

/// How one leaf key is checked on the merged table.
#[derive(Debug, Clone, Copy)]
enum Rule {
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
    fn allowed(self) -> String {
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

fn rule_for(key: &str) -> Option<Rule> {
    RULES.iter().find(|(k, _)| *k == key).map(|(_, r)| *r)
}

/// Checks every leaf of `root` against [`RULES`]; returns the problems and the refused keys.
fn check_values(root: &Table) -> (Vec<Problem>, BTreeSet<&'static str>) {
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
fn check_relations(c: &Config, bad: &BTreeSet<&'static str>) -> Vec<Problem> {
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

/// Shows a value as given (TOML notation), with URL passwords redacted.
fn show(key: &str, v: &Value) -> String {
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
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A string in quotes, escaped so that it stays on one line.
fn show_str(s: &str) -> String {
    format!("{s:?}")
}

/// An unknown key whose value should not be echoed.
fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "token"]
        .iter()
        .any(|w| k.contains(w))
}

fn join_key(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_owned()
    } else {
        format!("{prefix}.{k}")
    }
}

fn lookup<'a>(root: &'a Table, key: &str) -> Option<&'a Value> {
    let mut parts = key.split('.');
    let mut v = root.get(parts.next()?)?;
    for part in parts {
        v = v.as_table()?.get(part)?;
    }
    Some(v)
}

fn lookup_mut<'a>(root: &'a mut Table, key: &str) -> Option<&'a mut Value> {
    let mut parts = key.split('.');
    let mut v = root.get_mut(parts.next()?)?;
    for part in parts {
        v = v.as_table_mut()?.get_mut(part)?;
    }
    Some(v)
}

/// Merges `over` into `base` (shaped by the defaults): unknown keys and a value where a section
/// is due (or the reverse) are reported, not merged. `env_name` names the env var the values
/// came from, if any.
fn merge(
    base: &mut Table,
    over: Table,
    prefix: &str,
    env_name: Option<&str>,
    problems: &mut Vec<Problem>,
) {
    let from = env_name
        .map(|n| format!(" (set by env {n})"))
        .unwrap_or_default();
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
                problems.push(Problem {
                    value: show(&key, &v),
                    allowed: format!("unknown key{from}; {section} accepts: {}", known.join(", ")),
                    key,
                });
            }
            Some(Value::Table(section)) => match v {
                Value::Table(t) => merge(section, t, &key, env_name, problems),
                other => {
                    let keys: Vec<&str> = section.keys().map(String::as_str).collect();
                    problems.push(Problem {
                        value: show(&key, &other),
                        allowed: format!(
                            "must be a section [{key}]{from} with keys: {}",
                            keys.join(", ")
                        ),
                        key,
                    });
                }
            },
            Some(slot) => match v {
                Value::Table(_) => {
                    let allowed = rule_for(&key)
                        .map(Rule::allowed)
                        .unwrap_or_else(|| "must be a value, not a section".to_owned());
                    problems.push(Problem {
                        value: show(&key, &v),
                        allowed: format!("{allowed}{from}"),
                        key,
                    });
                }
                other => *slot = other,
            },
        }
    }
}

/// Applies one `CARDWORKER__SECTION__KEY=raw` override.
fn apply_env(
    merged: &mut Table,
    defaults: &Table,
    name: &str,
    raw: &str,
    problems: &mut Vec<Problem>,
) {
    let rest = name.strip_prefix(ENV_PREFIX).unwrap_or(name);
    let segments: Vec<String> = rest.split(ENV_SEPARATOR).map(str::to_lowercase).collect();
    if segments.iter().any(|s| s.is_empty()) {
        problems.push(Problem {
            key: name.to_owned(),
            value: show_str(raw),
            allowed: "not a valid override name: use CARDWORKER__SECTION__KEY, \
                      e.g. CARDWORKER__POLLING__TOTAL_LIMIT"
                .to_owned(),
        });
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
        merge(merged, t, "", Some(name), problems);
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

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn from_str_env(text: &str, pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let table = toml::from_str::<Table>(text).expect("test TOML parses");
        Config::build(Some(table), env(pairs))
    }

    fn from_str(text: &str) -> Result<Config, ConfigError> {
        from_str_env(text, &[])
    }

    fn problems(r: Result<Config, ConfigError>) -> Vec<Problem> {
        match r {
            Err(ConfigError::Invalid(p)) => p,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    fn problem_for(r: Result<Config, ConfigError>, key: &str) -> Problem {
        let all = problems(r);
        all.iter()
            .find(|p| p.key == key)
            .cloned()
            .unwrap_or_else(|| panic!("no problem for {key} in {all:?}"))
    }

    fn bundled(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("config")
            .join(name)
    }

    #[test]
    fn defaults_are_valid_and_match_the_spec() {
        let c = Config::default();
        c.validate().expect("defaults are valid");
        assert_eq!(c.polling.total_limit, 8);
        assert_eq!(c.polling.carddata.interval_secs, 30);
        assert_eq!(c.polling.card_status.interval_secs, 300);
        assert_eq!(c.polling.task(Task::CardStatus).limit, 4);
        assert_eq!(c.telemetry.log_format, LogFormat::Json);
        assert_eq!(Config::build(None, vec![]).expect("loads"), c);
    }

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
    fn unknown_key_is_refused_naming_the_dotted_key() {
        let p = problem_for(from_str("[polling]\nbogus = 1"), "polling.bogus");
        assert_eq!(p.value, "1");
        assert!(p.allowed.starts_with("unknown key"), "{p}");
        assert!(p.allowed.contains("total_limit"), "{p}");
        problem_for(
            from_str("[polling.carddata]\nlimitt = 2"),
            "polling.carddata.limitt",
        );
    }

    #[test]
    fn unknown_section_is_refused_naming_the_dotted_key() {
        let p = problem_for(from_str("[polling.foo]\nlimit = 1"), "polling.foo");
        assert!(p.allowed.starts_with("unknown key"), "{p}");
        let p = problem_for(from_str("[bogus]\nx = 1"), "bogus");
        assert!(p.allowed.contains("the top level"), "{p}");
    }

    #[test]
    fn a_value_where_a_section_is_due_is_refused() {
        let p = problem_for(from_str("polling = 3"), "polling");
        assert!(p.allowed.contains("section"), "{p}");
        problem_for(
            from_str("[polling.total_limit]\nx = 1"),
            "polling.total_limit",
        );
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
    fn env_overrides_win_over_the_file() {
        let c = from_str_env(
            "[polling]\ntotal_limit = 10\n[polling.carddata]\nlimit = 5",
            &[
                ("CARDWORKER__POLLING__TOTAL_LIMIT", "6"),
                ("CARDWORKER__POLLING__CARDDATA__LIMIT", "2"),
                ("CARDWORKER__TELEMETRY__LOG_FORMAT", "pretty"),
                ("CARDWORKER__MAINTENANCE__ENABLED", "true"),
                ("CARDWORKER__REDIS__KEY_PREFIX", "123"),
                ("UNRELATED", "x"),
            ],
        )
        .expect("valid");
        assert_eq!(c.polling.total_limit, 6);
        assert_eq!(c.polling.carddata.limit, 2);
        assert_eq!(c.telemetry.log_format, LogFormat::Pretty);
        assert!(c.maintenance.enabled);
        assert_eq!(c.redis.key_prefix, "123");
    }

    #[test]
    fn env_override_of_the_wrong_type_is_refused_naming_the_key() {
        for raw in ["abc", "0", "-1", "3.5", "inf", "1e9", "100000", ""] {
            let p = problem_for(
                from_str_env("", &[("CARDWORKER__POLLING__TOTAL_LIMIT", raw)]),
                "polling.total_limit",
            );
            assert!(p.allowed.contains("integer in 1..=256"), "{raw}: {p}");
        }
    }

    #[test]
    fn unknown_env_override_is_refused_naming_the_dotted_key() {
        let p = problem_for(
            from_str_env("", &[("CARDWORKER__POLLING__BOGUS", "1")]),
            "polling.bogus",
        );
        assert!(p.allowed.contains("CARDWORKER__POLLING__BOGUS"), "{p}");
        problem_for(
            from_str_env("", &[("CARDWORKER__POLLING__", "1")]),
            "CARDWORKER__POLLING__",
        );
    }

    #[test]
    fn all_problems_are_reported_at_once() {
        let err = from_str(
            "[database]\nmax_connections = 0\n[polling]\ntotal_limit = \"abc\"\nbogus = 1\n\
             reconcile_cron = \"nope\"\n[polling.card_status]\nlimit = 300\n\
             [telemetry]\nlog_format = \"xml\"",
        )
        .expect_err("invalid");
        let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
        for key in [
            "database.max_connections",
            "polling.total_limit",
            "polling.bogus",
            "polling.reconcile_cron",
            "polling.card_status.limit",
            "telemetry.log_format",
        ] {
            assert!(keys.contains(&key), "{key} missing from {keys:?}");
        }
        let text = err.to_string();
        assert_eq!(text.lines().count(), err.problems().len(), "{text}");
        assert!(text.contains("polling.total_limit = \"abc\": must be an integer in 1..=256"));
        assert_eq!(err.exit_status(), 2);
    }

    #[test]
    fn redaction_hides_passwords_only() {
        let mut c = Config::default();
        c.database.url = "postgres://app:s3cret@db:5432/cw?sslmode=verify-full".to_owned();
        c.redis.url = "rediss://:r3dis@cache:6380/0".to_owned();
        let r = c.redacted();
        assert_eq!(
            r.database.url,
            "postgres://app:***@db:5432/cw?sslmode=verify-full"
        );
        assert_eq!(r.redis.url, "rediss://:***@cache:6380/0");
        assert_eq!(r.gateway.base_url, c.gateway.base_url);
        let text = r.to_toml_string().expect("renders");
        assert!(
            !text.contains("s3cret") && !text.contains("r3dis"),
            "{text}"
        );
        let json = serde_json::to_string(&r).expect("json");
        assert!(!json.contains("s3cret"), "{json}");
        assert!(json.contains("\"log_format\":\"json\""), "{json}");
        // Without a password the URL is left as written.
        assert_eq!(
            Config::default().redacted().database.url,
            Config::default().database.url
        );
        assert_eq!(
            redact_url("postgres://db/cw?user=a&password=p"),
            "postgres://db/cw?user=a&password=***"
        );
    }

    #[test]
    fn rendered_toml_loads_back_to_the_same_config() {
        let mut c = Config::default();
        c.polling.carddata.limit = 2;
        let text = c.to_toml_string().expect("renders");
        assert_eq!(from_str(&text).expect("valid"), c);
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

    #[test]
    fn task_names_parse_and_label() {
        assert_eq!("carddata".parse::<Task>(), Ok(Task::Carddata));
        assert_eq!("card-status".parse::<Task>(), Ok(Task::CardStatus));
        assert_eq!("card_status".parse::<Task>(), Ok(Task::CardStatus));
        assert!("cardStatus".parse::<Task>().is_err());
        let labels: Vec<&str> = Task::ALL.iter().map(|t| t.label()).collect();
        assert_eq!(labels, ["carddata", "card_status"]);
        assert_eq!(Task::CardStatus.to_string(), "card_status");
    }

    #[test]
    fn file_path_comes_from_the_argument_or_the_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[polling]\ntotal_limit = 5\n").expect("write");
        let c = Config::load_from(Some(&path), vec![]).expect("valid");
        assert_eq!(c.polling.total_limit, 5);
        let c = Config::load_from(
            None,
            env(&[(CONFIG_PATH_ENV, path.to_str().expect("utf-8 path"))]),
        )
        .expect("valid");
        assert_eq!(c.polling.total_limit, 5);
        assert_eq!(
            Config::load_from(None, vec![]).expect("valid"),
            Config::default()
        );
    }

    #[test]
    fn unreadable_file_and_bad_syntax_are_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.toml");
        assert!(matches!(
            Config::load_from(Some(&missing), vec![]),
            Err(ConfigError::Read { .. })
        ));
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[polling\ntotal_limit = ").expect("write");
        let err = Config::load_from(Some(&bad), vec![]).expect_err("syntax");
        assert!(matches!(err, ConfigError::Syntax { .. }), "{err}");
        assert_eq!(err.exit_status(), 2);
    }

    #[test]
    fn bundled_default_file_equals_the_built_in_defaults() {
        let c = Config::load_from(Some(&bundled("default.toml")), vec![]).expect("valid");
        assert_eq!(c, Config::default());
    }

    #[test]
    fn bundled_local_file_is_valid() {
        let c = Config::load_from(Some(&bundled("local.toml")), vec![]).expect("valid");
        c.validate().expect("valid");
        assert_eq!(c.telemetry.log_format, LogFormat::Pretty);
        assert_eq!(c.polling.carddata.interval_secs, 10);
        assert_eq!(c.polling.card_status.interval_secs, 20);
        assert_eq!(c.telemetry.listen_addr().expect("addr").port(), 9464);
    }

    #[test]
    fn bundled_production_file_is_valid() {
        let c = Config::load_from(Some(&bundled("production.toml")), vec![]).expect("valid");
        c.validate().expect("valid");
        assert!(!c.maintenance.enabled);
        assert_eq!(
            c.polling.total_limit, 4,
            "the rollout starts with conservative budgets"
        );
        // Credentials come from env, layered over the file.
        let c = Config::load_from(
            Some(&bundled("production.toml")),
            env(&[
                (
                    "CARDWORKER__DATABASE__URL",
                    "postgres://cw:pw@pg:5432/cw?sslmode=verify-full",
                ),
                ("CARDWORKER__REDIS__URL", "rediss://:pw@redis:6380/0"),
            ]),
        )
        .expect("valid");
        assert!(c.redis.url.starts_with("rediss://"));
    }
}
