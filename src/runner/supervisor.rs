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
//! outage ended less than [`RECOVERY_WINDOW`] ago, or its own error is a connection-level Redis
//! error or lost state) is marked `Restarting` (`/healthz` stays 200, `cardworker_worker_up` 0)
//! and started again from its factory, under a fresh name (apalis refuses a name it saw within a
//! heartbeat). Its in-flight jobs are not lost with the stream: the job service runs each job in a
//! task of its own (`Shutdown::spawn_job`), which finishes on its own.
//!
//! [`Grace`] decides when: a worker whose registration (or in-flight set) was lost while Redis
//! answers is started again at once; one stopped by an outage is started again once Redis answers
//! and after a back-off ([`restart_backoff`]). The grace, `worker.redis_outage_grace_secs`, is per
//! outage: its clock starts when Redis stops answering and is cleared as soon as it answers again,
//! so short outages in a row never add up to an exit. Past the grace (one outage still going on,
//! or a worker still failing while Redis answers) the process stops as on any fatal error: drain,
//! shutdown hooks, exit non-zero. A worker that ends for a reason that is not Redis trouble (a
//! corrupt queue, say) stops the process at once.

use std::future::Future;
use std::time::{Duration, Instant};

use apalis::prelude::WorkerError;
use futures::future::BoxFuture;
use tokio::task::JoinSet;

use crate::backoff::{Backoff, Jitter};
use crate::shutdown::Shutdown;
use crate::telemetry::{Health, RedisSnapshot, RedisStatus, WorkerState};

/// A worker that ends this soon after an outage ended is still counted as its casualty (its
/// heartbeat finds its registration gone a heartbeat or two after Redis returned). A quiet
/// queue's worker may find it later (its beat is 30 s): a lost registration counts as Redis
/// trouble whenever it comes ([`is_redis_trouble`]).
pub const RECOVERY_WINDOW: Duration = Duration::from_secs(30);
/// A restarted worker that has run this long is healthy again: its next failure starts a new
/// clock (fresh back-off, fresh grace) even if the Redis verdict has not changed since.
pub const STABLE_AFTER: Duration = Duration::from_secs(30);
/// How often the supervisor checks how long an outage has lasted.
const OUTAGE_CHECK: Duration = Duration::from_millis(250);

/// The delay before restart number `n` (1-based) of one worker: 0.5 s doubling to 10 s, ±20 %.
pub fn restart_backoff(n: u32) -> Duration {
    Backoff::new(
        Duration::from_millis(500),
        Duration::from_secs(10),
        Jitter::Proportional(0.2),
    )
    .delay(n)
}

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

/// How a worker's run ended, as the grace reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Its run returned, or failed with an error that is not Redis trouble.
    Other,
    /// A connection-level Redis error: refused, dropped, timed out, I/O.
    Connection,
    /// Redis answered, but without state the worker had there: its registration ("worker not
    /// registered") or its in-flight set, lost with Redis's data or dropped by a peer.
    LostState,
}

impl Ending {
    /// How `result` ended.
    pub fn of(result: &Result<(), WorkerError>) -> Self {
        match result {
            Err(e) if is_lost_state(e) => Self::LostState,
            Err(e) if is_redis_trouble(e) => Self::Connection,
            _ => Self::Other,
        }
    }
}

/// What the supervisor does after one failure of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Start it again at once.
    RestartNow,
    /// Start it again after this back-off, once Redis answers.
    RestartAfter(Duration),
    /// Stop the process: the failure is not Redis trouble (`false`), or Redis trouble past the
    /// grace (`true`).
    Stop { past_grace: bool },
}

/// The grace clock of one worker: decides, failure by failure, whether to restart it.
///
/// **One outage** is one generation of the probe's verdict ([`RedisSnapshot::generation`]): from
/// the first probe Redis does not answer to the first one it answers again. Its clock starts when
/// Redis stopped answering (the outage's start, not the worker's first failure in it), and it is
/// over as soon as Redis answers: a worker that fails after that starts a new clock with a fresh
/// back-off, however many outages came before. A worker that fails while the probe still gets
/// answers (its connection broke first, or it keeps failing while Redis answers) clocks from that
/// failure, for as long as the verdict does not change; so a worker that never gets going again
/// with Redis answering is still stopped once past the grace.
///
/// State lost with Redis's data (a registration or an in-flight set gone after an empty restart,
/// or dropped by a peer's orphan recovery) is not an outage: with Redis answering, the worker is
/// started again at once under a fresh name, which registers it again, and no clock starts. Once
/// per generation: a registration that vanishes again with nothing changed in between is backed
/// off and clocked like any other failure, so it can never spin.
#[derive(Debug, Default)]
pub struct Grace {
    /// The clock of the failures of the current generation, if this worker failed in it.
    clock: Option<Clock>,
    /// Restarts since the clock started.
    restarts: u32,
    /// The generation in which this worker last registered again at once.
    reregistered_in: Option<u64>,
}

/// When a worker's failures in one generation of the Redis verdict began to count.
#[derive(Debug, Clone, Copy)]
struct Clock {
    since: Instant,
    generation: u64,
}

impl Grace {
    /// One failure at `now` of a run that lasted `ran_for` and ended as `ending`, while Redis
    /// stood as `redis`, under `worker.redis_outage_grace_secs` = `grace`.
    pub fn on_failure(
        &mut self,
        now: Instant,
        ran_for: Duration,
        ending: Ending,
        redis: &RedisSnapshot,
        grace: Duration,
    ) -> Verdict {
        let redis_trouble = redis.troubled_within(now, RECOVERY_WINDOW) || ending != Ending::Other;
        if !redis_trouble || grace.is_zero() {
            return Verdict::Stop { past_grace: false };
        }
        if ending == Ending::LostState
            && redis.is_up()
            && self.reregistered_in != Some(redis.generation)
        {
            self.reregistered_in = Some(redis.generation);
            return Verdict::RestartNow;
        }
        let clock = match self.clock {
            Some(clock) if clock.generation == redis.generation && ran_for < STABLE_AFTER => clock,
            _ => {
                self.restarts = 0;
                let clock = Clock {
                    since: redis.down_since.unwrap_or(now),
                    generation: redis.generation,
                };
                self.clock = Some(clock);
                clock
            }
        };
        if now.saturating_duration_since(clock.since) > grace {
            return Verdict::Stop { past_grace: true };
        }
        self.restarts += 1;
        Verdict::RestartAfter(restart_backoff(self.restarts))
    }

    /// Restarts since the current clock started.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }
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

/// How connection-level trouble reads once apalis has turned an error into text.
const CONNECTION_TEXTS: &[&str] = &[
    "broken pipe",
    "connection refused",
    "connection reset",
    "connection closed",
    "connection dropped",
    "timed out",
    "os error",
    "io error",
    "ioerror",
];

/// Whether a worker's error says that Redis answered without state the worker had there: its
/// registration, or the in-flight set its acknowledgement expected.
pub fn is_lost_state(error: &WorkerError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = match error {
        WorkerError::BackendError(inner) => Some(inner.as_ref()),
        _ => return false,
    };
    while let Some(e) = source {
        let text = e.to_string();
        if LOST_STATE_TEXTS.iter().any(|t| text.contains(t)) {
            return true;
        }
        source = e.source();
    }
    false
}

/// How a lost registration or in-flight set reads (apalis-redis's scripts and `fetch.lua`).
const LOST_STATE_TEXTS: &[&str] = &[
    "worker not registered",
    "task not executed by worker",
    "WorkerOutOfSync",
];

/// Whether a worker's error is Redis trouble rather than a fault of the worker or its data: a
/// connection-level Redis error (refused, dropped, timed out, I/O), or apalis-redis finding the
/// worker's registration gone (Redis lost its data, or a peer's orphan recovery dropped it after
/// an outage).
pub fn is_redis_trouble(error: &WorkerError) -> bool {
    let WorkerError::BackendError(inner) = error else {
        return matches!(error, WorkerError::IoError(_));
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
    while let Some(e) = source {
        let redis = e.downcast_ref::<redis::RedisError>().or_else(|| {
            match e.downcast_ref::<apalis_redis::Error>() {
                Some(apalis_redis::Error::Database(redis)) => Some(redis),
                _ => None,
            }
        });
        if let Some(redis) = redis {
            if redis.is_io_error()
                || redis.is_connection_dropped()
                || redis.is_connection_refusal()
                || redis.is_timeout()
                || redis.is_unrecoverable_error()
            {
                return true;
            }
        }
        if e.downcast_ref::<std::io::Error>().is_some() {
            return true;
        }
        // apalis flattens some backend errors into text (`PollNextError: broken pipe`).
        let text = e.to_string();
        let lower = text.to_lowercase();
        // Redis restarting with its data answers `LOADING` (the redis crate names it
        // `BusyLoading`) until the dataset is in memory: an outage like any other.
        if CONNECTION_TEXTS.iter().any(|t| lower.contains(t))
            || LOST_STATE_TEXTS.iter().any(|t| text.contains(t))
            || text.contains("LOADING")
            || lower.contains("busyloading")
            || lower.contains("loading the dataset")
        {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(60);

    /// The probe's verdict along a test's own timeline, kept as `RedisStatus` keeps it (its
    /// generation moves on at each outage's start and end and at a data loss; the test
    /// `the_redis_generation_moves_on_when_an_outage_begins_or_ends_and_when_data_is_lost`
    /// checks that on the real thing).
    struct Timeline {
        start: Instant,
        now: Instant,
        redis: RedisSnapshot,
    }

    impl Timeline {
        fn new() -> Self {
            let start = Instant::now();
            Self {
                start,
                now: start,
                redis: RedisSnapshot {
                    down_since: None,
                    recovered_at: None,
                    generation: 0,
                },
            }
        }

        /// Moves the clock to `ms` after the start.
        fn at(&mut self, ms: u64) -> Instant {
            self.now = self.start + Duration::from_millis(ms);
            self.now
        }

        fn down(&mut self) {
            self.redis.down_since = Some(self.now);
            self.redis.generation += 1;
        }

        fn up(&mut self, empty: bool) {
            self.redis.down_since = None;
            self.redis.recovered_at = Some(self.now);
            self.redis.generation += 1;
            if empty {
                self.redis.generation += 1;
            }
        }
    }

    /// A worker under test: its grace and when its current run started.
    struct Subject {
        grace: Grace,
        started_at: Instant,
    }

    impl Subject {
        fn fails(&mut self, t: &Timeline, ending: Ending) -> Verdict {
            self.grace.on_failure(
                t.now,
                t.now.saturating_duration_since(self.started_at),
                ending,
                &t.redis,
                GRACE,
            )
        }

        /// Restarted at the time `t` is at.
        fn restarted(&mut self, t: &Timeline) {
            self.started_at = t.now;
        }
    }

    #[test]
    fn six_short_outages_in_two_minutes_each_get_their_own_grace_and_a_lost_registration_re_registers_at_once(
    ) {
        // The combined-fault run's six outages (start, length in ms as logged; `true`: Redis
        // restarted empty), each shorter than the grace, 119 s from the first to the last.
        let outages = [
            (0, 10_752, false),
            (22_000, 2_858, true),
            (40_000, 2_715, true),
            (58_000, 11_005, false),
            (82_000, 10_073, false),
            (109_000, 2_719, true),
        ];
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        let mut delays = Vec::new();
        for (i, &(start, length, empty)) in outages.iter().enumerate() {
            let last = i == outages.len() - 1;
            t.at(start);
            t.down();
            if !last {
                // The worker's fetch fails in the outage (refused, or timed out in a pause).
                t.at(start + length / 2);
                match worker.fails(&t, Ending::Connection) {
                    Verdict::RestartAfter(delay) => delays.push(delay),
                    other => panic!(
                        "outage {} ({length} ms, within the grace): the worker is restarted, not {other:?}",
                        i + 1
                    ),
                }
            }
            t.at(start + length);
            t.up(empty);
            t.at(start + length + 500);
            worker.restarted(&t);
        }
        // The last outage's worker was rebuilt before it began; 91 ms after Redis answered
        // (empty), its fetch finds its registration gone.
        let (start, length, _) = outages[5];
        worker.started_at = t.start + Duration::from_millis(start - 1_500);
        t.at(start + length + 91);
        assert_eq!(
            worker.fails(&t, Ending::LostState),
            Verdict::RestartNow,
            "a lost registration with Redis answering registers again at once, whatever earlier outages did"
        );
        for (i, delay) in delays.iter().enumerate() {
            assert!(
                *delay <= Duration::from_millis(600),
                "outage {}: a new outage starts its back-off afresh: {delay:?}",
                i + 1
            );
        }
    }

    #[test]
    fn the_grace_clock_of_an_outage_starts_when_redis_stops_answering_not_when_a_worker_fails() {
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        t.at(1_000);
        t.down();
        // The worker's first failure comes late in the outage (a quiet queue's beat), past the
        // grace counted from the outage's start.
        t.at(1_000 + GRACE.as_millis() as u64 + 1);
        assert_eq!(
            worker.fails(&t, Ending::Connection),
            Verdict::Stop { past_grace: true }
        );
    }

    #[test]
    fn a_worker_failing_again_and_again_while_redis_answers_is_stopped_once_past_the_grace() {
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        let mut ms = 5_000;
        t.at(ms);
        assert_eq!(worker.fails(&t, Ending::LostState), Verdict::RestartNow);
        worker.restarted(&t);
        // A second lost registration with no outage or data loss since is not re-registered at
        // once again: it is backed off and clocked like a connection failure.
        ms += 100;
        t.at(ms);
        assert!(matches!(
            worker.fails(&t, Ending::LostState),
            Verdict::RestartAfter(_)
        ));
        loop {
            ms += 5_000;
            t.at(ms);
            worker.restarted(&t);
            ms += 100;
            t.at(ms);
            match worker.fails(&t, Ending::Connection) {
                Verdict::RestartAfter(_) => assert!(ms <= 5_100 + GRACE.as_millis() as u64),
                Verdict::Stop { past_grace: true } => {
                    assert!(ms > 5_100 + GRACE.as_millis() as u64);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_worker_ending_for_another_reason_stops_the_process_at_once() {
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        t.at(120_000);
        assert_eq!(
            worker.fails(&t, Ending::Other),
            Verdict::Stop { past_grace: false }
        );
    }

    #[test]
    fn restarts_back_off_from_half_a_second_to_ten_seconds() {
        for _ in 0..100 {
            let first = restart_backoff(1);
            assert!(first >= Duration::from_millis(400) && first <= Duration::from_millis(600));
            assert!(restart_backoff(30) <= Duration::from_secs(10));
        }
    }

    #[test]
    fn a_refused_connection_and_a_lost_registration_are_redis_trouble_a_bad_queue_is_not() {
        let refused = redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "Connection refused (os error 111)",
        ));
        let e = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(refused)));
        assert!(is_redis_trouble(&e));
        let lost = redis::RedisError::from((
            redis::ErrorKind::Extension,
            "script error",
            "Heartbeat failed: worker not registered".to_owned(),
        ));
        let e = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(lost)));
        assert!(is_redis_trouble(&e));
        let corrupt = WorkerError::BackendError(Box::new(apalis_redis::Error::Json(
            serde_json::from_str::<String>("{").expect_err("bad json"),
        )));
        assert!(!is_redis_trouble(&corrupt));
        let flattened = WorkerError::BackendError("PollNextError: broken pipe".into());
        assert!(is_redis_trouble(&flattened));
    }

    #[test]
    fn redis_loading_its_dataset_after_a_restart_is_redis_trouble() {
        // As a worker ended while Redis restarted with its data (`make chaos`, seed 105): the
        // process exited 1 with "worker stopped unexpectedly" instead of riding it out.
        let flattened = WorkerError::BackendError(
            "PollNextError: BusyLoading: Redis is loading the dataset in memory".into(),
        );
        assert!(is_redis_trouble(&flattened));
        let typed = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::BusyLoading),
            "Redis is loading the dataset in memory",
        ));
        let e = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(typed)));
        assert!(is_redis_trouble(&e));
    }

    #[test]
    fn a_lost_registration_reads_as_lost_state_a_refused_connection_as_connection_trouble() {
        // As the supervisor logged it when an empty restart had dropped the worker.
        let lost = WorkerError::BackendError(
            "PollNextError: \"Cant\": fetch next: worker not registered".into(),
        );
        assert_eq!(Ending::of(&Err(lost)), Ending::LostState);
        let refused = WorkerError::BackendError(Box::new(apalis_redis::Error::Database(
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "Connection refused (os error 111)",
            )),
        )));
        assert_eq!(Ending::of(&Err(refused)), Ending::Connection);
        let corrupt = WorkerError::BackendError(Box::new(apalis_redis::Error::Json(
            serde_json::from_str::<String>("{").expect_err("bad json"),
        )));
        assert_eq!(Ending::of(&Err(corrupt)), Ending::Other);
        assert_eq!(Ending::of(&Ok(())), Ending::Other);
    }
}
