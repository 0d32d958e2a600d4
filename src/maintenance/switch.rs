//! The one answer to "may maintenance run now?".
//!
//! Two things decide it:
//! - the **master switch**, `maintenance.enabled` (off by default), read from this process's
//!   configuration: off, no archive or retention schedule is registered, a queued run is
//!   acknowledged as a no-op without a query on the log, audit or archive tables, and the CLI
//!   says so;
//! - the **brake**, `cardworker maintenance pause|resume`, one Redis key shared by every pod: a
//!   run reads it before any database work and before every batch, and stops at the boundary.
//!
//! Cron registration (`workers`), the no-op acknowledgement and the brake of a run (`run`,
//! `session`), `maintenance status`, the console and the CLI's notes all ask here.

use anyhow::Context as _;
use redis::AsyncCommands as _;

use crate::config::MaintenanceConfig;
use crate::keys::maintenance_paused_key;

/// Whether the master switch is on: the schedules are registered, and queued runs run.
pub fn enabled(config: &MaintenanceConfig) -> bool {
    config.enabled
}

/// Sets or lifts the brake.
pub async fn set_paused(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
    paused: bool,
) -> anyhow::Result<()> {
    let key = maintenance_paused_key(prefix);
    if paused {
        conn.set::<_, _, ()>(&key, "1").await
    } else {
        conn.del::<_, ()>(&key).await
    }
    .context("writing the maintenance brake to Redis")
}

/// Whether the brake is set.
pub async fn is_paused(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
) -> anyhow::Result<bool> {
    conn.exists(maintenance_paused_key(prefix))
        .await
        .context("reading the maintenance brake from Redis")
}

/// What the CLI adds to `maintenance pause|resume` while the switch is off: the brake is
/// recorded, but nothing runs either way.
pub fn brake_note(config: &MaintenanceConfig) -> &'static str {
    if enabled(config) {
        ""
    } else {
        "\nnote: maintenance.enabled is false in this configuration, so archive and retention do not run \
         anyway (queued runs are acknowledged as no-ops); the pause is kept in Redis and applies \
         once maintenance is enabled"
    }
}

/// What the CLI adds to `enqueue archive|retention` while the switch is off.
pub fn enqueue_note(config: &MaintenanceConfig) -> &'static str {
    if enabled(config) {
        ""
    } else {
        "; maintenance.enabled is false, so it will be acknowledged as a no-op"
    }
}
