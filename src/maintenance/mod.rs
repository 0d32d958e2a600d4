//! Archive and retention: off by default; when on, exactly one ended Asia/Shanghai day per run.
//!
//! # Layout
//! - [`archive`]: the `RunArchive` job.
//! - [`retention`]: the `RunRetention` job.

pub mod archive;
pub mod retention;

use crate::telemetry::metrics as m;

/// Counts one maintenance run by result.
pub fn count_run(job: &'static str, result: &'static str) {
    metrics::counter!(m::MAINTENANCE_RUNS, "job" => job, "result" => result).increment(1);
}

/// The Redis key of the runtime brake shared by every pod.
pub fn paused_key(prefix: &str) -> String {
    format!("{prefix}:maintenance:paused")
}

/// Sets or lifts the maintenance brake.
pub async fn set_paused(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
    paused: bool,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use redis::AsyncCommands as _;
    let key = paused_key(prefix);
    if paused {
        conn.set::<_, _, ()>(&key, "1").await
    } else {
        conn.del::<_, ()>(&key).await
    }
    .context("writing the maintenance brake to Redis")
}

/// Whether the maintenance brake is set.
pub async fn is_paused(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
) -> anyhow::Result<bool> {
    use anyhow::Context as _;
    use redis::AsyncCommands as _;
    conn.exists(paused_key(prefix))
        .await
        .context("reading the maintenance brake from Redis")
}
