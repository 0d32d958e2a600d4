//! Finishes that ride on the next acquire: at most one budget round trip per admitted poll.
//!
//! A poll's end (release its lease, count its outcome in the task's circuit) is not a script call
//! of its own: after the acquire's, that would make two round trips per poll, and the budget
//! layer's share of a no-op job's cost larger than apalis-redis's. A finished poll's lease is
//! *carried* instead: it stays in this process's list for a moment, and the next acquire of this
//! process releases it in the same script call, before it checks the limits, so a slot that turns
//! over costs one round trip. The polling layer's acquire carries its own task's finishes when
//! there are any (it takes over one of their slots, below), else every task's. When no acquire
//! comes within [`CARRY_FOR`], a flush sends what is carried in one call
//! ([`Budget::flush_carried`]).
//!
//! Why the limits hold: a carried lease still counts until the call that releases it, so the
//! fleet-wide count is never lower than the polls running; an acquire that carries finishes
//! releases them before it counts. A crashed process's carried leases expire with their lease,
//! like every lease it held (nothing here outlives `polling.lease_ttl_secs`). A process waiting for
//! a token is woken when a local poll finishes, and its acquire carries that finish, so waiting
//! costs no extra round trip either.
//!
//! What is carried is released at most [`CARRY_FOR`] after its poll ends: other processes see the
//! slot free that much later. Shutdown flushes before it releases what is still held.
//!
//! A granted acquire of the polling layer ([`Budget::acquire_slot`]) takes over one carried
//! finish's lease id (its own task's if it carries one): the script re-scores that member instead
//! of removing it and adding a fresh one. A lease id therefore lives in exactly one place at a
//! time: held by a running poll, in the carried list, or in the one call that carries it; when
//! that call does not answer, the batch's drop releases it, whichever poll it was going to.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{Budget, CallReport, Task, Transition};

/// How long a finished poll's lease may wait for an acquire to carry its release.
pub const CARRY_FOR: Duration = Duration::from_millis(5);
/// The most finishes one call carries (bounded, so a call never grows without limit).
pub const MAX_CARRIED: usize = 64;

/// What a process does with a circuit transition that a carried finish made (the polling layer
/// writes its audit event).
pub type TransitionHook = Arc<dyn Fn(Task, Transition) + Send + Sync>;

/// One finished poll, not yet released.
pub(super) struct Carried {
    task: Task,
    lease: String,
    report: CallReport,
    probe_round: u64,
    card: String,
    /// Successes of the task's polls on kept slots, counted in the circuit before this outcome
    /// (`budget::pool`).
    successes: u64,
}

impl Carried {
    /// A kept slot going back (no poll outcome of its own), with the successes to count first.
    pub(super) fn back(task: Task, lease: String, successes: u64) -> Self {
        Self {
            task,
            lease,
            report: CallReport::NoCall,
            probe_round: 0,
            card: String::new(),
            successes,
        }
    }
}

/// The answer of the script for one carried finish: existed, transition name, its numbers.
pub(super) type CarriedAnswer = (i64, String, Vec<u64>);

/// Finishes taken out of the list for one call. If the call does not answer (an error, a timeout
/// that drops the future), they are released in the background: whether the call released them
/// is unknown, and release is idempotent (their outcomes are not counted twice: lost instead).
pub(super) struct CarriedBatch {
    budget: Budget,
    items: Vec<Carried>,
}

impl CarriedBatch {
    /// Appends the batch to a script call: how many, then 6 values each.
    pub(super) fn push_args(&self, inv: &mut redis::ScriptInvocation<'_>) {
        inv.arg(self.items.len());
        for c in &self.items {
            inv.arg(Budget::task_index(c.task))
                .arg(&c.lease)
                .arg(c.report.lua())
                .arg(c.probe_round)
                .arg(&c.card)
                .arg(c.successes);
        }
    }

    /// The call answered: the leases are released; counts and hands on the transitions.
    pub(super) fn settle(mut self, answers: Vec<CarriedAnswer>) {
        let items = std::mem::take(&mut self.items);
        if let Ok(mut held) = self.budget.held.lock() {
            for c in &items {
                held.remove(&c.lease);
            }
        }
        let hook = self
            .budget
            .on_transition
            .lock()
            .ok()
            .and_then(|h| h.clone());
        for (c, (_existed, name, numbers)) in items.iter().zip(answers) {
            if let Some(t) = Transition::parse(&name, &numbers) {
                t.count(c.task);
                if matches!(t, Transition::Opened { .. }) {
                    // This process opened it: it stops starting polls on kept slots at once.
                    self.budget.stop_reuse(c.task);
                }
                match &hook {
                    Some(hook) => hook(c.task, t),
                    None => {
                        tracing::info!(task = %c.task, transition = ?t, "Gateway circuit transition")
                    }
                }
            }
        }
    }
}

impl Drop for CarriedBatch {
    fn drop(&mut self) {
        // An outcome without a lease (`Budget::report_outcome`) has nothing to give back.
        for c in std::mem::take(&mut self.items) {
            if !c.lease.is_empty() {
                self.budget.release_in_background(c.lease);
            }
        }
    }
}

impl Budget {
    /// Where circuit transitions made by carried finishes go (the polling layer's audit events).
    pub fn on_transition(&self, hook: TransitionHook) {
        if let Ok(mut h) = self.on_transition.lock() {
            *h = Some(hook);
        }
    }

    /// Ends a poll: its lease is released, and its outcome counted in the task's circuit, by this
    /// process's next acquire, or by a flush within [`CARRY_FOR`]. Returns at once. Local waiters
    /// for a token are woken (their acquire carries this finish).
    pub fn finish_carried(
        &self,
        task: Task,
        lease_id: String,
        report: CallReport,
        probe_round: u64,
        card_ref: &str,
    ) {
        self.finish_carried_after(task, lease_id, report, probe_round, card_ref, 0);
    }

    /// [`Budget::finish_carried`], counting `successes` of the task's polls in its circuit first.
    pub(super) fn finish_carried_after(
        &self,
        task: Task,
        lease_id: String,
        report: CallReport,
        probe_round: u64,
        card_ref: &str,
        successes: u64,
    ) {
        if let Ok(mut carried) = self.carried.lock() {
            carried.push(Carried {
                task,
                lease: lease_id,
                report,
                probe_round,
                card: card_ref.to_owned(),
                successes,
            });
        }
        self.released.notify_waiters();
        self.arm_flush();
    }

    /// Schedules a flush of what is carried within [`CARRY_FOR`], unless one is scheduled.
    pub(super) fn arm_flush(&self) {
        if !self.flush_armed.swap(true, Ordering::AcqRel) {
            let budget = self.clone();
            self.shutdown.spawn_detached(async move {
                tokio::time::sleep(CARRY_FOR).await;
                budget.flush_armed.store(false, Ordering::Release);
                if let Err(e) = budget.flush_carried().await {
                    tracing::debug!(error = %format!("{e:#}"), "flushing finished polls' leases failed; they expire with their lease");
                }
            });
        }
    }

    /// Takes up to [`MAX_CARRIED`] carried finishes for one call: with `prefer`, only that
    /// task's when there are any (an acquire of a task takes over one of its own task's slots,
    /// which re-scores the lease in both sets; the other task's finishes wait at most
    /// [`CARRY_FOR`] for their own task's acquire or the flush), else every task's (so that a
    /// waiter for a total token still frees the other task's finished slots in its call).
    pub(super) fn take_carried(&self, prefer: Option<Task>) -> CarriedBatch {
        let items = match self.carried.lock() {
            Ok(mut c) => match prefer {
                Some(task) if c.iter().any(|f| f.task == task) => {
                    let mut taken = Vec::new();
                    let mut rest = Vec::with_capacity(c.len());
                    for f in c.drain(..) {
                        if f.task == task && taken.len() < MAX_CARRIED {
                            taken.push(f);
                        } else {
                            rest.push(f);
                        }
                    }
                    *c = rest;
                    taken
                }
                _ => {
                    let n = c.len().min(MAX_CARRIED);
                    c.drain(..n).collect()
                }
            },
            Err(_) => Vec::new(),
        };
        CarriedBatch {
            budget: self.clone(),
            items,
        }
    }

    /// How many finished polls wait to be carried.
    pub fn carried_count(&self) -> usize {
        self.carried.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Sends every carried finish now (one call per [`MAX_CARRIED`]).
    pub async fn flush_carried(&self) -> anyhow::Result<usize> {
        use anyhow::Context as _;
        let mut sent = 0;
        loop {
            let batch = self.take_carried(None);
            if batch.items.is_empty() {
                return Ok(sent);
            }
            sent += batch.items.len();
            let mut inv = self.invocation("finish_batch");
            inv.arg(&*self.circuit);
            batch.push_args(&mut inv);
            let answers: Vec<CarriedAnswer> = inv
                .invoke_async(&mut self.conn.clone())
                .await
                .context("releasing finished polls' tokens")?;
            batch.settle(answers);
            self.released.notify_waiters();
        }
    }
}
