//! What `cardworker maintenance status` reports, fleet-wide: the switch, the brake, and per job
//! the last day a run processed and the backlog the next run would see.
//!
//! Why a command: the backlog must be sized *before* maintenance is turned on, and while it is
//! off the `cardworker_maintenance_days_pending` gauge is never measured (it reads 0). The
//! hand-written `count(DISTINCT day)` query operators used to run read every due index entry and
//! spilled to disk (1.0–1.25 s at 3M integration logs, issue 18); the status measures the same
//! number with the bounded index probes a run itself uses ([`run::backlog`]), in milliseconds,
//! whether maintenance is on or off.
//!
//! The last processed day is kept in Redis by every run (`{prefix}:maintenance:last_day:{job}`),
//! so any pod answers for the fleet; the `cardworker_maintenance_last_day` gauge only knows the
//! runs of its own pod. A lost key (Redis failover) only empties `last_day` until the next run.

use std::collections::BTreeMap;

use anyhow::Context as _;
use chrono::{DateTime, NaiveDate, Utc};
use redis::AsyncCommands as _;
use serde::{Deserialize, Serialize};

use super::run;
use super::session::{JobKind, DAYS_PENDING_CAP};
use crate::context::AppContext;

/// The Redis key of a job's last processed day.
pub fn last_day_key(prefix: &str, job: JobKind) -> String {
    format!("{prefix}:maintenance:last_day:{}", job.label())
}

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
pub async fn record_last_day(ctx: &AppContext, job: JobKind, day: NaiveDate, day_finished: bool) {
    let last = LastDay {
        day,
        day_finished,
        at: Utc::now(),
    };
    let written = async {
        let value = serde_json::to_string(&last).context("rendering the last day")?;
        ctx.redis
            .clone()
            .set::<_, _, ()>(last_day_key(ctx.prefix(), job), value)
            .await
            .context("writing the last processed day to Redis")
    }
    .await;
    if let Err(e) = written {
        tracing::warn!(job = job.label(), error = %format!("{e:#}"), "could not record the last processed maintenance day");
    }
}

/// Reads a job's last processed day; `None` when no run recorded one (or the value is not ours).
pub async fn last_day(ctx: &AppContext, job: JobKind) -> anyhow::Result<Option<LastDay>> {
    let raw: Option<String> = ctx
        .redis
        .clone()
        .get(last_day_key(ctx.prefix(), job))
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

/// One job's part of the status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobStatus {
    /// The last Shanghai day a run of this job processed, fleet-wide (`None`: none recorded).
    pub last_day: Option<NaiveDate>,
    /// Whether that run finished the day.
    pub last_day_finished: Option<bool>,
    /// When that run recorded it.
    pub last_run_at: Option<DateTime<Utc>>,
    /// The day the next run handles: the oldest due day (`None`: nothing is due).
    pub next_day: Option<NaiveDate>,
    /// Due days waiting, one run each (capped at [`DAYS_PENDING_CAP`]).
    pub days_pending: i64,
    /// Whether `days_pending` hit the cap (there may be more).
    pub days_pending_capped: bool,
    /// Days before this Shanghai day are due.
    pub due_before: NaiveDate,
}

/// Everything `cardworker maintenance status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MaintenanceStatus {
    /// `maintenance.enabled` in this process's configuration.
    pub enabled: bool,
    /// `maintenance.cleanup_enabled` (physical deletion in retention).
    pub cleanup_enabled: bool,
    /// Whether the fleet-wide brake (`cardworker maintenance pause`) is set.
    pub paused: bool,
    /// Per job (`archive`, `retention`).
    pub jobs: BTreeMap<&'static str, JobStatus>,
}

/// Gathers the status: two Redis reads per job and the backlog probes of [`run::backlog`].
pub async fn status(ctx: &AppContext) -> anyhow::Result<MaintenanceStatus> {
    let paused = super::is_paused(&mut ctx.redis.clone(), ctx.prefix()).await?;
    let mut jobs = BTreeMap::new();
    for job in [JobKind::Archive, JobKind::Retention] {
        let last = last_day(ctx, job).await?;
        let backlog = run::backlog(ctx, job)
            .await
            .with_context(|| format!("measuring the {} backlog", job.label()))?;
        jobs.insert(
            job.label(),
            JobStatus {
                last_day: last.map(|l| l.day),
                last_day_finished: last.map(|l| l.day_finished),
                last_run_at: last.map(|l| l.at),
                next_day: backlog.next_day,
                days_pending: backlog.days_pending,
                days_pending_capped: backlog.days_pending >= DAYS_PENDING_CAP,
                due_before: backlog.due_before,
            },
        );
    }
    Ok(MaintenanceStatus {
        enabled: ctx.config.maintenance.enabled,
        cleanup_enabled: ctx.config.maintenance.cleanup_enabled,
        paused,
        jobs,
    })
}
