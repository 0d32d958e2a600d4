//! Batches that wait a little for latecomers: [`recv_batch`].
//!
//! A process's acknowledgements (`queue::batch`) and card reads (`storage::card_reads`) are
//! queued and sent several to a round trip. The polls of one fetch start and end within a few
//! milliseconds of each other, so a batch sent the moment its first call arrives carries that
//! call and little else; one that waits a millisecond or a few carries most of the fetch. What
//! the wait costs is the first call's latency, at most the linger, and a backlog never waits it
//! out: its calls fill a batch sooner.

use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;

/// Waits for at least one message on `rx`, then gathers more into `batch` until it holds `max`
/// or `linger` has passed since the first (no wait at all when `linger` is zero: whatever had
/// queued). Returns how many `batch` holds: 0 only when every sender is gone and nothing is left.
pub async fn recv_batch<T>(
    rx: &mut UnboundedReceiver<T>,
    batch: &mut Vec<T>,
    max: usize,
    linger: Duration,
) -> usize {
    if rx.recv_many(batch, max).await == 0 {
        return batch.len();
    }
    if !linger.is_zero() {
        let until = tokio::time::Instant::now() + linger;
        while batch.len() < max {
            let room = max - batch.len();
            match tokio::time::timeout_at(until, rx.recv_many(batch, room)).await {
                // The linger is over, or every sender is gone: the batch is what there is.
                Err(_) | Ok(0) => break,
                Ok(_) => {}
            }
        }
    }
    batch.len()
}
