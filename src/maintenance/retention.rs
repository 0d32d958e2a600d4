//! `RunRetention`: handles one due Shanghai day of the archive.

use std::sync::Arc;

use cardworker_jobs::RunRetention;

use super::count_run;
use crate::app::AppContext;
use crate::queue::registry::Scheduled;
use crate::queue::RunJob;

impl RunJob for RunRetention {
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        if !ctx.config.maintenance.enabled {
            tracing::info!(scheduled_for = ?self.scheduled_for, "retention run skipped: maintenance disabled");
            count_run("retention", "skipped_disabled");
            return Ok(());
        }
        anyhow::bail!("retention runs are not built yet")
    }
}

impl Scheduled for RunRetention {
    const CRON_KIND: &'static str = "retention-cron";
    fn for_tick(timestamp: i64) -> Self {
        RunRetention {
            scheduled_for: Some(timestamp),
        }
    }
}
