//! Archive and retention: off by default; when on, exactly one ended Asia/Shanghai day per run.
//!
//! Operating guide: docs/MAINTENANCE.md.
//!
//! # Layout
//! - [`archive`]: the `RunArchive` job (one day of online records into the archive tables).
//! - [`retention`]: the `RunRetention` job (one expired day of the archive: delete or count).
//! - [`run`]: the frame both share: brake, advisory lock on a dedicated session,
//!   `statement_timeout`, batch boundaries, metrics and the log line per run.
//! - [`session`]: what the job bodies build on: [`JobKind`], [`RunReport`], the dedicated
//!   session and the index-probe queries that find the day a run handles.
//! - [`day`]: Asia/Shanghai day arithmetic.
//! - [`last_day`]: the last day each job processed, recorded in Redis by every run.
//! - [`status`]: what `cardworker maintenance status` reports (switch, brake, last day, backlog).
//! - [`switch`]: may maintenance run now? The master switch and the brake, asked by every other
//!   place.

pub mod archive;
pub mod day;
pub mod last_day;
pub mod retention;
pub mod run;
pub mod session;
pub mod status;
pub mod switch;

pub use run::{register_metrics, run_job};
pub use session::{JobKind, RunReport};
pub use switch::{is_paused, set_paused};

use std::sync::Arc;

use cardworker_jobs::Job;

use crate::config::Config;
use crate::context::AppContext;
use crate::runner::{RunJob, Scheduled};
use crate::telemetry::metrics as m;

/// An archive or retention run's payload. Both run the same way (the frame in [`run`]), so they
/// are one [`RunJob`] and one [`Scheduled`] impl, told apart by [`MaintenanceJob::JOB`].
pub trait MaintenanceJob: Job + Clone {
    /// Which run this is.
    const JOB: JobKind;
    /// The cron tick this run was enqueued for (unix seconds), if any.
    fn scheduled_for(&self) -> Option<i64>;
    /// The run for one cron tick.
    fn for_tick(timestamp: i64) -> Self;
}

impl<J: MaintenanceJob> RunJob for J {
    // A run a night (its cron): an idle worker beats and fetches every 30 s; this pod's feeder
    // wakes it at once for a job it moved (`runner::spawn`).
    const HEARTBEAT: std::time::Duration = crate::runner::spawn::QUIET_HEARTBEAT;

    fn timeout(_config: &Config) -> std::time::Duration {
        run::RUN_TIMEOUT
    }

    #[tracing::instrument(skip_all, fields(job = J::JOB.label(), scheduled_for = %crate::telemetry::rfc3339_opt(self.scheduled_for())))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        run::run_queued(&ctx, J::JOB, self.scheduled_for()).await
    }
}

impl<J: MaintenanceJob> Scheduled for J {
    const CRON_KIND: &'static str = J::JOB.cron_kind();

    fn for_tick(timestamp: i64) -> Self {
        <J as MaintenanceJob>::for_tick(timestamp)
    }
}

/// Counts one maintenance run by result.
pub fn count_run(job: &'static str, result: &'static str) {
    metrics::counter!(m::MAINTENANCE_RUNS, "job" => job, "result" => result).increment(1);
}
