//! [`Supervisor`]: runs the workers of one process, restarts them in process through a Redis
//! outage, and fails the process when one stops for any other reason or the outage lasts too long.
//!
//! Why a supervisor of our own instead of apalis's `Monitor`: with a shutdown timeout the Monitor
//! discards worker errors, and a failed worker stays dead while the others run on. An operator
//! needs the opposite: if one worker stops unexpectedly, `/healthz` fails at once and the process
//! exits non-zero so that the orchestrator restarts it. Each worker still runs through apalis's
//! own `Worker::run_until`, so fetching stops and in-flight jobs drain on shutdown.
//!
//! # Riding out Redis trouble
//! An apalis-redis worker ends its stream at the first failed fetch, heartbeat or acknowledgement,
//! and after Redis comes back empty its next heartbeat or fetch fails ("worker not registered").
//! Restarting the whole process for that would re-run every in-flight job of every pod on each
//! Sentinel failover. So a worker that ends while Redis is in trouble (the probe says down, an
//! outage ended less than [`RECOVERY_WINDOW`](super::grace::RECOVERY_WINDOW) ago, or its own
//! error is a connection-level Redis error or lost state) is marked `Restarting` (`/healthz`
//! stays 200, `cardworker_worker_up` 0) and started again from its factory, under a fresh name
//! (apalis refuses a name it saw within a heartbeat). Its in-flight jobs are not lost with the stream: the job service runs each job in a
//! task of its own (`Shutdown::spawn_job`), which finishes on its own.
//!
//! [`Grace`] ([`super::grace`]) decides when, on how the run ended ([`Ending`], read from its
//! error by [`super::ending`]): a worker whose registration (or in-flight set) was lost while
//! Redis answers is started again at once; one stopped by an outage is started again once Redis
//! answers and after a back-off ([`super::grace::restart_backoff`]). The grace,
//! `worker.redis_outage_grace_secs`, is per outage: its clock starts when Redis stops answering
//! and is cleared as soon as it answers again, so short outages in a row never add up to an exit.
//! Past the grace (one outage still going on, or a worker still failing while Redis answers) the
//! process stops as on any fatal error: drain, shutdown hooks, exit non-zero. A worker that ends
//! for a reason that is not Redis trouble (a corrupt queue, say) stops the process at once.

use std::future::Future;
use std::time::{Duration, Instant};

use apalis::prelude::WorkerError;
use futures::future::BoxFuture;
use tokio::task::JoinSet;

use super::ending::Ending;
use super::grace::{Grace, Verdict};
use crate::shutdown::Shutdown;
use crate::telemetry::{Health, RedisStatus, WorkerState};

/// How often the supervisor checks how long an outage has lasted.
const OUTAGE_CHECK: Duration = Duration::from_millis(250);

/// Builds one incarnation of a worker: its (fresh, unique) apalis name and its run future.
pub type WorkerFactory =
    Box<dyn FnMut() -> (String, BoxFuture<'static, Result<(), WorkerError>>) + Send + Sync>;

/// One supervised worker: its kind (the `/healthz` and metric name) and how to start it again.
struct Slot {
    kind: &'static str,
    factory: WorkerFactory,
    /// When its current run started.
    started_at: Instant,
    /// Its grace clock and back-off.
    grace: Grace,
}

/// How one incarnation ended: its slot, its apalis name and its result.
type Ended = (usize, String, Result<(), WorkerError>);

/// How the workers of one process are started, restarted and stopped.
pub struct Supervisor {
    /// Every worker, restarted through its factory.
    slots: Vec<Slot>,
    /// Running incarnations.
    workers: JoinSet<Ended>,
    /// Restarts waiting for Redis and their back-off: each yields its slot.
    restarts: JoinSet<usize>,
    /// The process's shutdown signal: its drain phase stops every worker.
    shutdown: Shutdown,
    /// Liveness, as `/healthz` reports it.
    health: Health,
    /// The Redis probe's verdict.
    redis: RedisStatus,
    /// `worker.redis_outage_grace_secs`.
    outage_grace: Duration,
}

impl Supervisor {
    /// A supervisor reporting into `health`, stopping its workers when `shutdown` drains, riding
    /// out Redis outages of up to `outage_grace` as `redis` reports them.
    pub fn new(
        health: Health,
        shutdown: Shutdown,
        redis: RedisStatus,
        outage_grace: Duration,
    ) -> Self {
        Self {
            slots: Vec::new(),
            workers: JoinSet::new(),
            restarts: JoinSet::new(),
            shutdown,
            health,
            redis,
            outage_grace,
        }
    }

    /// The process's shutdown signal (what a worker's `run_until` waits for).
    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Starts one worker of `kind`, and keeps `factory` to start it again after a Redis outage.
    pub fn spawn(&mut self, kind: &'static str, factory: WorkerFactory) {
        self.slots.push(Slot {
            kind,
            factory,
            started_at: Instant::now(),
            grace: Grace::default(),
        });
        self.start(self.slots.len() - 1);
    }

    fn start(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        let (name, run) = (slot.factory)();
        slot.started_at = Instant::now();
        self.health
            .set_state(slot.kind, slot.kind, WorkerState::Running);
        tracing::info!(worker = %name, kind = slot.kind, restarts = slot.grace.restarts(), "worker started");
        self.workers
            .spawn(async move { (index, name.clone(), run.await) });
    }

    /// Waits until `shutdown` resolves, or a worker stops for good, or a Redis outage outlasts
    /// the grace. Returns why the process must fail, if it must, after stopping every worker
    /// within `grace`.
    pub async fn supervise(
        mut self,
        shutdown: impl Future<Output = ()>,
        grace: Duration,
    ) -> Option<String> {
        tokio::pin!(shutdown);
        let mut check = tokio::time::interval(OUTAGE_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let failed = loop {
            tokio::select! {
                () = &mut shutdown => {
                    tracing::info!("shutdown requested; draining in-flight jobs");
                    break None;
                }
                ended = self.workers.join_next() => {
                    if let Some(why) = self.on_ended(ended) {
                        break Some(why);
                    }
                }
                Some(restart) = self.restarts.join_next() => {
                    if let Ok(index) = restart {
                        self.start(index);
                    }
                }
                _ = check.tick() => {
                    if let Some(down) = self.redis.down_for() {
                        if down > self.outage_grace {
                            break Some(format!(
                                "Redis unreachable for {} s, longer than worker.redis_outage_grace_secs = {}",
                                down.as_secs(),
                                self.outage_grace.as_secs()
                            ));
                        }
                    }
                }
            }
        };
        if let Some(why) = &failed {
            tracing::error!(reason = %why, "stopping the process");
        }
        self.restarts.abort_all();
        self.shutdown.begin();
        let drain = async {
            while let Some(ended) = self.workers.join_next().await {
                if let Ok((index, name, result)) = &ended {
                    let kind = self.slots[*index].kind;
                    self.health.set_state(kind, kind, WorkerState::Stopped);
                    if let Err(e) = result {
                        tracing::warn!(worker = %name, error = %e, "worker ended with an error during shutdown");
                    }
                }
            }
        };
        if tokio::time::timeout(grace, drain).await.is_err() {
            tracing::warn!(grace_secs = grace.as_secs(), "shutdown grace period over; abandoning in-flight jobs (apalis re-enqueues them as orphans)");
            self.workers.abort_all();
        }
        failed
    }

    /// One incarnation ended before the drain: schedules its restart, or says why the process must
    /// stop.
    fn on_ended(&mut self, ended: Option<Result<Ended, tokio::task::JoinError>>) -> Option<String> {
        let (index, name, result) = match ended {
            Some(Ok(ended)) => ended,
            Some(Err(e)) => return Some(format!("worker task failed: {e}")),
            None => return Some("no workers registered".to_owned()),
        };
        let what = match &result {
            Ok(()) => format!("{name} (returned)"),
            Err(e) => format!("{name}: {e}"),
        };
        let slot = &mut self.slots[index];
        let verdict = slot.grace.on_failure(
            Instant::now(),
            slot.started_at.elapsed(),
            Ending::of(&result),
            &self.redis.snapshot(),
            self.outage_grace,
        );
        let delay = match verdict {
            Verdict::Stop { past_grace: false } => {
                self.health
                    .set_state(slot.kind, slot.kind, WorkerState::Stopped);
                tracing::error!(worker = %what, "a worker stopped unexpectedly; stopping the process");
                return Some(what);
            }
            Verdict::Stop { past_grace: true } => {
                self.health
                    .set_state(slot.kind, slot.kind, WorkerState::Stopped);
                return Some(format!(
                    "{what}; still failing after worker.redis_outage_grace_secs = {} s",
                    self.outage_grace.as_secs()
                ));
            }
            Verdict::RestartNow => {
                tracing::warn!(worker = %what, "Redis answers without this worker's state (its data was lost, or a peer dropped the worker); registering it again now");
                self.start(index);
                return None;
            }
            Verdict::RestartAfter(delay) => delay,
        };
        self.health
            .set_state(slot.kind, slot.kind, WorkerState::Restarting);
        tracing::warn!(worker = %what, restart = slot.grace.restarts(), delay_ms = delay.as_millis() as u64, "worker stopped by Redis trouble; restarting it once Redis answers");
        let redis = self.redis.clone();
        self.restarts.spawn(async move {
            tokio::time::sleep(delay).await;
            redis.wait_up().await;
            index
        });
        None
    }
}
