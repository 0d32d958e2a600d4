//! The Redis probe of one process: is Redis answering, and did it lose its data?
//!
//! Every [`PROBE_INTERVAL`] it reads the deployment's epoch marker (`{prefix}:redis_epoch`, one
//! `EXISTS`) with a short timeout and records the verdict in [`RedisStatus`]
//! (`cardworker_redis_up`), which the supervisor uses to ride out an outage and the feeder to stay
//! quiet during one.
//!
//! The marker is written once and never expires, so finding it missing means Redis came back
//! empty (a restart without persistence, a failover to an empty replica, a flush) or this is the
//! deployment's first start. Then every chain, intake entry and lease is gone while PostgreSQL
//! still says which cards should be polled: the first pod to re-create the marker (`SET NX`, sent
//! only when `EXISTS` found it missing) runs the `on_data_lost` action (`workers` enqueues a full
//! reconcile), so polling resumes within seconds instead of waiting for the reconcile cursor to
//! come round.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use redis::aio::ConnectionManager;

use crate::telemetry::RedisStatus;

/// How often the probe asks Redis.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// A probe slower than this counts as Redis down.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The marker key whose absence means Redis lost the deployment's data.
pub fn epoch_key(prefix: &str) -> String {
    format!("{prefix}:redis_epoch")
}

/// What the pod that notices a data loss does (enqueue a full reconcile, say).
pub type OnDataLost = Arc<dyn Fn() -> BoxFuture<'static, anyhow::Result<()>> + Send + Sync>;

/// The probe of one process.
pub struct RedisWatch {
    /// The shared connection.
    pub conn: ConnectionManager,
    /// `redis.key_prefix`.
    pub prefix: String,
    /// Where the verdict goes.
    pub status: RedisStatus,
    /// Run by the pod that re-creates a missing epoch marker.
    pub on_data_lost: OnDataLost,
    /// Whether a probe of this process has seen Redis answer before: a marker missing at the
    /// first probe is a first start (or a loss while no pod ran), not trouble for running workers.
    pub answered_before: bool,
}

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Redis answered and the marker was there.
    Up,
    /// Redis answered without the marker, and this pod re-created it.
    DataLost,
    /// Redis did not answer in time.
    Down(String),
}

impl RedisWatch {
    /// Probes once and records the verdict.
    pub async fn probe(&mut self) -> Probe {
        let key = epoch_key(&self.prefix);
        let answer = tokio::time::timeout(PROBE_TIMEOUT, async {
            // A read first: the marker is nearly always there, and `EXISTS` writes nothing and
            // sends no value (issue 16). Only a missing marker is re-created, with `SET NX`, so
            // that of the pods that all found it missing exactly one runs `on_data_lost`.
            let present: bool = redis::cmd("EXISTS")
                .arg(&key)
                .query_async(&mut self.conn)
                .await?;
            if present {
                return Ok::<bool, redis::RedisError>(false);
            }
            let epoch = ulid::Ulid::new().to_string();
            let created: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&epoch)
                .arg("NX")
                .query_async(&mut self.conn)
                .await?;
            Ok(created.is_some())
        })
        .await;
        match answer {
            Ok(Ok(created)) => {
                self.status.mark_up();
                let answered_before = std::mem::replace(&mut self.answered_before, true);
                if created {
                    if answered_before {
                        self.status.mark_data_lost();
                    }
                    Probe::DataLost
                } else {
                    Probe::Up
                }
            }
            Ok(Err(e)) => {
                let why = format!("{e}");
                self.status.mark_down(&why);
                Probe::Down(why)
            }
            Err(_) => {
                let why = format!("no answer within {PROBE_TIMEOUT:?}");
                self.status.mark_down(&why);
                Probe::Down(why)
            }
        }
    }

    /// Probes every [`PROBE_INTERVAL`] until `stop` resolves.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) {
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(PROBE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut stop => return,
                _ = tick.tick() => {
                    let watched = self.answered_before;
                    if self.probe().await == Probe::DataLost {
                        self.restore(watched).await;
                    }
                }
            }
        }
    }

    /// Runs `on_data_lost`; if it fails, drops the marker again so that the next probe (of any
    /// pod) retries instead of nobody restoring.
    ///
    /// `watched`: this process had seen the marker's Redis answer before, so the data went while
    /// workers ran, which an operator should look at (WARN). Missing at this process's first
    /// probe, it is the deployment's first start (or a loss while no pod ran): routine, INFO.
    async fn restore(&mut self, watched: bool) {
        if watched {
            tracing::warn!(
                prefix = %self.prefix,
                "Redis lost the deployment's data (its epoch marker is gone); restoring the schedule from PostgreSQL"
            );
        } else {
            tracing::info!(
                prefix = %self.prefix,
                "Redis holds no epoch marker at start-up (the deployment's first start, or Redis lost its data while no worker ran); restoring the schedule from PostgreSQL"
            );
        }
        if let Err(e) = (self.on_data_lost)().await {
            tracing::error!(error = %format!("{e:#}"), "restoring after a Redis data loss failed; will retry");
            let _: Result<(), _> = redis::cmd("DEL")
                .arg(epoch_key(&self.prefix))
                .query_async(&mut self.conn)
                .await;
        }
    }
}
