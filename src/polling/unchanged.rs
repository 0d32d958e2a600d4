//! Unchanged polls: counted in Redis, never recorded in PostgreSQL, in memory that does not grow.
//!
//! A valid poll that changed nothing writes no database row (the seed's rule). What Redis keeps of
//! it is sized for a fleet of millions of cards (issue 19):
//! - **per card and task, in the card's chain entry** (`{prefix}:chain:{task}`, which exists
//!   anyway): how many unchanged polls since the chain's last recorded change or failure (or
//!   since the chain started, when it has had neither), and when the last one was. The chain
//!   script (`jobs/src/chain.lua`) updates this tally in the same call that schedules the
//!   successor, so an unchanged poll costs no round trip of its own, and the tally goes when the
//!   chain goes. It replaced a hash per task and UTC hour with one field per card, kept 48 h:
//!   about 58 bytes per card, task and hour, 2.8 KB per card at steady state for one task.
//! - **fleet-wide, per task and UTC hour**: one counter `{prefix}:unchanged_total:{task}:{YYYYMMDDHH}`
//!   (a plain string, INCR), which expires [`HOUR_TTL_SECS`] after its first increment: at most
//!   49 counters per task, whatever the fleet size.
//!
//! After Redis loses its data (a flush, a restart without persistence), both restart from zero:
//! a chain re-created by reconcile or adopted by its job starts its tally at that moment, marked as
//! such ([`Since::ChainStart`]), so `investigate` says the count restarted instead of showing a
//! wrong one; and the fleet counters begin with the deployment's epoch marker
//! ([`crate::runner::redis_watch`]).

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use redis::aio::ConnectionManager;

use super::chain;
use crate::config::Task;

/// How many UTC hours of fleet-wide counts `investigate` shows (the counters live one hour more,
/// so the oldest shown hour is complete).
pub const HOURS_KEPT: i64 = 48;
/// Expiry of an hourly counter, set by the increment that creates it.
pub const HOUR_TTL_SECS: i64 = (HOURS_KEPT + 1) * 3600;

/// The fleet-wide counter of unchanged polls of one task and UTC hour (`YYYYMMDDHH`).
pub fn hour_key(prefix: &str, task: Task, hour: &str) -> String {
    format!("{prefix}:unchanged_total:{}:{hour}", task.label())
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

/// The unchanged-poll tally kept in a chain entry.
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

/// One chain entry, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The live chain id.
    pub chain: String,
    /// Its tally; `None` for an entry written before tallies existed (`chain_id|due_ms`).
    pub tally: Option<Tally>,
}

fn seconds36(s: &str) -> Option<DateTime<Utc>> {
    let secs = i64::from_str_radix(s, 36).ok()?;
    if secs <= 0 {
        return None;
    }
    DateTime::from_timestamp(secs, 0)
}

/// Parses a chain entry (`chain_id|unchanged|last|since`, or the older `chain_id|due_ms`).
pub fn parse_entry(raw: &str) -> Entry {
    let fields: Vec<&str> = raw.split('|').collect();
    let chain = fields.first().copied().unwrap_or_default().to_owned();
    let tally = match fields.as_slice() {
        [_, count, last, since, ..] => {
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
        _ => None,
    };
    Entry { chain, tally }
}

/// The card's chain entry for `task` (`None` when the card has no chain in Redis).
pub async fn entry(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
) -> anyhow::Result<Option<Entry>> {
    let raw: Option<String> = redis::cmd("HGET")
        .arg(chain::chain_key(prefix, task))
        .arg(card_ref)
        .query_async(conn)
        .await
        .with_context(|| format!("reading the {task} chain of {card_ref}"))?;
    Ok(raw.as_deref().map(parse_entry))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tallied_entry_parses_into_its_count_last_time_and_since() {
        // 1733100000 s = "snucio" in base 36.
        let e = parse_entry("01JDCHAIN|12|snucio|csnuci0");
        assert_eq!(e.chain, "01JDCHAIN");
        let t = e.tally.expect("tally");
        assert_eq!(t.count, 12);
        assert_eq!(t.last.map(|d| d.timestamp()), Some(1_733_100_000));
        assert_eq!(t.since_kind, Since::ChangeOrFailure);
        assert_eq!(
            t.since.timestamp(),
            i64::from_str_radix("snuci0", 36).unwrap()
        );
        let fresh = parse_entry("01JDCHAIN|0|0|ssnucio").tally.expect("tally");
        assert_eq!((fresh.count, fresh.last), (0, None));
        assert_eq!(fresh.since_kind, Since::ChainStart);
    }

    #[test]
    fn an_entry_from_before_the_tally_parses_without_one() {
        let e = parse_entry("01OLDCHAIN|1733100000000");
        assert_eq!(e.chain, "01OLDCHAIN");
        assert_eq!(e.tally, None);
        assert_eq!(parse_entry("01BARE").tally, None);
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
