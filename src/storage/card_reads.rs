//! One process's concurrent card reads, sent together: [`CardReads`].
//!
//! Every poll reads its card once before the Gateway call (an unchanged poll's only PostgreSQL
//! work), and a process runs many polls at once: apalis starts the jobs of one fetch together.
//! One `SELECT … WHERE card_ref = $1` per poll would cost the worker a round trip, a socket send
//! that wakes PostgreSQL and a backend's parse-bind-execute each, and socket sends are a large
//! share of the worker's CPU (perf). [`CardReads`] queues the reads and a task of its own sends
//! whatever queued meanwhile as one [`cards::load_many`] (`card_ref = ANY($1)`, the unique index),
//! at most [`IN_FLIGHT`] queries at a time. The first read of a query waits up to [`READ_LINGER`]
//! for others to join it ([`crate::linger`]): the polls of one fetch start within about a
//! millisecond of each other, and a read sent the moment it comes, with a query slot free, would
//! go to PostgreSQL with few others (docs/BENCHMARKS.md, PostgreSQL commits per poll).
//!
//! A query that fails is not the failure of every card it carried: one card_ref PostgreSQL refuses
//! (a NUL byte in a hand-written payload) would fail the whole `ANY`, and a connection blip may be
//! over by the next query. So each read of a failed query is made again on its own
//! ([`cards::load`]), and answers with its own result, exactly as it would have alone.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::cards::{self, Card};

/// The most reads one query carries.
pub const MAX_BATCH: usize = 64;

/// The most batched queries in flight at once (of the pool's connections).
pub const IN_FLIGHT: usize = 4;

/// How long the first read of a query waits for others: a poll's Gateway call comes this much
/// later at most.
pub const READ_LINGER: Duration = Duration::from_millis(1);

/// One queued read.
struct Read {
    card_ref: String,
    reply: oneshot::Sender<sqlx::Result<Option<Card>>>,
}

/// A queue of card reads, sent several to a query by a task of its own. Cheap to clone; the task
/// ends when the last clone is dropped.
#[derive(Clone)]
pub struct CardReads {
    /// Into the sending task.
    tx: mpsc::UnboundedSender<Read>,
    /// How many queries the reads have taken so far (batched and single ones).
    queries: Arc<AtomicU64>,
}

impl CardReads {
    /// Starts the task that reads cards from `pool`, each query's first read waiting up to
    /// [`READ_LINGER`] for others. Needs a Tokio runtime.
    pub fn new(pool: PgPool) -> Self {
        Self::lingering(pool, READ_LINGER)
    }

    /// [`Self::new`], whose first read of a query waits up to `linger` for others to join it.
    pub fn lingering(pool: PgPool, linger: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let queries = Arc::new(AtomicU64::new(0));
        tokio::spawn(send_reads(pool, rx, linger, queries.clone()));
        Self { tx, queries }
    }

    /// How many queries the reads have taken so far.
    pub fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }

    /// The card `card_ref` (`None` for an unknown card), read in the next query.
    pub async fn load(&self, card_ref: &str) -> sqlx::Result<Option<Card>> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Read {
                card_ref: card_ref.to_owned(),
                reply,
            })
            .map_err(|_| sqlx::Error::PoolClosed)?;
        answer.await.map_err(|_| sqlx::Error::PoolClosed)?
    }
}

/// The sending task: once a query slot is free, takes what has queued (at least one read), and
/// what joins it within `linger`, and sends it.
async fn send_reads(
    pool: PgPool,
    mut rx: mpsc::UnboundedReceiver<Read>,
    linger: Duration,
    queries: Arc<AtomicU64>,
) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut queued = Vec::with_capacity(MAX_BATCH);
        if crate::linger::recv_batch(&mut rx, &mut queued, MAX_BATCH, linger).await == 0 {
            return;
        }
        let (pool, queries) = (pool.clone(), queries.clone());
        tokio::spawn(async move {
            answer(&pool, queued, &queries).await;
            drop(slot);
        });
    }
}

/// One query for `reads`, and their answers.
async fn answer(pool: &PgPool, reads: Vec<Read>, queries: &AtomicU64) {
    queries.fetch_add(1, Ordering::Relaxed);
    let mut refs: Vec<String> = reads.iter().map(|r| r.card_ref.clone()).collect();
    refs.sort_unstable();
    refs.dedup();
    match cards::load_many(pool, &refs).await {
        Ok(found) => {
            let by_ref: HashMap<&str, &Card> =
                found.iter().map(|c| (c.card_ref.as_str(), c)).collect();
            for read in reads {
                let card = by_ref.get(read.card_ref.as_str()).map(|c| (*c).clone());
                let _ = read.reply.send(Ok(card));
            }
        }
        Err(e) => {
            tracing::debug!(reads = reads.len(), error = %e, "a batched card read failed; each read is made again on its own");
            join_all(reads.into_iter().map(|read| async move {
                queries.fetch_add(1, Ordering::Relaxed);
                let result = cards::load(pool, &read.card_ref).await;
                let _ = read.reply.send(result);
            }))
            .await;
        }
    }
}
