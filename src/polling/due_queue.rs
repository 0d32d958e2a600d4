//! The due queue of one polling task shard: each card's one record in Redis, which workers fetch
//! under a lease and acknowledge by writing the card's next due time
//! ([`due_queue.lua`](./due_queue.lua)).
//!
//! One sorted set holds it all. A waiting card is scored by its due time; a leased card by
//! `LEASED` + its lease's deadline, both on Redis's clock. So:
//! - **one poll per card at a time** is a property of the script alone: a fetch takes only cards
//!   that wait and are due, or whose lease ended, and every op that names a lease acts only while
//!   that lease holds the card ([`Lease`]): a stale or repeated acknowledgement changes nothing;
//! - **a lease that ends makes the card due again**, as of the lease's deadline: no heartbeat, no
//!   orphan sweep, no per-job hash and no run marker;
//! - **under a backlog the oldest due cards go first** (a fetch takes the earliest), and a card
//!   given back unpolled keeps its place ([`DueQueue::release`]);
//! - **the lateness gauges** read the head in one call ([`DueQueue::head`]).
//!
//! Every key of a shard carries the shard's hash tag ([`ShardKeys`]), and every key a call
//! touches is passed in `KEYS`, so the script runs on a Redis Cluster; a test runs it on a
//! three-master one.

use std::sync::LazyLock;
use std::time::Duration;

use anyhow::Context as _;
use redis::aio::ConnectionLike;
use redis::Script;

use crate::config::Task;

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("due_queue.lua")));

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
}

impl ShardKeys {
    /// The keys of shard `shard` of `task` in the deployment with key prefix `prefix`.
    pub fn new(prefix: &str, task: Task, shard: u16) -> Self {
        let tag = format!("{prefix}:{{poll:{}:{shard}}}", task.label());
        Self {
            due: format!("{tag}:due"),
            last_lease: format!("{tag}:last_lease"),
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
}

/// A card a fetch leased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    pub card_ref: String,
    pub lease: Lease,
    /// When the card came due (unix ms, Redis clock): its due time, or the deadline of a lease
    /// that ended without an acknowledgement.
    pub due_ms: u64,
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

/// One task shard's due queue.
#[derive(Debug, Clone)]
pub struct DueQueue {
    keys: ShardKeys,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl DueQueue {
    pub fn new(keys: ShardKeys) -> Self {
        Self { keys }
    }

    /// The shard's keys.
    pub fn keys(&self) -> &ShardKeys {
        &self.keys
    }

    fn call(&self, op: &str) -> redis::ScriptInvocation<'static> {
        let mut inv = SCRIPT.key(&self.keys.due);
        inv.key(&self.keys.last_lease).arg(op);
        inv
    }

    /// Leases at most `max` due cards for `lease`, the earliest due first.
    pub async fn fetch(
        &self,
        conn: &mut impl ConnectionLike,
        max: usize,
        lease: Duration,
    ) -> anyhow::Result<Vec<Leased>> {
        let mut inv = self.call("fetch");
        inv.arg(max).arg(millis(lease));
        let raw: Vec<redis::Value> = inv.invoke_async(conn).await.context("fetching due cards")?;
        raw.chunks(3)
            .map(|entry| match entry {
                [card, lease, due] => Ok(Leased {
                    card_ref: redis::from_redis_value_ref(card)?,
                    lease: Lease(redis::from_redis_value_ref(lease)?),
                    due_ms: redis::from_redis_value_ref(due)?,
                }),
                _ => anyhow::bail!("due_queue.lua fetch answered {} values", raw.len()),
            })
            .collect()
    }

    /// Ends the poll under `lease`: its card is due again `next_in` from now.
    pub async fn ack(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        lease: Lease,
        next_in: Duration,
    ) -> anyhow::Result<StillHeld<()>> {
        let held = self.ack_many(conn, &[(card_ref, lease, next_in)]).await?;
        Ok(held.into_iter().next().unwrap_or(StillHeld::Stale))
    }

    /// Ends several polls in one call ([`DueQueue::ack`] for each, in order).
    pub async fn ack_many(
        &self,
        conn: &mut impl ConnectionLike,
        polls: &[(&str, Lease, Duration)],
    ) -> anyhow::Result<Vec<StillHeld<()>>> {
        let mut inv = self.call("ack");
        for (card_ref, lease, next_in) in polls {
            inv.arg(*card_ref).arg(lease.score()).arg(millis(*next_in));
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
        Ok(done
            .into_iter()
            .map(|d| {
                if d == 1 {
                    StillHeld::Yes(())
                } else {
                    StillHeld::Stale
                }
            })
            .collect())
    }

    /// Gives the card under `lease` back unpolled, at the due time it was fetched with (so it
    /// keeps its place among the due cards).
    pub async fn release(
        &self,
        conn: &mut impl ConnectionLike,
        leased: &Leased,
    ) -> anyhow::Result<StillHeld<()>> {
        let mut inv = self.call("release");
        inv.arg(&leased.card_ref)
            .arg(leased.lease.score())
            .arg(leased.due_ms);
        let done: u8 = inv.invoke_async(conn).await.context("releasing a lease")?;
        Ok(if done == 1 {
            StillHeld::Yes(())
        } else {
            StillHeld::Stale
        })
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

    /// Adds `card_ref`, due `after` from now, unless it has an entry already (which is left as
    /// it is). Returns whether it was added.
    pub async fn add(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        after: Duration,
    ) -> anyhow::Result<bool> {
        let mut inv = self.call("add");
        inv.arg(card_ref).arg(millis(after));
        let added: u8 = inv.invoke_async(conn).await.context("adding a card")?;
        Ok(added == 1)
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
