//! What the fleet-wide Gateway circuit breaker (`budget::circuit`) means for polling.
//!
//! - **Reporting a poll's outcome without a round trip.** The budget layer runs each poll inside
//!   [`scoped`], a task-local slot; the poll calls [`report`] once it has classified the Gateway's
//!   answer; the lease's end (`Budget::finish_poll`) counts it in the circuit's window in the same
//!   script call. A poll that made no Gateway call reports nothing, which counts as no call.
//! - **The poll owns its lease.** The slot also holds the poll's lease ([`Lease`]) until the job
//!   service spawns the poll on a task of its own: [`carry`] moves the lease into that task, which
//!   ends it once the poll has finished (or releases it if the task is cancelled). apalis drops a
//!   worker's in-flight futures when its stream ends (a Redis timeout, a reset connection, a
//!   worker whose registration was removed), while the spawned poll runs on: a lease held by the
//!   layer's future would go back to the budget under a running Gateway call.
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
use crate::gateway::AtGateway;
use crate::storage::records::{self, AuditRecord};

/// The audit event written when a task's circuit opens.
pub const OPENED_EVENT: &str = "gateway.circuit_opened";
/// The audit event written when a task's circuit closes.
pub const CLOSED_EVENT: &str = "gateway.circuit_closed";

/// What ends a poll's hold on its budget tokens: `finish` once the poll is over (with what it
/// reported), `finish_after` when its Gateway call may still be at the Gateway, or its `Drop` if
/// the task that owns it is cancelled first.
pub trait Lease: Send {
    /// The poll is over: hand its tokens back (or keep its slot) with its outcome.
    fn finish(self: Box<Self>, reported: Reported);

    /// The poll is over, but it stopped waiting for its Gateway call (`call`), which the Gateway
    /// may still be working on: the outcome counts now, and the tokens stay held until the call
    /// ends or `polling.handler_timeout_secs` after it was sent.
    fn finish_after(self: Box<Self>, reported: Reported, call: AtGateway);
}

/// What one poll run tells the layer around it.
struct RunSlot {
    /// The poll is a probe of a half-open circuit.
    probe: bool,
    /// The classified outcome of its Gateway call (valid or not) and the card; `None`: no call.
    report: Mutex<Option<(bool, String)>>,
    /// The poll's lease, until [`carry`] moves it into the poll's own task.
    lease: Mutex<Option<Box<dyn Lease>>>,
    /// The poll's Gateway call once it is sent ([`at_gateway`]).
    call: Mutex<Option<AtGateway>>,
}

impl RunSlot {
    fn new(probe: bool, lease: Box<dyn Lease>) -> Self {
        Self {
            probe,
            report: Mutex::new(None),
            lease: Mutex::new(Some(lease)),
            call: Mutex::new(None),
        }
    }

    /// Ends `lease` with what the poll reported: at once, or, while the poll's Gateway call is
    /// still under way (the poll stopped waiting for it), once that call is over.
    fn end(&self, lease: Box<dyn Lease>) {
        let reported = self.reported();
        match self.call.lock().ok().and_then(|mut c| c.take()) {
            Some(call) if !call.has_ended() => lease.finish_after(reported, call),
            _ => lease.finish(reported),
        }
    }

    /// What the poll reported (taken: asked once, when the poll is over).
    fn reported(&self) -> Reported {
        match self.report.lock().ok().and_then(|mut r| r.take()) {
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
        }
    }
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

/// Runs one poll (the budget layer's inner service) with its report slot, holding `lease`; returns
/// its output and what it reported ([`CallReport::NoCall`] when it made no Gateway call or was cut
/// off before classifying one). When the poll carried the lease into a task of its own
/// ([`carry`]), that task has ended it; else it is ended here, with the report.
pub async fn scoped<F: Future>(probe: bool, lease: Box<dyn Lease>, poll: F) -> F::Output {
    let slot = Arc::new(RunSlot::new(probe, lease));
    let out = RUN.scope(slot.clone(), poll).await;
    let lease = slot.lease.lock().ok().and_then(|mut l| l.take());
    if let Some(lease) = lease {
        slot.end(lease);
    }
    out
}

/// `poll` with this task's report slot and the poll's lease, if it has them, carried along: the
/// job service runs each job on a task of its own (a task-local does not cross `spawn`), so the
/// poll's future takes the slot with it, and the lease moves into it now, before the spawn. The
/// lease ends when the poll does, in that task, whatever becomes of the future that spawned it;
/// if the task is cancelled, the lease's `Drop` gives it back. Call it where [`scoped`] is in
/// force (the budget layer's inner call).
pub fn carry<F: Future>(poll: F) -> impl Future<Output = F::Output> {
    let slot = RUN.try_with(Arc::clone).ok();
    let lease = slot
        .as_ref()
        .and_then(|s| s.lease.lock().ok().and_then(|mut l| l.take()));
    async move {
        match slot {
            Some(slot) => {
                let out = RUN.scope(slot.clone(), poll).await;
                if let Some(lease) = lease {
                    slot.end(lease);
                }
                out
            }
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

/// Records that this poll's Gateway call is sent: if the poll stops waiting for it (the client's
/// timeout) or ends before it is answered, its lease stays held until the call is over (a no-op
/// outside [`scoped`]).
pub fn at_gateway(call: AtGateway) {
    let _ = RUN.try_with(|slot| {
        if let Ok(mut c) = slot.call.lock() {
            *c = Some(call);
        }
    });
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

    /// A lease that says how it ended: finished with a report, or dropped unfinished.
    struct Probe(Option<std::sync::mpsc::Sender<Option<Reported>>>);

    impl Lease for Probe {
        fn finish(mut self: Box<Self>, reported: Reported) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(Some(reported));
            }
        }

        fn finish_after(self: Box<Self>, reported: Reported, _call: AtGateway) {
            self.finish(reported);
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(None);
            }
        }
    }

    fn probe() -> (Box<dyn Lease>, std::sync::mpsc::Receiver<Option<Reported>>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (Box::new(Probe(Some(tx))), rx)
    }

    #[tokio::test]
    async fn a_poll_that_reports_nothing_counts_as_no_call() {
        let (lease, ended) = probe();
        scoped(false, lease, async {}).await;
        let r = ended.recv().expect("ended").expect("finished");
        assert_eq!(r.report, CallReport::NoCall);
    }

    #[tokio::test]
    async fn the_last_report_of_a_poll_is_what_its_lease_ends_with() {
        let (lease, ended) = probe();
        scoped(false, lease, async {
            report("c-1", false);
            tokio::task::yield_now().await;
            report("c-1", true);
        })
        .await;
        assert_eq!(
            ended.recv().expect("ended"),
            Some(Reported {
                report: CallReport::Ok,
                card_ref: "c-1".to_owned()
            })
        );
        let (lease, ended) = probe();
        let probe = scoped(true, lease, async {
            report("c-2", false);
            is_probe()
        })
        .await;
        assert!(probe);
        assert_eq!(
            ended.recv().expect("ended").expect("finished").report,
            CallReport::Failed
        );
    }

    /// The seam apalis tears: the layer's future is dropped (its worker's stream ended) while the
    /// spawned poll runs on. The lease must stay held until the poll itself is over.
    #[tokio::test]
    async fn a_carried_lease_outlives_the_dropped_layer_future_and_ends_with_its_poll() {
        let (lease, ended) = probe();
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let (spawned_tx, spawned) = tokio::sync::oneshot::channel();
        let layer = tokio::spawn(scoped(false, lease, async move {
            let poll = carry(async move {
                let _ = wait.await;
                report("c-1", true);
            });
            let handle = tokio::spawn(poll);
            let _ = spawned_tx.send(());
            let _ = handle.await;
        }));
        spawned.await.expect("the poll was spawned");
        layer.abort();
        let _ = layer.await;
        assert!(
            ended.try_recv().is_err(),
            "the lease is still held while the poll runs"
        );
        go.send(()).expect("the poll waits");
        let r = tokio::task::spawn_blocking(move || ended.recv())
            .await
            .expect("joined")
            .expect("ended");
        assert_eq!(
            r,
            Some(Reported {
                report: CallReport::Ok,
                card_ref: "c-1".to_owned()
            })
        );
    }

    #[tokio::test]
    async fn a_carried_lease_is_given_back_when_its_poll_s_task_is_cancelled() {
        let (lease, ended) = probe();
        let mut spawned = None;
        scoped(false, lease, async {
            spawned = Some(tokio::spawn(carry(std::future::pending::<()>())));
        })
        .await;
        let handle = spawned.expect("spawned");
        assert!(ended.try_recv().is_err(), "held while the poll runs");
        handle.abort();
        let _ = handle.await;
        assert_eq!(ended.recv().expect("ended"), None, "dropped, not finished");
    }

    #[tokio::test]
    async fn outside_a_scope_reporting_is_a_no_op_and_no_poll_is_a_probe() {
        report("c-1", true);
        assert!(!is_probe());
    }
}
