//! Starting a polling worker: an apalis worker on its task's due queue ([`PollBackend`]), under
//! the budget layer and a [`RunningLayer`] that counts its polls for the backend's fetches.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use apalis::prelude::*;
use apalis_core::worker::lifecycle::LifecycleService;
use futures::FutureExt as _;
use tower::layer::util::Stack;
use tower::{Layer, Service};

use super::backend::{FetchPause, PollBackend, PollFetch, RunningLayer};
use super::lease::PollJob;
use crate::context::AppContext;
use crate::pod;
use crate::runner::spawn::{stopped, ORPHAN_MARGIN};
use crate::runner::{JobService, RunJob, Supervisor};

/// What a polling worker's lease adds to its poll's limit: the budget layer's acquire and the
/// acknowledgement, each bounded by a 2 s Redis timeout.
pub const POLL_LEASE_MARGIN: Duration = ORPHAN_MARGIN;

/// The longest an idle polling worker waits between two fetches (sooner when the next card is
/// due sooner): how long a card another process makes due earlier waits for an idle worker.
pub const POLL_IDLE_MAX: Duration = Duration::from_secs(2);

/// How long a polling worker that leased every due card gathers the next ones before it fetches
/// again ([`PollFetch::gather`]): a poll at most this much later, for a fetch of the cards due in
/// this window instead of one per card. Small against any polling interval.
pub const POLL_GATHER: Duration = Duration::from_millis(10);

/// Starts one polling worker for job `J` on its task's due queue ([`PollBackend`]), its service
/// wrapped in `layer` (the polling budget, which pauses the worker's fetching through `pause`
/// when it defers) inside a [`RunningLayer`] that counts its polls for the backend. Each fetched card is leased for the poll's limit plus [`POLL_LEASE_MARGIN`]: a
/// card whose worker died is due again after that.
pub fn spawn<J, L>(ctx: &Arc<AppContext>, sup: &mut Supervisor, layer: L, pause: FetchPause)
where
    J: RunJob + PollJob + Send + 'static,
    L: Layer<LifecycleService<JobService<J>>> + Clone + Send + Sync + 'static,
    L::Service: Service<Task<String>, Response = (), Error = BoxDynError> + Send + 'static,
    <L::Service as Service<Task<String>>>::Future: Send + 'static,
{
    let ctx = ctx.clone();
    let shutdown = sup.shutdown().clone();
    sup.spawn(
        J::KIND,
        Box::new(move || {
            let concurrency = J::concurrency(&ctx.config);
            let name = pod::worker_name(J::KIND);
            let running = Arc::new(AtomicUsize::new(0));
            let fetch = PollFetch {
                slots: concurrency,
                lease: J::timeout(&ctx.config) + POLL_LEASE_MARGIN,
                idle_max: POLL_IDLE_MAX,
                gather: POLL_GATHER,
            };
            let backend = PollBackend::new(
                super::lease::due_queue(ctx.prefix(), <J as PollJob>::TASK),
                ctx.redis.clone(),
                fetch,
                running.clone(),
                pause.clone(),
            );
            let worker = WorkerBuilder::new(name.as_str())
                .backend(backend)
                .concurrency(concurrency)
                .layer(Stack::new(layer.clone(), RunningLayer::new(running)))
                .build(JobService::<J>::new(ctx.clone()));
            let stopped = stopped(&shutdown);
            (name, worker.run_until(stopped).boxed())
        }),
    );
}
