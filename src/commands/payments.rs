//! `enqueue payment`, `enqueue callback`.

use std::path::Path;

use anyhow::Context as _;
use cardworker_jobs::{ProcessCallback, SubmitPayment};

use super::CommandError;
use crate::context::AppContext;
use crate::payments::{callback, store};

/// Submits one payment row through the reliable path. An unknown payment is an error (exit 1);
/// a settled one is reported and not submitted again.
///
/// PostgreSQL first: a `requested` payment is touched (committed) before the job goes to Redis,
/// so that if Redis loses the job, payment recovery resubmits the payment once
/// `payments.recovery_after_secs` have passed.
pub async fn enqueue_payment(ctx: &AppContext, payment_id: uuid::Uuid) -> Result<(), CommandError> {
    store::touch_requested(&ctx.pool, payment_id)
        .await
        .context("recording the payment's submission request")?
        .ok_or_else(|| anyhow::anyhow!("unknown payment {payment_id}"))?;
    let payment = store::load(&ctx.pool, payment_id)
        .await
        .context("loading the payment")?
        .ok_or_else(|| anyhow::anyhow!("unknown payment {payment_id}"))?;
    if payment.is_settled() {
        println!(
            "payment {payment_id} is already {} (channel_ref {}); not submitted again",
            payment.tracking.status,
            payment.tracking.channel_ref.as_deref().unwrap_or("-")
        );
        return Ok(());
    }
    let id = ctx
        .producer
        .enqueue(&SubmitPayment {
            payment_id,
            retries: 0,
        })
        .await
        .context("enqueueing the payment submission")?;
    println!(
        "payment {payment_id} ({}) enqueued for submission ({id}); Idempotency-Key = {payment_id}",
        payment.tracking.status
    );
    Ok(())
}

/// Hands one channel callback to the callback job, as the ingress would: committed as `received`
/// (with its body) in PostgreSQL first, then enqueued, so that a Redis loss cannot lose it (the
/// sweep of `received` callbacks re-enqueues it). An applied callback is counted, not enqueued.
pub async fn enqueue_callback(
    ctx: &AppContext,
    channel: &str,
    callback_id: &str,
    body_file: &Path,
) -> Result<(), CommandError> {
    let bytes = std::fs::read(body_file)
        .with_context(|| format!("reading the callback body from {}", body_file.display()))?;
    // Kept as received, even when it is not valid UTF-8: the job records the malformed body.
    let body = String::from_utf8_lossy(&bytes).into_owned();
    match callback::record_received(&ctx.pool, channel, callback_id, &body)
        .await
        .context("recording the callback delivery")?
    {
        callback::Received::AlreadyApplied => {
            println!("callback {channel}/{callback_id} was already applied; delivery counted, not applied again");
            return Ok(());
        }
        callback::Received::Recorded => {}
    }
    let id = ctx
        .producer
        .enqueue(&ProcessCallback {
            channel: channel.to_owned(),
            callback_id: callback_id.to_owned(),
            body,
            retries: 0,
            recorded: true,
        })
        .await
        .context(
            "enqueueing the callback (it is recorded as received; the sweep of received \
             callbacks enqueues it after payments.recovery_after_secs)",
        )?;
    println!("callback {channel}/{callback_id} recorded and enqueued ({id})");
    Ok(())
}
