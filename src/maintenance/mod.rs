//! Archive and retention: off by default; when on, exactly one ended Asia/Shanghai day per run.
//!
//! Operating guide: docs/MAINTENANCE.md.
//!
//! # Layout
//! - [`archive`]: the `RunArchive` job (one day of online records into the archive tables).
//! - [`retention`]: the `RunRetention` job (one expired day of the archive: delete or count).
//! - [`run`]: the frame both share: brake, advisory lock on a dedicated session,
//!   `statement_timeout`, batch boundaries, metrics and the log line per run.
//! - [`day`]: Asia/Shanghai day arithmetic.

pub mod archive;
pub mod day;
pub mod retention;
pub mod run;

pub use run::{register_metrics, run_job, JobKind, RunReport};

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
