//! `enqueue payment`, `enqueue callback`.

use std::path::Path;

use anyhow::Context as _;
use cardworker_jobs::{ProcessCallback, SubmitPayment};

use super::CommandError;
use crate::context::AppContext;
use crate::payments::{callback, store};
use crate::reliable::payment::PaymentCall;
use crate::reliable::recover;

/// Submits one payment row through the reliable path. An unknown payment is an error (exit 1);
/// a settled one is reported and not submitted again.
///
/// Only a `requested` payment is enqueued for submission. One that is `pending` or `unknown` is
/// never POSTed again before a query: it is queried now ([`crate::reliable::recover::query_now`]:
/// settled from the Gateway's record, or resubmitted with the same key if the Gateway never saw
/// it), or, while its attempt may still be in flight, left to recovery, which asks once the
/// attempt's deadline has passed. Either way it says which, and exits 0.
///
/// PostgreSQL first: a `requested` payment is touched (committed) before the job goes to Redis,
/// so that if Redis loses the job, payment recovery resubmits the payment once
/// `payments.recovery_after_secs` have passed.
pub async fn enqueue_payment(ctx: &AppContext, payment_id: uuid::Uuid) -> Result<(), CommandError> {
    let status = store::touch_requested(&ctx.pool, payment_id)
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
    if status != "requested" {
        let asked = recover::query_now::<PaymentCall>(ctx, payment_id)
            .await
            .context("asking the Gateway about the payment")?;
        println!(
            "payment {payment_id} ({status}): {}",
            describe_asked("payment", &asked)
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
        "payment {payment_id} ({status}) enqueued for submission ({id}); Idempotency-Key = {payment_id}"
    );
    Ok(())
}

/// What `enqueue payment|approval` did with a row it did not POST (see [`enqueue_payment`]).
pub(super) fn describe_asked(resource: &str, asked: &recover::Asked) -> String {
    match asked {
        recover::Asked::InFlight { deadline } => format!(
            "its submission attempt may still be in flight (until {}); nothing sent: recovery \
             queries the Gateway once that has passed",
            deadline.map_or_else(|| "-".to_owned(), |d| d.to_rfc3339())
        ),
        recover::Asked::Queried(r) if r.settled > 0 => {
            "queried the Gateway now, nothing sent: settled from its record".to_owned()
        }
        recover::Asked::Queried(r) if r.resubmitted > 0 => format!(
            "queried the Gateway now: it never saw this {resource} (404), so it is resubmitted \
             with the same Idempotency-Key"
        ),
        recover::Asked::Queried(r) if r.refused > 0 => format!(
            "queried the Gateway now: it never saw this {resource} (404), and it cannot be \
             submitted: made final with the reason, nothing sent"
        ),
        recover::Asked::Queried(r) if r.skipped > 0 => {
            "changed meanwhile by another path; nothing sent".to_owned()
        }
        recover::Asked::Queried(_) => "queried the Gateway now, nothing sent: no decision yet \
                                       (or no answer); recovery asks again"
            .to_owned(),
    }
}

/// Hands one channel callback to the callback job, as the ingress would: committed as `received`
/// (with its body) in PostgreSQL first, then enqueued, so that a Redis loss cannot lose it (the
/// sweep of `received` callbacks re-enqueues it). A final callback (applied, or failed as a
/// contradiction of a final decision) is counted, not enqueued.
pub async fn enqueue_callback(
    ctx: &AppContext,
    channel: &str,
    callback_id: &str,
    body_file: &Path,
) -> Result<(), CommandError> {
    callback::check_key(channel, callback_id)
        .map_err(|refused| CommandError::Usage(format!("callback refused: {refused}")))?;
    let bytes = std::fs::read(body_file)
        .with_context(|| format!("reading the callback body from {}", body_file.display()))?;
    // Reduced to the fields the contract knows (nothing else is stored or queued), even when it
    // is not valid UTF-8: the job records a malformed body as such.
    let body = callback::known_fields(&String::from_utf8_lossy(&bytes));
    match callback::record_received(&ctx.pool, channel, callback_id, &body)
        .await
        .context("recording the callback delivery")?
    {
        callback::Received::AlreadyApplied => {
            println!("callback {channel}/{callback_id} was already applied; delivery counted, not applied again");
            return Ok(());
        }
        callback::Received::AlreadyContradicted => {
            println!("callback {channel}/{callback_id} already failed as a contradiction of a final decision; delivery counted, not processed again");
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
