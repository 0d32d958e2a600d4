//! The due queue of one polling task shard: each card's one record in Redis, which workers fetch
//! under a lease and acknowledge by writing the card's next due time
//! (`jobs/src/due_queue.lua`, [`cardworker_jobs::due::SCRIPT`], which producers share).
//!
//! One sorted set holds when each card is due. A waiting card is scored by its due time; a leased
//! card by `LEASED` + its lease's deadline, both on Redis's clock. One hash beside it holds what
//! the card's next poll needs ([`PollState`]: its failures, its deferrals and the unchanged-poll
//! tally); the script writes and removes both together. So:
//! - **one poll per card at a time** is a property of the script alone: a fetch takes only cards
//!   that wait and are due, or whose lease ended, and every op that names a lease acts only while
//!   that lease holds the card ([`Lease`]): a stale or repeated acknowledgement changes nothing;
//! - **a lease that ends makes the card due again**, as of the lease's deadline: no heartbeat, no
//!   orphan sweep, no per-job hash and no run marker;
//! - **the acknowledgement is the successor**: one call per batch of finished polls writes each
//!   card's next due time and its next state, which the worker works out from the state the
//!   fetch handed it ([`Successor`], [`PollState::after`]): the script reads no state back;
//! - **under a backlog the oldest due cards go first** (a fetch takes the earliest), and a card
//!   given back unpolled keeps its place ([`DueQueue::release`]);
//! - **the lateness gauges** read the head in one call ([`DueQueue::head`]).
//!
//! Every key of a shard carries the shard's hash tag ([`ShardKeys`]), and every key a call
//! touches is passed in `KEYS`, so the script runs on a Redis Cluster; a test runs it on a
//! three-master one.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use anyhow::Context as _;
use redis::aio::ConnectionLike;
use redis::{Script, Value};

pub use super::poll_state::{PollState, Step};
use crate::config::Task;
use crate::keys;

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(cardworker_jobs::due::SCRIPT));

/// The score offset of a leased card (2^50 ms, as in `due_queue.lua`).
pub const LEASED: u64 = 1 << 50;

/// The Redis keys of one task shard. Each carries the hash tag `{poll:<task>:<shard>}`, so that a
/// shard's keys share a Redis Cluster slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardKeys {
    /// The due set (card_ref -> due ms, or `LEASED` + the lease's deadline).
    pub due: String,
    /// The last lease score the shard wrote: every new one is above it, so no two leases of a
    /// card share a score.
    pub last_lease: String,
    /// The poll state (card_ref -> `unchanged|last|since|failures[.deferrals]`, [`PollState`]).
    pub state: String,
}

impl ShardKeys {
    /// The keys of shard `shard` of `task` in the deployment with key prefix `prefix`.
    pub fn new(prefix: &str, task: Task, shard: u16) -> Self {
        Self {
            due: keys::poll_due_key(prefix, task, shard),
            last_lease: keys::poll_last_lease_key(prefix, task, shard),
            state: keys::poll_state_key(prefix, task, shard),
        }
    }
}

/// A lease on one card: its score in the due set, `LEASED` + its deadline (ms, Redis clock). It
/// names the lease: no two leases of a card share a score (each new lease score of a shard is
/// above the last one it wrote).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lease(u64);

impl Lease {
    /// When the lease ends, unless extended (unix ms, Redis clock).
    pub fn deadline_ms(self) -> u64 {
        self.0.saturating_sub(LEASED)
    }

    /// The lease's score, as the script takes it.
    pub fn score(self) -> u64 {
        self.0
    }

    /// The lease named by `score` (a score a fetch or an extension answered).
    pub fn from_score(score: u64) -> Self {
        Self(score)
    }
}

/// A card a fetch leased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    pub card_ref: String,
    pub lease: Lease,
    /// When the card came due (unix ms, Redis clock): its due time, or the deadline of a lease
    /// that ended without an acknowledgement.
    pub due_ms: u64,
    /// What its poll needs: failures, deferrals, tally.
    pub state: PollState,
}

/// One finished poll's acknowledgement: the card's next poll, fenced by the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Successor<'a> {
    pub card_ref: &'a str,
    /// The lease the poll ran under: nothing is written unless it still holds the card.
    pub lease: Lease,
    /// When the next poll is due, from the acknowledgement on.
    pub next_in: Duration,
    /// The next poll's state ([`PollState::after`]).
    pub next: PollState,
}

/// Where a card stands in its shard ([`DueQueue::entry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// It waits for its next poll, due then (unix ms, Redis clock; in the past: overdue).
    Waiting { due_ms: u64 },
    /// A poll holds it until then (unix ms, Redis clock), unless acknowledged or extended first;
    /// after it the card is due again.
    Leased { deadline_ms: u64 },
}

/// What [`DueQueue::fetch_or_wait`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// The cards it leased (at least one).
    Leased(Vec<Leased>),
    /// No card was due; the next one is due after `next_in` (its due time, or the end of a
    /// lease), `None` when the shard is empty.
    NoneDue { next_in: Option<Duration> },
}

/// What [`DueQueue::restart`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restarted {
    /// The card had no entry: it was added.
    Started,
    /// It waited: it is due when asked, with a fresh state.
    Restarted,
    /// A poll holds it: its state is fresh, and the running poll is the one asked for.
    Running,
}

/// What [`DueQueue::merge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The card had no entry: it was added, its first poll due when asked.
    Started,
    /// The card had one: a waiting card is due no later than asked, a leased one is being polled.
    IntoLive,
}

/// What the head of the due set says (for the lateness gauges).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Redis's clock at the call (unix ms).
    pub now_ms: u64,
    /// The earliest due time of a card that is due now, if any.
    pub earliest_due_ms: Option<u64>,
    /// How many cards are due now (waiting, or with a lease that ended).
    pub due_now: u64,
}

/// An acknowledgement's, a release's or an extension's answer: whether the lease still held its
/// card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StillHeld<T> {
    /// It did, and the call took effect.
    Yes(T),
    /// It did not (the lease ended and the card was leased again, or it was acknowledged or
    /// released already): nothing changed.
    Stale,
}

/// One task shard's due queue. Cheap to clone: its keys are shared.
#[derive(Debug, Clone)]
pub struct DueQueue {
    keys: Arc<ShardKeys>,
    /// The same keys in the order the script takes them (`KEYS[1..3]`), for the calls sent
    /// through a batcher (`queue::batch`), which takes them shared.
    script_keys: Arc<[String]>,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A due time as a fetch answers it: an integer, or a waiting card's score as Redis wrote it
/// (whole milliseconds, in digits, for every score this project writes; a fraction is cut off).
fn whole_ms(value: &redis::Value) -> anyhow::Result<u64> {
    if let Ok(ms) = redis::from_redis_value_ref::<u64>(value) {
        return Ok(ms);
    }
    let ms: f64 = redis::from_redis_value_ref(value).context("a due time that is no number")?;
    anyhow::ensure!(ms.is_finite() && ms >= 0.0, "a due time out of range: {ms}");
    Ok(ms.trunc() as u64)
}

/// The script's answer for one lease-fenced call: 1 done, 0 stale.
fn still_held(done: u8) -> StillHeld<()> {
    if done == 1 {
        StillHeld::Yes(())
    } else {
        StillHeld::Stale
    }
}

impl DueQueue {
    pub fn new(keys: ShardKeys) -> Self {
        let script_keys = Arc::from(vec![
            keys.due.clone(),
            keys.last_lease.clone(),
            keys.state.clone(),
        ]);
        Self {
            keys: Arc::new(keys),
            script_keys,
        }
    }

    /// The shard's keys.
    pub fn keys(&self) -> &ShardKeys {
        &self.keys
    }

    /// The shard's keys as the script takes them (`KEYS[1..3]`).
    pub fn script_keys(&self) -> Arc<[String]> {
        self.script_keys.clone()
    }

    fn call(&self, op: &str) -> redis::ScriptInvocation<'static> {
        let mut inv = SCRIPT.key(&self.keys.due);
        inv.key(&self.keys.last_lease).key(&self.keys.state).arg(op);
        inv
    }

    /// Leases at most `max` due cards for `lease`, the earliest due first.
    pub async fn fetch(
        &self,
        conn: &mut impl ConnectionLike,
        max: usize,
        lease: Duration,
    ) -> anyhow::Result<Vec<Leased>> {
        Ok(match self.fetch_or_wait(conn, max, lease).await? {
            Fetched::Leased(leased) => leased,
            Fetched::NoneDue { .. } => Vec::new(),
        })
    }

    /// [`DueQueue::fetch`], telling, when no card is due, how soon one is.
    pub async fn fetch_or_wait(
        &self,
        conn: &mut impl ConnectionLike,
        max: usize,
        lease: Duration,
    ) -> anyhow::Result<Fetched> {
        let mut inv = self.call("fetch");
        inv.arg(max).arg(millis(lease));
        let raw: Vec<redis::Value> = inv.invoke_async(conn).await.context("fetching due cards")?;
        match raw.as_slice() {
            [] => return Ok(Fetched::NoneDue { next_in: None }),
            [next_in] => {
                let ms: u64 = redis::from_redis_value_ref(next_in)?;
                return Ok(Fetched::NoneDue {
                    next_in: Some(Duration::from_millis(ms)),
                });
            }
            _ => {}
        }
        let [lease, Value::Array(taken), Value::Array(states)] = raw.as_slice() else {
            anyhow::bail!(
                "due_queue.lua fetch answered {} values, not a lease and two lists",
                raw.len()
            );
        };
        anyhow::ensure!(
            taken.len() == 2 * states.len(),
            "due_queue.lua fetch answered {} cards and due times for {} states",
            taken.len(),
            states.len()
        );
        let lease = Lease(redis::from_redis_value_ref(lease)?);
        taken
            .chunks_exact(2)
            .zip(states)
            .map(|(entry, state)| {
                Ok(Leased {
                    card_ref: redis::from_redis_value_ref(&entry[0])?,
                    lease,
                    due_ms: whole_ms(&entry[1])?,
                    state: PollState::parse(
                        &redis::from_redis_value_ref::<Option<String>>(state)?.unwrap_or_default(),
                    ),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()
            .map(Fetched::Leased)
    }

    /// Ends the poll under `successor.lease` with its card's next poll.
    pub async fn ack(
        &self,
        conn: &mut impl ConnectionLike,
        successor: &Successor<'_>,
    ) -> anyhow::Result<StillHeld<()>> {
        let held = self.ack_many(conn, std::slice::from_ref(successor)).await?;
        Ok(held.into_iter().next().unwrap_or(StillHeld::Stale))
    }

    /// Ends several polls in one call ([`DueQueue::ack`] for each, in order).
    pub async fn ack_many(
        &self,
        conn: &mut impl ConnectionLike,
        polls: &[Successor<'_>],
    ) -> anyhow::Result<Vec<StillHeld<()>>> {
        let mut inv = self.call("ack");
        for poll in polls {
            inv.arg(poll.card_ref)
                .arg(poll.lease.score())
                .arg(millis(poll.next_in))
                .arg(poll.next.to_raw());
        }
        let done: Vec<u8> = inv
            .invoke_async(conn)
            .await
            .context("acknowledging polls")?;
        anyhow::ensure!(
            done.len() == polls.len(),
            "due_queue.lua ack answered {} of {} polls",
            done.len(),
            polls.len()
        );
        Ok(done.into_iter().map(still_held).collect())
    }

    /// Ends the card's polling under `lease`: its due entry and state go.
    pub async fn finish(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        lease: Lease,
    ) -> anyhow::Result<StillHeld<()>> {
        let mut inv = self.call("finish");
        inv.arg(card_ref).arg(lease.score());
        let done: u8 = inv
            .invoke_async(conn)
            .await
            .context("finishing a card's polling")?;
        Ok(still_held(done))
    }

    /// Gives the card under `lease` back unpolled, at the due time it was fetched with (so it
    /// keeps its place among the due cards).
    pub async fn release(
        &self,
        conn: &mut impl ConnectionLike,
        leased: &Leased,
    ) -> anyhow::Result<StillHeld<()>> {
        self.release_at(conn, &leased.card_ref, leased.lease, leased.due_ms)
            .await
    }

    /// [`DueQueue::release`] of `card_ref` under `lease`, due again at `due_ms` (the due time it
    /// was fetched with).
    pub async fn release_at(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        lease: Lease,
        due_ms: u64,
    ) -> anyhow::Result<StillHeld<()>> {
        let mut inv = self.call("release");
        inv.arg(card_ref).arg(lease.score()).arg(due_ms);
        let done: u8 = inv.invoke_async(conn).await.context("releasing a lease")?;
        Ok(still_held(done))
    }

    /// Extends `lease` to end `by` from now (never earlier than it does); the lease is named by
    /// the answer from then on.
    pub async fn extend(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        lease: Lease,
        by: Duration,
    ) -> anyhow::Result<StillHeld<Lease>> {
        let mut inv = self.call("extend");
        inv.arg(card_ref).arg(lease.score()).arg(millis(by));
        let score: u64 = inv.invoke_async(conn).await.context("extending a lease")?;
        Ok(if score == 0 {
            StillHeld::Stale
        } else {
            StillHeld::Yes(Lease(score))
        })
    }

    /// Adds `card_ref`, due `after` from now with a fresh state, unless it has an entry already
    /// (which is left as it is). Returns whether it was added.
    pub async fn add(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        after: Duration,
    ) -> anyhow::Result<bool> {
        Ok(self.add_many(conn, &[(card_ref, after)]).await? == 1)
    }

    /// [`DueQueue::add`] for each of `cards` in one call; returns how many were added.
    pub async fn add_many(
        &self,
        conn: &mut impl ConnectionLike,
        cards: &[(&str, Duration)],
    ) -> anyhow::Result<usize> {
        if cards.is_empty() {
            return Ok(0);
        }
        let mut inv = self.call("add");
        for (card_ref, after) in cards {
            inv.arg(*card_ref).arg(millis(*after));
        }
        inv.invoke_async(conn).await.context("adding cards")
    }

    /// Adds each card of `cards` (card_ref, due ms on Redis's clock, raw state or `""` for a
    /// fresh one) that has no entry yet; a card that has one keeps it. Returns how many were
    /// added. Moving chains over ([`super::takeover`]).
    pub async fn adopt(
        &self,
        conn: &mut impl ConnectionLike,
        cards: &[(String, u64, String)],
    ) -> anyhow::Result<usize> {
        if cards.is_empty() {
            return Ok(0);
        }
        let mut inv = self.call("adopt");
        for (card_ref, due_ms, state) in cards {
            inv.arg(card_ref).arg(*due_ms).arg(state);
        }
        inv.invoke_async(conn).await.context("adopting cards")
    }

    /// A producer's request for a poll of `card_ref` `after` from now: a waiting card is brought
    /// forward to then (never put back), a leased one is left to its running poll, and a card
    /// without an entry is added.
    pub async fn merge(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        after: Duration,
    ) -> anyhow::Result<Merged> {
        let mut inv = self.call("merge");
        inv.arg(card_ref).arg(millis(after));
        let verdict: String = inv
            .invoke_async(conn)
            .await
            .context("merging a poll request")?;
        Ok(if verdict == "started" {
            Merged::Started
        } else {
            Merged::IntoLive
        })
    }

    /// An operator's restart of `card_ref`'s polling: a fresh state, and a waiting card due
    /// `after` from now; a card a poll holds keeps its lease (that poll sees the reset).
    pub async fn restart(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        after: Duration,
    ) -> anyhow::Result<Restarted> {
        let mut inv = self.call("restart");
        inv.arg(card_ref).arg(millis(after));
        let verdict: String = inv
            .invoke_async(conn)
            .await
            .context("restarting a card's polling")?;
        Ok(match verdict.as_str() {
            "started" => Restarted::Started,
            "running" => Restarted::Running,
            _ => Restarted::Restarted,
        })
    }

    /// Where `card_ref` stands and its state, or `None` when it has no entry (two commands on
    /// the shard's keys, not a script: a read for `investigate` and the console).
    pub async fn entry(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
    ) -> anyhow::Result<Option<(Standing, PollState)>> {
        let (score, state): (Option<u64>, Option<String>) = redis::pipe()
            .cmd("ZSCORE")
            .arg(&self.keys.due)
            .arg(card_ref)
            .cmd("HGET")
            .arg(&self.keys.state)
            .arg(card_ref)
            .query_async(conn)
            .await
            .with_context(|| format!("reading the due entry of {card_ref}"))?;
        Ok(score.map(|score| {
            let standing = if score >= LEASED {
                Standing::Leased {
                    deadline_ms: score - LEASED,
                }
            } else {
                Standing::Waiting { due_ms: score }
            };
            (standing, PollState::parse(state.as_deref().unwrap_or("")))
        }))
    }

    /// Removes `card_ref`: it is polled no more, and a running poll's acknowledgement changes
    /// nothing. Returns whether it had an entry.
    pub async fn remove(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
    ) -> anyhow::Result<bool> {
        let mut inv = self.call("remove");
        inv.arg(card_ref);
        let removed: u8 = inv.invoke_async(conn).await.context("removing a card")?;
        Ok(removed == 1)
    }

    /// The head of the due set, in one call.
    pub async fn head(&self, conn: &mut impl ConnectionLike) -> anyhow::Result<Head> {
        let (now_ms, earliest, due_now): (u64, i64, u64) = self
            .call("head")
            .invoke_async(conn)
            .await
            .context("reading the due set's head")?;
        Ok(Head {
            now_ms,
            earliest_due_ms: u64::try_from(earliest).ok(),
            due_now,
        })
    }
}
