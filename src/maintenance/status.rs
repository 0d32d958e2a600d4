//! What `cardworker maintenance status` reports, fleet-wide: the switch, the brake, and per job
//! the last day a run processed and the backlog the next run would see.
//!
//! Why a command: the backlog must be sized *before* maintenance is turned on, and while it is
//! off the `cardworker_maintenance_days_pending` gauge is never measured (it reads 0). A
//! hand-written `count(DISTINCT day)` query reads every due index entry and spills to disk at
//! production volumes (docs/BENCHMARKS.md, "bench-plans"); the status measures the same number
//! with the bounded index probes a run itself uses ([`run::backlog`]), in milliseconds, whether
//! maintenance is on or off.
//!
//! The last processed day comes from [`super::last_day`], which every run writes, so any pod
//! answers for the fleet.

use std::collections::BTreeMap;

use anyhow::Context as _;
use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;

use super::last_day;
use super::run;
use super::session::{JobKind, DAYS_PENDING_CAP};
use crate::context::AppContext;

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
    let paused = super::switch::is_paused(&mut ctx.redis.clone(), ctx.prefix()).await?;
    let mut jobs = BTreeMap::new();
    for job in [JobKind::Archive, JobKind::Retention] {
        let last = last_day::read(ctx, job).await?;
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
        enabled: super::switch::enabled(&ctx.config.maintenance),
        cleanup_enabled: ctx.config.maintenance.cleanup_enabled,
        paused,
        jobs,
    })
}
