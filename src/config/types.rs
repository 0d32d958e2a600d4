//! The domain types of the configuration: [`Config`] and its sections, [`Task`] and
//! [`LogFormat`], their defaults (the values of the spec) and the `Duration` helpers.
//!
//! Nothing here validates: every section is a plain serde struct with `deny_unknown_fields`, and
//! the checks live in `rules` so that one table describes every key.
//!
//! The sections mirror `config/default.toml` one to one, each declared with `section!`: a
//! field's type, doc, default and `Duration` getter on one line, so that a reader checks a key's
//! type, default and unit in one place.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use std::net::SocketAddr;

use super::error::{ConfigError, Problem};
use super::limit::Limit;
use super::rules::{int, int_note, show_str, Rule};
use super::secret::{SecretToken, SecretUrl};
use super::source::Source;
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

/// Declares a section: the struct (every field defaulted, unknown fields refused), its `Default`
/// from the value written beside each field, the [`Rule`] of each field (`RULES`) and a
/// `Duration` getter for each field that names one (`=> getter from_secs`).
macro_rules! section {
    (
        $(#[$meta:meta])*
        $name:ident {
            $(
                $(#[$field_meta:meta])*
                $field:ident: $ty:ty = $default:expr, $rule:expr $(=> $getter:ident $unit:ident)?;
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
                Self { $($field: $default,)* }
            }
        }

        impl $name {
            /// The rule of each key of this section, named relative to it.
            pub(super) const RULES: &'static [(&'static str, Rule)] =
                &[$((stringify!($field), $rule),)*];

            $($(
                #[doc = concat!("`", stringify!($field), "` as a [`Duration`].")]
                pub fn $getter(&self) -> Duration {
                    Duration::$unit(self.$field)
                }
            )?)*
        }
    };
}

section! {
    /// The whole configuration; see the module docs for how it is layered and validated.
    Config {
        /// `[database]`: PostgreSQL.
        database: DatabaseConfig = DatabaseConfig::default(), Rule::Section(DatabaseConfig::RULES);
        /// `[redis]`: Redis (queues, budgets, runtime brakes).
        redis: RedisConfig = RedisConfig::default(), Rule::Section(RedisConfig::RULES);
        /// `[gateway]`: the card/payment Gateway.
        gateway: GatewayConfig = GatewayConfig::default(), Rule::Section(GatewayConfig::RULES);
        /// `[worker]`: process lifecycle.
        worker: WorkerConfig = WorkerConfig::default(), Rule::Section(WorkerConfig::RULES);
        /// `[polling]`: polling budgets and chains.
        polling: PollingConfig = PollingConfig::default(), Rule::Section(PollingConfig::RULES);
        /// `[payments]`: payment submission and recovery.
        payments: PaymentsConfig = PaymentsConfig::default(), Rule::Section(PaymentsConfig::RULES);
        /// `[approvals]`: approval submission and recovery.
        approvals: ApprovalsConfig = ApprovalsConfig::default(),
            Rule::Section(ApprovalsConfig::RULES);
        /// `[maintenance]`: archive and retention.
        maintenance: MaintenanceConfig = MaintenanceConfig::default(),
            Rule::Section(MaintenanceConfig::RULES);
        /// `[telemetry]`: HTTP endpoint and logs.
        telemetry: TelemetryConfig = TelemetryConfig::default(),
            Rule::Section(TelemetryConfig::RULES);
        /// `[console]`: the operator's console (`cardworker console`).
        console: ConsoleConfig = ConsoleConfig::default(), Rule::Section(ConsoleConfig::RULES);
    }
}

section! {
    /// `[database]`
    DatabaseConfig {
        /// `postgres://` or `postgresql://` URL; may carry a password (redacted when shown).
        url: SecretUrl = SecretUrl::from("postgres://root@127.0.0.1:5432/cardworker"),
            Rule::Url(&["postgres", "postgresql"]);
        /// Pool size, 1..=200.
        max_connections: u32 = 10, int(1, 200);
    }
}

section! {
    /// `[redis]`
    RedisConfig {
        /// `redis://` or `rediss://` URL; may carry a password (redacted when shown).
        url: SecretUrl = SecretUrl::from("redis://127.0.0.1:6379/0"),
            Rule::Url(&["redis", "rediss"]);
        /// Every Redis key and queue of this deployment lives under it. Non-empty,
        /// `[A-Za-z0-9_.-]` only.
        key_prefix: String = "cardworker".to_owned(), Rule::KeyPrefix;
    }
}

section! {
    /// `[gateway]`
    GatewayConfig {
        /// `http://` or `https://` base URL of the Gateway. It may carry user info (basic
        /// credentials), so it is redacted when shown like the other URLs.
        base_url: SecretUrl = SecretUrl::from("http://127.0.0.1:8089"),
            Rule::Url(&["http", "https"]);
        /// Timeout of one Gateway call in milliseconds, 100..=60000.
        timeout_ms: u64 = 5000, int(100, 60_000) => timeout from_millis;
    }
}

section! {
    /// `[worker]`
    WorkerConfig {
        /// Time in-flight jobs get to finish on shutdown, 1..=600 s.
        shutdown_grace_secs: u64 = 30, int(1, 600) => shutdown_grace from_secs;
        /// How long a Redis outage is ridden out (workers stop fetching, restart when Redis
        /// answers) before the process exits non-zero, 0..=3600 s; 0 exits at the first outage.
        redis_outage_grace_secs: u64 = 60, int(0, 3600) => redis_outage_grace from_secs;
    }
}

section! {
    /// `[polling]`
    PollingConfig {
        /// Tokens for all polling tasks together, fleet-wide, 1..=[`LIMIT_CEILING`].
        total_limit: Limit = DEFAULT_TOTAL_LIMIT, Rule::Limit { note: "" };
        /// Hard limit on one poll in seconds; greater than the gateway timeout + 1 s.
        handler_timeout_secs: u64 = 15,
            int_note(1, 3595, ", and greater than (gateway.timeout_ms + 1000 ms) in seconds")
            => handler_timeout from_secs;
        /// Token lease in seconds; `>= handler_timeout_secs + 5`, `<= 3600`.
        lease_ttl_secs: u64 = 60,
            int_note(6, 3600, ", and at least polling.handler_timeout_secs + 5")
            => lease_ttl from_secs;
        /// First delay for a job deferred for lack of tokens, 1..=60 s.
        defer_delay_secs: u64 = 2, int(1, 60) => defer_delay from_secs;
        /// Cap of the (jittered, growing) defer delay; `>= defer_delay_secs`, `<= 600`.
        defer_max_delay_secs: u64 = 30,
            int_note(1, 600, ", and at least polling.defer_delay_secs")
            => defer_max_delay from_secs;
        /// Cron of the scheduled reconcile (six or seven fields, seconds first; Asia/Shanghai).
        reconcile_cron: String = "0 */10 * * * *".to_owned(), Rule::Cron;
        /// Cards examined per scheduled reconcile run, 1..=100000.
        reconcile_batch: u32 = 2000, int(1, 100_000);
        /// `[polling.carddata]`
        carddata: TaskConfig = TaskConfig::default(), Rule::Section(TaskConfig::RULES);
        /// `[polling.card_status]`
        card_status: TaskConfig = TaskConfig {
            interval_secs: 300,
            ..TaskConfig::default()
        }, Rule::Section(TaskConfig::RULES);
        /// `[polling.circuit]`: the fleet-wide Gateway circuit breaker (one per task).
        circuit: CircuitConfig = CircuitConfig::default(), Rule::Section(CircuitConfig::RULES);
    }
}

/// `n` as a [`Limit`], checked when the constant is evaluated (at compile time).
const fn limit(n: u32) -> Limit {
    match Limit::new(n) {
        Ok(l) => l,
        Err(_) => panic!("a default limit is out of range"),
    }
}

/// The default of `polling.total_limit`.
const DEFAULT_TOTAL_LIMIT: Limit = limit(8);

/// The default of each task's `limit`.
const DEFAULT_TASK_LIMIT: Limit = limit(4);

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
        /// Per-task token limit, 1..=[`LIMIT_CEILING`] and `<= total_limit`; `budget set`
        /// overrides it at run time.
        limit: Limit = DEFAULT_TASK_LIMIT,
            Rule::Limit { note: ", and at most polling.total_limit" };
        /// Delay between two polls of one card, 1..=86400 s.
        interval_secs: u64 = 30, int(1, 86_400) => interval from_secs;
        /// Consecutive failed polls after which the chain is parked, 1..=1000.
        max_consecutive_failures: u32 = 10, int(1, 1000);
        /// A parked chain is probed again (one poll) this long after it was parked,
        /// 1..=2592000 s; a success un-parks it.
        parked_retry_secs: u64 = 21_600, int(1, 2_592_000) => parked_retry from_secs;
    }
}

section! {
    /// `[polling.circuit]`: when the Gateway fails broadly, every pod stops calling it for a
    /// polling task (the state is in Redis, shared by the fleet); see `budget::circuit`.
    ///
    /// The window is the last `window_calls` Gateway outcomes of the task, fleet-wide, of which
    /// only those younger than `window_secs` count. The circuit opens when at least `min_calls`
    /// of them count, at least `failure_percent` % of those failed (failed, unknown or timed
    /// out), and the failures are about at least `min_failing_cards` distinct cards (a few bad
    /// cards are parked, they never open the circuit). After `cooldown_secs` it lets
    /// `half_open_probes` polls through: a success closes it, a failure opens it again with twice
    /// the cool-down, up to `max_cooldown_secs`.
    CircuitConfig {
        /// Whether the breaker opens by itself (an operator can force it either way regardless).
        enabled: bool = true, Rule::Bool;
        /// How many of the latest outcomes the window holds, 2..=10000.
        window_calls: u32 = 20, int(2, 10_000);
        /// Outcomes older than this do not count, 1..=3600 s.
        window_secs: u64 = 60, int(1, 3600) => window from_secs;
        /// Fewer counted outcomes never open the circuit, 1..=10000 and at most `window_calls`.
        min_calls: u32 = 10, int_note(1, 10_000, ", and at most polling.circuit.window_calls");
        /// Failures about fewer distinct cards never open it, 1..=10000 and at most `min_calls`.
        min_failing_cards: u32 = 3, int_note(1, 10_000, ", and at most polling.circuit.min_calls");
        /// The share of failed outcomes that opens it, 1..=100 (percent).
        failure_percent: u32 = 50, int(1, 100);
        /// The first cool-down before probes are let through, 1..=3600 s.
        cooldown_secs: u64 = 10, int(1, 3600) => cooldown from_secs;
        /// The cool-down doubles after each failed probe, up to this; `>= cooldown_secs`,
        /// `<= 3600`.
        max_cooldown_secs: u64 = 120,
            int_note(1, 3600, ", and at least polling.circuit.cooldown_secs")
            => max_cooldown from_secs;
        /// Probe polls let through when the cool-down is over, 1..=100.
        half_open_probes: u32 = 2, int(1, 100);
    }
}

section! {
    /// `[payments]`
    PaymentsConfig {
        /// Worker concurrency for payment submission (not a polling budget), 1..=256.
        concurrency: u32 = 4, int(1, 256);
        /// A payment still pending/unknown after this many seconds is reconciled, 10..=86400.
        recovery_after_secs: u64 = 300, int(10, 86_400) => recovery_after from_secs;
        /// Cron of payment recovery (Asia/Shanghai); not gated by `maintenance.enabled`.
        recovery_cron: String = "0 * * * * *".to_owned(), Rule::Cron;
    }
}

section! {
    /// `[approvals]` (spec section 7)
    ApprovalsConfig {
        /// Worker concurrency for approval submission, 1..=256.
        concurrency: u32 = 4, int(1, 256);
        /// A requested/pending/unknown approval untouched this long is queried, 10..=86400.
        recovery_after_secs: u64 = 300, int(10, 86_400) => recovery_after from_secs;
        /// An in_review approval not queried for this long is queried again, 60..=86400.
        review_query_secs: u64 = 900, int(60, 86_400) => review_query from_secs;
        /// Cron of approval recovery (Asia/Shanghai); not gated by `maintenance.enabled`.
        recovery_cron: String = "30 * * * * *".to_owned(), Rule::Cron;
    }
}

section! {
    /// `[maintenance]`
    MaintenanceConfig {
        /// Master switch for archive and retention; off by default.
        enabled: bool = false, Rule::Bool;
        /// Physical deletion in retention (AuditRetentionCleanupEnabled).
        cleanup_enabled: bool = false, Rule::Bool;
        /// Cron of the archive run (Asia/Shanghai).
        archive_cron: String = "0 30 3 * * *".to_owned(), Rule::Cron;
        /// Cron of the retention run (Asia/Shanghai).
        retention_cron: String = "0 0 4 * * *".to_owned(), Rule::Cron;
        /// Day D is due for archive when D + this < today (Shanghai), 1..=3650.
        archive_after_days: u32 = 30, int(1, 3650);
        /// Retention horizon in days, 1..=36500.
        retention_days: u32 = 180, int(1, 36_500);
        /// Rows per transaction, 1..=100000.
        batch_size: u32 = 1000, int(1, 100_000);
        /// Statement timeout for maintenance statements, 100..=600000 ms.
        statement_timeout_ms: u64 = 5000, int(100, 600_000) => statement_timeout from_millis;
    }
}

section! {
    /// `[telemetry]`
    TelemetryConfig {
        /// Listen address of `/metrics`, `/healthz`, `/readyz`; a socket address.
        listen: String = "0.0.0.0:9464".to_owned(), Rule::SocketAddr;
        /// `json` or `pretty`.
        log_format: LogFormat = LogFormat::Json, Rule::LogFormat;
        /// Seconds between two background reads of the fleet-wide gauges (tokens, limits,
        /// circuits, parked chains, queue depth) while the endpoint is scraped; 1..=30.
        fleet_gauges_secs: u64 = 10, int(1, 30) => fleet_gauges_every from_secs;
        /// Seconds without a scrape after which the background reads of the fleet-wide gauges
        /// pause (the next scrape wakes them and waits up to a second for a fresh round);
        /// 1..=3600.
        fleet_gauges_idle_secs: u64 = 300, int(1, 3600) => fleet_gauges_idle from_secs;
    }
}

section! {
    /// `[console]` (spec section 8): the operator's console, a process of its own.
    ConsoleConfig {
        /// Listen address of `cardworker console` (loopback by default); a socket address.
        listen: String = "127.0.0.1:9465".to_owned(), Rule::SocketAddr;
        /// The token every console action needs. Accepted only from env
        /// `CARDWORKER__CONSOLE__ADMIN_TOKEN` (a mounted Secret goes through it), never from a
        /// file; empty = the console is read-only.
        admin_token: SecretToken = SecretToken::default(), Rule::EnvOnlyToken;
    }
}

impl Config {
    /// The configuration as a TOML document (call [`Config::redacted`] first before showing it:
    /// serialization writes the real URLs).
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        Ok(toml::to_string_pretty(self)?)
    }

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

impl TelemetryConfig {
    /// `listen` as a [`SocketAddr`] (validated at load time).
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| {
            // Loading has checked the address, so only a config built in code gets here.
            ConfigError::Invalid(vec![Problem::new(
                "telemetry.listen",
                show_str(&self.listen),
                Source::Code,
                Rule::SocketAddr.allowed(),
            )])
        })
    }
}
