//! Job payloads of cardworker and the producer-side enqueue API.
//!
//! Other services depend on this crate to hand work to cardworker. It holds no database or HTTP
//! code: a producer only writes into cardworker's bounded **intake** in Redis, never straight
//! into apalis, so that no producer can pile up more due jobs in apalis than it survives.
//!
//! # Layout
//! - [`Job`]: the small trait every payload implements (its queue as an associated const).
//! - [`payloads`]: one struct per job.
//! - [`keys`]: the Redis key names shared by producers and the worker.
//! - [`due`]: the polling due queue's script (shared with the worker) and how a producer's poll
//!   job reaches a card ([`due::merge`]).
//! - [`Producer`]: `enqueue`, `enqueue_after` and `enqueue_once` into the intake.
//!
//! # The intake
//! One sorted set per queue, `{prefix}:intake:{queue}`, with the entry id as member and the due
//! time (Redis clock, unix milliseconds) as score, plus a hash `{prefix}:intake:{queue}:payload`
//! from entry id to the JSON payload. Entries with the same id replace each other, which is how a
//! card keeps at most one pending poll per task. cardworker's feeder moves due entries into apalis
//! only while that queue's apalis backlog is under a high-water mark.
//!
//! Poll jobs ([`Job::POLL`]) do not enter the intake: each card waits for its next poll as one
//! entry in its polling task's due queue ([`keys::poll_due`], its state beside it), which the
//! worker fetches from directly. A producer's poll job is a request for a poll of the card
//! ([`due::merge`]): it brings a waiting card's next poll forward, leaves a card being polled to
//! that poll, and adds a card that has none. So cardworker must be upgraded before its producers:
//! an older cardworker reads the chains, not the due queue, and finds a card a newer producer
//! added only through its reconcile.

use std::time::Duration;

use redis::aio::ConnectionLike;
use serde::{de::DeserializeOwned, Serialize};

pub mod due;
pub mod keys;
pub mod payloads;

pub use payloads::*;

/// A job cardworker knows how to run.
pub trait Job: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The queue's short name; the Redis queue is `{prefix}:q:{QUEUE}`.
    const QUEUE: &'static str;

    /// The intake entry id. Jobs with the same id replace each other while they wait in the
    /// intake. `None` gives every enqueue a fresh id.
    fn entry_id(&self) -> Option<String> {
        None
    }

    /// Whether this is a poll job: it does not enter the intake, it asks the due queue for a
    /// poll of its card ([`due::merge`], its [`Job::entry_id`] being the card).
    const POLL: bool = false;
}

/// What can go wrong when handing a job to cardworker.
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    /// The payload could not be serialised.
    #[error("could not serialise the job payload: {0}")]
    Serialize(#[from] serde_json::Error),
    /// Redis refused or could not be reached.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
}

/// Adds (or replaces) one entry of a queue's intake, due `ARGV[3]` ms after the Redis clock's
/// now: due times come from one clock, whatever the producers' clocks say. KEYS[3] is the
/// deployment's due hint ([`keys::intake_due_hint`]): lowered to the entry's due time, so that the
/// feeder looks at this intake by then.
const ADD_SCRIPT: &str = r#"
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], due, ARGV[1])
if redis.call('ZADD', KEYS[3], 'LT', 'CH', due, KEYS[1]) == 1 then
  redis.call('PUBLISH', (string.gsub(KEYS[3], ':due$', ':wake')), due)
end
return 1
"#;

/// Claims a one-off key (for example one cron tick) and adds the entry only for the first
/// claimer, so several pods enqueueing the same tick produce one job.
const ONCE_SCRIPT: &str = r#"
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', tonumber(ARGV[3])) then
  return 0
end
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], due, ARGV[1])
if redis.call('ZADD', KEYS[4], 'LT', 'CH', due, KEYS[1]) == 1 then
  redis.call('PUBLISH', (string.gsub(KEYS[4], ':due$', ':wake')), due)
end
return 1
"#;

/// The producer-side API: writes jobs into cardworker's intake.
///
/// Cheap to clone; `C` is usually a `redis::aio::ConnectionManager`.
#[derive(Clone)]
pub struct Producer<C> {
    /// The shared Redis connection.
    conn: C,
    /// `redis.key_prefix` of the cardworker deployment to feed.
    prefix: String,
}

impl<C> std::fmt::Debug for Producer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl<C: ConnectionLike + Clone + Send + Sync> Producer<C> {
    /// A producer for the deployment whose `redis.key_prefix` is `prefix`.
    pub fn new(conn: C, prefix: impl Into<String>) -> Self {
        Self {
            conn,
            prefix: prefix.into(),
        }
    }

    /// The deployment's key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Enqueues a job, due now. Returns the intake entry id.
    pub async fn enqueue<J: Job>(&self, job: &J) -> Result<String, EnqueueError> {
        self.enqueue_after(job, Duration::ZERO).await
    }

    /// Enqueues a job, due after `delay` (measured on the Redis clock). An entry with the same
    /// [`Job::entry_id`] that is still waiting is replaced, except for a poll job, which asks the
    /// due queue for a poll of its card ([`due::merge`]); for a poll job the returned id is the
    /// card's.
    pub async fn enqueue_after<J: Job>(
        &self,
        job: &J,
        delay: Duration,
    ) -> Result<String, EnqueueError> {
        let id = job.entry_id().unwrap_or_else(fresh_id);
        if J::POLL {
            due::merge(&mut self.conn.clone(), &self.prefix, J::QUEUE, &id, delay).await?;
            return Ok(id);
        }
        let payload = serde_json::to_string(job)?;
        self.enqueue_raw(J::QUEUE, &id, &payload, delay).await?;
        Ok(id)
    }

    /// Enqueues a job at most once for `claim` within `claim_ttl`, however many producers try.
    /// Used for cron ticks seen by every pod. Returns whether this call enqueued it.
    pub async fn enqueue_once<J: Job>(
        &self,
        job: &J,
        claim: &str,
        claim_ttl: Duration,
    ) -> Result<bool, EnqueueError> {
        if J::POLL {
            // A poll job keeps the due queue's rules: claim first, then merge.
            let claimed: Option<String> = redis::cmd("SET")
                .arg(keys::claim(&self.prefix, claim))
                .arg("1")
                .arg("NX")
                .arg("EX")
                .arg(claim_ttl.as_secs().max(1))
                .query_async(&mut self.conn.clone())
                .await?;
            if claimed.is_none() {
                return Ok(false);
            }
            self.enqueue(job).await?;
            return Ok(true);
        }
        let id = job.entry_id().unwrap_or_else(|| claim.to_owned());
        let payload = serde_json::to_string(job)?;
        let added: i64 = redis::Script::new(ONCE_SCRIPT)
            .key(keys::intake(&self.prefix, J::QUEUE))
            .key(keys::intake_payload(&self.prefix, J::QUEUE))
            .key(keys::claim(&self.prefix, claim))
            .key(keys::intake_due_hint(&self.prefix))
            .arg(id)
            .arg(payload)
            .arg(claim_ttl.as_secs().max(1))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(added == 1)
    }

    /// Writes a raw payload into a queue's intake. For tools and tests: the payload is not
    /// checked here (nor routed to the due queue), and cardworker records a payload it cannot
    /// decode as a dead job.
    pub async fn enqueue_raw(
        &self,
        queue: &str,
        entry_id: &str,
        payload: &str,
        delay: Duration,
    ) -> Result<(), EnqueueError> {
        let _: i64 = redis::Script::new(ADD_SCRIPT)
            .key(keys::intake(&self.prefix, queue))
            .key(keys::intake_payload(&self.prefix, queue))
            .key(keys::intake_due_hint(&self.prefix))
            .arg(entry_id)
            .arg(payload)
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

/// A fresh, time-ordered entry id.
pub fn fresh_id() -> String {
    ulid::Ulid::new().to_string()
}
