//! The fleet page's chart: polls per UTC hour by outcome, from the hourly counters every worker
//! writes.

use chrono::Utc;
use serde::Serialize;

use crate::config::Task;
use crate::context::AppContext;
use crate::polling::poll::{PERSISTED_CHANGE, PERSISTED_FAILURE, SKIPPED_UNCHANGED};
use crate::polling::unchanged;

/// Polls per UTC hour by outcome, fleet-wide and both tasks together, over the last
/// [`unchanged::HOURS_KEPT`] hours: read from the hourly counters every worker writes (the unchanged polls'
/// and the recorded ones', `crate::polling::unchanged`), a few MGETs whatever the fleet's size.
#[derive(Debug, Clone, Serialize)]
pub struct PollChart {
    /// Oldest hour first: the hour (`YYYYMMDDHH`, UTC) and its polls per outcome, in the order of
    /// [`OUTCOMES`].
    pub hours: Vec<(String, [u64; 3])>,
}

impl PollChart {
    /// Every hour's polls of outcome `i` (an index into [`OUTCOMES`]) added up.
    pub fn total(&self, i: usize) -> u64 {
        self.hours.iter().map(|(_, n)| n[i]).sum()
    }
}

/// The chart's outcomes, as `cardworker_poll_outcomes_total` labels them.
pub const OUTCOMES: [&str; 3] = [SKIPPED_UNCHANGED, PERSISTED_CHANGE, PERSISTED_FAILURE];

/// Reads the chart's counters.
pub async fn poll_chart(ctx: &AppContext) -> anyhow::Result<PollChart> {
    let now = Utc::now();
    let mut conn = ctx.redis.clone();
    // Newest hour first, as the counters are read.
    let mut hours: Vec<(String, [u64; 3])> = Vec::new();
    for task in Task::ALL {
        for (i, outcome) in OUTCOMES.iter().enumerate() {
            let counts = if i == 0 {
                unchanged::fleet_hours(&mut conn, ctx.prefix(), task, now).await?
            } else {
                unchanged::fleet_outcome_hours(&mut conn, ctx.prefix(), task, outcome, now).await?
            };
            if hours.is_empty() {
                hours = counts.iter().map(|(h, _)| (h.clone(), [0; 3])).collect();
            }
            for ((_, slot), (_, n)) in hours.iter_mut().zip(counts) {
                slot[i] += n;
            }
        }
    }
    hours.reverse();
    Ok(PollChart { hours })
}
