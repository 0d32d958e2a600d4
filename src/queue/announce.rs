//! Announcements of intake entries due earlier than the feeder knew: what lets an idle feeder
//! send nothing at all.
//!
//! Every intake writer lowers the deployment's due hint with `ZADD … LT CH`; when that lowered it
//! (the entry is due before anything the hint held for its intake), the same script publishes the
//! entry's due time, unix ms on the Redis clock, on [`cardworker_jobs::keys::intake_wake`]. Each
//! process subscribes once ([`Announcements::run`]); its feeder remembers the earliest due time
//! it read from the hint and reads the hint again only when that time comes, when an
//! announcement names an earlier one, after every (re)subscription, on every sweep, and at least
//! every [`super::intake::QUIET_READ_EVERY_TICKS`] ticks. A job that becomes due is therefore
//! still fed within one feeder tick, while a pod with nothing due reads the hint about once a
//! second instead of on every tick.
//!
//! The subscription is a hint, never the only path: while it is down (not yet connected, Redis
//! gone, the connection dropped), [`Announcements::live`] is `false` and the feeder reads the
//! hint on every tick, as it would without announcements. A message lost on a connection that
//! died silently costs at most the quiet read's second; writers that do not publish (a producer
//! from an older build) are found by the same reads or, without the hint, by the sweep.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;

use crate::backoff::{Backoff, Jitter};

/// What the subscription has heard, shared between it and the feeder.
#[derive(Debug)]
struct Heard {
    /// The earliest due time announced since the feeder last took it (unix ms on the Redis
    /// clock); `i64::MAX` for none.
    earliest: AtomicI64,
    /// Incremented at every successful (re)subscription: announcements made before it may have
    /// been missed, so the feeder reads the hint when it sees a new value.
    generation: AtomicU64,
    /// `true` while subscribed.
    live: AtomicBool,
}

/// The announcements of one process's feeder. Cheap to clone; every clone shares the state.
#[derive(Debug, Clone)]
pub struct Announcements {
    heard: Arc<Heard>,
}

impl Default for Announcements {
    fn default() -> Self {
        Self {
            heard: Arc::new(Heard {
                earliest: AtomicI64::new(i64::MAX),
                generation: AtomicU64::new(0),
                live: AtomicBool::new(false),
            }),
        }
    }
}

impl Announcements {
    /// `true` while the subscription is up: only then may the feeder skip a read.
    pub fn live(&self) -> bool {
        self.heard.live.load(Ordering::Acquire)
    }

    /// The subscription's generation (see `Heard::generation`).
    pub fn generation(&self) -> u64 {
        self.heard.generation.load(Ordering::Acquire)
    }

    /// The earliest due time announced since the last [`Self::take`], if any.
    pub fn earliest(&self) -> Option<i64> {
        match self.heard.earliest.load(Ordering::Acquire) {
            i64::MAX => None,
            at => Some(at),
        }
    }

    /// Forgets what was announced: called just before the feeder reads the hint, so that an
    /// announcement racing the read is kept for the next decision.
    pub fn take(&self) {
        self.heard.earliest.store(i64::MAX, Ordering::Release);
    }

    /// Records one announcement (a due time, unix ms).
    pub fn heard(&self, due_ms: i64) {
        self.heard.earliest.fetch_min(due_ms, Ordering::AcqRel);
    }

    /// Subscribes to `channel` on `client` and records every announcement until `shutdown`
    /// resolves, reconnecting with a capped back-off whenever the subscription fails or ends.
    pub async fn run(
        self,
        client: redis::Client,
        channel: String,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let backoff = Backoff::new(
            Duration::from_millis(200),
            Duration::from_secs(5),
            Jitter::FromBase,
        );
        let mut failures = 0u32;
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                ended = self.listen(&client, &channel) => {
                    self.heard.live.store(false, Ordering::Release);
                    match ended {
                        Ok(()) => {
                            failures = 0;
                            tracing::debug!(%channel, "intake announcements ended; resubscribing");
                        }
                        Err(e) => {
                            failures = failures.saturating_add(1);
                            tracing::debug!(%channel, error = %e, "intake announcements unavailable; the feeder reads the due hint every tick meanwhile");
                        }
                    }
                }
            }
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(backoff.delay(failures.max(1))) => {}
            }
        }
        self.heard.live.store(false, Ordering::Release);
    }

    /// One subscription: returns when its connection ends.
    async fn listen(&self, client: &redis::Client, channel: &str) -> redis::RedisResult<()> {
        let mut pubsub = tokio::time::timeout(Duration::from_secs(5), client.get_async_pubsub())
            .await
            .map_err(|_| {
                redis::RedisError::from((redis::ErrorKind::Io, "subscribing timed out"))
            })??;
        pubsub.subscribe(channel).await?;
        // Subscribed: anything announced before this moment may have been missed, which the new
        // generation tells the feeder.
        self.heard.generation.fetch_add(1, Ordering::AcqRel);
        self.heard.live.store(true, Ordering::Release);
        let mut messages = pubsub.on_message();
        while let Some(msg) = messages.next().await {
            match msg
                .get_payload::<String>()
                .ok()
                .and_then(|p| p.parse().ok())
            {
                Some(due_ms) => self.heard(due_ms),
                // Not ours to parse: take it as "something is due now" rather than drop it.
                None => self.heard(i64::MIN),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_earliest_announcement_wins_and_take_forgets_it() {
        let a = Announcements::default();
        assert_eq!(a.earliest(), None);
        a.heard(500);
        a.heard(900);
        a.heard(300);
        assert_eq!(a.earliest(), Some(300));
        a.take();
        assert_eq!(a.earliest(), None);
        assert!(!a.live(), "not live before a subscription");
        assert_eq!(a.generation(), 0);
    }
}
