//! The polling due queue, seen from the producer side and shared with the worker: its script
//! (`due_queue.lua`, a timing wheel), what its keys are, which key each card and due time goes
//! in, and how a producer's poll job reaches a card ([`merge`]): it brings a waiting card's next
//! poll forward (it keeps its failures and tally), leaves a card being polled to that poll, and
//! adds a card that has no entry.
//!
//! A card's waiting poll is one entry (`due|state|card`) in the list of a time slot that ends a
//! little after it is due ([`slot_id`]); a sorted set orders the slots by their end, and one
//! small hash field per card (in one of [`BUCKETS`] hashes, by card) names the slot of its entry. A poll's fetch and acknowledgement
//! touch the slots' ends and the card's presence field only, so no call on a poll's path looks a
//! card up; an operator's or producer's op on one card reads its presence first, then names the
//! slot it found, and the script changes nothing when the presence moved in between
//! ([`Moved`](Verdict::Moved)).
//!
//! Every key of a shard carries the shard's hash tag, and every key a call touches is passed in
//! `KEYS`, so the script runs on a Redis Cluster.

use std::time::Duration;

use redis::aio::ConnectionLike;

use crate::EnqueueError;

/// The due queue's script. Keys and ops: see the file's header.
pub const SCRIPT: &str = include_str!("due_queue.lua");

/// Arguments per acknowledgement in a batched call of the script (its `batch` op), after the
/// two `KEYS` positions of its slot list and presence hash: card, lease, next due in ms, state.
pub const ACK_WIDTH: usize = 4;

/// The shard every card is in: the due queue has one shard per task.
pub const SHARD: u16 = 0;

/// The widest slot: 8.192 s of due times. Wider slots cost Redis fewer keys per card; every
/// entry is handed out at most its slot's width after its due time.
pub const MAX_SLOT_MS: u64 = 8192;

/// The narrowest slot: 8 ms.
pub const MIN_SLOT_MS: u64 = 8;

/// The slot of an entry due already: 1.024 s, so that the lateness gauges, which read a due
/// slot's end as its entries' due time, count such an entry overdue by at most that much more.
pub const DUE_SLOT_MS: u64 = 1024;

/// Where slot ids count from: 2025-01-01T00:00:00Z (unix ms).
pub const SLOT_EPOCH_MS: u64 = 1_735_689_600_000;

/// The presence hashes of a shard. Each stays listpack-encoded (a few bytes a card) while it holds
/// at most `hash-max-listpack-entries` cards (512 by default): up to about 500,000 cards a shard.
pub const BUCKETS: u32 = 1024;

/// The keys of shard `shard` of the polling queue `queue`, under the deployment's prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardKeys {
    /// The hash tag with the prefix before it; every key below starts with it.
    tag: String,
    /// The slots: slot id -> its first entry's due time.
    pub slots: String,
    /// The shard's last lease score: every new one is above it.
    pub last_lease: String,
    /// In flight: card -> `LEASED` + the deadline of the lease a poll holds it under.
    pub inflight: String,
    /// The slots' lengths: slot id -> entries.
    pub lengths: String,
    /// The leased entries: card -> its entry, while the card is in flight.
    pub held: String,
}

impl ShardKeys {
    pub fn new(prefix: &str, queue: &str, shard: u16) -> Self {
        let tag = crate::keys::poll_shard(prefix, queue, shard);
        Self {
            slots: format!("{tag}:slots"),
            last_lease: crate::keys::poll_last_lease(prefix, queue, shard),
            inflight: format!("{tag}:inflight"),
            lengths: format!("{tag}:lengths"),
            held: format!("{tag}:held"),
            tag,
        }
    }

    /// The fixed keys, in the order the script takes them (`KEYS[1..5]`).
    pub fn fixed(&self) -> [&str; FIXED_KEYS] {
        [
            &self.slots,
            &self.last_lease,
            &self.inflight,
            &self.lengths,
            &self.held,
        ]
    }

    /// The list of slot `id`.
    pub fn slot(&self, id: u64) -> String {
        format!("{}:slot:{id}", self.tag)
    }

    /// The presence hash that holds `card_ref`'s field.
    pub fn presence(&self, card_ref: &str) -> String {
        format!("{}:cards:{}", self.tag, bucket(card_ref))
    }

    /// The pattern of every slot list's key (for SCAN).
    pub fn slot_pattern(&self) -> String {
        format!("{}:slot:*", glob_escape(&self.tag))
    }

    /// The pattern of every presence hash's key (for SCAN).
    pub fn presence_pattern(&self) -> String {
        format!("{}:cards:*", glob_escape(&self.tag))
    }
}

/// `s` with Redis's glob characters escaped.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 4);
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The presence bucket of `card_ref`: FNV-1a of its bytes, modulo [`BUCKETS`]. Producers and
/// workers must agree on it, so it is defined here once.
pub fn bucket(card_ref: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in card_ref.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % BUCKETS
}

/// The slot of an entry due at `due_ms` (unix ms), named by a caller whose estimate of Redis's
/// clock is `now_ms`. An entry due later goes in a slot that ends after its due time by less than
/// its width: the largest power of two within a twentieth of its delay, between [`MIN_SLOT_MS`]
/// and [`MAX_SLOT_MS`]. It is handed out once the slot ended, so at most 5 % of its delay (and
/// 8.192 s) after its due time, never before; entries of one delay share slots of one width, so
/// a card polled every hour costs Redis about a tenth of a slot's key. An entry due already (a
/// card given back unpolled, one moved over) goes in the [`DUE_SLOT_MS`] slot that ended by its
/// due time: handed out at once, ahead of the later ones.
///
/// The id is the slot's end since [`SLOT_EPOCH_MS`] in units of its width, times 16, plus the
/// width's power of two less 3, so that an hourly card's slot id (and presence field) is a
/// 32-bit integer to Redis, which keeps it in 5 bytes, for the next 30 years; the script reads
/// the end back from it.
pub fn slot_id(due_ms: u64, now_ms: u64) -> u64 {
    let since = due_ms.saturating_sub(SLOT_EPOCH_MS);
    let (width, units) = if due_ms <= now_ms {
        (DUE_SLOT_MS, since / DUE_SLOT_MS)
    } else {
        let width = ((due_ms - now_ms) / 20).clamp(MIN_SLOT_MS, MAX_SLOT_MS);
        // The largest power of two within it, so that slots of nearby widths end together.
        let width = 1u64 << (63 - width.leading_zeros());
        (width, since.div_ceil(width))
    };
    units * 16 + u64::from(width.trailing_zeros() - 3)
}

/// The end (unix ms) of the slot `id` ([`slot_id`]).
pub fn slot_end(id: u64) -> u64 {
    SLOT_EPOCH_MS + ((id / 16) << ((id % 16) + 3))
}

/// What an op on one card did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The card had no entry: it was added.
    Started,
    /// The card had one (for a merge: a waiting card is due no later than asked, a leased one is
    /// being polled).
    Merged,
    /// The card waited: it was restarted.
    Restarted,
    /// A poll holds the card.
    Running,
    /// The card's presence changed between its read and the script: nothing changed; read again.
    Moved,
}

impl Verdict {
    fn parse(s: &str) -> Self {
        match s {
            "started" => Self::Started,
            "restarted" => Self::Restarted,
            "running" => Self::Running,
            "moved" => Self::Moved,
            _ => Self::Merged,
        }
    }
}

/// How often a one-card op reads the card's presence again when it moved in between: each move is
/// a poll's acknowledgement of that card, so a few rounds always settle.
pub const MOVED_ROUNDS: usize = 16;

/// The keys every call of the script names first ([`ShardKeys::fixed`]); an op's own keys follow
/// them.
pub const FIXED_KEYS: usize = 5;

/// Runs the one-card op `op` (merge or restart) for `card_ref`, its due time `delay` from now,
/// rereading the presence while it moved. `now_ms` is the caller's estimate of Redis's clock.
pub async fn one_card<C: ConnectionLike>(
    conn: &mut C,
    keys: &ShardKeys,
    op: &str,
    card_ref: &str,
    delay: Duration,
    now_ms: u64,
) -> Result<Verdict, redis::RedisError> {
    let presence = keys.presence(card_ref);
    let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    let target = keys.slot(slot_id(now_ms.saturating_add(delay_ms), now_ms));
    let script = redis::Script::new(SCRIPT);
    for _ in 0..MOVED_ROUNDS {
        let seen: Option<u64> = redis::cmd("HGET")
            .arg(&presence)
            .arg(card_ref)
            .query_async(conn)
            .await?;
        let mut inv = script.prepare_invoke();
        for key in keys.fixed() {
            inv.key(key);
        }
        inv.key(&presence).key(&target);
        match seen {
            Some(id) => inv.key(keys.slot(id)),
            None => inv.key(&target),
        };
        inv.arg(op)
            .arg(card_ref)
            .arg(delay_ms)
            .arg(seen.map(|id| id.to_string()).unwrap_or_default());
        let verdict: String = inv.invoke_async(conn).await?;
        let verdict = Verdict::parse(&verdict);
        if verdict != Verdict::Moved {
            return Ok(verdict);
        }
    }
    Ok(Verdict::Moved)
}

/// What [`merge`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The card had no entry: it was added, its first poll due when asked.
    Started,
    /// The card had one: a waiting card is due no later than asked, a leased one is being polled.
    IntoLive,
}

/// Asks for a poll of `card_ref` by `queue` (a polling task's queue) after `delay` (Redis clock):
/// a waiting card is brought forward to then (never put back), a card being polled is left to
/// that poll, and a card without an entry is added.
pub async fn merge<C: ConnectionLike>(
    conn: &mut C,
    prefix: &str,
    queue: &str,
    card_ref: &str,
    delay: Duration,
) -> Result<Merged, EnqueueError> {
    let keys = ShardKeys::new(prefix, queue, SHARD);
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    match one_card(conn, &keys, "merge", card_ref, delay, now_ms).await? {
        Verdict::Started => Ok(Merged::Started),
        Verdict::Moved => Err(EnqueueError::Moved(card_ref.to_owned())),
        _ => Ok(Merged::IntoLive),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_s_bucket_is_fnv_1a_of_its_bytes_within_the_bucket_count() {
        // FNV-1a 32 of "" and "a" (published test vectors), reduced.
        assert_eq!(bucket(""), 0x811c_9dc5 % BUCKETS);
        assert_eq!(bucket("a"), 0xe40c_292c % BUCKETS);
        assert!((0..10_000).all(|i| bucket(&format!("c-{i}")) < BUCKETS));
    }

    #[test]
    fn an_entry_s_slot_ends_within_a_twentieth_of_its_delay_after_it_is_due_and_never_before() {
        let now = 1_765_000_000_123;
        for delay in [1, 10, 1_000, 60_000, 3_600_000] {
            let due = now + delay;
            let end = slot_end(slot_id(due, now));
            assert!(end >= due, "{end} before {due}");
            let width = (delay / 20).clamp(MIN_SLOT_MS, MAX_SLOT_MS);
            assert!(
                end - due < width,
                "{} ms late for a delay of {delay}",
                end - due
            );
        }
        // Due already: the slot of DUE_SLOT_MS that ended by then.
        let end = slot_end(slot_id(now - 5, now));
        assert!(end <= now - 5 && now - 5 - end < DUE_SLOT_MS, "{end}");
        // An hourly card's slot id is a 32-bit integer for Redis (a signed one) until 2055.
        let in_2055 = SLOT_EPOCH_MS + 30 * 365 * 86_400_000;
        assert!(slot_id(in_2055 + 3_600_000, in_2055) < i32::MAX as u64);
        let (now, due) = (SLOT_EPOCH_MS + 7193, SLOT_EPOCH_MS + 8193);
        assert_eq!(slot_end(slot_id(due, now)), SLOT_EPOCH_MS + 8224);
    }

    #[test]
    fn every_key_of_a_shard_carries_its_hash_tag() {
        let keys = ShardKeys::new("cw", "poll-carddata", 0);
        for key in keys
            .fixed()
            .into_iter()
            .map(str::to_owned)
            .chain([keys.slot(7), keys.presence("c-1")])
        {
            assert!(key.starts_with("cw:{poll:poll-carddata:0}:"), "{key}");
        }
    }
}
