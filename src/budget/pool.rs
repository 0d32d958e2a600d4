//! Slots a process keeps between its polls: most polls start without a budget round trip.
//!
//! Taking a poll's two tokens costs a script call (several Redis commands with the release it
//! carries), more than apalis-redis itself needs per poll: asked per poll, the budget would be the
//! largest cost of a poll in Redis. So a finished poll's slot (its lease id, a member of the total
//! set and of its task's set, scored by its expiry) is *kept* by the process, idle, when the last
//! renewal allowed it, and the process's next poll of the same task starts on it without asking
//! Redis: the member never left the sets, so every process still counts it, and the limits hold
//! exactly (a poll runs only on a member that an acquire admitted under the limits).
//!
//! **Renewal.** While the process keeps idle slots, one script call every [`RENEW_EVERY`]
//! (`renew` in `budget.lua`, both tasks): it gives back the slots idle for longer than
//! [`IDLE_FOR`], refreshes the expiry of the others from Redis `TIME` (`ZADD XX`: a slot lost with a
//! Redis flush is reported and dropped, never re-created), counts the successes added up since the
//! last report in the circuits, and answers per task whether the process may go on reusing its
//! slots: only while the task is not paused, its circuit is closed and not forced open, neither
//! set holds more than its limit (an override lowered meanwhile), and no *other* process was
//! refused a token in the last 2 s (a refused acquire writes it into the budget's `waiters` set).
//! That answer is good for [`VERDICT_FOR`]; without a fresh one, a poll asks Redis for its tokens
//! (`Budget::acquire_slot`, which takes over one of the task's kept slots and gives back the
//! rest), and a finish under a "no" goes back through `budget::carry`.
//!
//! Why it is safe:
//! - **The limits.** A poll runs only on a member of both sets, admitted by an acquire under both
//!   limits; keeping it idle does not add one. The fleet-wide count of running polls is therefore
//!   never above a limit. A lowered limit, a pause, a forced or opened circuit reach a process at
//!   its next renewal (at most [`VERDICT_FOR`]) rather than at its next acquire; polls already
//!   started finish.
//! - **A crashed process** stops renewing: its kept slots expire within `polling.lease_ttl_secs`,
//!   like every lease. A slot is reused only while its expiry, as this process last set it, is at
//!   least `polling.handler_timeout_secs` + [`EXPIRY_MARGIN`] away, so a slot never expires under
//!   a poll.
//! - **Other processes** see a kept slot as taken for up to [`IDLE_FOR`] + [`RENEW_EVERY`] after
//!   this process's last poll of the task. While any other process is refused a token, every
//!   process gives its idle slots back at its next renewal and stops keeping them: under
//!   contention the budget is shared poll by poll; without contention, kept slots cost nobody
//!   anything.
//! - **The circuit.** A poll on a kept slot that got a valid answer (or made no call) reports
//!   nothing at once: its success is added up, and the sum is counted with the process's next
//!   failure of the task (before it, so that the window keeps about the order of the outcomes) or
//!   renewal. A failed poll, and every probe, goes back through `budget::carry`, so failures are
//!   counted at once and the circuit opens on them; the process whose call opened it stops
//!   reusing at once, the others at their next renewal.
//! - **Budget show** and `cardworker_poll_tokens_kept` count kept slots apart from the tokens of
//!   running polls (`in_use`): each renewal records the process's idle slots in the budget's
//!   `kept` hash (the process's entry goes when it keeps none), and `show` counts those still
//!   leases. The record is as old as the last renewal (at most about [`RENEW_EVERY`]): a poll that
//!   started on a kept slot since shows as kept until then, and a slot kept since as in use.
//!
//! A pod with nothing to do keeps nothing and renews nothing: the renewal runs only while there
//! are idle slots or successes to report.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::carry::Carried;
use super::{Acquired, Budget, CallReport, ShortReason, Task};
use crate::limit::LIMIT_CEILING;

/// How often a process with idle slots renews them (and learns whether it may go on reusing).
pub const RENEW_EVERY: Duration = Duration::from_secs(1);
/// A slot idle for longer than this goes back at the next renewal.
pub const IDLE_FOR: Duration = Duration::from_secs(1);
/// How long a renewal's "you may reuse" holds: two renewal periods, so that one late renewal
/// (a busy runtime) does not stop the reuse, and no more.
pub const VERDICT_FOR: Duration = Duration::from_secs(2);
/// What a slot's remaining lease must exceed the handler timeout by for a poll to start on it.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// A lease a poll holds: its id, and when it expires at the earliest (this process's clock: the
/// moment the call that scored it was sent, plus the lease TTL; Redis scored it later).
#[derive(Debug, Clone)]
pub struct Slot {
    /// The lease id (`{pod}-{pid}-{ulid}`).
    pub lease: String,
    /// The earliest moment the lease may expire.
    pub expires: Instant,
}

/// What the last renewal said about a task.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// Keep and reuse slots until then.
    Reuse(Instant),
    /// Give slots back after each poll (the budget shared poll by poll) until then.
    Return(Instant),
}

/// One idle slot.
struct Idle {
    slot: Slot,
    /// When its last poll ended.
    since: Instant,
}

/// One task's part of the pool.
#[derive(Default)]
struct TaskPool {
    /// Idle slots, the most recently used last (a poll takes the last one, so the slots in use stay
    /// few and the others age out).
    idle: Vec<Idle>,
    /// The last renewal's (or refusal's) verdict; `None` before the first.
    verdict: Option<Verdict>,
    /// Valid answers of polls on kept slots not yet counted in the task's circuit.
    successes: u64,
}

impl TaskPool {
    fn reuse_now(&self, now: Instant) -> Option<bool> {
        match self.verdict {
            Some(Verdict::Reuse(until)) if now < until => Some(true),
            Some(Verdict::Return(until)) if now < until => Some(false),
            _ => None,
        }
    }
}

/// The idle slots of one process, per task.
#[derive(Default)]
pub(super) struct Pool {
    tasks: [TaskPool; 2],
}

impl Pool {
    fn task(&mut self, task: Task) -> &mut TaskPool {
        &mut self.tasks[usize::from(Budget::task_index(task) - 2)]
    }

    fn is_empty(&self) -> bool {
        self.tasks
            .iter()
            .all(|t| t.idle.is_empty() && t.successes == 0)
    }
}

/// One task's part of a renewal, as sent.
struct Renewing {
    keep: Vec<String>,
    back: Vec<String>,
    successes: u64,
}

/// One task's part of a renewal's answer: reuse, effective limit, invalid override, lost ids.
type RenewAnswer = (i64, u32, String, Vec<String>);

impl Budget {
    /// Takes both tokens for a poll of `task`: on an idle slot of this process when the last
    /// renewal allows it (no Redis call), else with one acquire ([`Budget::acquire_slot`], which
    /// takes over one of the task's idle slots, if any, and gives the others back). Answers as
    /// `acquire_slot`, with the slot held when granted.
    pub async fn admit(&self, task: Task, lease_id: &str) -> anyhow::Result<(Acquired, Slot)> {
        // This process's own running polls already hold the whole total: no token can be free,
        // whatever Redis says (right after Redis came back empty it has forgotten their leases
        // until the probe writes them back). Nor is one admitted during a hold after a Redis
        // failure (`Budget::hold_for`): another process's leases may not be back yet.
        if self.running_polls() >= usize::from(self.total_limit()) || self.is_held() {
            return Ok((
                Acquired::Short {
                    reason: ShortReason::Total,
                },
                Slot {
                    lease: String::new(),
                    expires: Instant::now(),
                },
            ));
        }
        let floor = Instant::now() + self.handler_timeout + EXPIRY_MARGIN;
        if let Ok(mut pool) = self.pool.lock() {
            let now = Instant::now();
            let tp = pool.task(task);
            match tp.reuse_now(now) {
                Some(true) => {
                    while let Some(idle) = tp.idle.pop() {
                        if idle.slot.expires > floor {
                            self.reused.fetch_add(1, Ordering::Relaxed);
                            return Ok((Acquired::Acquired, idle.slot));
                        }
                        // Too close to its expiry for a whole poll: it goes back.
                        self.carry_back(task, idle.slot.lease, 0);
                    }
                }
                _ => {
                    // Ask Redis; the acquire takes over one of these (or gives them back). The
                    // successes ride on the first; with no slot to carry them they wait for the
                    // next failure or renewal.
                    let idle = std::mem::take(&mut tp.idle);
                    let mut successes = if idle.is_empty() {
                        0
                    } else {
                        std::mem::take(&mut tp.successes)
                    };
                    for idle in idle {
                        self.carry_back(task, idle.slot.lease, std::mem::take(&mut successes));
                    }
                }
            }
        }
        let sent = Instant::now();
        let (answer, lease) = self.acquire_slot(task, lease_id).await?;
        match answer {
            Acquired::Short {
                reason: ShortReason::Paused,
            }
            | Acquired::Fenced { .. }
            | Acquired::CircuitOpen { .. } => self.stop_reuse(task),
            Acquired::Short {
                reason: ShortReason::Total,
            } => {
                // The other task's idle slots hold total tokens this task's polls need now.
                let other = match task {
                    Task::Carddata => Task::CardStatus,
                    Task::CardStatus => Task::Carddata,
                };
                let idle = self
                    .pool
                    .lock()
                    .map(|mut p| std::mem::take(&mut p.task(other).idle))
                    .unwrap_or_default();
                for i in idle {
                    self.carry_back(other, i.slot.lease, 0);
                }
            }
            Acquired::Short {
                reason: ShortReason::Task,
            }
            | Acquired::Acquired
            | Acquired::Probe { .. } => {}
        }
        Ok((
            answer,
            Slot {
                lease,
                expires: sent + self.lease_ttl,
            },
        ))
    }

    /// Ends a poll that [`Budget::admit`] started. Its slot stays with this process, idle, for the
    /// task's next poll when the poll was no probe, did not fail, and the last renewal did not say
    /// "give back"; else it goes back through `budget::carry` with the outcome. Local
    /// waiters for a token are woken either way.
    pub fn finish_poll(
        &self,
        task: Task,
        slot: Slot,
        report: CallReport,
        probe_round: u64,
        card_ref: &str,
    ) {
        let kept = probe_round == 0
            && report != CallReport::Failed
            && self.pool.lock().is_ok_and(|mut pool| {
                let tp = pool.task(task);
                if tp.reuse_now(Instant::now()) == Some(false) {
                    return false;
                }
                if report == CallReport::Ok {
                    tp.successes += 1;
                }
                tp.idle.push(Idle {
                    slot: slot.clone(),
                    since: Instant::now(),
                });
                true
            });
        if kept {
            self.released.notify_waiters();
            self.arm_renewal();
            return;
        }
        // A failure carries the successes added up before it, so the window keeps their order.
        let successes = if report == CallReport::Failed {
            self.take_successes(task)
        } else {
            0
        };
        self.finish_carried_after(task, slot.lease, report, probe_round, card_ref, successes);
    }

    /// The successes of `task`'s polls on kept slots not yet counted in its circuit (taken).
    pub(super) fn take_successes(&self, task: Task) -> u64 {
        self.pool
            .lock()
            .map(|mut p| std::mem::take(&mut p.task(task).successes))
            .unwrap_or(0)
    }

    /// Stops reusing `task`'s slots until the next renewal says otherwise (its circuit opened).
    pub(super) fn stop_reuse(&self, task: Task) {
        if let Ok(mut pool) = self.pool.lock() {
            pool.task(task).verdict = Some(Verdict::Return(Instant::now() + VERDICT_FOR));
        }
    }

    /// Takes every idle slot out of the pool (shutdown: they are released with the held leases)
    /// and stops keeping new ones.
    pub(super) fn drain_pool(&self) {
        if let Ok(mut pool) = self.pool.lock() {
            let until = Instant::now() + Duration::from_secs(3600);
            for tp in &mut pool.tasks {
                tp.idle.clear();
                tp.successes = 0;
                tp.verdict = Some(Verdict::Return(until));
            }
        }
    }

    /// Gives an idle slot back through `budget::carry` (no outcome of its own).
    fn carry_back(&self, task: Task, lease: String, successes: u64) {
        if let Ok(mut carried) = self.carried.lock() {
            carried.push(Carried::back(task, lease, successes));
        }
        self.arm_flush();
    }

    /// Polls started on kept slots so far (this process).
    pub fn reused(&self) -> u64 {
        self.reused.load(Ordering::Relaxed)
    }

    /// Idle slots this process keeps right now.
    pub fn idle_count(&self) -> usize {
        self.pool
            .lock()
            .map(|p| p.tasks.iter().map(|t| t.idle.len()).sum())
            .unwrap_or(0)
    }

    /// Starts the renewal loop unless it runs: every [`RENEW_EVERY`] while there is something to
    /// renew or report, then it stops (an idle pod sends nothing).
    fn arm_renewal(&self) {
        if self.renew_armed.swap(true, Ordering::AcqRel) {
            return;
        }
        let budget = self.clone();
        // A background loop: the process's stop cancels it (its kept slots are released by then).
        self.shutdown.spawn(async move {
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                if let Err(e) = budget.renew().await {
                    budget.hold_for(super::OUTAGE_HOLD);
                    tracing::debug!(error = %format!("{e:#}"), "renewing kept polling slots failed; they are not reused until a renewal answers, and expire with their lease");
                }
                if budget.pool.lock().map(|p| p.is_empty()).unwrap_or(true) {
                    budget.renew_armed.store(false, Ordering::Release);
                    // A slot kept between the check and the store would find the loop armed.
                    let refill = budget.pool.lock().map(|p| !p.is_empty()).unwrap_or(false);
                    if !refill || budget.renew_armed.swap(true, Ordering::AcqRel) {
                        break;
                    }
                }
            }
        });
    }

    /// One renewal of the idle slots (both tasks, one call). See the module docs.
    pub async fn renew(&self) -> anyhow::Result<()> {
        let now = Instant::now();
        let parts: Vec<(Task, Renewing)> = {
            let mut pool = self
                .pool
                .lock()
                .map_err(|_| anyhow::anyhow!("the slot pool's lock is poisoned"))?;
            Task::ALL
                .into_iter()
                .map(|task| {
                    let tp = pool.task(task);
                    let max = usize::try_from(LIMIT_CEILING).unwrap_or(usize::MAX);
                    let (mut keep, mut back) = (Vec::new(), Vec::new());
                    // Kept slots stay reusable while the call runs: the script never removes them.
                    tp.idle.retain(|i| {
                        if now.duration_since(i.since) > IDLE_FOR || keep.len() >= max {
                            back.push(i.slot.lease.clone());
                            false
                        } else {
                            keep.push(i.slot.lease.clone());
                            true
                        }
                    });
                    let successes = std::mem::take(&mut tp.successes);
                    (
                        task,
                        Renewing {
                            keep,
                            back,
                            successes,
                        },
                    )
                })
                .collect()
        };
        let ttl_ms = u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX);
        let mut inv = self.invocation("renew");
        inv.arg(&*self.owner)
            .arg(ttl_ms)
            .arg(self.total_limit.get())
            .arg(LIMIT_CEILING)
            .arg(&*self.circuit);
        for (task, r) in &parts {
            inv.arg(task.label())
                .arg(self.config_limit(*task).get())
                .arg(r.successes)
                .arg(r.keep.len())
                .arg(r.back.len())
                .arg(&r.keep)
                .arg(&r.back);
        }
        inv.arg(self.fence_ms());
        let answers: Vec<RenewAnswer> = match inv.invoke_async(&mut self.conn.clone()).await {
            Ok(answers) => answers,
            Err(e) => {
                // The slots given back may still be in Redis: they stay tracked (shutdown releases
                // them) and go back with the next carried call, as a finished poll's would.
                for (task, r) in parts {
                    for lease in r.back {
                        self.carry_back(task, lease, 0);
                    }
                }
                return Err(
                    anyhow::Error::new(e).context("renewing this process's idle polling slots")
                );
            }
        };
        if let Ok(mut held) = self.held.lock() {
            for (_, r) in &parts {
                for id in &r.back {
                    held.remove(id);
                }
            }
        }
        let sent_expiry = now + self.lease_ttl;
        let mut give_back = Vec::new();
        if let Ok(mut pool) = self.pool.lock() {
            for ((task, r), (reuse, _limit, invalid, lost)) in parts.iter().zip(answers) {
                if !invalid.is_empty() {
                    self.warn_invalid_override(*task, &invalid);
                }
                let tp = pool.task(*task);
                tp.idle.retain(|i| !lost.contains(&i.slot.lease));
                for i in &mut tp.idle {
                    if r.keep.contains(&i.slot.lease) {
                        i.slot.expires = sent_expiry;
                    }
                }
                if reuse == 1 {
                    tp.verdict = Some(Verdict::Reuse(now + VERDICT_FOR));
                } else {
                    tp.verdict = Some(Verdict::Return(now + VERDICT_FOR));
                    give_back.extend(std::mem::take(&mut tp.idle).into_iter().map(|i| (*task, i)));
                }
                if !lost.is_empty() {
                    if let Ok(mut held) = self.held.lock() {
                        for id in &lost {
                            held.remove(id);
                        }
                    }
                }
            }
        }
        for (task, idle) in give_back {
            self.carry_back(task, idle.slot.lease, 0);
        }
        self.released.notify_waiters();
        Ok(())
    }
}
