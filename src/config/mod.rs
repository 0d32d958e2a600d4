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
//! or section anywhere is refused naming its dotted key; the merge records the [`Source`] of
//! every key it sets. Validation then runs once, over the merged table (types, ranges, URL
//! schemes, cron expressions, ...) and over the deserialized [`Config`] (relations between keys),
//! and collects every problem instead of stopping at the first. [`ConfigError::Invalid`] lists
//! them all under one heading, one per line, each naming where its value came from (`default`,
//! the file path as given, or `env NAME`), and for a relation the source of the other key too:
//!
//! ```text
//! invalid configuration (2 problems):
//!   - polling.total_limit = "abc" (from env CARDWORKER__POLLING__TOTAL_LIMIT): must be an integer in 1..=256
//!   - polling.lease_ttl_secs = 60 (from default): must be at least polling.handler_timeout_secs + 5 (58 + 5 = 63) and at most 3600; checked against polling.handler_timeout_secs = 58 (from /etc/cardworker/config.toml)
//! ```
//!
//! Every [`ConfigError`] maps to exit status 2.
//!
//! The URLs that may carry credentials (`database.url`, `redis.url`, `gateway.base_url`) are held
//! in a [`SecretUrl`], whose `Debug` and `Display` redact the password, so that logging a
//! [`Config`] with `{:?}` cannot leak one.
//!
//! # Layout
//!
//! - `types`: the domain types ([`Config`] and its sections, [`Task`], [`LogFormat`]); each
//!   section's fields with their defaults, value rules and `Duration` helpers.
//! - `load`: the layering (defaults -> file -> `CARDWORKER__...` env), the merge that refuses
//!   unknown keys and records the source of every key it sets, the check of every value against
//!   its rule, and [`Config::validate`].
//! - `rules`: what a value rule may say and how a refused value is shown.
//! - `limit`: [`Limit`], a polling limit, whose constructors are the one range check of limits.
//! - `relations`: the checks between keys (limits, timeouts, delays), on the typed [`Config`].
//! - `secret`: [`SecretUrl`] and URL redaction ([`Config::redacted`]).
//! - `source`: [`Source`], where a value came from, and the per-key record the merge keeps.
//! - `error`: [`ConfigError`], [`Problem`] and how a refused value is shown.
//!
//! # Why hand-written layering
//!
//! figment would replace only the merge, not the walk that reports every problem at once nor
//! the env variable names in the sources; `docs/DESIGN.md` has the measurement.

mod error;
mod limit;
mod load;
mod relations;
mod rules;
mod secret;
mod source;
mod types;

pub use error::{ConfigError, Problem, Related};
pub use limit::{Limit, LimitError, LIMIT_CEILING};
pub use secret::{SecretToken, SecretUrl};
pub use source::Source;
pub use types::{
    ApprovalsConfig, CircuitConfig, Config, ConsoleConfig, DatabaseConfig, GatewayConfig,
    LogFormat, MaintenanceConfig, PaymentsConfig, PollingConfig, RedisConfig, Task, TaskConfig,
    TelemetryConfig, WorkerConfig,
};

/// Env var naming the config file when `--config` is not given.
pub const CONFIG_PATH_ENV: &str = "CARDWORKER_CONFIG";

/// Prefix of env overrides: `CARDWORKER__SECTION__KEY`.
pub const ENV_PREFIX: &str = "CARDWORKER__";
