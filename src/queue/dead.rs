//! The dead set of a queue: what apalis-redis 1.0.0 keeps of every job our job service killed
//! (`{queue}:dead`, with the payload in `{queue}:data` and the reason in `{queue}:meta:<id>`),
//! listed, requeued through the intake, or discarded.
//!
//! Dead jobs are trimmed after [`super::intake::DEAD_RETENTION`]; until then an operator decides.
//! A requeue goes through the intake like every other re-run (so the high-water mark holds), and
//! never replaces an entry that is already waiting under the same id (see `dead.lua`).

use std::collections::HashMap;
use std::sync::LazyLock;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use redis::aio::ConnectionManager;
use redis::Script;
use serde::Serialize;

use super::QueueName;

static DEAD: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("dead.lua")));

/// Ids handed to one script call.
const BATCH: usize = 500;

/// One dead job as apalis keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadEntry {
    /// The apalis task id.
    pub id: String,
    /// The intake entry id it was fed from (a card's entry is `<card_ref>` per task), if known.
    pub intake_entry: Option<String>,
    /// The payload as the producer wrote it (raw: callers redact before showing it).
    pub payload: Option<String>,
    /// Why it died: apalis's recorded result (our `JobError`), raw.
    pub reason: Option<String>,
    /// When it died (apalis's `done_at`, unix seconds), if recorded.
    pub died_at: Option<DateTime<Utc>>,
}

/// The size of a queue's dead set and up to `limit` of its entries, newest first.
pub async fn list(
    conn: &mut ConnectionManager,
    queue: &QueueName,
    limit: usize,
) -> anyhow::Result<(u64, Vec<DeadEntry>)> {
    let dead = format!("{}:dead", queue.apalis);
    let total: u64 = redis::cmd("SCARD")
        .arg(&dead)
        .query_async(conn)
        .await
        .with_context(|| format!("counting the dead set of {}", queue.apalis))?;
    let ids = ids(conn, queue, Some(limit)).await?;
    if ids.is_empty() {
        return Ok((total, Vec::new()));
    }
    let mut pipe = redis::pipe();
    for id in &ids {
        pipe.cmd("HGET")
            .arg(format!("{}:data", queue.apalis))
            .arg(id);
        pipe.cmd("HGETALL")
            .arg(format!("{}:meta:{id}", queue.apalis));
    }
    let raw: Vec<redis::Value> = pipe
        .query_async(conn)
        .await
        .with_context(|| format!("reading the dead jobs of {}", queue.apalis))?;
    let mut out = Vec::with_capacity(ids.len());
    for (id, pair) in ids.into_iter().zip(raw.chunks(2)) {
        let data: Option<String> = redis::from_redis_value(pair[0].clone()).unwrap_or(None);
        let meta: HashMap<String, String> =
            redis::from_redis_value(pair[1].clone()).unwrap_or_default();
        // The feeder stores the payload as a JSON string; show what the producer wrote.
        let payload = data.map(|d| serde_json::from_str::<String>(&d).unwrap_or(d));
        let died_at = meta
            .get("done_at")
            .and_then(|s| s.parse::<i64>().ok())
            .and_then(|s| DateTime::from_timestamp(s, 0));
        out.push(DeadEntry {
            id,
            intake_entry: meta.get("intake_entry").filter(|e| !e.is_empty()).cloned(),
            payload,
            reason: meta.get("result").cloned(),
            died_at,
        });
    }
    out.sort_by(|a, b| b.died_at.cmp(&a.died_at).then(b.id.cmp(&a.id)));
    Ok((total, out))
}

/// Up to `limit` ids of the dead set (all of them for `None`), by SSCAN.
async fn ids(
    conn: &mut ConnectionManager,
    queue: &QueueName,
    limit: Option<usize>,
) -> anyhow::Result<Vec<String>> {
    let dead = format!("{}:dead", queue.apalis);
    let mut cursor: u64 = 0;
    let mut out = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SSCAN")
            .arg(&dead)
            .arg(cursor)
            .arg("COUNT")
            .arg(BATCH)
            .query_async(conn)
            .await
            .with_context(|| format!("scanning the dead set of {}", queue.apalis))?;
        out.extend(batch);
        if limit.is_some_and(|l| out.len() >= l) {
            out.truncate(limit.unwrap_or(usize::MAX));
            return Ok(out);
        }
        if next == 0 {
            out.sort();
            out.dedup();
            return Ok(out);
        }
        cursor = next;
    }
}

/// Which dead jobs an action takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadSelector {
    /// These ids.
    Ids(Vec<String>),
    /// Every job in the dead set.
    All,
}

/// What a dead-set action did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DeadOutcome {
    /// Jobs requeued (or discarded).
    pub acted: u64,
    /// Ids that were not in the dead set (any more).
    pub not_dead: u64,
    /// Requeue only: jobs left dead because a newer entry of the same id was already waiting.
    pub kept: u64,
}

/// Whether an action requeues or discards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadAction {
    /// Back into the intake, due now.
    Requeue,
    /// Gone for good.
    Discard,
}

impl DeadAction {
    fn arg(self) -> &'static str {
        match self {
            DeadAction::Requeue => "requeue",
            DeadAction::Discard => "discard",
        }
    }
}

/// Requeues or discards the dead jobs `which` selects, in batches.
pub async fn act(
    conn: &mut ConnectionManager,
    queue: &QueueName,
    action: DeadAction,
    which: &DeadSelector,
) -> anyhow::Result<DeadOutcome> {
    let ids = match which {
        DeadSelector::Ids(ids) => ids.clone(),
        DeadSelector::All => ids(conn, queue, None).await?,
    };
    let mut total = DeadOutcome::default();
    for chunk in ids.chunks(BATCH) {
        let mut inv = DEAD.prepare_invoke();
        inv.key(format!("{}:dead", queue.apalis))
            .key(format!("{}:data", queue.apalis))
            .key(format!("{}:meta", queue.apalis))
            .key(&queue.intake)
            .key(&queue.intake_payload)
            .key(&queue.due_hint);
        let (acted, not_dead, kept): (u64, u64, u64) = inv
            .arg(action.arg())
            .arg(chunk)
            .invoke_async(conn)
            .await
            .with_context(|| format!("{}ing dead jobs of {}", action.arg(), queue.apalis))?;
        total.acted += acted;
        total.not_dead += not_dead;
        total.kept += kept;
    }
    Ok(total)
}
