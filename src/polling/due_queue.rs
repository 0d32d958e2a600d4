//! The due queue of one polling task shard: each card's one record in Redis, which workers fetch
//! under a lease and acknowledge by writing the card's next due time (`jobs/src/due_queue.lua`,
//! [`cardworker_jobs::due`], which producers share).
//!
//! It is a timing wheel. A card's waiting poll is one entry, `due|state|card`, in the list of a
//! time slot that ends a little after the entry is due ([`cardworker_jobs::due::slot_id`]: at
//! most a twentieth of its delay, and 8.192 s); a sorted set orders the slots by their end, and a
//! fetch takes entries only from slots that ended; a leased card waits in one in-flight
//! sorted set, scored `LEASED` + its lease's deadline on Redis's clock, its entry in a hash
//! beside it; and one field per card,
//! in one of a fixed number of small hashes, names the slot of its entry (its presence). So:
//! - **one poll per card at a time** is a property of the script alone: a card has one entry,
//!   waiting in a slot or leased in flight, a fetch takes only entries that are due or whose
//!   lease ended, and every op that names a lease acts only while that lease holds the card's
//!   entry ([`Lease`]): a stale or repeated acknowledgement changes nothing;
//! - **a lease that ends makes the card due again**, as of the lease's deadline: no heartbeat, no
//!   orphan sweep, no per-job hash and no run marker;
//! - **the acknowledgement is the successor**: one call per batch of finished polls writes each
//!   card's next entry whole, with the state the worker works out from the one the fetch handed
//!   it ([`Successor`], [`PollState::after`]), into the slot of its due time, which this process
//!   names from the Redis clock the last fetch reported;
//! - **no call on a poll's path looks a card up**: a fetch takes the heads of the due slots (two
//!   calls: the first slots' ids, then the script with their keys), and an acknowledgement reads
//!   its lease's holders as a score range;
//! - **an op on one card** (merge, restart, remove, [`DueQueue::entry`]) reads the card's presence
//!   first and names the slot it found; the script changes nothing when the presence moved in
//!   between, and the op reads again;
//! - **under a backlog the oldest due cards go first** (a fetch takes the earliest), and a card
//!   given back unpolled keeps its place ([`DueQueue::release`]);
//! - **the lateness gauges** read the head in one call ([`DueQueue::head`]).
//!
//! A card costs Redis its entry and its presence field, both packed into small encodings: about
//! a third of a sorted-set member and a hash field (docs/SCALING.md, "Redis memory per card").
//! Every key of a shard carries the shard's hash tag ([`ShardKeys`]), and every key a call
//! touches is passed in `KEYS`, so the script runs on a Redis Cluster; a test runs it on a
//! three-master one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use cardworker_jobs::due::{self as shared, Verdict};
use redis::aio::ConnectionLike;
use redis::Script;

pub use super::poll_state::{PollState, Step};
use crate::config::Task;
use crate::keys;
pub use cardworker_jobs::due::ShardKeys;

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(shared::SCRIPT));

/// The score offset of a leased card (2^50 ms, as in `due_queue.lua`).
pub const LEASED: u64 = 1 << 50;

/// A lease on one card: its entry's score in flight, `LEASED` + its deadline (ms, Redis clock). It
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

/// What the head of the due queue says (for the lateness gauges).
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

/// Every record of a shard ([`DueQueue::snapshot`]).
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Each entry: its card, where it stands and its state (a card twice is a broken shard).
    pub entries: Vec<(String, Standing, PollState)>,
    /// Each presence field: card -> the slot id it names.
    pub presence: std::collections::BTreeMap<String, u64>,
}

/// An entry's due time, state and card (`due|state|card`, the state four fields).
fn parse_entry(entry: &str) -> anyhow::Result<(u64, PollState, String)> {
    let mut parts = entry.splitn(6, '|');
    let due = parts.next().unwrap_or_default();
    let state: Vec<&str> = parts.by_ref().take(4).collect();
    let card = parts.next();
    match (due.parse::<u64>(), state.len(), card) {
        (Ok(due), 4, Some(card)) => Ok((due, PollState::parse(&state.join("|")), card.to_owned())),
        _ => anyhow::bail!("a due entry that is not due|state|card: {entry:?}"),
    }
}

/// How many slots a fetch names: the first ones by due time. A fetch whose due entries lie in
/// more slots than these takes what these hold; the next fetch takes the rest.
const FETCH_SLOTS: usize = 8;

/// One task shard's due queue as a timing wheel. Cheap to clone: its keys and its view of the
/// Redis clock are shared.
#[derive(Debug, Clone)]
pub struct DueQueue {
    keys: Arc<ShardKeys>,
    /// The fixed keys in the order the script takes them (`KEYS[1..5]`), for the calls sent
    /// through a batcher (`queue::batch`), which takes them shared.
    script_keys: Arc<[String]>,
    /// Redis's clock minus this process's (ms), as the last fetch or head read it: a successor's
    /// slot is named from it.
    offset_ms: Arc<AtomicI64>,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn local_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn still_held(done: u8) -> StillHeld<()> {
    if done == 1 {
        StillHeld::Yes(())
    } else {
        StillHeld::Stale
    }
}

/// The keys a call names beyond the fixed five, each once, and each group's positions in `KEYS`.
#[derive(Default)]
struct ExtraKeys {
    keys: Vec<String>,
    index: HashMap<String, usize>,
}

impl ExtraKeys {
    /// The 1-based `KEYS` position of `key`, added when new.
    fn position(&mut self, key: String) -> usize {
        if let Some(i) = self.index.get(&key) {
            return *i;
        }
        let i = shared::FIXED_KEYS + 1 + self.keys.len();
        self.index.insert(key.clone(), i);
        self.keys.push(key);
        i
    }
}

impl DueQueue {
    pub fn new(prefix: &str, task: Task, shard: u16) -> Self {
        let keys = ShardKeys::new(prefix, keys::queue_of(task), shard);
        let script_keys = keys.fixed().map(str::to_owned).to_vec().into();
        Self {
            keys: Arc::new(keys),
            script_keys,
            offset_ms: Arc::new(AtomicI64::new(0)),
        }
    }

    /// The fixed keys as the script takes them (`KEYS[1..5]`).
    pub fn script_keys(&self) -> Arc<[String]> {
        self.script_keys.clone()
    }

    /// The shard's keys.
    pub fn keys(&self) -> &ShardKeys {
        &self.keys
    }

    /// This process's estimate of Redis's clock (unix ms).
    pub fn redis_now_ms(&self) -> u64 {
        u64::try_from(local_ms() + self.offset_ms.load(Ordering::Relaxed)).unwrap_or(0)
    }

    fn saw_redis_clock(&self, redis_ms: u64) {
        let redis_ms = i64::try_from(redis_ms).unwrap_or(i64::MAX);
        self.offset_ms
            .store(redis_ms - local_ms(), Ordering::Relaxed);
    }

    /// The slot list and presence hash of a successor due `next_in` from now.
    pub fn successor_keys(&self, card_ref: &str, next_in: Duration) -> [String; 2] {
        let now = self.redis_now_ms();
        [
            self.keys
                .slot(shared::slot_id(now.saturating_add(millis(next_in)), now)),
            self.keys.presence(card_ref),
        ]
    }

    fn call(&self, op: &str, extra: &[String]) -> redis::ScriptInvocation<'static> {
        let mut inv = SCRIPT.prepare_invoke();
        for key in self.keys.fixed() {
            inv.key(key);
        }
        for key in extra {
            inv.key(key);
        }
        inv.arg(op);
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
        let ids: Vec<u64> = redis::cmd("ZRANGE")
            .arg(&self.keys.slots)
            .arg(0)
            .arg(FETCH_SLOTS - 1)
            .query_async(conn)
            .await
            .context("reading the first slots")?;
        let slots: Vec<String> = ids.into_iter().map(|id| self.keys.slot(id)).collect();
        let mut inv = self.call("fetch", &slots);
        inv.arg(max).arg(millis(lease));
        let raw: Vec<redis::Value> = inv.invoke_async(conn).await.context("fetching due cards")?;
        let Some((now, rest)) = raw.split_first() else {
            anyhow::bail!("due_queue.lua fetch answered nothing");
        };
        self.saw_redis_clock(redis::from_redis_value_ref(now)?);
        match rest {
            [] => return Ok(Fetched::NoneDue { next_in: None }),
            [next_in] => {
                let ms: u64 = redis::from_redis_value_ref(next_in)?;
                return Ok(Fetched::NoneDue {
                    next_in: Some(Duration::from_millis(ms)),
                });
            }
            _ => {}
        }
        rest.chunks(4)
            .map(|entry| match entry {
                [card, lease, due, state] => Ok(Leased {
                    card_ref: redis::from_redis_value_ref(card)?,
                    lease: Lease::from_score(redis::from_redis_value_ref(lease)?),
                    due_ms: redis::from_redis_value_ref(due)?,
                    state: PollState::parse(&redis::from_redis_value_ref::<String>(state)?),
                }),
                _ => anyhow::bail!("due_queue.lua fetch answered {} values", raw.len()),
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
        let mut extra = ExtraKeys::default();
        let mut args: Vec<String> = Vec::with_capacity(polls.len() * (shared::ACK_WIDTH + 2));
        for poll in polls {
            let [slot, presence] = self.successor_keys(poll.card_ref, poll.next_in);
            args.push(extra.position(slot).to_string());
            args.push(extra.position(presence).to_string());
            args.push(poll.card_ref.to_owned());
            args.push(poll.lease.score().to_string());
            args.push(millis(poll.next_in).to_string());
            args.push(poll.next.to_raw());
        }
        let mut inv = self.call("batch", &extra.keys);
        inv.arg(args);
        let done: Vec<u8> = inv
            .invoke_async(conn)
            .await
            .context("acknowledging polls")?;
        anyhow::ensure!(
            done.len() == polls.len(),
            "due_queue.lua batch answered {} of {} polls",
            done.len(),
            polls.len()
        );
        Ok(done.into_iter().map(still_held).collect())
    }

    /// Ends the card's polling under `lease`: its entry and presence go.
    pub async fn finish(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        lease: Lease,
    ) -> anyhow::Result<StillHeld<()>> {
        let mut inv = self.call("finish", &[self.keys.presence(card_ref)]);
        inv.arg(card_ref).arg(lease.score());
        let done: u8 = inv
            .invoke_async(conn)
            .await
            .context("finishing a card's polling")?;
        Ok(still_held(done))
    }

    /// Gives the card under `lease` back unpolled, at the due time it was fetched with.
    pub async fn release(
        &self,
        conn: &mut impl ConnectionLike,
        leased: &Leased,
    ) -> anyhow::Result<StillHeld<()>> {
        self.release_at(conn, &leased.card_ref, leased.lease, leased.due_ms)
            .await
    }

    /// [`DueQueue::release`] of `card_ref` under `lease`, due again at `due_ms`.
    pub async fn release_at(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
        lease: Lease,
        due_ms: u64,
    ) -> anyhow::Result<StillHeld<()>> {
        let keys = [
            self.keys.slot(shared::slot_id(due_ms, self.redis_now_ms())),
            self.keys.presence(card_ref),
        ];
        let mut inv = self.call("release", &keys);
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
        let mut inv = self.call("extend", &[]);
        inv.arg(card_ref).arg(lease.score()).arg(millis(by));
        let score: u64 = inv.invoke_async(conn).await.context("extending a lease")?;
        Ok(if score == 0 {
            StillHeld::Stale
        } else {
            StillHeld::Yes(Lease::from_score(score))
        })
    }

    /// Adds `card_ref`, due `after` from now with a fresh state, unless it has an entry already.
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
        let now = self.redis_now_ms();
        let mut extra = ExtraKeys::default();
        let mut args = Vec::with_capacity(cards.len() * 4);
        for (card_ref, after) in cards {
            let slot = shared::slot_id(now.saturating_add(millis(*after)), now);
            args.push(extra.position(self.keys.slot(slot)).to_string());
            args.push(extra.position(self.keys.presence(card_ref)).to_string());
            args.push((*card_ref).to_owned());
            args.push(millis(*after).to_string());
        }
        let mut inv = self.call("add", &extra.keys);
        inv.arg(args);
        inv.invoke_async(conn).await.context("adding cards")
    }

    /// Adds each card of `cards` (card_ref, due ms on Redis's clock, raw state or `""` for a
    /// fresh one) that has no entry yet; a card that has one keeps it. Returns how many were
    /// added. Moving another layout's records over.
    pub async fn adopt(
        &self,
        conn: &mut impl ConnectionLike,
        cards: &[(String, u64, String)],
    ) -> anyhow::Result<usize> {
        if cards.is_empty() {
            return Ok(0);
        }
        let now = self.redis_now_ms();
        let mut extra = ExtraKeys::default();
        let mut args = Vec::with_capacity(cards.len() * 5);
        for (card_ref, due_ms, state) in cards {
            let slot = shared::slot_id(*due_ms, now);
            args.push(extra.position(self.keys.slot(slot)).to_string());
            args.push(extra.position(self.keys.presence(card_ref)).to_string());
            args.push(card_ref.clone());
            args.push(due_ms.to_string());
            args.push(state.clone());
        }
        let mut inv = self.call("adopt", &extra.keys);
        inv.arg(args);
        inv.invoke_async(conn).await.context("adopting cards")
    }

    async fn one_card(
        &self,
        conn: &mut impl ConnectionLike,
        op: &str,
        card_ref: &str,
        after: Duration,
    ) -> anyhow::Result<Verdict> {
        let verdict = shared::one_card(conn, &self.keys, op, card_ref, after, self.redis_now_ms())
            .await
            .with_context(|| format!("{op} of {card_ref}"))?;
        anyhow::ensure!(
            verdict != Verdict::Moved,
            "{op} of {card_ref}: its entry kept moving under the call"
        );
        Ok(verdict)
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
        Ok(match self.one_card(conn, "merge", card_ref, after).await? {
            Verdict::Started => Merged::Started,
            _ => Merged::IntoLive,
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
        Ok(
            match self.one_card(conn, "restart", card_ref, after).await? {
                Verdict::Started => Restarted::Started,
                Verdict::Running => Restarted::Running,
                _ => Restarted::Restarted,
            },
        )
    }

    /// The card's presence (the slot of its entry), then `op` with that slot's key; again while
    /// the presence moves in between. `None` when the card has no presence.
    async fn with_presence<T: redis::FromRedisValue>(
        &self,
        conn: &mut impl ConnectionLike,
        op: &str,
        card_ref: &str,
        moved: impl Fn(&T) -> bool,
    ) -> anyhow::Result<T> {
        let presence = self.keys.presence(card_ref);
        for _ in 0..shared::MOVED_ROUNDS {
            let seen: Option<u64> = redis::cmd("HGET")
                .arg(&presence)
                .arg(card_ref)
                .query_async(conn)
                .await
                .with_context(|| format!("reading the presence of {card_ref}"))?;
            let mut keys = vec![presence.clone()];
            keys.extend(seen.map(|id| self.keys.slot(id)));
            let mut inv = self.call(op, &keys);
            inv.arg(card_ref)
                .arg(seen.map(|id| id.to_string()).unwrap_or_default());
            let answer: T = inv
                .invoke_async(conn)
                .await
                .with_context(|| format!("{op} of {card_ref}"))?;
            if !moved(&answer) {
                return Ok(answer);
            }
        }
        anyhow::bail!("{op} of {card_ref}: its entry kept moving under the call")
    }

    /// Where `card_ref` stands and its state, or `None` when it has no entry.
    pub async fn entry(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
    ) -> anyhow::Result<Option<(Standing, PollState)>> {
        let answer: Vec<redis::Value> = self
            .with_presence(conn, "entry", card_ref, |a: &Vec<redis::Value>| {
                a.len() == 1
            })
            .await?;
        let [kind, at, state] = answer.as_slice() else {
            return Ok(None);
        };
        let kind: String = redis::from_redis_value_ref(kind)?;
        let at: u64 = redis::from_redis_value_ref(at)?;
        let state: String = redis::from_redis_value_ref(state)?;
        let standing = if kind == "leased" {
            Standing::Leased { deadline_ms: at }
        } else {
            Standing::Waiting { due_ms: at }
        };
        Ok(Some((standing, PollState::parse(&state))))
    }

    /// Removes `card_ref`: it is polled no more, and a running poll's acknowledgement changes
    /// nothing. Returns whether it had an entry.
    pub async fn remove(
        &self,
        conn: &mut impl ConnectionLike,
        card_ref: &str,
    ) -> anyhow::Result<bool> {
        let removed: i8 = self
            .with_presence(conn, "remove", card_ref, |r: &i8| *r < 0)
            .await?;
        Ok(removed == 1)
    }

    /// Every record of the shard, read with plain commands (every slot's list, the in-flight
    /// set, every presence hash): for tests, benchmarks and an operator's audit, never a poll.
    /// Not atomic: a poll that ends meanwhile may show in neither or both.
    pub async fn snapshot(&self, conn: &mut impl ConnectionLike) -> anyhow::Result<Snapshot> {
        let mut snapshot = Snapshot::default();
        let ids: Vec<u64> = redis::cmd("ZRANGE")
            .arg(&self.keys.slots)
            .arg(0)
            .arg(-1)
            .query_async(conn)
            .await
            .context("reading the slots")?;
        for id in ids {
            let list: Vec<String> = redis::cmd("LRANGE")
                .arg(self.keys.slot(id))
                .arg(0)
                .arg(-1)
                .query_async(conn)
                .await
                .context("reading a slot")?;
            for entry in list {
                let (due_ms, state, card) = parse_entry(&entry)?;
                snapshot
                    .entries
                    .push((card, Standing::Waiting { due_ms }, state));
            }
        }
        let leased: Vec<(String, u64)> = redis::cmd("ZRANGE")
            .arg(&self.keys.inflight)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await
            .context("reading the cards in flight")?;
        let held: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&self.keys.held)
            .query_async(conn)
            .await
            .context("reading the leased entries")?;
        for (card, score) in leased {
            let state = held
                .get(&card)
                .map(|entry| parse_entry(entry).map(|(_, state, _)| state))
                .transpose()?
                .unwrap_or_default();
            let deadline_ms = score.saturating_sub(LEASED);
            snapshot
                .entries
                .push((card, Standing::Leased { deadline_ms }, state));
        }
        let mut cursor = 0u64;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(self.keys.presence_pattern())
                .arg("COUNT")
                .arg(1000)
                .query_async(conn)
                .await
                .context("finding the presence hashes")?;
            for key in found {
                let fields: Vec<(String, u64)> = redis::cmd("HGETALL")
                    .arg(&key)
                    .query_async(conn)
                    .await
                    .context("reading a presence hash")?;
                snapshot.presence.extend(fields);
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        Ok(snapshot)
    }

    /// The head of the wheel, in one call.
    pub async fn head(&self, conn: &mut impl ConnectionLike) -> anyhow::Result<Head> {
        let (now_ms, earliest, due_now): (u64, i64, u64) = self
            .call("head", &[])
            .invoke_async(conn)
            .await
            .context("reading the wheel's head")?;
        self.saw_redis_clock(now_ms);
        Ok(Head {
            now_ms,
            earliest_due_ms: u64::try_from(earliest).ok(),
            due_now,
        })
    }
}
