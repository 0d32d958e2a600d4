//! The last day each maintenance job processed, recorded in Redis by every run
//! (`{prefix}:maintenance:last_day:{job}`), so that any pod answers for the fleet: the
//! `cardworker_maintenance_last_day` gauge only knows the runs of its own pod. A lost key (Redis
//! failover) only empties the record until the next run.
//!
//! Below both [`super::run`] (which writes it) and [`super::status`] (which reads it with the
//! backlog), so neither imports the other's caller.

use anyhow::Context as _;
use chrono::{DateTime, NaiveDate, Utc};
use redis::AsyncCommands as _;
use serde::{Deserialize, Serialize};

use super::session::JobKind;
use crate::context::AppContext;
use crate::keys::last_day_key;

/// The last day a run of one job processed, as every run records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastDay {
    /// The Shanghai day.
    pub day: NaiveDate,
    /// Whether that run finished the day (false: the brake stopped it at a batch boundary).
    pub day_finished: bool,
    /// When the run recorded it.
    pub at: DateTime<Utc>,
}

/// Records the day a processed run handled. A Redis failure is logged, never fails the run: the
/// rows are already moved, and the next run records its day again.
pub async fn record(ctx: &AppContext, job: JobKind, day: NaiveDate, day_finished: bool) {
    let last = LastDay {
        day,
        day_finished,
        at: Utc::now(),
    };
    let written = async {
        let value = serde_json::to_string(&last).context("rendering the last day")?;
        ctx.redis
            .clone()
            .set::<_, _, ()>(last_day_key(ctx.prefix(), job.label()), value)
            .await
            .context("writing the last processed day to Redis")
    }
    .await;
    if let Err(e) = written {
        tracing::warn!(job = job.label(), error = %format!("{e:#}"), "could not record the last processed maintenance day");
    }
}

/// Reads a job's last processed day; `None` when no run recorded one (or the value is not ours).
pub async fn read(ctx: &AppContext, job: JobKind) -> anyhow::Result<Option<LastDay>> {
    let raw: Option<String> = ctx
        .redis
        .clone()
        .get(last_day_key(ctx.prefix(), job.label()))
        .await
        .context("reading the last processed maintenance day from Redis")?;
    Ok(raw.and_then(|raw| match serde_json::from_str(&raw) {
        Ok(last) => Some(last),
        Err(e) => {
            tracing::warn!(job = job.label(), %raw, error = %e, "ignoring an unreadable last-day record");
            None
        }
    }))
}
