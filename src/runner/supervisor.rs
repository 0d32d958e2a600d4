//! [`Supervisor`]: runs the workers of one process and fails the process when one stops.
//!
//! Why a supervisor of our own instead of apalis's `Monitor`: with a shutdown timeout the Monitor
//! discards worker errors, and a failed worker stays dead while the others run on. An operator
//! needs the opposite: if one worker stops unexpectedly, `/healthz` fails at once and the process
//! exits non-zero so that the orchestrator restarts it. Each worker still runs through apalis's
//! own `Worker::run_until`, so fetching stops and in-flight jobs drain on shutdown.

use std::future::Future;
use std::time::Duration;

use apalis::prelude::WorkerError;
use futures::future::BoxFuture;
use tokio::task::JoinSet;

use crate::shutdown::Shutdown;
use crate::telemetry::Health;

/// How the workers of one process are started and stopped.
pub struct Supervisor {
    /// Running workers: each yields its name, kind and how it ended.
    workers: JoinSet<Ended>,
    /// The process's shutdown signal: its drain phase stops every worker.
    shutdown: Shutdown,
    /// Liveness, as `/healthz` reports it.
    health: Health,
}

impl Supervisor {
    /// A supervisor reporting into `health`, stopping its workers when `shutdown` drains.
    pub fn new(health: Health, shutdown: Shutdown) -> Self {
        Self {
            workers: JoinSet::new(),
            shutdown,
            health,
        }
    }

    /// A future that resolves when the drain begins, in the shape apalis's `run_until` wants.
    pub fn stopped(&self) -> impl Future<Output = Result<(), std::io::Error>> + Send + 'static {
        let draining = self.shutdown.draining();
        async move {
            draining.await;
            Ok(())
        }
    }

    /// Starts one worker, given its run future.
    pub fn spawn(
        &mut self,
        name: String,
        kind: &'static str,
        run: BoxFuture<'static, Result<(), WorkerError>>,
    ) {
        self.health.set(&name, kind, true);
        tracing::info!(worker = %name, kind, "worker started");
        self.workers.spawn(async move { (name, kind, run.await) });
    }

    /// Waits until `shutdown` resolves or a worker stops on its own. Returns the first worker that
    /// stopped unexpectedly, if any, after stopping the others within `grace`.
    pub async fn supervise(
        mut self,
        shutdown: impl Future<Output = ()>,
        grace: Duration,
    ) -> Option<String> {
        let mut failed = None;
        tokio::select! {
            () = shutdown => tracing::info!("shutdown requested; draining in-flight jobs"),
            ended = self.workers.join_next() => {
                if let Some(Ok((name, kind, _))) = &ended {
                    self.health.set(name, kind, false);
                }
                let what = describe(ended);
                tracing::error!(worker = %what, "a worker stopped unexpectedly; stopping the process");
                failed = Some(what);
            }
        }
        self.shutdown.begin();
        let drain = async {
            while let Some(ended) = self.workers.join_next().await {
                if let Ok((name, kind, result)) = &ended {
                    self.health.set(name, kind, false);
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
}

/// How one worker ended: its name, kind and result.
type Ended = (String, &'static str, Result<(), WorkerError>);

fn describe(ended: Option<Result<Ended, tokio::task::JoinError>>) -> String {
    match ended {
        Some(Ok((name, _, Ok(())))) => format!("{name} (returned)"),
        Some(Ok((name, _, Err(e)))) => format!("{name}: {e}"),
        Some(Err(e)) => format!("worker task failed: {e}"),
        None => "no workers registered".to_owned(),
    }
}
