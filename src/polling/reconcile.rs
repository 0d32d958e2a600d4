//! `RunReconcile`: restores the schedule after a Redis loss, and restarts dead chains.
//!
//! Each scheduled run does two things per task, and only **reads** PostgreSQL:
//! 1. **Overdue chains** ([`restart_overdue`]): every chain whose next poll is overdue by more
//!    than the grace is read from the chain due set (`{prefix}:chain:{task}:due`, also the
//!    polling intake: [`chain::overdue`] reads its fed range, jobs that were fed that long ago and
//!    never wrote a successor, and its waiting range) in batches, so the work is proportional to
//!    the number of overdue chains, not of cards; each is restarted if its card still should be
//!    polled (one `card_ref = ANY(…)` lookup per batch), or dropped. A chain that lost its job (a
//!    pod killed while the job waited in apalis or ran, say) is thus back within grace + one
//!    reconcile period, at any number of cards.
//! 2. **The cursor walk** ([`run_once`]): `polling.reconcile_batch` cards, walking the partial
//!    indexes of the cards that should be polled and are not parked (`cards_carddata_due_idx`,
//!    `cards_card_status_due_idx`) in id order from a cursor kept in Redis
//!    (`{prefix}:reconcile:cursor:{task}`), wrapping around at the end: it finds cards that have
//!    no chain at all (a card inserted without `enqueue`).
//!
//! A run with `full` (enqueued by the pod that finds Redis came back empty, see
//! `runner::redis_watch`) sweeps every card at once ([`sweep`]).
//!
//! For every card without a live chain (none, or one overdue by more than the grace) it starts
//! one with a small random initial delay, so that a restored fleet does not come due all at once.
//! The chains are read [`chain::LIVENESS_BATCH`] cards per call of a filter script
//! ([`chain::maybe_dead`]), and only a card whose chain may be dead costs a chain script call: a
//! scheduled pass over 2,000 cards whose chains are all live sends about 20 commands per task,
//! not 2,000 script calls of 4 commands each (which would be a large share of an idle pod's
//! commands).
//! Parked chains are not in those indexes; a parked chain stays scheduled for its retry
//! (`poll`), and the scheduled run also restarts the parked chains whose retry is overdue by more
//! than the grace (their chain was lost with Redis), so that a Redis loss never leaves a parked
//! card without its retry. The `cardworker reconcile` sweep leaves parked chains alone.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::RunReconcile;
use rand::Rng as _;
use redis::AsyncCommands as _;

use super::chain;
use crate::config::{Config, Task};
use crate::context::AppContext;
use crate::runner::RunJob;
use crate::runner::Scheduled;
use crate::storage::cards;

/// Longest random initial delay of a chain started by reconcile.
pub const MAX_START_SPREAD: Duration = Duration::from_secs(60);

/// The Redis key of a task's reconcile cursor (the last card id examined), which [`crate::keys`]
/// owns.
pub use crate::keys::cursor_key;

/// A chain is dead when its next poll is overdue by more than this: 10 min + 2 × interval.
pub fn grace(config: &Config, task: Task) -> Duration {
    Duration::from_secs(600) + config.polling.task(task).interval() * 2
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// Cards examined.
    pub examined: u64,
    /// Chains started.
    pub started: u64,
    /// Where the next batch starts; `None` when this batch reached the end.
    pub next_cursor: Option<i64>,
}

/// Examines up to `batch` cards of `task` with id > `after` that should be polled and are not
/// parked, and starts a chain for each that has none. Only reads PostgreSQL.
pub async fn pass(ctx: &AppContext, task: Task, after: i64, batch: u32) -> anyhow::Result<Pass> {
    let sql = match task {
        Task::Carddata => {
            "SELECT id, card_ref FROM cards
              WHERE data_state = 'pending' AND carddata_parked_at IS NULL AND id > $1
              ORDER BY id LIMIT $2"
        }
        Task::CardStatus => {
            "SELECT id, card_ref FROM cards
              WHERE status NOT IN ('cancelled', 'expired') AND card_status_parked_at IS NULL
                AND id > $1
              ORDER BY id LIMIT $2"
        }
    };
    let rows: Vec<(i64, String)> = sqlx::query_as(sql)
        .bind(after)
        .bind(i64::from(batch))
        .fetch_all(&ctx.pool)
        .await
        .with_context(|| format!("reading the {task} cards to reconcile"))?;
    let grace = grace(&ctx.config, task);
    let refs: Vec<&str> = rows.iter().map(|(_, r)| r.as_str()).collect();
    let started = start_dead(ctx, task, &refs, grace).await?;
    let next_cursor = if rows.len() < batch as usize {
        None
    } else {
        rows.last().map(|(id, _)| *id)
    };
    Ok(Pass {
        examined: rows.len() as u64,
        started,
        next_cursor,
    })
}

/// Overdue chains read per batch of [`restart_overdue`].
pub const OVERDUE_BATCH: usize = 500;
/// Batches one [`restart_overdue`] call reads at most (a bound, should the index misbehave).
const MAX_OVERDUE_BATCHES: usize = 1_000;

/// What [`restart_overdue`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overdue {
    /// Overdue chains found in the chain due set.
    pub found: u64,
    /// Restarted (their card should still be polled).
    pub restarted: u64,
    /// Dropped (their card needs no more polling, is parked or is gone).
    pub dropped: u64,
}

/// Restarts (or drops) every chain of `task` overdue by more than the grace, reading only the
/// overdue ends of the chain due set (fed and waiting).
pub async fn restart_overdue(ctx: &AppContext, task: Task) -> anyhow::Result<Overdue> {
    let mut conn = ctx.redis.clone();
    let grace = grace(&ctx.config, task);
    let now = chain::redis_now_ms(&mut conn).await?;
    let before = now.saturating_sub(cardworker_jobs::chain::ms(grace));
    let mut done = Overdue::default();
    for _ in 0..MAX_OVERDUE_BATCHES {
        let found = chain::overdue(&mut conn, ctx.prefix(), task, before, OVERDUE_BATCH).await?;
        if found.is_empty() {
            break;
        }
        done.found += found.len() as u64;
        let pollable: std::collections::HashSet<String> = cards::load_many(&ctx.pool, &found)
            .await
            .with_context(|| format!("reading the {task} cards of overdue chains"))?
            .into_iter()
            .filter(|card| card.is_pollable(task))
            .map(|card| card.card_ref)
            .collect();
        for card_ref in &found {
            if pollable.contains(card_ref) {
                let delay = start_delay(&ctx.config, task);
                if chain::start_if_dead(&mut conn, ctx.prefix(), task, card_ref, delay, grace)
                    .await?
                {
                    done.restarted += 1;
                }
            } else if chain::drop_if_dead(&mut conn, ctx.prefix(), task, card_ref, grace).await? {
                done.dropped += 1;
            }
        }
        if found.len() < OVERDUE_BATCH {
            break;
        }
    }
    if done.found > 0 {
        tracing::warn!(%task, found = done.found, restarted = done.restarted, dropped = done.dropped, "overdue chains reconciled");
    }
    Ok(done)
}

/// A random initial delay within min(interval, [`MAX_START_SPREAD`]).
fn start_delay(config: &Config, task: Task) -> Duration {
    let spread = config.polling.task(task).interval().min(MAX_START_SPREAD);
    if spread.is_zero() {
        return Duration::ZERO;
    }
    let ms = u64::try_from(spread.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(rand::rng().random_range(0..=ms))
}

/// Starts a chain for each card of `card_refs` that has no live chain (none, or one overdue by
/// more than `grace`), with a random initial delay over min(interval, [`MAX_START_SPREAD`]).
/// Returns how many it started. The chains are read [`chain::LIVENESS_BATCH`] at a time
/// ([`chain::maybe_dead`]); only the cards that may need a start cost a script call, which
/// decides atomically.
async fn start_dead(
    ctx: &AppContext,
    task: Task,
    card_refs: &[&str],
    grace: Duration,
) -> anyhow::Result<u64> {
    let mut conn = ctx.redis.clone();
    let mut started = 0;
    // Read in batches first: the script runs only for the cards whose chain may be dead.
    let candidates = chain::maybe_dead(&mut conn, ctx.prefix(), task, card_refs, grace).await?;
    for card_ref in candidates {
        let delay = start_delay(&ctx.config, task);
        if chain::start_if_dead(&mut conn, ctx.prefix(), task, card_ref, delay, grace).await? {
            started += 1;
        }
    }
    Ok(started)
}

/// Restarts up to `polling.reconcile_batch` parked chains of `task` whose retry is overdue by
/// more than the grace (parked longer ago than `parked_retry_secs` + grace and without a live
/// chain: Redis lost it). Their first job is the retry. Returns how many it started.
pub async fn restart_overdue_parked(ctx: &AppContext, task: Task) -> anyhow::Result<u64> {
    let grace = grace(&ctx.config, task);
    let overdue = ctx.config.polling.task(task).parked_retry() + grace;
    let refs = cards::overdue_parked(
        &ctx.pool,
        task,
        overdue,
        i64::from(ctx.config.polling.reconcile_batch),
    )
    .await
    .with_context(|| format!("reading the {task} parked chains whose retry is overdue"))?;
    let refs: Vec<&str> = refs.iter().map(String::as_str).collect();
    start_dead(ctx, task, &refs, grace).await
}

/// One scheduled run for one task: a batch from the Redis cursor, then the cursor moved on (or
/// back to the start after the last card).
pub async fn run_once(ctx: &AppContext, task: Task) -> anyhow::Result<Pass> {
    let mut conn = ctx.redis.clone();
    let key = cursor_key(ctx.prefix(), task);
    let after: Option<i64> = conn
        .get(&key)
        .await
        .context("reading the reconcile cursor")?;
    let done = pass(
        ctx,
        task,
        after.unwrap_or(0),
        ctx.config.polling.reconcile_batch,
    )
    .await?;
    match done.next_cursor {
        Some(id) => conn.set::<_, _, ()>(&key, id).await,
        None => conn.del::<_, ()>(&key).await,
    }
    .context("moving the reconcile cursor")?;
    Ok(done)
}

/// A full sweep of one task (every card that should be polled), independent of the scheduled
/// runs' cursor. Returns (examined, started).
pub async fn sweep(ctx: &AppContext, task: Task) -> anyhow::Result<(u64, u64)> {
    let (mut examined, mut started) = (0, 0);
    let mut after = 0;
    loop {
        let done = pass(ctx, task, after, ctx.config.polling.reconcile_batch).await?;
        examined += done.examined;
        started += done.started;
        match done.next_cursor {
            Some(id) => after = id,
            None => return Ok((examined, started)),
        }
    }
}

impl RunJob for RunReconcile {
    // A run every 10 minutes (its cron), or one after a Redis data loss: an idle worker beats
    // and fetches every 30 s; this pod's feeder wakes it at once for a job it moved
    // (`runner::spawn`).
    const HEARTBEAT: Duration = crate::runner::spawn::QUIET_HEARTBEAT;

    fn timeout(_config: &Config) -> Duration {
        Duration::from_secs(600)
    }

    #[tracing::instrument(name = "reconcile", skip_all, fields(scheduled_for = %crate::telemetry::rfc3339_opt(self.scheduled_for), full = self.full))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        for task in Task::ALL {
            if self.full {
                let (examined, started) = sweep(&ctx, task).await?;
                tracing::info!(%task, examined, started, "full reconcile sweep done");
                continue;
            }
            restart_overdue(&ctx, task).await?;
            let done = run_once(&ctx, task).await?;
            let parked = restart_overdue_parked(&ctx, task).await?;
            tracing::info!(
                %task,
                examined = done.examined,
                started = done.started,
                parked_retries_restarted = parked,
                wrapped = done.next_cursor.is_none(),
                "reconcile batch done"
            );
        }
        Ok(())
    }
}

impl Scheduled for RunReconcile {
    const CRON_KIND: &'static str = "reconcile-cron";
    fn for_tick(timestamp: i64) -> Self {
        RunReconcile {
            scheduled_for: Some(timestamp),
            full: false,
        }
    }
}
