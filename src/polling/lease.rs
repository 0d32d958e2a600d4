//! A poll's hold on its card: the two poll payloads seen as one ([`PollJob`]), each task's due
//! queue, and how a poll ends in it: its successor (the acknowledgement), sent several to a
//! script call per process and retried while Redis refuses and the lease lasts ([`ack_or_retry`]).
//!
//! Every write a poll makes to its card names its lease, so a poll whose lease ended (its card
//! handed to another poll, or removed) writes nothing: one poll per card and task at a time is
//! the due queue script's property (`polling::due_queue`), not this module's.

use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::{Job, PollCardData, PollCardStatus, PollTicket};
use redis::aio::ConnectionManager;

use super::due_queue::{DueQueue, Lease, PollState, ShardKeys, StillHeld, Successor};
use crate::config::Task;
use crate::queue::batch::ScriptCalls;

pub use cardworker_jobs::due::ACK_WIDTH;

/// A polling job: one of the two payloads, seen through its ticket.
pub trait PollJob: Job + Clone {
    /// Which task it is.
    const TASK: Task;
    /// The card.
    fn card_ref(&self) -> &str;
    /// Its lease and state, from the due queue.
    fn ticket(&self) -> &PollTicket;

    /// The lease the poll runs under.
    fn lease(&self) -> Lease {
        Lease::from_score(self.ticket().lease)
    }

    /// The card's state before this poll.
    fn state(&self) -> PollState {
        PollState::parse(&self.ticket().state)
    }
}

impl PollJob for PollCardData {
    const TASK: Task = Task::Carddata;
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn ticket(&self) -> &PollTicket {
        &self.ticket
    }
}

impl PollJob for PollCardStatus {
    const TASK: Task = Task::CardStatus;
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn ticket(&self) -> &PollTicket {
        &self.ticket
    }
}

/// The due queue of `task` in the deployment with key prefix `prefix` (its one shard,
/// [`cardworker_jobs::due::SHARD`]).
///
/// Built once per process, prefix and task, and cloned after: every poll asks for its task's
/// queue, whose keys are formatted strings. A process has one prefix (tests a few), so the list
/// stays short.
pub fn due_queue(prefix: &str, task: Task) -> DueQueue {
    static BUILT: RwLock<Vec<(Box<str>, Task, DueQueue)>> = RwLock::new(Vec::new());
    let find = |built: &[(Box<str>, Task, DueQueue)]| {
        built
            .iter()
            .find(|(p, t, _)| *t == task && **p == *prefix)
            .map(|(_, _, queue)| queue.clone())
    };
    if let Some(queue) = find(&BUILT.read().unwrap_or_else(PoisonError::into_inner)) {
        return queue;
    }
    let mut built = BUILT.write().unwrap_or_else(PoisonError::into_inner);
    if let Some(queue) = find(&built) {
        return queue;
    }
    let queue = DueQueue::new(ShardKeys::new(prefix, task, cardworker_jobs::due::SHARD));
    built.push((prefix.into(), task, queue.clone()));
    queue
}

/// One acknowledgement through `calls` (`queue`'s keys).
pub async fn ack(
    calls: &ScriptCalls,
    queue: &DueQueue,
    successor: &Successor<'_>,
) -> anyhow::Result<StillHeld<()>> {
    let keys = queue.script_keys();
    let args = vec![
        successor.card_ref.to_owned(),
        successor.lease.score().to_string(),
        u64::try_from(successor.next_in.as_millis())
            .unwrap_or(u64::MAX)
            .to_string(),
        successor.next.to_raw(),
    ];
    let done = calls
        .call(keys, args)
        .await
        .with_context(|| format!("acknowledging the poll of {}", successor.card_ref))?;
    Ok(match done {
        redis::Value::Int(1) => StillHeld::Yes(()),
        _ => StillHeld::Stale,
    })
}

/// How long the acknowledgement of a poll is retried at most: past its lease it could only be
/// stale (the card is due again, with the state it had before the poll).
pub fn retry_for(lease: Lease, redis_now_ms: u64) -> Duration {
    Duration::from_millis(lease.deadline_ms().saturating_sub(redis_now_ms))
}

/// [`ack`], and if Redis refuses (an outage after the poll's PostgreSQL commit), keeps trying in
/// the background with back-off while the lease lasts (`until`, on this process's clock). Returns
/// whether the successor was written, or handed to the background; `false` when the lease no
/// longer held the card.
pub async fn ack_or_retry(
    calls: &ScriptCalls,
    shutdown: &crate::shutdown::Shutdown,
    queue: &DueQueue,
    successor: Successor<'_>,
    until: std::time::Instant,
) -> bool {
    match ack(calls, queue, &successor).await {
        Ok(held) => held == StillHeld::Yes(()),
        Err(e) => {
            let card_ref = successor.card_ref.to_owned();
            tracing::warn!(%card_ref, error = %format!("{e:#}"), "successor refused by Redis; retrying in the background while the lease lasts");
            let (calls, queue) = (calls.clone(), queue.clone());
            let (lease, next_in, next) = (successor.lease, successor.next_in, successor.next);
            shutdown.spawn(async move {
                let backoff = crate::backoff::Backoff::new(
                    Duration::from_millis(500),
                    Duration::from_secs(5),
                    crate::backoff::Jitter::Proportional(0.2),
                );
                let mut attempt = 0;
                while std::time::Instant::now() < until {
                    attempt += 1;
                    tokio::time::sleep(backoff.delay(attempt)).await;
                    let successor = Successor {
                        card_ref: &card_ref,
                        lease,
                        next_in,
                        next: next.clone(),
                    };
                    match ack(&calls, &queue, &successor).await {
                        Ok(held) => {
                            tracing::info!(%card_ref, attempt, written = held == StillHeld::Yes(()), "successor written after Redis came back");
                            return;
                        }
                        Err(e) => {
                            tracing::debug!(%card_ref, attempt, error = %format!("{e:#}"), "successor still refused")
                        }
                    }
                }
                tracing::warn!(%card_ref, "successor given up with its lease; the card is due again with the state it had when fetched");
            });
            true
        }
    }
}

/// Starts (or restarts) the polling of `card_ref`'s `task`: a fresh state, its next poll due
/// `delay` from now (a card a poll holds keeps its lease). One entry per card and task, however
/// often it is called ([`DueQueue::restart`]).
pub async fn start(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    delay: Duration,
) -> anyhow::Result<super::due_queue::Restarted> {
    due_queue(prefix, task)
        .restart(conn, card_ref, delay)
        .await
        .with_context(|| format!("starting the {task} polling of {card_ref}"))
}
