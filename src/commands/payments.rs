//! `enqueue payment`, `enqueue callback`.

use std::path::Path;

use anyhow::Context as _;
use cardworker_jobs::{ProcessCallback, SubmitPayment};

use super::CommandError;
use crate::context::AppContext;
use crate::payments::store;

/// Submits one payment row through the reliable path. An unknown payment is an error (exit 1);
/// a settled one is reported and not submitted again.
pub async fn enqueue_payment(ctx: &AppContext, payment_id: uuid::Uuid) -> Result<(), CommandError> {
    let payment = store::load(&ctx.pool, payment_id)
        .await
        .context("loading the payment")?
        .ok_or_else(|| anyhow::anyhow!("unknown payment {payment_id}"))?;
    if payment.is_settled() {
        println!(
            "payment {payment_id} is already {} (channel_ref {}); not submitted again",
            payment.status,
            payment.channel_ref.as_deref().unwrap_or("-")
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
        payment.status
    );
    Ok(())
}

/// Hands one channel callback to the callback job, as the ingress would.
pub async fn enqueue_callback(
    ctx: &AppContext,
    channel: &str,
    callback_id: &str,
    body_file: &Path,
) -> Result<(), CommandError> {
    let body = std::fs::read_to_string(body_file)
        .with_context(|| format!("reading the callback body from {}", body_file.display()))?;
    let id = ctx
        .producer
        .enqueue(&ProcessCallback {
            channel: channel.to_owned(),
            callback_id: callback_id.to_owned(),
            body,
            retries: 0,
        })
        .await
        .context("enqueueing the callback")?;
    println!("callback {channel}/{callback_id} enqueued ({id})");
    Ok(())
}
