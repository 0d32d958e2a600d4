//! Logs, metrics and the HTTP endpoint.
//!
//! # Layout
//! - [`log`]: the log subscriber ([`init_logging`]): every line names the process it comes
//!   from ([`Process`]), and [`rfc3339`] renders unix times for log fields.
//! - [`metrics`]: every metric name (an interface; see spec section 4).
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`.
//! - [`Health`]: which workers of this process run; `/healthz` answers from it.

pub mod http;
pub mod log;
pub mod metrics;

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

/// Which workers of this process are running. `/healthz` fails as soon as one of them stopped
/// unexpectedly, and the process then exits non-zero so that the orchestrator restarts it.
#[derive(Clone, Default)]
pub struct Health {
    /// Worker name -> running.
    workers: Arc<Mutex<BTreeMap<String, bool>>>,
}

impl Health {
    /// Marks a worker as running (or not) and mirrors it in `cardworker_worker_up{worker=kind}`.
    pub fn set(&self, name: &str, kind: &str, running: bool) {
        if let Ok(mut workers) = self.workers.lock() {
            workers.insert(name.to_owned(), running);
        }
        ::metrics::gauge!(metrics::WORKER_UP, "worker" => kind.to_owned()).set(if running {
            1.0
        } else {
            0.0
        });
    }

    /// The workers that are not running.
    pub fn stopped(&self) -> Vec<String> {
        self.workers
            .lock()
            .map(|w| {
                w.iter()
                    .filter(|(_, up)| !**up)
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_else(|_| vec!["<health state poisoned>".into()])
    }

    /// Whether at least one worker is registered and all of them run.
    pub fn healthy(&self) -> bool {
        self.workers
            .lock()
            .map(|w| !w.is_empty() && w.values().all(|up| *up))
            .unwrap_or(false)
    }
}

/// Registers the process-wide labelled series the alert rules and the dashboard use, at zero, so
/// that a scrape shows them from the start (a labelled metric otherwise appears only once touched,
/// and `rate()` over a series that appears mid-window misses its first increments). Each job
/// module registers its own series from the constants it counts with (`workers::register_metrics`
/// calls them all).
pub fn register_series() {
    use ::metrics::gauge;
    let scopes = Task::ALL.map(Task::label);
    for scope in ["total"].into_iter().chain(scopes) {
        let _ = gauge!(metrics::POLL_TOKENS_IN_USE, "scope" => scope);
        let _ = gauge!(metrics::POLL_LIMIT, "scope" => scope);
    }
}
