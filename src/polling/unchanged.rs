//! Unchanged polls: counted in Redis, never recorded in PostgreSQL, in memory that does not grow.
//!
//! A valid poll that changed nothing writes no database row (the seed's rule). What Redis keeps of
//! it is sized for a fleet of millions of cards:
//! - **per card and task, in the card's poll state** in the due queue
//!   (`polling::due_queue::PollState`, which exists anyway): how many unchanged polls since the
//!   card's last recorded change or failure (or since its polling started, when it has had
//!   neither), and when the last one was. The poll's acknowledgement writes this tally with the
//!   successor, so an unchanged poll costs no round trip of its own, and the tally goes when the
//!   card's polling ends. Counting per card and UTC hour instead (a field per card in an hourly
//!   hash, kept for two days) would cost Redis memory per card, task and hour kept; the tally
//!   costs a few bytes in a state that exists anyway (docs/SCALING.md, docs/BENCHMARKS.md).
//! - **fleet-wide, per task and UTC hour**: one counter `{prefix}:unchanged_total:{task}:{YYYYMMDDHH}`
//!   (a plain string), which expires [`HOUR_TTL_SECS`] after its first increment: at most
//!   49 counters per task, whatever the fleet size. Each process adds its unchanged polls up in
//!   memory ([`count_fleet`]) and writes them with one `INCRBY` per counter every
//!   [`FLUSH_EVERY`] and when it stops ([`flush`]): one command per counter and flush instead of
//!   one per poll. So the fleet totals `investigate` shows lag the polls by up to
//!   [`FLUSH_EVERY`], and a process killed with `kill -9` loses at most that much of its count;
//!   the per-card tally is written with the poll's successor and never lags.
//!
//! - **recorded polls, fleet-wide, per task, outcome and UTC hour**: the same kind of counter
//!   (`{prefix}:outcome_total:{task}:{outcome}:{YYYYMMDDHH}`, [`count_fleet_outcome`]) for
//!   `persisted_change` and `persisted_failure`, written by the same flush, so that the console's
//!   chart shows every poll by outcome without counting table rows.
//!
//! After Redis loses its data (a flush, a restart without persistence), both restart from zero:
//! a card reconcile adds back starts its tally at that moment, marked as such
//! ([`Since::ChainStart`]), so `investigate` says the count restarted instead of showing a
//! wrong one; and the fleet counters begin with the deployment's epoch marker
//! ([`crate::runner::redis_watch`]).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use redis::aio::ConnectionManager;
use redis::Script;

use crate::config::Task;

/// How many UTC hours of fleet-wide counts `investigate` shows (the counters live one hour more,
/// so the oldest shown hour is complete).
pub const HOURS_KEPT: i64 = 48;
/// Expiry of an hourly counter, set by the increment that creates it.
pub const HOUR_TTL_SECS: i64 = (HOURS_KEPT + 1) * 3600;

/// The hourly counters' key names, which [`crate::keys`] owns: the unchanged polls of a task and
/// UTC hour (`YYYYMMDDHH`), and a task's recorded polls of one outcome in an hour, kept like them
/// for [`HOURS_KEPT`] hours.
pub use crate::keys::{hour_key, outcome_hour_key};

/// How often each process writes the unchanged polls it counted to the fleet-wide counters.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);

/// This process's counted polls not yet written, per hourly counter key. A handful of keys (one
/// per task and hour of the last [`FLUSH_EVERY`], and outcome for the recorded ones); keyed by
/// the full key, so that processes of several deployments in one binary (tests) each write
/// their own.
static PENDING: LazyLock<Mutex<Pending>> = LazyLock::new(Mutex::default);

#[derive(Default)]
struct Pending {
    /// Counter key -> count not yet written.
    counts: HashMap<String, u64>,
    /// The unchanged-poll counter keys named lately, by prefix, task and hour (unix hours): an
    /// unchanged poll is counted under the key its hour already has, where formatting the hour
    /// and the key would cost every poll two strings. Each flush drops those older than the
    /// previous hour.
    recent: Vec<(Box<str>, Task, i64, String)>,
}

/// Adds to a counter and sets its expiry when this increment created it.
static ADD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "local n = redis.call('INCRBY', KEYS[1], ARGV[1])
         if n == tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
         return n",
    )
});

fn pending() -> std::sync::MutexGuard<'static, Pending> {
    // A poisoned lock only means a panic while adding a number: the map is still usable.
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts one unchanged poll of `task` at `at` for the fleet-wide hourly counter; written by the
/// next [`flush`].
pub fn count_fleet(prefix: &str, task: Task, at: DateTime<Utc>) {
    let hour = at.timestamp().div_euclid(3600);
    let mut pending = pending();
    let Pending { counts, recent } = &mut *pending;
    let named = recent
        .iter()
        .position(|(p, t, h, _)| *t == task && *h == hour && **p == *prefix);
    let i = named.unwrap_or_else(|| {
        let key = hour_key(prefix, task, &hour_bucket(at));
        recent.push((prefix.into(), task, hour, key));
        recent.len() - 1
    });
    let key = &recent[i].3;
    match counts.get_mut(key.as_str()) {
        Some(n) => *n += 1,
        None => {
            counts.insert(key.clone(), 1);
        }
    }
}

/// Counts one recorded poll of `task` with `outcome` at `at` for its fleet-wide hourly counter
/// ([`outcome_hour_key`]); written by the next [`flush`] with the unchanged ones.
pub fn count_fleet_outcome(prefix: &str, task: Task, outcome: &str, at: DateTime<Utc>) {
    *pending()
        .counts
        .entry(outcome_hour_key(prefix, task, outcome, &hour_bucket(at)))
        .or_default() += 1;
}

/// Writes this process's counted unchanged polls of deployment `prefix` to the hourly counters:
/// one script call per counter (a handful). What Redis refused is kept for the next flush.
/// Returns the polls written.
pub async fn flush(conn: &mut ConnectionManager, prefix: &str) -> anyhow::Result<u64> {
    let mine = [
        format!("{prefix}:unchanged_total:"),
        format!("{prefix}:outcome_total:"),
    ];
    let taken: Vec<(String, u64)> = {
        let mut pending = pending();
        let Pending { counts, recent } = &mut *pending;
        let keys: Vec<String> = counts
            .keys()
            .filter(|k| mine.iter().any(|m| k.starts_with(m.as_str())))
            .cloned()
            .collect();
        let taken = keys
            .into_iter()
            .filter_map(|k| counts.remove(&k).map(|n| (k, n)))
            .collect();
        // Keys of past hours go with their counts; the current hours' come back at once.
        let now = Utc::now().timestamp().div_euclid(3600);
        recent.retain(|(_, _, hour, _)| *hour >= now - 1);
        taken
    };
    if taken.is_empty() {
        return Ok(0);
    }
    let mut written = 0;
    let mut left = taken.into_iter();
    while let Some((key, n)) = left.next() {
        let added: redis::RedisResult<u64> = ADD
            .key(&key)
            .arg(n)
            .arg(HOUR_TTL_SECS)
            .invoke_async(conn)
            .await;
        if let Err(e) = added {
            let mut pending = pending();
            for (key, n) in std::iter::once((key, n)).chain(left) {
                *pending.counts.entry(key).or_default() += n;
            }
            return Err(anyhow::Error::new(e).context("writing the hourly unchanged-poll counters"));
        }
        written += n;
    }
    Ok(written)
}

/// Flushes every [`FLUSH_EVERY`] until `stop` resolves (the process's final flush is in its
/// shutdown hooks, after the drain: `workers::on_shutdown`).
pub async fn flush_every(
    mut conn: ConnectionManager,
    prefix: String,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {
                if let Err(e) = flush(&mut conn, &prefix).await {
                    tracing::warn!(error = %format!("{e:#}"), "unchanged-poll counters not written; kept for the next flush");
                }
            }
        }
    }
}

/// The hour bucket (`YYYYMMDDHH`, UTC) of `at`.
pub fn hour_bucket(at: DateTime<Utc>) -> String {
    at.format("%Y%m%d%H").to_string()
}

/// What `since` of a [`Tally`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Since {
    /// The chain's last recorded change or failure: every unchanged poll since is counted.
    ChangeOrFailure,
    /// The chain's start (first start, `enqueue`, reconcile, or a job adopting the card after
    /// Redis lost its data): unchanged polls before it are not known.
    ChainStart,
}

/// The unchanged-poll tally kept in a card's poll state (`polling::due_queue::PollState`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Unchanged polls since [`Tally::since`].
    pub count: u64,
    /// The last unchanged poll (Redis clock, whole seconds), if any was counted on this chain.
    pub last: Option<DateTime<Utc>>,
    /// When counting began.
    pub since: DateTime<Utc>,
    /// What happened then.
    pub since_kind: Since,
}

fn seconds36(s: &str) -> Option<DateTime<Utc>> {
    let secs = i64::from_str_radix(s, 36).ok()?;
    if secs <= 0 {
        return None;
    }
    DateTime::from_timestamp(secs, 0)
}

/// A tally from its three fields: the count, the last unchanged poll and `since` (a kind letter,
/// `c` or `s`, then base-36 unix seconds). `None` when `since` holds no time.
pub fn parse_tally(count: &str, last: &str, since: &str) -> Option<Tally> {
    let (kind, at) = match since.split_at_checked(1) {
        Some(("c", at)) => (Since::ChangeOrFailure, at),
        Some((_, at)) => (Since::ChainStart, at),
        None => (Since::ChainStart, ""),
    };
    seconds36(at).map(|since| Tally {
        count: count.parse().unwrap_or(0),
        last: seconds36(last),
        since,
        since_kind: kind,
    })
}

/// The next job's failures and deferrals from their field (`failures` or
/// `failures.deferrals`); a part that does not parse counts as 0.
pub fn parse_job_state(state: &str) -> (u32, u32) {
    let (failures, deferrals) = state.split_once('.').unwrap_or((state, "0"));
    (
        failures.parse().unwrap_or(0),
        deferrals.parse().unwrap_or(0),
    )
}

/// The fleet-wide unchanged polls of `task` in the [`HOURS_KEPT`] UTC hours up to `now`'s, newest
/// first, as (`YYYYMMDDHH`, count); hours without a counter count 0. One MGET.
pub async fn fleet_hours(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    now: DateTime<Utc>,
) -> anyhow::Result<Vec<(String, u64)>> {
    let hours: Vec<String> = (0..HOURS_KEPT)
        .map(|h| hour_bucket(now - chrono::Duration::hours(h)))
        .collect();
    let keys: Vec<String> = hours.iter().map(|h| hour_key(prefix, task, h)).collect();
    let counts: Vec<Option<u64>> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(conn)
        .await
        .with_context(|| format!("reading the hourly {task} unchanged-poll counters"))?;
    Ok(hours
        .into_iter()
        .zip(counts)
        .map(|(h, n)| (h, n.unwrap_or(0)))
        .collect())
}

/// The fleet-wide recorded polls of `task` with `outcome` in the [`HOURS_KEPT`] UTC hours up to
/// `now`'s, newest first, as (`YYYYMMDDHH`, count), hours without a counter at 0. One MGET.
pub async fn fleet_outcome_hours(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    outcome: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<Vec<(String, u64)>> {
    let hours: Vec<String> = (0..HOURS_KEPT)
        .map(|h| hour_bucket(now - chrono::Duration::hours(h)))
        .collect();
    let keys: Vec<String> = hours
        .iter()
        .map(|h| outcome_hour_key(prefix, task, outcome, h))
        .collect();
    let counts: Vec<Option<u64>> = redis::cmd("MGET")
        .arg(&keys)
        .query_async(conn)
        .await
        .with_context(|| format!("reading the hourly {task} {outcome} counters"))?;
    Ok(hours
        .into_iter()
        .zip(counts)
        .map(|(h, n)| (h, n.unwrap_or(0)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chain entries and poll payloads as Redis could hold them: arbitrary bytes (made text as
    /// the reader sees them), with the separators and multi-byte characters that matter, from a
    /// seeded generator. Every reader answers (a partial entry, or an error), never panics.
    #[test]
    fn no_poll_state_or_poll_payload_panics_its_reader_whatever_redis_holds() {
        use rand::{Rng as _, SeedableRng as _};
        let mut rng = rand::rngs::StdRng::seed_from_u64(29);
        for _ in 0..20_000 {
            let len = rng.random_range(0..40);
            let mut bytes: Vec<u8> = Vec::with_capacity(len * 2);
            for _ in 0..len {
                match rng.random_range(0..6) {
                    0 => bytes.extend_from_slice("é".as_bytes()),
                    1 => bytes.extend_from_slice("🦀".as_bytes()),
                    2 => bytes.push(b"|.cs0z9-{}\":,"[rng.random_range(0..13)]),
                    _ => bytes.push(rng.random()),
                }
            }
            let raw = String::from_utf8_lossy(&bytes);
            let _ = crate::polling::due_queue::PollState::parse(&raw);
            let _ = serde_json::from_slice::<cardworker_jobs::PollCardData>(&bytes);
            let _ = serde_json::from_str::<cardworker_jobs::PollCardStatus>(&raw);
            let _ = raw.parse::<crate::limit::Limit>();
        }
    }

    #[test]
    fn unchanged_polls_are_counted_under_their_own_hour_and_again_after_their_count_is_taken() {
        let prefix = "unit-count-fleet";
        let at = |h: u32, m: u32| {
            chrono::NaiveDate::from_ymd_opt(2026, 12, 6)
                .and_then(|d| d.and_hms_opt(h, m, 0))
                .map(|t| t.and_utc())
                .expect("a valid time")
        };
        let key = |h: &str| hour_key(prefix, Task::Carddata, h);
        let count = |k: &str| pending().counts.get(k).copied();
        count_fleet(prefix, Task::Carddata, at(5, 1));
        count_fleet(prefix, Task::Carddata, at(5, 59));
        count_fleet(prefix, Task::Carddata, at(6, 0));
        count_fleet(prefix, Task::CardStatus, at(5, 30));
        assert_eq!(count(&key("2026120605")), Some(2));
        assert_eq!(count(&key("2026120606")), Some(1));
        assert_eq!(
            count(&hour_key(prefix, Task::CardStatus, "2026120605")),
            Some(1)
        );
        // A flush takes the counts: the hour's next poll starts its count again.
        pending().counts.remove(&key("2026120605"));
        count_fleet(prefix, Task::Carddata, at(5, 2));
        assert_eq!(count(&key("2026120605")), Some(1));
    }

    #[test]
    fn a_tally_parses_into_its_count_last_time_and_since() {
        // 1733100000 s = "snucio" in base 36.
        let t = parse_tally("12", "snucio", "csnuci0").expect("tally");
        assert_eq!(t.count, 12);
        assert_eq!(t.last.map(|d| d.timestamp()), Some(1_733_100_000));
        assert_eq!(t.since_kind, Since::ChangeOrFailure);
        assert_eq!(
            t.since.timestamp(),
            i64::from_str_radix("snuci0", 36).unwrap()
        );
        let fresh = parse_tally("0", "0", "ssnucio").expect("tally");
        assert_eq!((fresh.count, fresh.last), (0, None));
        assert_eq!(fresh.since_kind, Since::ChainStart);
        assert_eq!(parse_job_state("3.1"), (3, 1));
        assert_eq!(parse_job_state("2"), (2, 0));
    }

    #[test]
    fn hour_keys_name_the_task_and_the_utc_hour() {
        let at = DateTime::from_timestamp(1_733_100_000, 0).expect("time");
        assert_eq!(hour_bucket(at), "2024120200");
        assert_eq!(
            hour_key("cw", Task::CardStatus, &hour_bucket(at)),
            "cw:unchanged_total:card_status:2024120200"
        );
    }
}
