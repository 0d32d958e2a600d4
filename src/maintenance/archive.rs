//! `RunArchive`: moves one ended Shanghai day of finished records into the archive tables.

use std::sync::Arc;

use cardworker_jobs::RunArchive;

use super::count_run;
use crate::app::AppContext;
use crate::queue::registry::Scheduled;
use crate::queue::RunJob;

impl RunJob for RunArchive {
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        if !ctx.config.maintenance.enabled {
            // Acknowledged without a single query: maintenance stays out of daily load.
            tracing::info!(scheduled_for = ?self.scheduled_for, "archive run skipped: maintenance disabled");
            count_run("archive", "skipped_disabled");
            return Ok(());
        }
        anyhow::bail!("archive runs are not built yet")
    }
}

impl Scheduled for RunArchive {
    const CRON_KIND: &'static str = "archive-cron";
    fn for_tick(timestamp: i64) -> Self {
        RunArchive {
            scheduled_for: Some(timestamp),
        }
    }
}
