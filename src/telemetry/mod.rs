//! Logs, metrics and the HTTP endpoint.
//!
//! # Layout
//! - [`log`]: the log subscriber ([`init_logging`]): every line names the process it comes
//!   from ([`Process`]), and [`rfc3339`] renders unix times for log fields.
//! - [`metrics`]: every metric name (an interface; see spec section 4).
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`fleet`]: the background refresh of the fleet-wide gauges, so that `/metrics` never waits
//!   on Redis or PostgreSQL, and their age.
//! - [`Health`]: which workers of this process run; `/healthz` answers from it.
//! - [`RedisStatus`]: whether Redis answers (the probe's verdict, `cardworker_redis_up`).

pub mod fleet;
pub mod http;
pub mod log;
pub mod metrics;
pub mod pan;

pub use log::{init_logging, rfc3339, rfc3339_opt, Process};

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::Context as _;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::config::Task;

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder once per process and returns its handle.
pub fn metrics_handle() -> anyhow::Result<PrometheusHandle> {
    if let Some(handle) = RECORDER.get() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_duration_seconds".into()),
            metrics::DURATION_BUCKETS,
        )
        .context("configuring histogram buckets")?
        .build_recorder();
    let handle = recorder.handle();
    match ::metrics::set_global_recorder(recorder) {
        Ok(()) => {
            let _ = RECORDER.set(handle.clone());
            Ok(handle)
        }
        // Another thread won the race: use its handle.
        Err(_) => RECORDER
            .get()
            .cloned()
            .context("a metrics recorder was installed outside cardworker"),
    }
}

/// Where one worker of this process stands, as `/healthz` and `cardworker_worker_up` see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    /// Fetching and running jobs.
    Running,
    /// Stopped by a Redis outage and restarted by the supervisor once Redis answers: not
    /// fetching (`cardworker_worker_up` 0), but the process is healthy (`/healthz` 200) while the
    /// outage is within `worker.redis_outage_grace_secs`.
    Restarting,
    /// Stopped for good: the process is unhealthy and about to exit non-zero.
    Stopped,
}

/// Which workers of this process are running. `/healthz` fails as soon as one of them stopped
/// for good, and the process then exits non-zero so that the orchestrator restarts it; a worker
/// the supervisor is restarting after a Redis outage keeps the process healthy.
#[derive(Clone, Default)]
pub struct Health {
    /// Worker name -> state.
    workers: Arc<Mutex<BTreeMap<String, WorkerState>>>,
}

impl Health {
    /// Marks a worker as running (or stopped) and mirrors it in `cardworker_worker_up{worker=kind}`.
    pub fn set(&self, name: &str, kind: &str, running: bool) {
        let state = if running {
            WorkerState::Running
        } else {
            WorkerState::Stopped
        };
        self.set_state(name, kind, state);
    }

    /// Records a worker's state and mirrors it in `cardworker_worker_up{worker=kind}` (1 only
    /// while it runs).
    pub fn set_state(&self, name: &str, kind: &str, state: WorkerState) {
        if let Ok(mut workers) = self.workers.lock() {
            workers.insert(name.to_owned(), state);
        }
        let up = if state == WorkerState::Running {
            1.0
        } else {
            0.0
        };
        ::metrics::gauge!(metrics::WORKER_UP, "worker" => kind.to_owned()).set(up);
    }

    /// The workers that stopped for good.
    pub fn stopped(&self) -> Vec<String> {
        self.workers
            .lock()
            .map(|w| {
                w.iter()
                    .filter(|(_, state)| **state == WorkerState::Stopped)
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_else(|_| vec!["<health state poisoned>".into()])
    }

    /// Whether at least one worker is registered and none stopped for good.
    pub fn healthy(&self) -> bool {
        self.workers
            .lock()
            .map(|w| !w.is_empty() && w.values().all(|s| *s != WorkerState::Stopped))
            .unwrap_or(false)
    }
}

/// What this process knows about Redis: up, or down since when. Written by the Redis probe
/// (`runner::redis_watch`), read by the supervisor (restart or give up), the feeder (quiet while
/// down) and mirrored in `cardworker_redis_up`. It holds no connection: it is the shared verdict,
/// so that every part of the process rides out one outage the same way.
#[derive(Clone)]
pub struct RedisStatus {
    /// `true` while Redis answers; watchers wake on every change.
    up: Arc<tokio::sync::watch::Sender<bool>>,
    /// When the current outage began and when the last one ended.
    times: Arc<Mutex<OutageTimes>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct OutageTimes {
    down_since: Option<std::time::Instant>,
    recovered_at: Option<std::time::Instant>,
    /// Bumped when an outage begins, when it ends, and when Redis is found to have lost its data.
    generation: u64,
}

/// The probe's verdict at one moment, as the supervisor's grace reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisSnapshot {
    /// When the outage going on began (`None` while Redis answers).
    pub down_since: Option<std::time::Instant>,
    /// When the last outage ended, or Redis was last found to have lost its data.
    pub recovered_at: Option<std::time::Instant>,
    /// Changes when an outage begins, when it ends, and when Redis is found to have lost its
    /// data: two moments with the same generation lie in the same outage, or in the same stretch
    /// of Redis answering with its data.
    pub generation: u64,
}

impl RedisSnapshot {
    /// Whether Redis answered at the last probe.
    pub fn is_up(&self) -> bool {
        self.down_since.is_none()
    }

    /// Whether, at `now`, an outage is going on or ended less than `window` ago.
    pub fn troubled_within(&self, now: std::time::Instant, window: std::time::Duration) -> bool {
        !self.is_up()
            || self
                .recovered_at
                .is_some_and(|at| now.saturating_duration_since(at) < window)
    }
}

impl Default for RedisStatus {
    fn default() -> Self {
        let (up, _) = tokio::sync::watch::channel(true);
        Self {
            up: Arc::new(up),
            times: Arc::default(),
        }
    }
}

impl RedisStatus {
    /// Redis answered: ends an outage if one was going on. Returns whether one ended.
    pub fn mark_up(&self) -> bool {
        ::metrics::gauge!(metrics::REDIS_UP).set(1.0);
        let ended = self.up.send_if_modified(|up| !std::mem::replace(up, true));
        if ended {
            if let Ok(mut t) = self.times.lock() {
                let lasted = t.down_since.take().map(|s| s.elapsed());
                t.recovered_at = Some(std::time::Instant::now());
                t.generation += 1;
                tracing::warn!(
                    outage_ms = lasted.map_or(0, |d| d.as_millis() as u64),
                    "Redis answers again; workers resume"
                );
            }
        }
        ended
    }

    /// Redis did not answer: begins an outage unless one is going on. Returns whether one began.
    pub fn mark_down(&self, why: &str) -> bool {
        ::metrics::gauge!(metrics::REDIS_UP).set(0.0);
        let began = self.up.send_if_modified(|up| std::mem::replace(up, false));
        if began {
            if let Ok(mut t) = self.times.lock() {
                t.down_since = Some(std::time::Instant::now());
                t.generation += 1;
            }
            tracing::error!(error = %why, "Redis does not answer; riding out the outage");
        }
        began
    }

    /// Redis answered but had lost its data (the probe found its epoch marker gone): counted like
    /// the end of an outage, since workers then find their registrations gone.
    pub fn mark_data_lost(&self) {
        if let Ok(mut t) = self.times.lock() {
            t.recovered_at = Some(std::time::Instant::now());
            t.generation += 1;
        }
    }

    /// Whether Redis answered at the last probe.
    pub fn is_up(&self) -> bool {
        *self.up.borrow()
    }

    /// How long the current outage has lasted (`None` while Redis is up).
    pub fn down_for(&self) -> Option<std::time::Duration> {
        self.times
            .lock()
            .ok()
            .and_then(|t| t.down_since.map(|s| s.elapsed()))
    }

    /// The verdict now: when the outage going on began, when the last one ended, and its
    /// generation.
    pub fn snapshot(&self) -> RedisSnapshot {
        let t = self
            .times
            .lock()
            .map(|t| *t)
            .unwrap_or_else(|p| *p.into_inner());
        RedisSnapshot {
            down_since: t.down_since,
            recovered_at: t.recovered_at,
            generation: t.generation,
        }
    }

    /// Resolves once Redis is up (at once if it is).
    pub async fn wait_up(&self) {
        let mut rx = self.up.subscribe();
        // `wait_for` only fails when the sender is gone, which `self` keeps alive.
        let _ = rx.wait_for(|up| *up).await;
    }

    /// Resolves at the next change of the verdict.
    pub async fn changed(&self) {
        let mut rx = self.up.subscribe();
        let _ = rx.changed().await;
    }
}

/// Registers the process-wide labelled series the alert rules and the dashboard use, at zero, so
/// that a scrape shows them from the start (a labelled metric otherwise appears only once touched,
/// and `rate()` over a series that appears mid-window misses its first increments). Each job
/// module registers its own series from the constants it counts with (`workers::register_metrics`
/// calls them all).
pub fn register_series() {
    use ::metrics::gauge;
    gauge!(metrics::REDIS_UP).set(1.0);
    let scopes = Task::ALL.map(Task::label);
    for scope in ["total"].into_iter().chain(scopes) {
        let _ = gauge!(metrics::POLL_TOKENS_IN_USE, "scope" => scope);
        let _ = gauge!(metrics::POLL_TOKENS_KEPT, "scope" => scope);
        let _ = gauge!(metrics::POLL_LIMIT, "scope" => scope);
        let _ = ::metrics::counter!(metrics::BUDGET_LEASES_EXPIRED, "scope" => scope);
    }
    for task in scopes {
        let _ = gauge!(metrics::BUDGET_ABANDONED_CALLS, "task" => task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redis_generation_moves_on_when_an_outage_begins_or_ends_and_when_data_is_lost() {
        let status = RedisStatus::default();
        let first = status.snapshot();
        assert!(first.is_up());
        assert!(!status.mark_up(), "up while up is no change");
        assert_eq!(status.snapshot().generation, first.generation);
        assert!(status.mark_down("refused"));
        let down = status.snapshot();
        assert!(!down.is_up());
        assert!(down.down_since.is_some());
        assert_eq!(down.generation, first.generation + 1);
        assert!(!status.mark_down("refused again"), "one outage");
        assert_eq!(status.snapshot(), down);
        assert!(status.mark_up());
        let back = status.snapshot();
        assert!(back.is_up() && back.recovered_at.is_some());
        assert_eq!(back.generation, down.generation + 1);
        status.mark_data_lost();
        assert_eq!(status.snapshot().generation, back.generation + 1);
    }
}
