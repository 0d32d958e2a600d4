//! Moving a task's polling chains into its due queue ([`super::due_queue`]), so that a release
//! that polls from the due queue goes on from where the chains were, instead of polling every
//! card at once with its failures and tally forgotten.
//!
//! Each chain becomes one due entry and one state, and then its chain entry and its due-set member
//! go:
//! - a chain whose next poll **waits** keeps its due time;
//! - a chain whose job **exists** (fed, running, in the `FED` range: a pod of the release before
//!   may be polling it now) is due no sooner than `not_before` from now, so that such a poll is
//!   over before the due queue hands the card out (pass the handler's limit);
//! - a chain without a due-set member is due `not_before` from now, as a running one;
//! - its state is the chain entry's tally and next poll's failures and deferrals, the same
//!   fields in the same format; an entry of an older format (without them) starts fresh.
//!
//! A card the due queue already holds keeps its entry (adopting never overwrites), so a second
//! run, or a run of each pod started together, changes nothing more; a chain that a pod of the
//! release before writes again meanwhile is removed by the next run. The release before gets its
//! chains back from PostgreSQL through its own reconcile, which starts a chain for every card
//! that wants polling and has none (the RUNBOOK's rollback).

use std::time::Duration;

use anyhow::Context as _;
use redis::aio::ConnectionLike;

use super::due_queue::DueQueue;
use crate::config::Task;
use crate::context::AppContext;
use crate::keys;

/// The score offset of a chain whose job existed (fed, running): its due-set member was `FED` +
/// its turn (2^50 ms, as the release before wrote it).
pub const FED: u64 = 1 << 50;

/// Chain entries read per round.
const BATCH: usize = 500;

/// What [`take_over`] did for one task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TakenOver {
    /// Chain entries read (each removed, unless a pod wrote it again while it moved).
    pub chains: usize,
    /// Of them, cards added to the due queue (the others had an entry there already).
    pub added: usize,
}

/// The due-queue state of a chain entry (`chain_id|unchanged|last|since|state[|marker]`): its
/// fields after the id, up to the next poll's state; `""` (a fresh state) for an entry of an
/// older format.
fn state_of(entry: &str) -> String {
    let fields: Vec<&str> = entry.split('|').collect();
    match fields.as_slice() {
        [_, unchanged, last, since, state, ..] => format!("{unchanged}|{last}|{since}|{state}"),
        _ => String::new(),
    }
}

/// When a chain's card is due in the due queue: its waiting poll's due time, or for a chain
/// whose job exists (or whose due-set member is missing), its turn but no sooner than
/// `not_before_ms` (unix ms, Redis clock).
fn due_of(score: Option<u64>, not_before_ms: u64) -> u64 {
    match score {
        Some(s) if s < FED => s,
        Some(s) => (s - FED).max(not_before_ms),
        None => not_before_ms,
    }
}

/// Redis's clock (unix ms).
async fn redis_now_ms(conn: &mut impl ConnectionLike) -> anyhow::Result<u64> {
    let (secs, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(conn)
        .await
        .context("reading Redis's clock")?;
    Ok(secs * 1000 + micros / 1000)
}

/// Moves every chain of `task` in the deployment with key prefix `prefix` into `queue`: a chain
/// whose job may be running is due no sooner than `not_before` from now.
#[tracing::instrument(skip_all, fields(task = %task))]
pub async fn take_over(
    conn: &mut impl ConnectionLike,
    prefix: &str,
    task: Task,
    queue: &DueQueue,
    not_before: Duration,
) -> anyhow::Result<TakenOver> {
    let chain_key = keys::chain_key(prefix, task);
    let due_key = keys::due_key(prefix, task);
    let mut done = TakenOver::default();
    // Whole passes over the hash until one finds no chain: an entry a pod of the release before
    // wrote again while it was moved stays for the next pass.
    loop {
        let mut cursor = 0u64;
        let mut found = 0;
        loop {
            let (next, pairs): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
                .arg(&chain_key)
                .arg(cursor)
                .arg("COUNT")
                .arg(BATCH)
                .query_async(conn)
                .await
                .with_context(|| format!("reading the {task} chains"))?;
            found += pairs.len();
            done.added += move_chains(conn, &chain_key, &due_key, queue, &pairs, not_before)
                .await
                .with_context(|| format!("moving the {task} chains"))?;
            done.chains += pairs.len();
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        if found == 0 {
            break;
        }
    }
    tracing::info!(
        chains = done.chains,
        added = done.added,
        "polling chains moved into the due queue"
    );
    Ok(done)
}

/// Adopts the chains `pairs` (card_ref, chain entry) into `queue`, then removes each whose entry
/// is still the one read. Returns how many cards were added.
async fn move_chains(
    conn: &mut impl ConnectionLike,
    chain_key: &str,
    due_key: &str,
    queue: &DueQueue,
    pairs: &[(String, String)],
    not_before: Duration,
) -> anyhow::Result<usize> {
    if pairs.is_empty() {
        return Ok(0);
    }
    let cards: Vec<&str> = pairs.iter().map(|(card, _)| card.as_str()).collect();
    let scores: Vec<Option<u64>> = redis::cmd("ZMSCORE")
        .arg(due_key)
        .arg(&cards)
        .query_async(conn)
        .await
        .context("reading the chains' due times")?;
    let not_before_ms = redis_now_ms(conn).await? + u64::try_from(not_before.as_millis())?;
    let moved: Vec<(String, u64, String)> = pairs
        .iter()
        .zip(&scores)
        .map(|((card, entry), score)| {
            (card.clone(), due_of(*score, not_before_ms), state_of(entry))
        })
        .collect();
    let added = queue.adopt(conn, &moved).await?;
    let mut pipe = redis::pipe();
    for (card, entry) in pairs {
        pipe.cmd("EVAL")
            .arg(REMOVE_IF_UNCHANGED)
            .arg(2)
            .arg(chain_key)
            .arg(due_key)
            .arg(card)
            .arg(entry)
            .ignore();
    }
    pipe.query_async::<()>(conn)
        .await
        .context("removing the chains moved over")?;
    Ok(added)
}

/// What a worker does as it starts, before its polling workers: moves both tasks' chains into
/// the due queue ([`take_over`], a chain whose job may still run due only after the handler's
/// limit), then hands each poll request waiting in the old polling intakes to the due queue and
/// removes those intakes and the old polling queues' apalis keys. Each step is idempotent; when
/// Redis refuses, the worker starts all the same (reconcile adds every card that wants polling,
/// and the next start moves what is left).
pub async fn on_start(ctx: &AppContext) {
    for task in Task::ALL {
        let queue = super::lease::due_queue(ctx.prefix(), task);
        let mut conn = ctx.redis.clone();
        let moved = async {
            let done = take_over(
                &mut conn,
                ctx.prefix(),
                task,
                &queue,
                ctx.config.polling.handler_timeout(),
            )
            .await?;
            let requests = clear_old_queue(&mut conn, ctx.prefix(), task, &queue).await?;
            anyhow::Ok((done, requests))
        };
        match moved.await {
            Ok((done, requests)) if done.chains > 0 || requests > 0 => {
                tracing::info!(%task, chains = done.chains, added = done.added, requests, "the release before's polling moved into the due queue");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%task, error = %format!("{e:#}"), "the release before's polling not moved now; reconcile adds every card that wants polling, and the next start moves the rest");
            }
        }
    }
}

/// Hands the poll requests waiting in `task`'s old polling intake (entry id: the card) to
/// `queue` (a request for a poll now: [`DueQueue::merge`]), then deletes that intake, the old
/// late set, and every key of the old polling apalis queue (`{prefix}:q:<task>` and what hangs
/// under it). Returns how
/// many requests it handed over.
async fn clear_old_queue(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
    task: Task,
    queue: &DueQueue,
) -> anyhow::Result<usize> {
    let short = keys::queue_of(task);
    let intake = keys::intake(prefix, short);
    let entries: Vec<String> = redis::cmd("ZRANGE")
        .arg(&intake)
        .arg(0)
        .arg(-1)
        .query_async(conn)
        .await
        .context("reading the old polling intake")?;
    for card_ref in &entries {
        queue.merge(conn, card_ref, Duration::ZERO).await?;
    }
    let apalis = keys::queue(prefix, short);
    let mut doomed = vec![
        intake.clone(),
        keys::intake_payload(prefix, short),
        apalis.clone(),
    ];
    // The keyspace is scanned only while the old queue has any of its fixed keys: once it is
    // gone, a start costs one EXISTS here.
    let fixed: Vec<String> = [
        "active",
        "scheduled",
        "data",
        "dead",
        "done",
        "failed",
        "signal",
        "workers",
    ]
    .iter()
    .map(|k| format!("{apalis}:{k}"))
    .collect();
    let present: usize = redis::cmd("EXISTS")
        .arg(&fixed)
        .query_async(conn)
        .await
        .context("looking for the old polling queue")?;
    if present > 0 {
        let mut cursor = 0u64;
        loop {
            let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{apalis}:*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(conn)
                .await
                .context("finding the old polling queue's keys")?;
            doomed.extend(found);
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    for chunk in doomed.chunks(500) {
        let _: () = redis::cmd("DEL")
            .arg(chunk)
            .query_async(conn)
            .await
            .context("deleting the old polling queue's keys")?;
    }
    let _: () = redis::cmd("ZREM")
        .arg(keys::intake_due_hint(prefix))
        .arg(&intake)
        .query_async(conn)
        .await
        .context("removing the old polling intake from the due hint")?;
    Ok(entries.len())
}

/// Removes a card's chain entry (KEYS[1]) and due-set member (KEYS[2]) if the entry is still
/// ARGV[2]: a chain written again since it was read stays for the next run.
const REMOVE_IF_UNCHANGED: &str = r"
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 0
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_entry_s_state_is_its_tally_and_next_poll_and_an_older_entry_starts_fresh() {
        assert_eq!(state_of("ABC|3|t0g|ct0f|2.1"), "3|t0g|ct0f|2.1");
        assert_eq!(state_of("ABC|3|t0g|ct0f|0|ABC#17@1700"), "3|t0g|ct0f|0");
        assert_eq!(state_of("ABC|3|t0g|ct0f"), "");
        assert_eq!(state_of("ABC|1700000000000"), "");
    }

    #[test]
    fn a_waiting_chain_keeps_its_due_time_and_a_running_one_waits_for_its_poll() {
        assert_eq!(due_of(Some(1_000), 5_000), 1_000);
        assert_eq!(due_of(Some(FED + 1_000), 5_000), 5_000);
        assert_eq!(due_of(Some(FED + 9_000), 5_000), 9_000);
        assert_eq!(due_of(None, 5_000), 5_000);
    }
}
