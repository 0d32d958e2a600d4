//! The domain types of the configuration: [`Config`] and its sections, [`Task`] and
//! [`LogFormat`], their defaults (the values of the spec) and the `Duration` helpers.
//!
//! Nothing here validates: every section is a plain serde struct with `deny_unknown_fields`, and
//! the checks live in `rules` so that one table describes every key.
//!
//! One file on purpose: the sections mirror `config/default.toml` one to one, and a reader checks
//! a key's type, default and unit in one place; about a third of it is the tests of the defaults
//! and of the redaction of secrets.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::secret::{SecretToken, SecretUrl};
#[cfg(doc)]
use super::LIMIT_CEILING;

/// A polling task: each has its own budget section, metric label and job chain.
///
/// One spelling for users: `carddata` and `card_status`, in config sections, metric labels,
/// `budget show`, `investigate`, every message and the command line's help ([`Task::label`]).
/// The command line also accepts `card-status` (spec section 2 names it), as an alias only: no
/// output ever prints it. `ValueEnum` lets clap parse `--task` into a `Task` directly; its names
/// must stay those of `label` (tested).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum Task {
    /// Polls `GET /v1/cards/{card_ref}/data` until the card data is ready.
    #[value(name = "carddata")]
    Carddata,
    /// Polls `GET /v1/cards/{card_ref}/status` until the status is final.
    #[serde(alias = "card-status")]
    #[value(name = "card_status", alias = "card-status")]
    CardStatus,
}

impl Task {
    /// Every polling task, in a fixed order.
    pub const ALL: [Task; 2] = [Task::Carddata, Task::CardStatus];

    /// The one name users see: `carddata` or `card_status` (config sections, metric labels,
    /// every output).
    pub const fn label(self) -> &'static str {
        match self {
            Task::Carddata => "carddata",
            Task::CardStatus => "card_status",
        }
    }

    /// The name a message shows for a command-line argument (`cardworker enqueue card_status`):
    /// the same as [`Task::label`], one spelling for users. `card-status` is still accepted
    /// when parsing, never shown.
    pub const fn cli_name(self) -> &'static str {
        self.label()
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for Task {
    type Err = String;

    /// Accepts `carddata`, `card_status` and its alias `card-status`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "carddata" => Ok(Task::Carddata),
            "card_status" | "card-status" => Ok(Task::CardStatus),
            other => Err(format!(
                "unknown task {other:?}: must be carddata or card_status"
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
    /// `[approvals]`: approval submission and recovery.
    pub approvals: ApprovalsConfig,
    /// `[maintenance]`: archive and retention.
    pub maintenance: MaintenanceConfig,
    /// `[telemetry]`: HTTP endpoint and logs.
    pub telemetry: TelemetryConfig,
    /// `[console]`: the operator's console (`cardworker console`).
    pub console: ConsoleConfig,
}

/// `[database]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `postgres://` or `postgresql://` URL; may carry a password (redacted when shown).
    pub url: SecretUrl,
    /// Pool size, 1..=200.
    pub max_connections: u32,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: SecretUrl::from("postgres://root@127.0.0.1:5432/cardworker"),
            max_connections: 10,
        }
    }
}

/// `[redis]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` URL; may carry a password (redacted when shown).
    pub url: SecretUrl,
    /// Every Redis key and queue of this deployment lives under it. Non-empty,
    /// `[A-Za-z0-9_.-]` only.
    pub key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: SecretUrl::from("redis://127.0.0.1:6379/0"),
            key_prefix: "cardworker".to_owned(),
        }
    }
}

/// `[gateway]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// `http://` or `https://` base URL of the Gateway. It may carry user info (basic
    /// credentials), so it is redacted when shown like the other URLs.
    pub base_url: SecretUrl,
    /// Timeout of one Gateway call in milliseconds, 100..=60000.
    pub timeout_ms: u64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            base_url: SecretUrl::from("http://127.0.0.1:8089"),
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
    /// How long a Redis outage is ridden out (workers stop fetching, restart when Redis answers)
    /// before the process exits non-zero, 0..=3600 s; 0 exits at the first outage.
    pub redis_outage_grace_secs: u64,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            shutdown_grace_secs: 30,
            redis_outage_grace_secs: 60,
        }
    }
}

impl WorkerConfig {
    /// `shutdown_grace_secs` as a [`Duration`].
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs(self.shutdown_grace_secs)
    }

    /// `redis_outage_grace_secs` as a [`Duration`].
    pub fn redis_outage_grace(&self) -> Duration {
        Duration::from_secs(self.redis_outage_grace_secs)
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
    /// `[polling.circuit]`: the fleet-wide Gateway circuit breaker (one per task).
    pub circuit: CircuitConfig,
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
            circuit: CircuitConfig::default(),
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
    /// A parked chain is probed again (one poll) this long after it was parked,
    /// 1..=2592000 s; a success un-parks it.
    pub parked_retry_secs: u64,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            limit: 4,
            interval_secs: 30,
            max_consecutive_failures: 10,
            parked_retry_secs: 21_600,
        }
    }
}

impl TaskConfig {
    /// `interval_secs` as a [`Duration`].
    pub fn interval(&self) -> Duration {
        Duration::from_secs(self.interval_secs)
    }

    /// `parked_retry_secs` as a [`Duration`].
    pub fn parked_retry(&self) -> Duration {
        Duration::from_secs(self.parked_retry_secs)
    }
}

/// `[polling.circuit]`: when the Gateway fails broadly, every pod stops calling it for a polling
/// task (the state is in Redis, shared by the fleet); see `budget::circuit`.
///
/// The window is the last `window_calls` Gateway outcomes of the task, fleet-wide, of which only
/// those younger than `window_secs` count. The circuit opens when at least `min_calls` of them
/// count, at least `failure_percent` % of those failed (failed, unknown or timed out), and the
/// failures are about at least `min_failing_cards` distinct cards (a few bad cards are parked,
/// they never open the circuit). After
/// `cooldown_secs` it lets `half_open_probes` polls through: a success closes it, a failure
/// opens it again with twice the cool-down, up to `max_cooldown_secs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CircuitConfig {
    /// Whether the breaker opens by itself (an operator can force it either way regardless).
    pub enabled: bool,
    /// How many of the latest outcomes the window holds, 2..=10000.
    pub window_calls: u32,
    /// Outcomes older than this do not count, 1..=3600 s.
    pub window_secs: u64,
    /// Fewer counted outcomes never open the circuit, 1..=10000 and at most `window_calls`.
    pub min_calls: u32,
    /// Failures about fewer distinct cards never open it, 1..=10000 and at most `min_calls`.
    pub min_failing_cards: u32,
    /// The share of failed outcomes that opens it, 1..=100 (percent).
    pub failure_percent: u32,
    /// The first cool-down before probes are let through, 1..=3600 s.
    pub cooldown_secs: u64,
    /// The cool-down doubles after each failed probe, up to this; `>= cooldown_secs`, `<= 3600`.
    pub max_cooldown_secs: u64,
    /// Probe polls let through when the cool-down is over, 1..=100.
    pub half_open_probes: u32,
}

impl Default for CircuitConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window_calls: 20,
            window_secs: 60,
            min_calls: 10,
            min_failing_cards: 3,
            failure_percent: 50,
            cooldown_secs: 10,
            max_cooldown_secs: 120,
            half_open_probes: 2,
        }
    }
}

impl CircuitConfig {
    /// `cooldown_secs` as a [`Duration`].
    pub fn cooldown(&self) -> Duration {
        Duration::from_secs(self.cooldown_secs)
    }

    /// `max_cooldown_secs` as a [`Duration`].
    pub fn max_cooldown(&self) -> Duration {
        Duration::from_secs(self.max_cooldown_secs)
    }

    /// `window_secs` as a [`Duration`].
    pub fn window(&self) -> Duration {
        Duration::from_secs(self.window_secs)
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

/// `[approvals]` (spec section 7)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApprovalsConfig {
    /// Worker concurrency for approval submission, 1..=256.
    pub concurrency: u32,
    /// A requested/pending/unknown approval untouched this long is queried, 10..=86400.
    pub recovery_after_secs: u64,
    /// An in_review approval not queried for this long is queried again, 60..=86400.
    pub review_query_secs: u64,
    /// Cron of approval recovery (Asia/Shanghai); not gated by `maintenance.enabled`.
    pub recovery_cron: String,
}

impl Default for ApprovalsConfig {
    fn default() -> Self {
        Self {
            concurrency: 4,
            recovery_after_secs: 300,
            review_query_secs: 900,
            recovery_cron: "30 * * * * *".to_owned(),
        }
    }
}

impl ApprovalsConfig {
    /// `recovery_after_secs` as a [`Duration`].
    pub fn recovery_after(&self) -> Duration {
        Duration::from_secs(self.recovery_after_secs)
    }

    /// `review_query_secs` as a [`Duration`].
    pub fn review_query(&self) -> Duration {
        Duration::from_secs(self.review_query_secs)
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
    /// Seconds between two background reads of the fleet-wide gauges (tokens, limits, circuits,
    /// parked chains, queue depth) while the endpoint is scraped; 1..=30.
    pub fleet_gauges_secs: u64,
    /// Seconds without a scrape after which the background reads of the fleet-wide gauges pause
    /// (the next scrape wakes them and waits up to a second for a fresh round); 1..=3600.
    pub fleet_gauges_idle_secs: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:9464".to_owned(),
            log_format: LogFormat::Json,
            fleet_gauges_secs: 10,
            fleet_gauges_idle_secs: 300,
        }
    }
}

impl TelemetryConfig {
    /// `fleet_gauges_secs` as a [`Duration`].
    pub fn fleet_gauges_every(&self) -> Duration {
        Duration::from_secs(self.fleet_gauges_secs)
    }

    /// `fleet_gauges_idle_secs` as a [`Duration`].
    pub fn fleet_gauges_idle(&self) -> Duration {
        Duration::from_secs(self.fleet_gauges_idle_secs)
    }
}

/// `[console]` (spec section 8): the operator's console, a process of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleConfig {
    /// Listen address of `cardworker console` (loopback by default); a socket address.
    pub listen: String,
    /// The token every console action needs. Accepted only from env
    /// `CARDWORKER__CONSOLE__ADMIN_TOKEN` (a mounted Secret goes through it), never from a file;
    /// empty = the console is read-only.
    pub admin_token: SecretToken,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9465".to_owned(),
            admin_token: SecretToken::default(),
        }
    }
}

impl Config {
    /// The configuration as a TOML document (call [`Config::redacted`] first before showing it:
    /// serialization writes the real URLs).
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        Ok(toml::to_string_pretty(self)?)
    }
}

impl Config {
    /// A copy with the passwords in `database.url`, `redis.url` and `gateway.base_url` (user
    /// info and a `password` query parameter) replaced by `***`, for showing: unlike `Debug`,
    /// serializing a [`SecretUrl`] writes what it holds, so `check-config` renders this copy.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        c.database.url = SecretUrl::new(c.database.url.redacted());
        c.redis.url = SecretUrl::new(c.redis.url.redacted());
        c.gateway.base_url = SecretUrl::new(c.gateway.base_url.redacted());
        if c.console.admin_token.expose().is_some() {
            c.console.admin_token = SecretToken::new("***");
        }
        c
    }
}
