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
//!    it parses as one, else as a string (and then refused if a number was due).
//!
//! Validation runs once, over the merged table, and collects every problem instead of stopping
//! at the first. [`ConfigError::Invalid`] lists them all, one per line, each naming where its
//! value came from (`default`, the file path as given, or `env NAME`), and for a relation the
//! source of the other key too:
//!
//! ```text
//! invalid configuration (2 problems):
//!   - polling.total_limit = "abc" (from env CARDWORKER__POLLING__TOTAL_LIMIT): must be an integer in 1..=256
//!   - polling.lease_ttl_secs = 60 (from default): must be at least polling.handler_timeout_secs + 5 (58 + 5 = 63) and at most 3600; checked against polling.handler_timeout_secs = 58 (from /etc/cardworker/config.toml)
//! ```
//!
//! Every [`ConfigError`] maps to exit status 2. `docs/DESIGN.md` describes the files and why the
//! layering is ours rather than figment's.

mod error;
mod load;
mod rules;
mod types;

pub use error::{ConfigError, Problem, Related, Source};
pub use types::{
    ApprovalsConfig, CircuitConfig, Config, ConsoleConfig, DatabaseConfig, GatewayConfig,
    LogFormat, MaintenanceConfig, PaymentsConfig, PollingConfig, RedisConfig, Task, TaskConfig,
    TelemetryConfig, WorkerConfig,
};

/// Env var naming the config file when `--config` is not given.
pub const CONFIG_PATH_ENV: &str = "CARDWORKER_CONFIG";

/// Prefix of env overrides: `CARDWORKER__SECTION__KEY`.
pub const ENV_PREFIX: &str = "CARDWORKER__";
