//! Polling chains in Redis: at most one live chain per card and task.
//!
//! A chain is an id in `{prefix}:chain:{task}` (card_ref -> `chain_id|due_ms`). Every job carries
//! its chain id; a job whose id is no longer the card's chain is stale and is acknowledged without
//! calling the Gateway. Scheduling the next poll writes the card's single intake entry (entry id =
//! card_ref) only if the job's chain is still live, atomically, so a stale job can never overwrite
//! the entry of the chain that replaced it.
//!
//! Redis holds the schedule, not authoritative state: if it is lost, reconcile restarts every
//! card that should be polled (parking lives in PostgreSQL), and a job that finds no chain adopts
//! the card. The worst case is one extra poll, never a stuck card.

use std::sync::LazyLock;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::{keys, ChainState, Job, PollCardData, PollCardStatus};
use redis::aio::ConnectionManager;
use redis::Script;

use crate::config::Task;

static CHAIN: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("chain.lua")));

/// The chain hash of one task.
pub fn chain_key(prefix: &str, task: Task) -> String {
    format!("{prefix}:chain:{}", task.label())
}

/// A polling job: one of the two payloads, seen through its chain.
pub trait PollJob: Job + Clone {
    /// Which task it is.
    const TASK: Task;
    /// A job for `card_ref` in `state`.
    fn new(card_ref: String, state: ChainState) -> Self;
    /// The card.
    fn card_ref(&self) -> &str;
    /// Its chain bookkeeping.
    fn state(&self) -> &ChainState;
}

impl PollJob for PollCardData {
    const TASK: Task = Task::Carddata;
    fn new(card_ref: String, state: ChainState) -> Self {
        Self { card_ref, state }
    }
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn state(&self) -> &ChainState {
        &self.state
    }
}

impl PollJob for PollCardStatus {
    const TASK: Task = Task::CardStatus;
    fn new(card_ref: String, state: ChainState) -> Self {
        Self { card_ref, state }
    }
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn state(&self) -> &ChainState {
        &self.state
    }
}

/// What a running job learns about its chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// The job's chain is the card's live chain.
    Live,
    /// The card had no chain (Redis lost it, or an outside producer enqueued): the job adopted
    /// the card under this chain id.
    Adopted(String),
    /// Another chain replaced this one: acknowledge without calling the Gateway.
    Stale,
}

fn invoke<'a>(
    prefix: &str,
    task: Task,
    op: &str,
    card_ref: &str,
    chain: &str,
) -> redis::ScriptInvocation<'a> {
    let queue = queue_of(task);
    let mut inv = CHAIN.prepare_invoke();
    inv.key(chain_key(prefix, task))
        .key(keys::intake(prefix, queue))
        .key(keys::intake_payload(prefix, queue))
        .arg(op)
        .arg(card_ref)
        .arg(chain);
    inv
}

fn queue_of(task: Task) -> &'static str {
    match task {
        Task::Carddata => PollCardData::QUEUE,
        Task::CardStatus => PollCardStatus::QUEUE,
    }
}

fn payload(card_ref: &str, state: &ChainState) -> anyhow::Result<String> {
    // Both payloads have the same shape: card_ref plus the flattened chain state.
    serde_json::to_string(&PollCardData {
        card_ref: card_ref.to_owned(),
        state: state.clone(),
    })
    .context("serialising a poll payload")
}

/// A new chain id and the payload of its first job.
fn fresh_chain(card_ref: &str) -> anyhow::Result<(String, String)> {
    let state = ChainState {
        chain: ulid::Ulid::new().to_string(),
        ..ChainState::default()
    };
    let job = payload(card_ref, &state)?;
    Ok((state.chain, job))
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Starts (or restarts, replacing any live chain) the card's chain; its first poll is due after
/// `delay`. Returns the new chain id.
pub async fn start(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    delay: Duration,
) -> anyhow::Result<String> {
    let (id, payload) = fresh_chain(card_ref)?;
    let _: i64 = invoke(prefix, task, "start", card_ref, &id)
        .arg(ms(delay))
        .arg(payload)
        .invoke_async(conn)
        .await
        .with_context(|| format!("starting the {task} chain of {card_ref}"))?;
    Ok(id)
}

/// Starts the card's chain unless a live one exists (one whose next poll is not overdue by more
/// than `grace`). Returns whether it started one. Used by reconcile.
pub async fn start_if_dead(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    delay: Duration,
    grace: Duration,
) -> anyhow::Result<bool> {
    let (id, payload) = fresh_chain(card_ref)?;
    let started: i64 = invoke(prefix, task, "start_if_dead", card_ref, &id)
        .arg(ms(delay))
        .arg(payload)
        .arg(ms(grace))
        .invoke_async(conn)
        .await
        .with_context(|| format!("reconciling the {task} chain of {card_ref}"))?;
    Ok(started == 1)
}

/// Schedules the job's successor (next poll, back-off after a failure, or a deferral) after
/// `delay`, if the job's chain is still live. Returns false for a stale chain (nothing written).
pub async fn schedule(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    next: &ChainState,
    delay: Duration,
) -> anyhow::Result<bool> {
    let done: i64 = invoke(prefix, task, "schedule", card_ref, &next.chain)
        .arg(ms(delay))
        .arg(payload(card_ref, next)?)
        .invoke_async(conn)
        .await
        .with_context(|| format!("scheduling the next {task} poll of {card_ref}"))?;
    Ok(done == 1)
}

/// Checks a running job against the card's chain (adopting the card if it has none).
pub async fn check(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    state: &ChainState,
) -> anyhow::Result<Liveness> {
    let fresh = ulid::Ulid::new().to_string();
    let (verdict, id): (String, String) = invoke(prefix, task, "check", card_ref, &state.chain)
        .arg(fresh)
        .invoke_async(conn)
        .await
        .with_context(|| format!("checking the {task} chain of {card_ref}"))?;
    Ok(match verdict.as_str() {
        "live" => Liveness::Live,
        "adopted" => Liveness::Adopted(id),
        _ => Liveness::Stale,
    })
}

/// Ends the card's chain (data ready, status final, parked) if it is still the job's chain.
pub async fn finish(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_ref: &str,
    chain: &str,
) -> anyhow::Result<bool> {
    let done: i64 = invoke(prefix, task, "finish", card_ref, chain)
        .invoke_async(conn)
        .await
        .with_context(|| format!("finishing the {task} chain of {card_ref}"))?;
    Ok(done == 1)
}

/// The live chain of each card (`None` when the card has no chain in Redis).
pub async fn live_chains(
    conn: &mut ConnectionManager,
    prefix: &str,
    task: Task,
    card_refs: &[String],
) -> anyhow::Result<Vec<Option<String>>> {
    if card_refs.is_empty() {
        return Ok(Vec::new());
    }
    let raw: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(chain_key(prefix, task))
        .arg(card_refs)
        .query_async(conn)
        .await
        .with_context(|| format!("reading {task} chains"))?;
    Ok(raw
        .into_iter()
        .map(|v| v.map(|s| s.split('|').next().unwrap_or_default().to_owned()))
        .collect())
}
