//! [`PollBackend`]: the apalis backend of a polling worker that fetches straight from its task
//! shard's due queue ([`super::due_queue`]), with no apalis-redis job in between.
//!
//! Each fetch leases at most as many due cards as the worker has free slots (its concurrency
//! less the polls it runs and the cards it holds unstarted), so that a card is leased only to be
//! polled at once, and its lease does not run down in a buffer. A fetched card becomes one task
//! whose payload is a [`LeasedPoll`]: the card, its lease and its state. What ends the lease is
//! the poll's own acknowledgement (the successor, [`super::due_queue::DueQueue::ack`]): there is
//! no heartbeat, no in-flight set and no orphan recovery, because a lease that ends unacknowledged
//! makes its card due again by itself. On close, the cards fetched and never started are given
//! back at their due time ([`super::due_queue::DueQueue::release`]), so they keep their place.
//!
//! When a fetch finds nothing due, it says how soon the shard's next card is, and the worker
//! waits that long, at most [`PollFetch::idle_max`]: an idle worker costs a script call per due
//! time, and one per `idle_max` while nothing is due for longer. When a fetch leases every due
//! card it finds with slots to spare, the worker gathers the cards coming due for
//! [`PollFetch::gather`] before it fetches again, so that a steady trickle of due cards costs a
//! fetch per `gather`, not one per card.
//!
//! # Layout
//! - [`LeasedPoll`]: the payload of a fetched card.
//! - [`PollFetch`]: how a worker fetches.
//! - [`PollBackend`]: the backend (`Backend`, `BackendConfig`, `WireFormatBackend`).
//! - [`RunningLayer`]: the worker's outermost layer, which counts its polls from the moment the
//!   worker takes one until it is over (deferred or run), so that the backend fetches only for
//!   slots that are free.

use std::collections::VecDeque;
use std::future::Future as _;
use std::pin::Pin;
use std::str::FromStr as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use apalis::prelude::Task;
use apalis_core::backend::codec::Codec;
use apalis_core::backend::{Backend, BackendConfig, WireFormatBackend};
use apalis_core::task::builder::TaskBuilder;
use apalis_core::task::task_id::TaskId;
use apalis_core::worker::context::WorkerContext;
use futures::future::BoxFuture;
use futures::FutureExt as _;
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use tower::layer::util::Identity;
use tower::{Layer, Service};

use super::due_queue::{DueQueue, Fetched, Lease, Leased, PollState};

/// The codec a polling worker's payloads pass through: a [`LeasedPoll`]'s JSON as its UTF-8
/// bytes. The payload never leaves the process (the due queue keeps its own records), so it is
/// not wrapped in a JSON string as apalis-redis's payloads are, which the job service would
/// unwrap again for every poll.
#[derive(Debug, Clone, Copy, Default)]
pub struct PayloadCodec;

impl Codec<String> for PayloadCodec {
    type Error = std::string::FromUtf8Error;
    type Compact = Vec<u8>;

    fn encode(&self, val: &String) -> Result<Vec<u8>, Self::Error> {
        Ok(val.as_bytes().to_vec())
    }

    fn decode(&self, val: &Vec<u8>) -> Result<String, Self::Error> {
        String::from_utf8(val.clone())
    }
}

/// The payload of one fetched card: what its poll needs, and the lease it runs under (which
/// every write of its successor names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeasedPoll {
    pub card_ref: String,
    /// The lease's score ([`Lease::score`]).
    pub lease: u64,
    /// When the card came due (unix ms, Redis clock).
    pub due_ms: u64,
    /// Its state as the due queue keeps it ([`PollState::to_raw`]).
    pub state: String,
}

impl LeasedPoll {
    fn of(leased: &Leased) -> Self {
        Self {
            card_ref: leased.card_ref.clone(),
            lease: leased.lease.score(),
            due_ms: leased.due_ms,
            state: leased.state.to_raw(),
        }
    }

    /// The card's state before this poll: its failures, deferrals and tally.
    pub fn state(&self) -> PollState {
        PollState::parse(&self.state)
    }

    /// The lease the poll runs under.
    pub fn lease(&self) -> Lease {
        Lease::from_score(self.lease)
    }
}

/// How a polling worker fetches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PollFetch {
    /// The most polls the worker runs at once (its concurrency): a fetch never leases more
    /// cards than are free of these.
    pub slots: usize,
    /// How long a fetched card's lease lasts: no shorter than the poll's handler limit plus its
    /// acknowledgement, so that a running poll's card is never due again under it.
    pub lease: Duration,
    /// The longest wait after a fetch that found nothing due. The wait ends sooner when the
    /// shard's next card is due sooner (the fetch says when); this bounds how long a card that
    /// another process makes due earlier (a producer's request) waits for an idle worker.
    pub idle_max: Duration,
    /// The wait after a fetch that leased every due card it found and had room for more: the
    /// cards coming due meanwhile are leased together by the next fetch. Under a steady trickle
    /// of due cards this turns a script call per card into one per `gather`, for a poll up to
    /// `gather` later; a backlog never waits on it (its fetches fill every free slot).
    pub gather: Duration,
}

/// A polling worker's pause in fetching, which its budget layer sets when it gives a card back
/// unpolled (no token, a paused task, an open circuit, a fence): the worker fetches nothing more
/// until then, so a card is not fetched again and again only to be given back. Consecutive
/// deferrals are counted here, for the deferral back-off. Cheap to clone; shared by the worker's
/// builds.
#[derive(Clone, Default)]
pub struct FetchPause {
    inner: Arc<std::sync::Mutex<PauseState>>,
}

#[derive(Default)]
struct PauseState {
    until: Option<std::time::Instant>,
    deferrals: u32,
    /// The first deferral since the last admission.
    refused_since: Option<std::time::Instant>,
}

impl FetchPause {
    /// One more deferral: no fetch before `until` (a later pause already set stands). Returns
    /// how many deferrals came in a row, this one included.
    pub fn defer_until(&self, until: std::time::Instant) -> u32 {
        let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        state.until = Some(state.until.map_or(until, |u| u.max(until)));
        state.deferrals = state.deferrals.saturating_add(1);
        state
            .refused_since
            .get_or_insert_with(std::time::Instant::now);
        state.deferrals
    }

    /// How long the worker has been refused since its last admission (zero when it has not).
    /// A deferral's back-off never outgrows it: a batch of cards refused together in one
    /// brief shortage counts as one short refusal, not as a long run of them.
    pub fn refused_for(&self) -> Duration {
        self.inner
            .lock()
            .ok()
            .and_then(|s| s.refused_since)
            .map_or(Duration::ZERO, |since| since.elapsed())
    }

    /// How many deferrals came in a row so far.
    pub fn deferrals(&self) -> u32 {
        self.inner.lock().map_or(0, |s| s.deferrals)
    }

    /// A poll was admitted: tokens are free again, so the pause ends and the deferrals in a row
    /// start again.
    pub fn admitted(&self) {
        if let Ok(mut state) = self.inner.lock() {
            state.until = None;
            state.deferrals = 0;
            state.refused_since = None;
        }
    }

    /// Until when fetching waits, if it does now.
    fn until(&self) -> Option<std::time::Instant> {
        let state = self.inner.lock().ok()?;
        state.until.filter(|u| *u > std::time::Instant::now())
    }
}

/// The backend of one polling worker.
pub struct PollBackend {
    queue: DueQueue,
    conn: ConnectionManager,
    fetch: PollFetch,
    /// The worker's polls under way ([`RunningLayer`] counts them): the slots they take are not
    /// fetched for.
    running: Arc<AtomicUsize>,
    /// The pause its budget layer sets after giving a card back unpolled.
    pause: FetchPause,
    /// The fetch under way, if any.
    fetching: Option<BoxFuture<'static, anyhow::Result<Fetched>>>,
    /// How many cards the last fetch asked for (the slots free when it started).
    asked: usize,
    /// Cards fetched and not yet handed to the worker.
    buffer: VecDeque<Leased>,
    /// The wait before the next fetch, after one that found nothing due or leased every due card
    /// it found ([`PollFetch::gather`]).
    idle: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Handing the unstarted cards back on close, while under way.
    releasing: Option<BoxFuture<'static, ()>>,
    /// A fetch failed: the stream ends (the supervisor builds the worker again).
    dead: bool,
    codec: PayloadCodec,
}

impl PollBackend {
    /// The backend of a worker that polls `queue`'s cards on `conn`, fetching by `fetch`, with
    /// `running` counting its polls under way, pausing while `pause` says so.
    pub fn new(
        queue: DueQueue,
        conn: ConnectionManager,
        fetch: PollFetch,
        running: Arc<AtomicUsize>,
        pause: FetchPause,
    ) -> Self {
        Self {
            queue,
            conn,
            fetch,
            running,
            pause,
            fetching: None,
            asked: 0,
            buffer: VecDeque::new(),
            idle: None,
            releasing: None,
            dead: false,
            codec: PayloadCodec,
        }
    }

    /// How many cards a fetch may lease now.
    fn free_slots(&self) -> usize {
        self.fetch
            .slots
            .saturating_sub(self.running.load(Ordering::Acquire))
            .saturating_sub(self.buffer.len())
    }

    fn task(leased: &Leased) -> Result<Task<Vec<u8>>, std::io::Error> {
        let payload = serde_json::to_vec(&LeasedPoll::of(leased))?;
        let id = TaskId::from_str(&ulid::Ulid::new().to_string()).map_err(std::io::Error::other)?;
        Ok(TaskBuilder::new(payload).task_id(id).build())
    }
}

impl Backend for PollBackend {
    type Task = Task<Vec<u8>>;
    type Error = std::io::Error;

    fn poll_ready(
        &mut self,
        _cx: &mut Context<'_>,
        _worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        _worker: &WorkerContext,
    ) -> Poll<Option<Result<Self::Task, Self::Error>>> {
        loop {
            if let Some(leased) = self.buffer.pop_front() {
                return Poll::Ready(Some(Self::task(&leased)));
            }
            if self.dead {
                return Poll::Ready(None);
            }
            if let Some(idle) = self.idle.as_mut() {
                futures::ready!(idle.as_mut().poll(cx));
                self.idle = None;
            }
            if self.fetching.is_none() {
                if let Some(until) = self.pause.until() {
                    self.idle = Some(Box::pin(tokio::time::sleep_until(until.into())));
                    continue;
                }
                let max = self.free_slots();
                if max == 0 {
                    // Every slot is busy: look again shortly (a poll ending frees one, and the
                    // worker drives this stream again when it has room).
                    self.idle = Some(Box::pin(tokio::time::sleep(self.fetch.idle_max)));
                    continue;
                }
                self.asked = max;
                let (queue, mut conn, lease) =
                    (self.queue.clone(), self.conn.clone(), self.fetch.lease);
                self.fetching =
                    Some(async move { queue.fetch_or_wait(&mut conn, max, lease).await }.boxed());
            }
            let Some(fetching) = self.fetching.as_mut() else {
                continue;
            };
            match futures::ready!(fetching.poll_unpin(cx)) {
                Ok(Fetched::Leased(leased)) => {
                    self.fetching = None;
                    if leased.len() < self.asked {
                        self.idle = Some(Box::pin(tokio::time::sleep(self.fetch.gather)));
                    }
                    self.buffer.extend(leased);
                }
                Ok(Fetched::NoneDue { next_in }) => {
                    self.fetching = None;
                    let wait = next_in.map_or(self.fetch.idle_max, |d| d.min(self.fetch.idle_max));
                    self.idle = Some(Box::pin(tokio::time::sleep(wait)));
                }
                Err(e) => {
                    self.fetching = None;
                    self.dead = true;
                    return Poll::Ready(Some(Err(std::io::Error::other(format!("{e:#}")))));
                }
            }
        }
    }

    fn poll_close(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        // A fetch under way finishes first, so that what it leased is given back with the rest
        // instead of waiting for its lease to end.
        if let Some(fetching) = self.fetching.as_mut() {
            let fetched = futures::ready!(fetching.poll_unpin(cx));
            self.fetching = None;
            if let Ok(Fetched::Leased(leased)) = fetched {
                self.buffer.extend(leased);
            }
        }
        if !self.buffer.is_empty() {
            let unstarted: Vec<Leased> = self.buffer.drain(..).collect();
            let (queue, mut conn) = (self.queue.clone(), self.conn.clone());
            let name = worker.name().to_owned();
            self.releasing = Some(
                async move {
                    for leased in &unstarted {
                        if let Err(e) = queue.release(&mut conn, leased).await {
                            // Its lease ends by itself; the card is due again then.
                            tracing::warn!(worker = %name, card_ref = %leased.card_ref, error = %format!("{e:#}"), "a fetched card not given back on close; it is due again when its lease ends");
                        }
                    }
                }
                .boxed(),
            );
        }
        if let Some(releasing) = self.releasing.as_mut() {
            futures::ready!(releasing.poll_unpin(cx));
            self.releasing = None;
        }
        Poll::Ready(Ok(()))
    }
}

impl BackendConfig for PollBackend {
    type Args = String;
    type Id = ulid::Ulid;
    type Kind = apalis_core::backend::finalize::Durable;
    type Config = PollFetch;
    type Layer = Identity;

    fn config(&self) -> &Self::Config {
        &self.fetch
    }

    fn middleware(&mut self, _worker: &mut WorkerContext) -> Self::Layer {
        Identity::new()
    }
}

impl WireFormatBackend for PollBackend {
    type Codec = PayloadCodec;
    type Compact = Vec<u8>;

    fn codec(&self) -> &Self::Codec {
        &self.codec
    }
}

/// Counts a worker's polls in `running` from the call until its future ends (or is dropped):
/// the outermost layer of a polling worker, so that a poll waiting for its tokens counts as a
/// busy slot too.
#[derive(Clone)]
pub struct RunningLayer {
    running: Arc<AtomicUsize>,
}

impl RunningLayer {
    /// The layer counting into `running` (the count [`PollBackend`] fetches by).
    pub fn new(running: Arc<AtomicUsize>) -> Self {
        Self { running }
    }
}

impl<S> Layer<S> for RunningLayer {
    type Service = Running<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Running {
            inner,
            running: self.running.clone(),
        }
    }
}

/// [`RunningLayer`]'s service.
#[derive(Clone)]
pub struct Running<S> {
    inner: S,
    running: Arc<AtomicUsize>,
}

/// One counted poll; the count goes down when it drops.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<S, Req> Service<Req> for Running<S>
where
    S: Service<Req>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.running.fetch_add(1, Ordering::AcqRel);
        let counted = Counted(self.running.clone());
        let run = self.inner.call(req);
        async move {
            let _counted = counted;
            run.await
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_counts_deferrals_in_a_row_from_the_first_refusal_and_an_admission_ends_them() {
        let pause = FetchPause::default();
        assert_eq!(pause.refused_for(), Duration::ZERO);
        assert_eq!(pause.until(), None);
        let later = std::time::Instant::now() + Duration::from_secs(30);
        // A batch refused together: eight deferrals in a row, all within the same instant.
        for n in 1..=8 {
            assert_eq!(pause.defer_until(later), n);
        }
        assert!(
            pause.refused_for() < Duration::from_secs(1),
            "refused for {:?}",
            pause.refused_for()
        );
        // A later deferral never shortens the pause.
        pause.defer_until(std::time::Instant::now());
        assert_eq!(pause.until(), Some(later));
        pause.admitted();
        assert_eq!(pause.deferrals(), 0);
        assert_eq!(pause.refused_for(), Duration::ZERO);
        assert_eq!(pause.until(), None, "an admission ends the pause");
    }
}
