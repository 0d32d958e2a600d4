//! PostgreSQL: the pool, the embedded migrations, and the writers of investigable records.
//!
//! # Layout
//! - this file: [`connect`] and [`migrate`].
//! - [`cards`]: the `cards` table, with optimistic version checks.
//! - [`card_reads`]: one process's concurrent card reads, sent several to a query.
//! - [`records`]: the audit writer, the terminal record path (changes and failures only) and the
//!   outbox writer.
//! - [`fault`]: transient or deterministic database errors, and free text fit to be stored (no
//!   NUL, no card number).
//! - [`ident`]: identifiers, stored exactly as received, and what an identifier may not be.
//!
//! The pending record of a money-moving call (written before the call, finalised with the
//! domain change and an outbox event) is part of the reliable path, `crate::reliable::pending`.

pub mod card_reads;
pub mod cards;
pub mod fault;
pub mod ident;
pub mod records;

use std::time::Duration;

use anyhow::Context as _;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::config::DatabaseConfig;

/// The migrations under `migrations/`, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Opens the pool. TLS follows the URL (`sslmode=verify-full&sslrootcert=…`).
pub async fn connect(config: &DatabaseConfig) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = config
        .url
        .expose()
        .parse()
        .context("parsing database.url")?;
    PgPoolOptions::new()
        .max_connections(config.max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .context("connecting to PostgreSQL")
}

/// Applies the embedded migrations (idempotent).
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR
        .run(pool)
        .await
        .context("applying database migrations")
}
