//! The Redis probe of one process: is Redis answering, and did it lose its data?
//!
//! Every [`PROBE_INTERVAL`] it reads the deployment's epoch marker (`{prefix}:redis_epoch`, one
//! `GET`) with a short timeout and records the verdict in [`RedisStatus`]
//! (`cardworker_redis_up`), which the supervisor uses to ride out an outage and the feeder to stay
//! quiet during one.
//!
//! The marker is written once and never expires, so finding it missing means Redis came back
//! empty (a restart without persistence, a failover to an empty replica, a flush) or this is the
//! deployment's first start. Then every due-queue entry, intake entry and lease is gone while PostgreSQL
//! still says which cards should be polled: the first pod to re-create the marker (`SET NX`, sent
//! only when `GET` found it missing) runs the `on_data_lost` action (`workers` enqueues a full
//! reconcile), so polling resumes within seconds instead of waiting for the reconcile cursor to
//! come round.
//!
//! Every pod that notices the loss (the marker missing, or back with another value than the one it
//! saw last) first runs `on_data_lost_here`: it writes back its running polls' budget leases,
//! which Redis lost while they were at the Gateway, so that their tokens still count. The full
//! reconcile waits [`RESTORE_SETTLE`] (a few probes) before it adds the cards back; the budget's
//! fence keeps any poll of them out until the polls admitted before the loss are over.
//!
//! A restore that fails (Redis went down again meanwhile) is retried by its pod at the first probe
//! that finds Redis answering, and its marker is dropped so that another pod restores should this
//! one die first.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use redis::aio::ConnectionManager;

use crate::telemetry::RedisStatus;

/// How often the probe asks Redis.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// A probe slower than this counts as Redis down.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the full reconcile after a data loss waits, so that every pod's probe has noticed the
/// loss and written its running polls back first.
pub const RESTORE_SETTLE: Duration = Duration::from_secs(3);

/// The marker key whose absence means Redis lost the deployment's data, which [`crate::keys`]
/// owns.
pub use crate::keys::epoch_key;

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
    /// Run by every pod that notices a data loss, before anything else: writes back what this
    /// process's running polls hold.
    pub on_data_lost_here: OnDataLost,
    /// The polling budget, held while Redis is down, for [`crate::budget::OUTAGE_HOLD`] after, and
    /// for [`RESTORE_SETTLE`] after a data loss (`None` where nothing polls).
    pub budget: Option<crate::budget::Budget>,
    /// The marker's value at this pod's last probe (`None` before the first, or after finding it
    /// missing).
    pub epoch: Option<String>,
    /// Whether a probe of this process has seen Redis answer before: a marker missing at the
    /// first probe is a first start (or a loss while no pod ran), not trouble for running workers.
    pub answered_before: bool,
    /// This process re-created the marker and its `on_data_lost` failed: it runs it again at the
    /// next probe that finds Redis answering. Dropping the marker for a retry is not enough on
    /// its own: when Redis went down during the restore, the drop fails too, and Redis may come
    /// back with its data (the marker included), so no probe would find it missing again.
    pub restore_pending: bool,
}

/// What one probe read of the marker.
enum Seen {
    /// There, with this value.
    Present(String),
    /// Missing; this probe re-created it with this value.
    Created(String),
    /// Missing; another pod re-created it first.
    Missing,
}

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Redis answered and the marker was there.
    Up,
    /// Redis answered without the marker, and this pod re-created it.
    DataLost,
    /// Redis lost its data and another pod re-created the marker (or is about to).
    LostElsewhere,
    /// Redis did not answer in time.
    Down(String),
}

impl RedisWatch {
    /// Probes once and records the verdict.
    pub async fn probe(&mut self) -> Probe {
        let key = epoch_key(&self.prefix);
        let answer = tokio::time::timeout(PROBE_TIMEOUT, async {
            // A read first: the marker is nearly always there, and `GET` writes nothing. Only a
            // missing marker is re-created, with `SET NX`, so that of the pods that all found it
            // missing exactly one runs `on_data_lost`.
            let present: Option<String> = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut self.conn)
                .await?;
            if let Some(epoch) = present {
                return Ok::<_, redis::RedisError>(Seen::Present(epoch));
            }
            let epoch = ulid::Ulid::new().to_string();
            let created: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg(&epoch)
                .arg("NX")
                .query_async(&mut self.conn)
                .await?;
            Ok(match created {
                Some(_) => Seen::Created(epoch),
                None => Seen::Missing,
            })
        })
        .await;
        match answer {
            Ok(Ok(seen)) => {
                self.status.mark_up();
                let answered_before = std::mem::replace(&mut self.answered_before, true);
                match seen {
                    Seen::Created(epoch) => {
                        self.epoch = Some(epoch);
                        if answered_before {
                            self.status.mark_data_lost();
                        }
                        Probe::DataLost
                    }
                    Seen::Missing => {
                        self.epoch = None;
                        Probe::LostElsewhere
                    }
                    Seen::Present(epoch) => {
                        let changed = self.epoch.as_ref().is_some_and(|seen| *seen != epoch);
                        self.epoch = Some(epoch);
                        if changed {
                            Probe::LostElsewhere
                        } else {
                            Probe::Up
                        }
                    }
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
                    let verdict = self.probe().await;
                    if let Some(budget) = &self.budget {
                        match verdict {
                            Probe::Down(_) => budget.hold_for(crate::budget::OUTAGE_HOLD),
                            // At this process's first probe nothing of it runs yet: a missing
                            // marker is a first start, with no lease to wait for.
                            Probe::DataLost if !watched => {}
                            Probe::DataLost | Probe::LostElsewhere => budget.hold_for(RESTORE_SETTLE),
                            Probe::Up => {}
                        }
                    }
                    match verdict {
                        Probe::DataLost => {
                            if watched {
                                self.write_back().await;
                            }
                            self.restore(watched).await;
                        }
                        Probe::LostElsewhere => {
                            // The pod that re-created the marker restores.
                            self.restore_pending = false;
                            self.write_back().await;
                        }
                        Probe::Up if self.restore_pending => {
                            tracing::warn!(
                                prefix = %self.prefix,
                                "Redis answers again: retrying the restore of the schedule from PostgreSQL after a data loss"
                            );
                            self.try_restore().await;
                        }
                        Probe::Up | Probe::Down(_) => {}
                    }
                }
            }
        }
    }

    /// Runs `on_data_lost_here`: this process's running polls written back.
    async fn write_back(&mut self) {
        tracing::warn!(prefix = %self.prefix, "Redis lost the deployment's data; writing back the budget leases of this process's running polls");
        if let Err(e) = (self.on_data_lost_here)().await {
            tracing::error!(error = %format!("{e:#}"), "writing back the running polls after a Redis data loss failed");
        }
    }

    /// Runs `on_data_lost` (after [`RESTORE_SETTLE`] when the data went while workers ran), as
    /// [`Self::try_restore`].
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
        if watched {
            tokio::time::sleep(RESTORE_SETTLE).await;
        }
        self.try_restore().await;
    }

    /// Runs `on_data_lost`. If it fails, this process retries at its next probe that finds Redis
    /// answering ([`Self::restore_pending`]), and the marker is dropped again, so that should
    /// this process die first, another pod's probe finds it missing and restores.
    async fn try_restore(&mut self) {
        match (self.on_data_lost)().await {
            Ok(()) => self.restore_pending = false,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "restoring after a Redis data loss failed; will retry once Redis answers");
                self.restore_pending = true;
                let _: Result<(), _> = redis::cmd("DEL")
                    .arg(epoch_key(&self.prefix))
                    .query_async(&mut self.conn)
                    .await;
            }
        }
    }
}
