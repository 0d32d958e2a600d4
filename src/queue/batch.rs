//! One process's concurrent calls of a script, sent together: [`ScriptCalls`].
//!
//! Every poll ends with a script call (its acknowledgement, the successor), and every job of the
//! other queues too: each costs Redis a script invocation, a request to read and a reply to
//! write, for two or three commands of real work. A process runs many polls at once, and a
//! worker starts the jobs of one fetch together, so their calls come in bursts. [`ScriptCalls`] queues the calls and a task of its own sends
//! them: whatever queued while the previous script call was in flight goes in the next one, as the
//! script's `batch` op (groups of a fixed number of arguments, one per call, answered in order).
//! Built with [`ScriptCalls::new`], it adds no wait of its own: a call that finds nothing in
//! flight is sent at once, alone. Built with [`ScriptCalls::lingering`], the first call of a
//! script call waits up to the linger for others to join it (or until [`MAX_BATCH`] have): calls
//! that come in a burst, such as the polls of one fetch ending within a few milliseconds of each
//! other, then cost Redis one script invocation and one round trip, not one per few calls.
//!
//! Calls with different keys (the two polling tasks) go in separate script calls of the same
//! round trip. A failed script call fails every call it carried, with the same error, as each
//! would have failed alone. One difference: a script that stops with an error part-way (Redis out
//! of memory, say) keeps the writes of the calls before the failing one, and those calls are
//! reported failed too; a poll's successor so reported is retried in the background
//! (`polling::lease::ack_or_retry`), which finds the lease no longer holding the card (the first
//! write ended it) and writes nothing. A call that times out alone has the same ambiguity.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use redis::aio::ConnectionManager;
use redis::{Script, Value};
use tokio::sync::{mpsc, oneshot};

/// The most calls one script call carries.
pub const MAX_BATCH: usize = 64;

/// How long the first of the polls' acknowledgements of a script call waits for others to join
/// it ([`poll_acks`]). The polls of one fetch start together and end within a few milliseconds of
/// each other; sent the moment each ends, they would go to Redis a few a call, and each call costs
/// Redis a script invocation and a round trip of its own. A poll's slot is held this much longer
/// at most, and a backlog never waits it out: its acknowledgements fill a script call sooner.
pub const POLL_ACK_LINGER: Duration = Duration::from_millis(4);

/// The polls' batched acknowledgements on `redis` (the due queue's script,
/// `polling::lease::ack`; a task of their own, needs a Tokio runtime): the polls that end while a
/// script call is in flight, or within [`POLL_ACK_LINGER`] of its first, go in one script call. A
/// process's own are `AppContext::poll_acks`.
pub fn poll_acks(redis: &ConnectionManager) -> ScriptCalls {
    ScriptCalls::lingering(
        redis.clone(),
        Script::new(cardworker_jobs::due::SCRIPT),
        cardworker_jobs::due::ACK_WIDTH,
        POLL_ACK_LINGER,
    )
}

/// Why a call sent through [`ScriptCalls`] has no answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BatchError {
    /// Redis refused or did not answer the script call that carried it.
    #[error("{0}")]
    Redis(String),
    /// The script answered something other than one result per call.
    #[error("the script answered {got} results for {sent} calls")]
    Shape {
        /// Results answered.
        got: usize,
        /// Calls sent.
        sent: usize,
    },
    /// The sending task has ended (the process is going away).
    #[error("the script call task has ended")]
    Gone,
}

/// One queued call.
struct Call {
    /// The script's keys (the same for every call of one script call).
    keys: Arc<[String]>,
    /// Its arguments, at most the script's group width.
    args: Vec<String>,
    /// Where its result goes.
    reply: oneshot::Sender<Result<Value, BatchError>>,
}

/// A queue of calls of one script, sent several to a script call by a task of its own. Cheap to
/// clone; the task ends when the last clone is dropped.
#[derive(Clone)]
pub struct ScriptCalls {
    /// Into the sending task.
    tx: mpsc::UnboundedSender<Call>,
}

impl ScriptCalls {
    /// Starts the task that sends `script`'s calls on `conn`; each call's arguments are padded
    /// with empty strings to `width`, the group size of the script's `batch` op. Needs a Tokio
    /// runtime.
    pub fn new(conn: ConnectionManager, script: Script, width: usize) -> Self {
        Self::lingering(conn, script, width, Duration::ZERO)
    }

    /// [`Self::new`], whose calls wait up to `linger` after the first of a script call for
    /// others to join it.
    pub fn lingering(
        conn: ConnectionManager,
        script: Script,
        width: usize,
        linger: Duration,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(send_calls(conn, Arc::new(script), width, linger, rx));
        Self { tx }
    }

    /// Calls the script with `keys` and `args` (at most the width), in the next script call.
    pub async fn call(&self, keys: Arc<[String]>, args: Vec<String>) -> Result<Value, BatchError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Call { keys, args, reply })
            .map_err(|_| BatchError::Gone)?;
        answer.await.map_err(|_| BatchError::Gone)?
    }
}

/// The sending task: takes what has queued (at least one call), and what joins it within
/// `linger`, sends it, and waits for the answers before taking the next calls.
async fn send_calls(
    conn: ConnectionManager,
    script: Arc<Script>,
    width: usize,
    linger: Duration,
    mut rx: mpsc::UnboundedReceiver<Call>,
) {
    let mut queued = Vec::with_capacity(MAX_BATCH);
    while crate::linger::recv_batch(&mut rx, &mut queued, MAX_BATCH, linger).await > 0 {
        // Group by keys; there are as many groups as polling tasks, so a scan is enough.
        let mut groups: Vec<(Arc<[String]>, Vec<Call>)> = Vec::new();
        for call in queued.drain(..) {
            match groups.iter_mut().find(|(k, _)| *k == call.keys) {
                Some((_, calls)) => calls.push(call),
                None => groups.push((call.keys.clone(), vec![call])),
            }
        }
        join_all(
            groups
                .into_iter()
                .map(|(keys, calls)| send_group(conn.clone(), &script, width, keys, calls)),
        )
        .await;
    }
}

/// One script call with `calls` (all with `keys`), and their answers.
async fn send_group(
    mut conn: ConnectionManager,
    script: &Script,
    width: usize,
    keys: Arc<[String]>,
    calls: Vec<Call>,
) {
    let mut inv = script.prepare_invoke();
    for key in keys.iter() {
        inv.key(key);
    }
    inv.arg("batch");
    for call in &calls {
        for i in 0..width {
            inv.arg(call.args.get(i).map_or("", String::as_str));
        }
    }
    let answered: Result<Vec<Value>, BatchError> = inv
        .invoke_async(&mut conn)
        .await
        .map_err(|e| BatchError::Redis(e.to_string()));
    match answered {
        Ok(results) if results.len() == calls.len() => {
            for (call, result) in calls.into_iter().zip(results) {
                let _ = call.reply.send(Ok(result));
            }
        }
        Ok(results) => {
            let e = BatchError::Shape {
                got: results.len(),
                sent: calls.len(),
            };
            for call in calls {
                let _ = call.reply.send(Err(e.clone()));
            }
        }
        Err(e) => {
            for call in calls {
                let _ = call.reply.send(Err(e.clone()));
            }
        }
    }
}
