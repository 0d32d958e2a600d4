//! Leases of calls the worker stopped waiting for: a token counts a call at the Gateway, not a
//! wait in the worker.
//!
//! A poll gives up on its Gateway call at `gateway.timeout_ms`, records the timeout (a failure,
//! counted in the task's circuit at once) and ends. The Gateway may still be working on the call:
//! its tokens stay held until the call is answered (its exchange, which runs on a task of its own,
//! ends) or until `polling.handler_timeout_secs` has passed since it was sent, whichever is first.
//! So a Gateway that answers within `handler_timeout_secs` never carries more polls at once than
//! the limits, however short the client's timeout. The client cuts the exchange off at that same
//! bound (`gateway::GatewayClient::holding_reads_for`), so a lease is never held for a call that
//! is over.
//!
//! A call sent late in its poll (after a slow database read, say) may count past the expiry its
//! lease got at the acquire: the lease then gets a fresh TTL shortly before that expiry
//! (`extend` in `budget.lua`), so that it never expires under a call the Gateway may still carry.
//!
//! While the lease is held this way, the poll still counts as running in this process (a Redis
//! that comes back empty gets its lease written back, [`Budget::reassert_running`], and the
//! process admits no more polls than the total on its own), and
//! `cardworker_budget_abandoned_calls{task}` counts it. Then the slot ends as a poll's slot does
//! ([`Budget::finish_poll`], with no outcome of its own: the outcome was counted already). A
//! graceful stop waits for these holds to end before it releases what the process holds
//! (`Budget::release_held`): at most `handler_timeout_secs`, within the pod's termination grace.

use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use super::{pool::Slot, Budget, CallReport, Task};
use crate::telemetry::metrics as m;

/// How long before its lease's expiry a hold that outlasts it extends the lease.
const EXTEND_BEFORE: std::time::Duration = std::time::Duration::from_secs(3);

/// Abandoned calls held per task in this process (carddata, card_status).
pub(super) type AbandonedCounts = [AtomicI64; 2];

fn index(task: Task) -> usize {
    usize::from(Budget::task_index(task) - 2)
}

impl Budget {
    /// Counts a finished poll's outcome in its task's circuit now (through `budget::carry`, like
    /// a finish, with no lease to release), for a poll whose lease stays held
    /// ([`Budget::hold_abandoned`]).
    pub fn report_outcome(&self, task: Task, report: CallReport, probe_round: u64, card: &str) {
        // A failure carries the successes added up before it, as a finish does.
        let successes = if report == CallReport::Failed {
            self.take_successes(task)
        } else {
            0
        };
        self.finish_carried_after(task, String::new(), report, probe_round, card, successes);
    }

    /// Keeps the poll's `slot` held for its call that the poll stopped waiting for, until
    /// `answered` resolves (the Gateway is done with it) or `until`, whichever is first, then ends
    /// the slot (no outcome: [`Budget::report_outcome`] counted it). The poll stays counted as
    /// running meanwhile. Returns at once.
    pub fn hold_abandoned<F>(&self, task: Task, slot: Slot, until: Instant, answered: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let counts = self.abandoned.clone();
        let now = counts[index(task)].fetch_add(1, Ordering::AcqRel) + 1;
        metrics::gauge!(m::BUDGET_ABANDONED_CALLS, "task" => task.label()).set(now as f64);
        let budget = self.clone();
        // Shutdown waits for it before its release (`abandoned_drained`); cancelled only when the
        // process stops, after that release.
        self.shutdown.spawn(async move {
            tokio::pin!(answered);
            // A call sent late in its poll (a slow database first) counts past the expiry its
            // lease got at the acquire: the lease gets a fresh TTL shortly before each expiry.
            let mut expires = slot.expires;
            loop {
                let extend_at = expires.checked_sub(EXTEND_BEFORE).unwrap_or(expires);
                let next = until.min(extend_at);
                tokio::select! {
                    () = &mut answered => break,
                    () = tokio::time::sleep_until(next.into()) => {}
                }
                if next >= until {
                    break;
                }
                let sent = Instant::now();
                match budget.extend(task, &slot.lease).await {
                    Ok(_) => expires = sent + budget.lease_ttl,
                    Err(e) => {
                        tracing::warn!(%task, error = %format!("{e:#}"), "cannot extend the lease of a call still at the Gateway; trying again in a second");
                        expires = Instant::now() + EXTEND_BEFORE + std::time::Duration::from_secs(1);
                    }
                }
            }
            budget.run_ended(&slot.lease);
            budget.finish_poll(task, slot, CallReport::NoCall, 0, "");
            let now = counts[index(task)].fetch_sub(1, Ordering::AcqRel) - 1;
            metrics::gauge!(m::BUDGET_ABANDONED_CALLS, "task" => task.label()).set(now as f64);
            budget.abandoned_ended.notify_waiters();
        });
    }

    /// Waits until no call this process stopped waiting for holds tokens any more, at most
    /// `limit` (each hold ends by its own deadline, `handler_timeout_secs` after its call was sent;
    /// shutdown waits for them before it releases what the process holds).
    pub(super) async fn abandoned_drained(&self, limit: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let ended = self.abandoned_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if Task::ALL.iter().all(|t| self.abandoned_calls(*t) == 0) {
                return;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return;
            }
        }
    }

    /// Gives `lease` (of `task`) a full TTL from now, if it still exists: the lease of a call that
    /// counts past the expiry its acquire gave it. Returns whether it existed.
    pub async fn extend(&self, task: Task, lease: &str) -> anyhow::Result<bool> {
        use anyhow::Context as _;
        let ttl_ms = u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX);
        let existed: i64 = self
            .invocation("extend")
            .arg(ttl_ms)
            .arg(Budget::task_index(task))
            .arg(lease)
            .invoke_async(&mut self.conn.clone())
            .await
            .with_context(|| format!("extending a {task} polling lease"))?;
        Ok(existed == 1)
    }

    /// Tokens this process holds for calls its polls stopped waiting for, per task.
    pub fn abandoned_calls(&self, task: Task) -> u64 {
        u64::try_from(self.abandoned[index(task)].load(Ordering::Acquire)).unwrap_or(0)
    }

    /// `polling.handler_timeout_secs`: how long after it was sent a call still counts.
    pub fn handler_timeout(&self) -> std::time::Duration {
        self.handler_timeout
    }
}
