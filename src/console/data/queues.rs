//! The queues: every queue's counts and live workers (the fleet page) and the dead sets (the
//! queues page).

use anyhow::Context as _;
use chrono::Utc;
use serde::Serialize;

use super::bounded::bounded;
use crate::context::AppContext;
use crate::gateway::redact_digits;
use crate::queue::dead::{self, DeadEntry};
use crate::queue::QueueName;

/// Dead entries shown per queue.
pub const DEAD_LIMIT: usize = 50;

/// One queue's counts, in the words an operator of Sidekiq or Oban reads them.
#[derive(Debug, Clone, Serialize)]
pub struct QueueCounts {
    /// Short name.
    pub queue: String,
    /// Jobs due now and not yet running: intake entries due now, and jobs handed to apalis but
    /// not yet fetched by a worker; for a polling task, its cards due now (waiting, or whose
    /// lease ended).
    pub waiting: u64,
    /// Jobs due later: intake entries not yet due and apalis's scheduled set; for a polling
    /// task, its cards whose next poll is not due yet.
    pub scheduled: u64,
    /// Jobs a worker fetched and is running (the inflight sets of the queue's workers); for a
    /// polling task, its cards a poll holds.
    pub running: u64,
    /// The dead set.
    pub dead: u64,
}

/// One live worker (an apalis worker of one queue in one process).
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// The queue.
    pub queue: String,
    /// Its name (`<kind>-<pod>-<ulid>`).
    pub name: String,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_secs: i64,
}

/// The queues of the deployment, by short name.
pub fn queues(ctx: &AppContext) -> Vec<QueueName> {
    crate::workers::queue_names(ctx.prefix())
}

/// Counts of every queue and its live workers: one pipeline, then one for the inflight sets of
/// the workers it found.
pub async fn queue_counts(ctx: &AppContext) -> anyhow::Result<(Vec<QueueCounts>, Vec<WorkerView>)> {
    let names = queues(ctx);
    let now_ms = Utc::now().timestamp_millis();
    let mut pipe = redis::pipe();
    for q in &names {
        pipe.cmd("ZCOUNT").arg(&q.intake).arg("-inf").arg(now_ms);
        pipe.cmd("ZCOUNT")
            .arg(&q.intake)
            .arg(format!("({now_ms}"))
            .arg("+inf");
        pipe.cmd("LLEN").arg(format!("{}:active", q.apalis));
        pipe.cmd("ZCARD").arg(format!("{}:scheduled", q.apalis));
        pipe.cmd("SCARD").arg(format!("{}:dead", q.apalis));
        pipe.cmd("ZRANGE")
            .arg(format!("{}:workers", q.apalis))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES");
    }
    type Row = (u64, u64, u64, u64, u64, Vec<(String, f64)>);
    let mut conn = ctx.redis.clone();
    let rows: Vec<Row> = pipe
        .query_async(&mut conn)
        .await
        .context("reading queue counts")?;
    let now = Utc::now().timestamp();
    let mut counts = Vec::new();
    let mut workers = Vec::new();
    let mut inflight = redis::pipe();
    for task in crate::config::Task::ALL {
        counts.push(polling_counts(ctx, task).await?);
    }
    for (q, (due, later, fed_jobs, retries, dead, ws)) in names.iter().zip(rows) {
        counts.push(QueueCounts {
            queue: q.short.clone(),
            waiting: due + fed_jobs,
            scheduled: later + retries,
            running: 0,
            dead,
        });
        for (name, beat) in ws {
            inflight
                .cmd("SCARD")
                .arg(format!("{}:inflight:{name}", q.apalis));
            workers.push(WorkerView {
                queue: q.short.clone(),
                name,
                heartbeat_age_secs: (now - beat as i64).max(0),
            });
        }
    }
    if !workers.is_empty() {
        let running: Vec<u64> = inflight
            .query_async(&mut conn)
            .await
            .context("reading the workers' running jobs")?;
        for (w, n) in workers.iter().zip(running) {
            if let Some(c) = counts.iter_mut().find(|c| c.queue == w.queue) {
                c.running += n;
            }
        }
    }
    workers.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((counts, workers))
}

/// A polling task's counts, from its due queue: cards due now, cards not due yet, cards a poll
/// holds. One pipeline of three counts.
async fn polling_counts(
    ctx: &AppContext,
    task: crate::config::Task,
) -> anyhow::Result<QueueCounts> {
    use crate::polling::due_queue::LEASED;
    let queue = crate::polling::lease::due_queue(ctx.prefix(), task);
    let mut conn = ctx.redis.clone();
    let head = queue.head(&mut conn).await?;
    let now = head.now_ms;
    let (later, held): (u64, u64) = redis::pipe()
        .cmd("ZCOUNT")
        .arg(&queue.keys().due)
        .arg(format!("({now}"))
        .arg(format!("({LEASED}"))
        .cmd("ZCOUNT")
        .arg(&queue.keys().due)
        .arg(format!("({}", LEASED + now))
        .arg("+inf")
        .query_async(&mut conn)
        .await
        .with_context(|| format!("reading the {task} due queue's counts"))?;
    Ok(QueueCounts {
        queue: task.label().to_owned(),
        waiting: head.due_now,
        scheduled: later,
        running: held,
        dead: 0,
    })
}

/// One queue on the queues page.
#[derive(Debug, Clone, Serialize)]
pub struct QueueDead {
    /// Short name.
    pub queue: String,
    /// Dead jobs in all.
    pub total: u64,
    /// The newest [`DEAD_LIMIT`], payload and reason with card numbers masked.
    pub entries: Vec<DeadEntry>,
}

/// Reads the dead set of every queue (card numbers masked).
pub async fn dead_sets(ctx: &AppContext) -> anyhow::Result<Vec<QueueDead>> {
    let mut out = Vec::new();
    let mut conn = ctx.redis.clone();
    for q in queues(ctx) {
        let (total, mut entries) =
            bounded("dead set", dead::list(&mut conn, &q, DEAD_LIMIT)).await?;
        for e in &mut entries {
            e.payload = e.payload.as_deref().map(redact_digits);
            e.reason = e.reason.as_deref().map(redact_digits);
        }
        out.push(QueueDead {
            queue: q.short.clone(),
            total,
            entries,
        });
    }
    Ok(out)
}
