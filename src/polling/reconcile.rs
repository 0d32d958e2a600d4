//! `RunReconcile`: restores the polling due queue from PostgreSQL after a Redis loss, and adds
//! cards that never entered it.
//!
//! The due queue needs no repair of its own: a poll whose worker died leaves a lease that ends
//! by itself, and the card is due again then. What it cannot know is a card it never held, or
//! held in data Redis lost. Each scheduled run therefore, per task, only **reads** PostgreSQL:
//! 1. **The cursor walk** ([`run_once`]): `polling.reconcile_batch` cards, walking the partial
//!    indexes of the cards that should be polled and are not parked (`cards_carddata_due_idx`,
//!    `cards_card_status_due_idx`) in id order from a cursor kept in Redis
//!    (`{prefix}:reconcile:cursor:{task}`), wrapping around at the end: each card missing from
//!    the due queue is added, with a small random first delay, so that a restored fleet does not
//!    come due all at once. One script call adds a whole batch (a card the queue holds is left as
//!    it is), so a pass over 2,000 cards costs one call per task.
//! 2. **Parked cards' retries** ([`restore_parked_retries`]): a parked card keeps its entry for its
//!    retry; one whose retry is overdue by more than the grace (its entry was lost with Redis) is
//!    added again, its first poll being the retry.
//!
//! A run with `full` (enqueued by the pod that finds Redis came back empty, see
//! `runner::redis_watch`) sweeps every card at once ([`sweep`]). The `cardworker reconcile` sweep
//! leaves parked cards alone.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::RunReconcile;
use rand::Rng as _;
use redis::AsyncCommands as _;

use super::lease;
use crate::config::{Config, Task};
use crate::context::AppContext;
use crate::runner::RunJob;
use crate::runner::Scheduled;
use crate::storage::cards;

/// Longest random first delay of a card reconcile adds.
pub const MAX_START_SPREAD: Duration = Duration::from_secs(60);

/// The Redis key of a task's reconcile cursor (the last card id examined), which [`crate::keys`]
/// owns.
pub use crate::keys::cursor_key;

/// A parked card's retry counts as lost when it is overdue by more than this: 10 min + 2 ×
/// interval.
pub fn grace(config: &Config, task: Task) -> Duration {
    Duration::from_secs(600) + config.polling.task(task).interval() * 2
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// Cards examined.
    pub examined: u64,
    /// Cards added to the due queue.
    pub started: u64,
    /// Where the next batch starts; `None` when this batch reached the end.
    pub next_cursor: Option<i64>,
}

/// Examines up to `batch` cards of `task` with id > `after` that should be polled and are not
/// parked, and adds each the due queue does not hold. Only reads PostgreSQL.
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
    let refs: Vec<&str> = rows.iter().map(|(_, r)| r.as_str()).collect();
    let started = add_missing(ctx, task, &refs).await?;
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

/// A random initial delay within min(interval, [`MAX_START_SPREAD`]).
fn start_delay(config: &Config, task: Task) -> Duration {
    let spread = config.polling.task(task).interval().min(MAX_START_SPREAD);
    if spread.is_zero() {
        return Duration::ZERO;
    }
    let ms = u64::try_from(spread.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(rand::rng().random_range(0..=ms))
}

/// Adds each card of `card_refs` that the due queue does not hold, with a random first delay
/// over min(interval, [`MAX_START_SPREAD`]), in one script call. Returns how many it added.
async fn add_missing(ctx: &AppContext, task: Task, card_refs: &[&str]) -> anyhow::Result<u64> {
    let cards: Vec<(&str, Duration)> = card_refs
        .iter()
        .map(|card_ref| (*card_ref, start_delay(&ctx.config, task)))
        .collect();
    let added = lease::due_queue(ctx.prefix(), task)
        .add_many(&mut ctx.redis.clone(), &cards)
        .await
        .with_context(|| format!("adding the missing {task} cards to the due queue"))?;
    Ok(added as u64)
}

/// Adds back up to `polling.reconcile_batch` parked cards of `task` whose retry is overdue by
/// more than the grace (parked longer ago than `parked_retry_secs` + grace) and that the due queue
/// does not hold (Redis lost them). Their first poll is the retry. Returns how many it added.
pub async fn restore_parked_retries(ctx: &AppContext, task: Task) -> anyhow::Result<u64> {
    let grace = grace(&ctx.config, task);
    let overdue = ctx.config.polling.task(task).parked_retry() + grace;
    let refs = cards::overdue_parked(
        &ctx.pool,
        task,
        overdue,
        i64::from(ctx.config.polling.reconcile_batch),
    )
    .await
    .with_context(|| format!("reading the {task} parked cards whose retry is overdue"))?;
    let refs: Vec<&str> = refs.iter().map(String::as_str).collect();
    add_missing(ctx, task, &refs).await
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
            let done = run_once(&ctx, task).await?;
            let parked = restore_parked_retries(&ctx, task).await?;
            tracing::info!(
                %task,
                examined = done.examined,
                started = done.started,
                parked_retries_restored = parked,
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
