//! What the fleet-wide Gateway circuit breaker (`budget::circuit`) means for polling.
//!
//! - **Reporting a poll's outcome without a round trip.** The budget layer runs each poll inside
//!   [`scoped`], a task-local slot; the poll calls [`report`] once it has classified the Gateway's
//!   answer; the layer hands the report to the lease release (`Budget::finish`), which counts it
//!   in the circuit's window in the same script call. A poll that made no Gateway call reports
//!   nothing, which counts as no call.
//! - **Probes.** When the circuit is half-open, the budget admits a few polls as probes
//!   ([`is_probe`]). A probe whose call fails writes nothing to PostgreSQL and does not advance
//!   the card's failure count: the failure is the Gateway's, and it re-opens the circuit.
//! - **One record per outage.** [`on_transition`] writes the `gateway.circuit_opened` audit event
//!   when the circuit opens and `gateway.circuit_closed` when it closes (never per card, never for
//!   a failed probe round), and logs every transition at warn level.

use std::future::Future;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use sqlx::PgPool;

use crate::budget::{CallReport, Transition};
use crate::config::Task;
use crate::storage::records::{self, AuditRecord};

/// The audit event written when a task's circuit opens.
pub const OPENED_EVENT: &str = "gateway.circuit_opened";
/// The audit event written when a task's circuit closes.
pub const CLOSED_EVENT: &str = "gateway.circuit_closed";

/// What one poll run tells the layer around it.
struct RunSlot {
    /// The poll is a probe of a half-open circuit.
    probe: bool,
    /// The classified outcome of its Gateway call (valid or not) and the card; `None`: no call.
    report: Mutex<Option<(bool, String)>>,
}

/// What a poll reported, for the lease release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reported {
    /// What the Gateway call showed.
    pub report: CallReport,
    /// The card it was about (empty without a call).
    pub card_ref: String,
}

tokio::task_local! {
    static RUN: Arc<RunSlot>;
}

/// Runs one poll (the budget layer's inner service) with its report slot; returns its output and
/// what it reported ([`CallReport::NoCall`] when it made no Gateway call or was cut off before
/// classifying one).
pub async fn scoped<F: Future>(probe: bool, poll: F) -> (F::Output, Reported) {
    let slot = Arc::new(RunSlot {
        probe,
        report: Mutex::new(None),
    });
    let out = RUN.scope(slot.clone(), poll).await;
    let reported = match slot.report.lock().ok().and_then(|mut r| r.take()) {
        Some((true, card_ref)) => Reported {
            report: CallReport::Ok,
            card_ref,
        },
        Some((false, card_ref)) => Reported {
            report: CallReport::Failed,
            card_ref,
        },
        None => Reported {
            report: CallReport::NoCall,
            card_ref: String::new(),
        },
    };
    (out, reported)
}

/// `poll` with this task's report slot, if it has one, carried along: the job service runs each
/// job on a task of its own (a task-local does not cross `spawn`), so the poll's future takes the
/// slot with it. Call it where [`scoped`] is in force (the budget layer's inner call).
pub fn carry<F: Future>(poll: F) -> impl Future<Output = F::Output> {
    let slot = RUN.try_with(Arc::clone).ok();
    async move {
        match slot {
            Some(slot) => RUN.scope(slot, poll).await,
            None => poll.await,
        }
    }
}

/// Reports the classified outcome of this poll's Gateway call about `card_ref` (valid or not; a
/// no-op outside [`scoped`], as in a poll run directly by a test).
pub fn report(card_ref: &str, valid: bool) {
    let _ = RUN.try_with(|slot| {
        if let Ok(mut r) = slot.report.lock() {
            *r = Some((valid, card_ref.to_owned()));
        }
    });
}

/// Whether this poll is a probe of a half-open circuit.
pub fn is_probe() -> bool {
    RUN.try_with(|slot| slot.probe).unwrap_or(false)
}

/// Logs a transition at warn level and, for an opening or a closing, writes its one audit event
/// (resource: the task). The process whose script call made the transition is the only one that
/// sees it, so the fleet writes each event once.
pub async fn on_transition(pool: Option<&PgPool>, task: Task, transition: Transition) {
    let record = match transition {
        Transition::Opened { calls, failures } => {
            tracing::warn!(
                %task,
                calls,
                failures,
                "Gateway circuit OPEN: the Gateway fails broadly; {task} polls are deferred \
                 without calling it until probes succeed"
            );
            AuditRecord {
                event_type: OPENED_EVENT,
                correlation_id: None,
                summary: format!(
                    "{task} Gateway circuit opened: {failures} of the last {calls} calls failed; \
                     polls are deferred without a Gateway call"
                ),
                details: serde_json::json!({
                    "task": task.label(),
                    "window_calls": calls,
                    "window_failures": failures,
                }),
                resource_type: "task",
                resource_id: task.label().to_owned(),
            }
        }
        Transition::Closed {
            duration_ms,
            reopens,
            open_calls,
            open_failures,
        } => {
            let secs = duration_ms as f64 / 1000.0;
            tracing::warn!(
                %task,
                duration_secs = secs,
                failed_probe_rounds = reopens,
                "Gateway circuit CLOSED: a probe succeeded; {task} polls call the Gateway again"
            );
            AuditRecord {
                event_type: CLOSED_EVENT,
                correlation_id: None,
                summary: format!(
                    "{task} Gateway circuit closed after {secs:.0} s ({reopens} failed probe \
                     rounds); polling resumes"
                ),
                details: serde_json::json!({
                    "task": task.label(),
                    "duration_ms": duration_ms,
                    "failed_probe_rounds": reopens,
                    "window_calls_when_opened": open_calls,
                    "window_failures_when_opened": open_failures,
                }),
                resource_type: "task",
                resource_id: task.label().to_owned(),
            }
        }
        Transition::Reopened { cooldown_ms } => {
            tracing::warn!(
                %task,
                cooldown_secs = cooldown_ms / 1000,
                "Gateway circuit stays open: a probe failed; next probes after the cool-down"
            );
            return;
        }
        Transition::HalfOpen => return,
    };
    let Some(pool) = pool else { return };
    if let Err(e) = write(pool, &record).await {
        tracing::warn!(%task, event = record.event_type, error = %format!("{e:#}"), "circuit audit event not written (the warn log above is the record)");
    }
}

/// Writes the transition event of a circuit an operator forced open or closed
/// (`cardworker circuit open|close`), when that changed its state: an outage begins or ends then
/// too, and its record should read the same whoever made it.
pub async fn on_forced(
    pool: &PgPool,
    task: Task,
    open: bool,
    outage_ms: u64,
) -> anyhow::Result<()> {
    let record = if open {
        AuditRecord {
            event_type: OPENED_EVENT,
            correlation_id: None,
            summary: format!(
                "{task} Gateway circuit forced open by an operator; polls are deferred without a \
                 Gateway call"
            ),
            details: serde_json::json!({ "task": task.label(), "forced": true }),
            resource_type: "task",
            resource_id: task.label().to_owned(),
        }
    } else {
        let secs = outage_ms as f64 / 1000.0;
        AuditRecord {
            event_type: CLOSED_EVENT,
            correlation_id: None,
            summary: format!(
                "{task} Gateway circuit forced closed by an operator after {secs:.0} s; polling \
                 resumes"
            ),
            details: serde_json::json!({
                "task": task.label(),
                "forced": true,
                "duration_ms": outage_ms,
            }),
            resource_type: "task",
            resource_id: task.label().to_owned(),
        }
    };
    write(pool, &record).await
}

async fn write(pool: &PgPool, record: &AuditRecord) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await.context("connecting to PostgreSQL")?;
    records::insert_audit(&mut conn, record, None)
        .await
        .context("writing the circuit audit event")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_poll_that_reports_nothing_counts_as_no_call() {
        let ((), r) = scoped(false, async {}).await;
        assert_eq!(r.report, CallReport::NoCall);
    }

    #[tokio::test]
    async fn the_last_report_of_a_poll_is_what_the_layer_sees() {
        let ((), r) = scoped(false, async {
            report("c-1", false);
            tokio::task::yield_now().await;
            report("c-1", true);
        })
        .await;
        assert_eq!(
            r,
            Reported {
                report: CallReport::Ok,
                card_ref: "c-1".to_owned()
            }
        );
        let (probe, r) = scoped(true, async {
            report("c-2", false);
            is_probe()
        })
        .await;
        assert!(probe);
        assert_eq!(r.report, CallReport::Failed);
    }

    #[tokio::test]
    async fn outside_a_scope_reporting_is_a_no_op_and_no_poll_is_a_probe() {
        report("c-1", true);
        assert!(!is_probe());
    }
}
