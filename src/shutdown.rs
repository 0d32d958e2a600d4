//! The one shutdown signal of a process, and the tracker of every task it spawns.
//!
//! A graceful stop has two phases, and both hang off one [`Shutdown`]:
//! 1. **drain** ([`Shutdown::begin`]): every apalis worker stops fetching and lets its in-flight
//!    jobs finish (`worker.shutdown_grace_secs`); the HTTP endpoint, the intake feeder and the
//!    gauge refresher keep running, so `/metrics` and `/healthz` answer while the pod drains;
//! 2. **stop** ([`Shutdown::finish`]): after the workers drained and the shutdown hooks ran
//!    (leases released), every background task is cancelled and awaited.
//!
//! Every task the process spawns goes through [`Shutdown::spawn`] (background loops) or
//! [`Shutdown::spawn_detached`] (short fire-and-forget calls such as a lease release), so
//! `finish` waits for all of them: none outlives the process's pool or its Redis connection
//! unnoticed. The workers themselves are owned by the supervisor (`runner::supervisor`), which
//! needs to see the first one that ends.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The shutdown signal and task tracker of one process. Cheap to clone; clones share state.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    /// Cancelled when the drain begins: workers stop fetching.
    drain: CancellationToken,
    /// Cancelled when the process stops: background tasks end.
    stop: CancellationToken,
    /// Every spawned task, background loops and detached calls alike.
    tasks: TaskTracker,
}

impl Shutdown {
    /// A fresh signal: nothing cancelled, no tasks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Begins the drain (phase 1). Idempotent.
    pub fn begin(&self) {
        self.drain.cancel();
    }

    /// Whether the drain has begun.
    pub fn is_draining(&self) -> bool {
        self.drain.is_cancelled()
    }

    /// Resolves when the drain begins.
    pub fn draining(&self) -> impl Future<Output = ()> + Send + 'static {
        self.drain.clone().cancelled_owned()
    }

    /// Resolves when the process stops (phase 2).
    pub fn stopping(&self) -> impl Future<Output = ()> + Send + 'static {
        self.stop.clone().cancelled_owned()
    }

    /// Spawns a background task that runs until it ends or the process stops, whichever is first.
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let stopping = self.stopping();
        self.tasks.spawn(async move {
            tokio::select! {
                () = task => {}
                () = stopping => {}
            }
        });
    }

    /// Spawns one job's run: it goes on even if the apalis worker that started it stops (a Redis
    /// outage ends a worker's stream and drops its in-flight futures; the job must still finish,
    /// schedule its successor and release what it holds). Cancelled when the process stops, like
    /// a background task; the handle then yields `None`.
    pub fn spawn_job<F>(&self, job: F) -> tokio::task::JoinHandle<Option<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let stopping = self.stopping();
        self.tasks.spawn(async move {
            tokio::select! {
                out = job => Some(out),
                () = stopping => None,
            }
        })
    }

    /// Spawns a short task that must run to its end even while the process stops (a lease
    /// release, say); [`Shutdown::finish`] waits for it.
    pub fn spawn_detached<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn(task);
    }

    /// Stops the process (phase 2): begins the drain if it had not begun, cancels every background
    /// task and waits until every tracked task ended.
    pub async fn finish(&self) {
        self.drain.cancel();
        self.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// How many tracked tasks are still running.
    pub fn running_tasks(&self) -> usize {
        self.tasks.len()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::*;

    /// A regression that leaves one of these waits pending fails the test instead of hanging it.
    async fn within<F: Future>(what: &str, f: F) -> F::Output {
        tokio::time::timeout(std::time::Duration::from_secs(10), f)
            .await
            .unwrap_or_else(|_| panic!("{what} did not happen within 10 s"))
    }

    #[tokio::test]
    async fn background_tasks_keep_running_through_the_drain_and_end_when_the_process_stops() {
        let shutdown = Shutdown::new();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        shutdown.spawn(async move {
            loop {
                if tx.send(()).is_err() {
                    return;
                }
                tokio::task::yield_now().await;
            }
        });
        shutdown.begin();
        assert!(shutdown.is_draining());
        within("the loop's send", rx.recv())
            .await
            .expect("the loop still runs while draining");
        within("finish", shutdown.finish()).await;
        assert_eq!(shutdown.running_tasks(), 0);
    }

    #[tokio::test]
    async fn finish_waits_for_detached_tasks_to_complete() {
        let shutdown = Shutdown::new();
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let (release, wait) = tokio::sync::oneshot::channel::<()>();
        shutdown.spawn_detached(async move {
            let _ = wait.await;
            flag.store(true, Ordering::SeqCst);
        });
        let finish = tokio::spawn({
            let s = shutdown.clone();
            async move { s.finish().await }
        });
        tokio::task::yield_now().await;
        assert!(
            !finish.is_finished(),
            "finish must wait for the detached task"
        );
        release.send(()).expect("the task waits");
        within("finish", finish).await.expect("finish completes");
        assert!(done.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_job_outlives_the_caller_that_dropped_its_handle_and_is_cancelled_at_stop() {
        let shutdown = Shutdown::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let handle = shutdown.spawn_job(async move {
            let _ = wait.await;
            let _ = tx.send(());
        });
        drop(handle);
        go.send(()).expect("the job waits");
        within("the job's end", rx)
            .await
            .expect("the job ran to its end without anyone awaiting it");
        let stuck = shutdown.spawn_job(std::future::pending::<()>());
        within("finish", shutdown.finish()).await;
        assert_eq!(
            within("the cancelled job", stuck).await.expect("joined"),
            None
        );
    }

    #[tokio::test]
    async fn draining_resolves_for_every_clone_once_begun() {
        let shutdown = Shutdown::new();
        let a = shutdown.draining();
        let b = shutdown.clone().draining();
        shutdown.begin();
        within("the first clone's drain", a).await;
        within("the second clone's drain", b).await;
    }
}
