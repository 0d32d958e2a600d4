//! [`QueueBackend`]: the apalis backend of every cardworker worker. apalis-redis 1.0.0's own
//! storage, with its fetch and its acknowledgement of done jobs replaced.
//!
//! # Why not plain `RedisStorage`
//! With the budget, chain and intake calls batched, most of what a poll would still cost Redis
//! through plain `RedisStorage` is apalis-redis's bookkeeping of each job: its fetch reads every
//! job's meta hash (`HGETALL`) for an attempt count and a status that cardworker never uses
//! (re-runs go through the intake, so every job runs once), and its acknowledgement of a done job
//! adds the id to the queue's done set and rewrites the meta hash, only for the trimmer to delete
//! both later. Here:
//! - the fetch ([`fetch.lua`](./fetch.lua)) is apalis's without the meta hash: every job starts at
//!   attempt 0 (cardworker's re-runs are new jobs, fed from the intake);
//! - a done job's data and meta hash are deleted by its acknowledgement ([`ack.lua`](./ack.lua)),
//!   batched with the other jobs of this worker that finished meanwhile ([`ScriptCalls`]); a
//!   failed or killed job is acknowledged exactly as apalis does (retry set, dead set, its result
//!   in its meta hash for `dead list` and the console).
//!
//! Everything else is apalis-redis's own, through the `RedisStorage` inside: registering the
//! worker, its heartbeats, the orphan recovery of dead peers (which reads only the inflight sets)
//! and deregistering on close. The key layout is apalis-redis's, so an older release's pods and
//! this one's share every queue during a rolling deploy: the feeder still writes each job's meta
//! hash, which an older pod's fetch needs, and trimming still removes what an older pod's
//! acknowledgements leave in the done set.
//!
//! # Layout
//! - [`QueueBackend`]: the backend (`Backend`, `BackendConfig`, `WireFormatBackend`).
//! - [`AckLayer`] / [`Ack`]: the middleware that acknowledges each job when its service returns.
//! - [`ack_keys`], [`fetch`], [`release`]: the Redis calls.

use std::collections::{HashMap, VecDeque};
use std::future::Future as _;
use std::pin::Pin;
use std::str::FromStr as _;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Duration;

use apalis::prelude::{BoxDynError, Task};
use apalis_core::backend::{Backend, BackendConfig, WireFormatBackend};
use apalis_core::task::status::Status;
use apalis_core::task::task_id::TaskId;
use apalis_core::worker::context::WorkerContext;
use apalis_redis::queries::CompactTask;
use apalis_redis::{RedisStorage, RedisTask};
use futures::future::BoxFuture;
use futures::FutureExt as _;
use redis::aio::ConnectionManager;
use redis::Script;
use tokio::sync::futures::OwnedNotified;
use tokio::sync::Notify;
use tower::{Layer, Service};

use super::batch::ScriptCalls;

static FETCH: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("fetch.lua")));
static ACK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("ack.lua")));

/// Arguments per job of an `ack.lua` call: task id, status, result, attempt.
pub const ACK_WIDTH: usize = 4;

/// The codec apalis-redis decodes payloads with (JSON into `String`, `queue/feed.lua` says why).
type Codec = <RedisStorage<String> as WireFormatBackend>::Codec;

/// The backend of one worker: apalis-redis's storage for registration, heartbeats, orphan
/// recovery and close; cardworker's own fetch and acknowledgement.
pub struct QueueBackend {
    /// apalis-redis's storage of the queue: drives registration, heartbeats and the orphan
    /// recovery of peers ([`Backend::poll_ready`]) and the close. Its fetch is never called, and
    /// its acknowledgement layer never built.
    apalis: RedisStorage<String>,
    /// The connection the fetches and releases use (the process's shared one).
    conn: ConnectionManager,
    /// Sends this worker's acknowledgements, several to a script call.
    acks: ScriptCalls,
    /// The fetch under way, if any.
    fetching: Option<BoxFuture<'static, Result<Vec<RedisTask>, apalis_redis::Error>>>,
    /// Jobs fetched and not yet handed to the worker.
    buffer: VecDeque<RedisTask>,
    /// Handing the buffered jobs back to the queue on close, while under way.
    releasing: Option<BoxFuture<'static, Result<(), apalis_redis::Error>>>,
    /// A fetch failed: the stream ends (the supervisor builds the worker again), as apalis's does.
    dead: bool,
    /// This process's wake-up of the queue's workers ([`super::wake`]): the feeder's, when it
    /// moved jobs into the queue.
    wake: Arc<Notify>,
    /// Armed just before each fetch is sent. A wake-up after that may be for jobs that landed
    /// after the fetch ran in Redis, however long its round trip: when the fetch comes back
    /// empty and this has fired, the worker fetches again at once instead of waiting for its
    /// queue's next heartbeat (up to 30 s for a quiet queue).
    woken: Pin<Box<OwnedNotified>>,
}

impl QueueBackend {
    /// The backend of queue `storage` (apalis-redis's storage with the queue's configuration),
    /// on the process's connection `conn`, woken by `wake` (this process's wake-up of the
    /// queue's workers, [`super::wake::handle`]).
    pub fn new(storage: RedisStorage<String>, conn: ConnectionManager, wake: Arc<Notify>) -> Self {
        let acks = ack_calls(conn.clone());
        let woken = Box::pin(wake.clone().notified_owned());
        Self {
            apalis: storage,
            conn,
            acks,
            fetching: None,
            buffer: VecDeque::new(),
            releasing: None,
            dead: false,
            wake,
            woken,
        }
    }

    /// The apalis-redis configuration of the queue (its key names, batch size, heartbeat).
    pub fn apalis_config(&self) -> &apalis_redis::Config {
        self.apalis.get_config()
    }
}

impl Backend for QueueBackend {
    type Task = RedisTask;
    type Error = apalis_redis::Error;

    fn poll_ready(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        self.apalis.poll_ready(cx, worker)
    }

    fn poll_next(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Option<Result<Self::Task, Self::Error>>> {
        loop {
            if let Some(task) = self.buffer.pop_front() {
                return Poll::Ready(Some(Ok(task)));
            }
            if self.dead {
                return Poll::Ready(None);
            }
            if self.fetching.is_none() {
                // Re-armed before the fetch is sent: whatever an earlier wake-up was for is in
                // Redis by now, so this fetch sees it.
                self.woken = Box::pin(self.wake.clone().notified_owned());
            }
            let fetching = self.fetching.get_or_insert_with(|| {
                fetch(
                    self.conn.clone(),
                    self.apalis.get_config().clone(),
                    worker.clone(),
                )
                .boxed()
            });
            match fetching.poll_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(tasks)) => {
                    self.fetching = None;
                    if tasks.is_empty() {
                        // Woken while this fetch was on its way: the jobs may have landed after
                        // it ran, so fetch again. Otherwise the next poll fetches after a
                        // heartbeat (its timer holds this task's waker) or a wake-up (polling
                        // `woken` here registers this task's waker with it).
                        if self.woken.as_mut().poll(cx).is_ready() {
                            continue;
                        }
                        return Poll::Pending;
                    }
                    self.buffer.extend(tasks);
                }
                Poll::Ready(Err(e)) => {
                    self.fetching = None;
                    self.dead = true;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }

    fn poll_close(
        &mut self,
        cx: &mut Context<'_>,
        worker: &WorkerContext,
    ) -> Poll<Result<(), Self::Error>> {
        // A fetch under way finishes first, so that what it moved into the inflight set is
        // handed back with the rest instead of waiting for the orphan recovery.
        if let Some(fetching) = self.fetching.as_mut() {
            let fetched = futures::ready!(fetching.poll_unpin(cx));
            self.fetching = None;
            if let Ok(tasks) = fetched {
                self.buffer.extend(tasks);
            }
        }
        if !self.buffer.is_empty() {
            let ids: Vec<String> = self
                .buffer
                .drain(..)
                .filter_map(|t| t.ctx().task_id().map(ToString::to_string))
                .collect();
            self.releasing = Some(
                release(
                    self.conn.clone(),
                    self.apalis.get_config().clone(),
                    worker.clone(),
                    ids,
                )
                .boxed(),
            );
        }
        if let Some(releasing) = self.releasing.as_mut() {
            let released = futures::ready!(releasing.poll_unpin(cx));
            // Done: never polled again, however often the close below is.
            self.releasing = None;
            if let Err(e) = released {
                // The jobs stay in the inflight set; the orphan recovery brings them back.
                tracing::warn!(worker = %worker.name(), error = %e, "fetched jobs not handed back on close; the orphan recovery will");
            }
        }
        self.apalis.poll_close(cx, worker)
    }
}

impl BackendConfig for QueueBackend {
    type Args = String;
    type Id = ulid::Ulid;
    type Kind = apalis_core::backend::finalize::Durable;
    type Config = apalis_redis::Config;
    type Layer = AckLayer;

    fn config(&self) -> &Self::Config {
        self.apalis.get_config()
    }

    fn middleware(&mut self, worker: &mut WorkerContext) -> Self::Layer {
        AckLayer {
            calls: self.acks.clone(),
            keys: ack_keys(self.apalis.get_config(), worker),
        }
    }
}

impl WireFormatBackend for QueueBackend {
    type Codec = Codec;
    type Compact = Vec<u8>;

    fn codec(&self) -> &Self::Codec {
        self.apalis.codec()
    }
}

/// Acknowledgements (`ack.lua`) on `conn`, several to a script call; each call takes
/// [`ack_keys`] and [`ACK_WIDTH`] arguments: task id, status, result (JSON), attempt.
pub fn ack_calls(conn: ConnectionManager) -> ScriptCalls {
    ScriptCalls::new(conn, ACK.clone(), ACK_WIDTH)
}

/// The keys of `ack.lua` for worker `worker` of the queue configured by `config`.
pub fn ack_keys(config: &apalis_redis::Config, worker: &WorkerContext) -> Arc<[String]> {
    Arc::from(vec![
        config.inflight_set_for(worker),
        config.dead_jobs_set(),
        config.scheduled_jobs_set(),
        config.job_data_hash(),
        config.job_meta_hash(),
    ])
}

/// One fetch of up to the queue's batch size for worker `worker`.
pub async fn fetch(
    mut conn: ConnectionManager,
    config: apalis_redis::Config,
    worker: WorkerContext,
) -> Result<Vec<RedisTask>, apalis_redis::Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (ids, data): (Vec<String>, Vec<Option<Vec<u8>>>) = FETCH
        .key(config.workers_set())
        .key(config.active_jobs_list())
        .key(config.inflight_set_for(&worker))
        .key(config.job_data_hash())
        .key(config.signal_list())
        .key(config.scheduled_jobs_set())
        .arg(now)
        .arg(config.batch_size)
        .arg(worker.name())
        .invoke_async(&mut conn)
        .await?;
    let mut tasks = Vec::with_capacity(ids.len());
    for (id, data) in ids.into_iter().zip(data) {
        let Some(data) = data else {
            tracing::warn!(queue = %config.active_jobs_list(), task_id = %id, "fetched a job whose data is gone; dropped");
            continue;
        };
        let task_id = TaskId::from_str(&id).map_err(apalis_redis::Error::TaskIdError)?;
        let task = CompactTask {
            data,
            attempts: 0,
            max_attempts: 1,
            status: Status::Pending,
            task_id,
            idempotency_key: None,
            meta: HashMap::new(),
            lock_by: None,
            lock_at: None,
        };
        tasks.push(task.into_full_compact());
    }
    Ok(tasks)
}

/// Hands jobs `ids`, fetched by worker `worker` and never run, back to the front of the queue.
pub async fn release(
    mut conn: ConnectionManager,
    config: apalis_redis::Config,
    worker: WorkerContext,
    ids: Vec<String>,
) -> Result<(), apalis_redis::Error> {
    if ids.is_empty() {
        return Ok(());
    }
    redis::pipe()
        .atomic()
        .cmd("SREM")
        .arg(config.inflight_set_for(&worker))
        .arg(&ids)
        .ignore()
        .cmd("LPUSH")
        .arg(config.active_jobs_list())
        .arg(ids.iter().rev().collect::<Vec<_>>())
        .ignore()
        .exec_async(&mut conn)
        .await?;
    Ok(())
}

/// The waits before each background retry of an acknowledgement that failed.
const ACK_RETRIES: [Duration; 3] = [
    Duration::from_secs(1),
    Duration::from_secs(4),
    Duration::from_secs(16),
];

/// One job's acknowledgement (`args`: [`ACK_WIDTH`] values) through `calls`.
async fn acknowledge(
    calls: &ScriptCalls,
    keys: &Arc<[String]>,
    args: &[String],
) -> Result<(), super::batch::BatchError> {
    if let redis::Value::Int(0) = calls.call(keys.clone(), args.to_vec()).await? {
        tracing::debug!(task_id = %args[0], "job finished after a peer took it back as an orphan; it runs again there");
    }
    Ok(())
}

/// The middleware that acknowledges each job of one worker when its service returns (the place
/// apalis-redis's own acknowledgement layer takes).
#[derive(Clone)]
pub struct AckLayer {
    /// Where the acknowledgements go.
    calls: ScriptCalls,
    /// `ack.lua`'s keys for this worker.
    keys: Arc<[String]>,
}

impl<S> Layer<S> for AckLayer {
    type Service = Ack<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Ack {
            inner,
            calls: self.calls.clone(),
            keys: self.keys.clone(),
        }
    }
}

/// [`AckLayer`]'s service.
#[derive(Clone)]
pub struct Ack<S> {
    inner: S,
    calls: ScriptCalls,
    keys: Arc<[String]>,
}

impl<S, Args> Service<Task<Args>> for Ack<S>
where
    S: Service<Task<Args>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxDynError>,
    S::Response: Send,
    Args: Send + 'static,
{
    type Response = S::Response;
    type Error = BoxDynError;
    type Future = BoxFuture<'static, Result<S::Response, BoxDynError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, task: Task<Args>) -> Self::Future {
        let ctx = task.ctx().clone();
        let run = self.inner.call(task);
        let calls = self.calls.clone();
        let keys = self.keys.clone();
        async move {
            let result = run.await.map_err(Into::into);
            let Some(id) = ctx.task_id().map(ToString::to_string) else {
                return result;
            };
            // The result as apalis-redis stores it in the meta hash (read for failed and killed
            // jobs only: `dead list`, the console).
            let stored = match &result {
                Ok(_) => serde_json::json!({ "Ok": null }),
                Err(e) => serde_json::json!({ "Err": e.to_string() }),
            };
            let args = vec![
                id.clone(),
                ctx.status().to_string(),
                stored.to_string(),
                ctx.attempt().to_string(),
            ];
            if let Err(e) = acknowledge(&calls, &keys, &args).await {
                // Retried in the background: a job left in this worker's inflight set would stay
                // there (with its data) for as long as this worker lives. If Redis stays away,
                // the worker is built again under a new name, and the orphan recovery of its
                // old one runs the job again (for a poll: one more poll; its successor is
                // written already).
                tracing::warn!(task_id = %id, error = %e, "job not acknowledged; retrying in the background");
                tokio::spawn(async move {
                    for wait in ACK_RETRIES {
                        tokio::time::sleep(wait).await;
                        match acknowledge(&calls, &keys, &args).await {
                            Ok(()) => return,
                            Err(e) => tracing::debug!(task_id = %id, error = %e, "acknowledgement retry failed"),
                        }
                    }
                    tracing::warn!(task_id = %id, "job never acknowledged; the orphan recovery runs it again if this worker is rebuilt");
                });
            }
            result
        }
        .boxed()
    }
}
