//! The domain types of the configuration: [`Config`] and its sections, [`Task`] and
//! [`LogFormat`].
//!
//! The sections mirror `config/default.toml` one to one, each declared with `section!`: a key's
//! type, default, [`Rule`] and `Duration` getter on one line, the one table of keys. Nothing here
//! validates; `load` checks every key against its rule on the merged TOML table.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::rules::Rule;
use crate::limit::Limit;
use crate::secret::{SecretToken, SecretUrl};

/// A polling task: each has its own budget section, metric label and job chain. One spelling
/// for users, [`Task::label`], in config sections, metric labels and every output; the command
/// line (clap's `ValueEnum`, its names tested to be those of `label`) also accepts
/// `card-status`, as an alias only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[derive(clap::ValueEnum)]
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

    /// The one name users see: `carddata` or `card_status`.
    pub const fn label(self) -> &'static str {
        match self {
            Task::Carddata => "carddata",
            Task::CardStatus => "card_status",
        }
    }

    /// The name a message shows for a command-line argument: [`Task::label`].
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
            _ => Err(format!(
                "unknown task {s:?}: must be carddata or card_status"
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

/// Declares a section: the struct (every field defaulted, unknown fields refused), its `Default`
/// (the value written beside each field, else `Default::default()`), its [`Rule`] and a
/// `Duration` getter for each field that names one (`=> getter from_secs`).
macro_rules! section {
    (
        $(#[$meta:meta])*
        $name:ident {
            $(
                $(#[$field_meta:meta])*
                $field:ident: $ty:ty $(= $default:expr)?, $rule:expr $(=> $getter:ident $unit:ident)?;
            )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $($(#[$field_meta])* pub $field: $ty,)*
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $($field: default_or!($($default)?),)* }
            }
        }

        impl $name {
            /// This section's rule: the rule of each key, named relative to it.
            pub(super) const RULE: Rule = Rule::Section(&[$((stringify!($field), $rule),)*]);

            $($(
                #[doc = concat!("`", stringify!($field), "` as a [`Duration`].")]
                pub fn $getter(&self) -> Duration {
                    Duration::$unit(self.$field)
                }
            )?)*
        }
    };
}

macro_rules! default_or {
    () => {
        Default::default()
    };
    ($e:expr) => {
        $e
    };
}

section! {
    /// The whole configuration; see the module docs for how it is layered and validated. Each
    /// key's meaning, default and range is documented in `config/default.toml`.
    Config {
        database: DatabaseConfig, DatabaseConfig::RULE;
        redis: RedisConfig, RedisConfig::RULE;
        gateway: GatewayConfig, GatewayConfig::RULE;
        worker: WorkerConfig, WorkerConfig::RULE;
        polling: PollingConfig, PollingConfig::RULE;
        payments: PaymentsConfig, PaymentsConfig::RULE;
        approvals: ApprovalsConfig, ApprovalsConfig::RULE;
        maintenance: MaintenanceConfig, MaintenanceConfig::RULE;
        telemetry: TelemetryConfig, TelemetryConfig::RULE;
        console: ConsoleConfig, ConsoleConfig::RULE;
    }
}

section! {
    /// `[database]`
    DatabaseConfig {
        url: SecretUrl = "postgres://root@127.0.0.1:5432/cardworker".into(),
            Rule::Url(&["postgres", "postgresql"]);
        max_connections: u32 = 10, Rule::Int(1, 200);
    }
}

section! {
    /// `[redis]`
    RedisConfig {
        url: SecretUrl = "redis://127.0.0.1:6379/0".into(), Rule::Url(&["redis", "rediss"]);
        key_prefix: String = "cardworker".to_owned(), Rule::KeyPrefix;
    }
}

section! {
    /// `[gateway]`
    GatewayConfig {
        base_url: SecretUrl = "http://127.0.0.1:8089".into(), Rule::Url(&["http", "https"]);
        timeout_ms: u64 = 5000, Rule::Int(100, 60_000) => timeout from_millis;
    }
}

section! {
    /// `[worker]`
    WorkerConfig {
        shutdown_grace_secs: u64 = 30, Rule::Int(1, 600) => shutdown_grace from_secs;
        redis_outage_grace_secs: u64 = 60, Rule::Int(0, 3600) => redis_outage_grace from_secs;
    }
}

section! {
    /// `[polling]`
    PollingConfig {
        total_limit: Limit = limit(8), Rule::Limit;
        handler_timeout_secs: u64 = 15, Rule::Int(1, 3595) => handler_timeout from_secs;
        lease_ttl_secs: u64 = 60, Rule::Int(6, 3600) => lease_ttl from_secs;
        defer_delay_secs: u64 = 2, Rule::Int(1, 60) => defer_delay from_secs;
        defer_max_delay_secs: u64 = 30, Rule::Int(1, 600) => defer_max_delay from_secs;
        reconcile_cron: String = "0 */10 * * * *".to_owned(), Rule::Cron;
        reconcile_batch: u32 = 2000, Rule::Int(1, 100_000);
        carddata: TaskConfig, TaskConfig::RULE;
        card_status: TaskConfig = TaskConfig { interval_secs: 300, ..TaskConfig::default() },
            TaskConfig::RULE;
        circuit: CircuitConfig, CircuitConfig::RULE;
    }
}

/// `n` as a [`Limit`], checked when the constant is evaluated (at compile time).
const fn limit(n: u32) -> Limit {
    match Limit::new(n) {
        Ok(l) => l,
        Err(_) => panic!("a default limit is out of range"),
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
}

section! {
    /// `[polling.carddata]` and `[polling.card_status]`
    TaskConfig {
        limit: Limit = limit(4), Rule::Limit;
        interval_secs: u64 = 30, Rule::Int(1, 86_400) => interval from_secs;
        max_consecutive_failures: u32 = 10, Rule::Int(1, 1000);
        parked_retry_secs: u64 = 21_600, Rule::Int(1, 2_592_000) => parked_retry from_secs;
    }
}

section! {
    /// `[polling.circuit]`: the fleet-wide Gateway circuit breaker of each polling task (state
    /// in Redis); see `budget::circuit` and `config/default.toml`.
    CircuitConfig {
        enabled: bool = true, Rule::Bool;
        window_calls: u32 = 20, Rule::Int(2, 10_000);
        window_secs: u64 = 60, Rule::Int(1, 3600) => window from_secs;
        min_calls: u32 = 10, Rule::Int(1, 10_000);
        min_failing_cards: u32 = 3, Rule::Int(1, 10_000);
        failure_percent: u32 = 50, Rule::Int(1, 100);
        cooldown_secs: u64 = 10, Rule::Int(1, 3600) => cooldown from_secs;
        max_cooldown_secs: u64 = 120, Rule::Int(1, 3600) => max_cooldown from_secs;
        half_open_probes: u32 = 2, Rule::Int(1, 100);
    }
}

section! {
    /// `[payments]`
    PaymentsConfig {
        concurrency: u32 = 4, Rule::Int(1, 256);
        recovery_after_secs: u64 = 300, Rule::Int(10, 86_400) => recovery_after from_secs;
        recovery_cron: String = "0 * * * * *".to_owned(), Rule::Cron;
    }
}

section! {
    /// `[approvals]`
    ApprovalsConfig {
        concurrency: u32 = 4, Rule::Int(1, 256);
        recovery_after_secs: u64 = 300, Rule::Int(10, 86_400) => recovery_after from_secs;
        review_query_secs: u64 = 900, Rule::Int(60, 86_400) => review_query from_secs;
        recovery_cron: String = "30 * * * * *".to_owned(), Rule::Cron;
    }
}

section! {
    /// `[maintenance]`
    MaintenanceConfig {
        enabled: bool = false, Rule::Bool;
        cleanup_enabled: bool = false, Rule::Bool;
        archive_cron: String = "0 30 3 * * *".to_owned(), Rule::Cron;
        retention_cron: String = "0 0 4 * * *".to_owned(), Rule::Cron;
        archive_after_days: u32 = 30, Rule::Int(1, 3650);
        retention_days: u32 = 180, Rule::Int(1, 36_500);
        batch_size: u32 = 1000, Rule::Int(1, 100_000);
        statement_timeout_ms: u64 = 5000, Rule::Int(100, 600_000) => statement_timeout from_millis;
    }
}

section! {
    /// `[telemetry]`
    TelemetryConfig {
        listen: String = "0.0.0.0:9464".to_owned(), Rule::SocketAddr;
        log_format: LogFormat, Rule::LogFormat;
        fleet_gauges_secs: u64 = 10, Rule::Int(1, 30) => fleet_gauges_every from_secs;
        fleet_gauges_idle_secs: u64 = 300, Rule::Int(1, 3600) => fleet_gauges_idle from_secs;
    }
}

section! {
    /// `[console]`: the operator's console, a process of its own.
    ConsoleConfig {
        listen: String = "127.0.0.1:9465".to_owned(), Rule::SocketAddr;
        admin_token: SecretToken, Rule::EnvOnlyToken;
    }
}

impl Config {
    /// The configuration as a TOML document (call [`Config::redacted`] first before showing it:
    /// serialization writes the real URLs).
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        Ok(toml::to_string_pretty(self)?)
    }

    /// A copy with the passwords in `database.url`, `redis.url` and `gateway.base_url` and the
    /// console's token replaced by `***`, for showing (`check-config` renders this copy).
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        for url in [
            &mut c.database.url,
            &mut c.redis.url,
            &mut c.gateway.base_url,
        ] {
            *url = SecretUrl::new(url.redacted());
        }
        if c.console.admin_token.expose().is_some() {
            c.console.admin_token = SecretToken::new("***");
        }
        c
    }
}
