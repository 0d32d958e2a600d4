//! `maintenance status`: the switch, the brake, and per job the last day processed and the
//! backlog, for sizing before maintenance is turned on and for watching it afterwards
//! (docs/MAINTENANCE.md).

use std::fmt::Write as _;

use anyhow::Context as _;

use super::args::Format;
use super::CommandError;
use crate::context::AppContext;
use crate::maintenance::status::{self, MaintenanceStatus};

/// Prints the status (`--format json`: [`MaintenanceStatus`] as JSON).
pub async fn status(ctx: &AppContext, format: Format) -> Result<(), CommandError> {
    let status = status::status(ctx).await?;
    match format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&status).context("rendering the maintenance status")?
        ),
        Format::Text => print!("{}", render_text(&status)),
    }
    Ok(())
}

/// The text rendering for people.
pub fn render_text(status: &MaintenanceStatus) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "maintenance: enabled={} cleanup_enabled={} paused={}",
        status.enabled, status.cleanup_enabled, status.paused
    );
    for (job, j) in &status.jobs {
        let last = match (j.last_day, j.last_day_finished, j.last_run_at) {
            (Some(day), Some(finished), Some(at)) => format!(
                "last day {day} ({}, recorded {})",
                if finished {
                    "finished"
                } else {
                    "stopped by the brake"
                },
                at.format("%Y-%m-%dT%H:%M:%SZ")
            ),
            _ => "last day: none recorded".to_owned(),
        };
        let next = j
            .next_day
            .map(|d| format!("next day {d}"))
            .unwrap_or_else(|| "nothing due".to_owned());
        let _ = writeln!(
            s,
            "{job:<10} {last}; {next}; {}{} days pending (days before {} are due)",
            if j.days_pending_capped {
                "at least "
            } else {
                ""
            },
            j.days_pending,
            j.due_before
        );
    }
    if !status.enabled {
        let _ = writeln!(
            s,
            "maintenance is off: nothing runs. Each due day takes one run (one a night per job); \
             see docs/MAINTENANCE.md before turning it on."
        );
    }
    s
}
