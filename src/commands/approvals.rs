//! `enqueue approval`: one approval row through the reliable path.

use anyhow::Context as _;
use cardworker_jobs::SubmitApproval;
use serde_json::json;

use super::operator::{self, Action};
use super::CommandError;
use crate::context::AppContext;
use crate::settle::approval::Approval;
use crate::settle::table;
use crate::storage::cards;

/// Submits one approval row through the reliable path.
///
/// Refused (exit 1, nothing queued, nothing changed): an unknown approval, an unknown `kind`, a
/// `limit_change` without an amount, a card that does not exist. A decided approval, or one
/// already submitted and waiting (`pending`, `in_review`), is reported and not submitted again.
///
/// PostgreSQL first: a `requested` approval is touched (committed) before the job goes to Redis,
/// so that if Redis loses the job, approval recovery submits it once
/// `approvals.recovery_after_secs` have passed.
pub async fn enqueue_approval(
    ctx: &AppContext,
    approval_id: uuid::Uuid,
    reason: Option<String>,
) -> Result<(), CommandError> {
    let approval = table::load::<Approval>(&ctx.pool, approval_id)
        .await
        .context("loading the approval")?
        .ok_or_else(|| {
            anyhow::anyhow!("unknown approval {approval_id}: there is no such row in approvals; nothing enqueued")
        })?;
    if let Some(why) = approval.refusal() {
        return Err(
            anyhow::anyhow!("approval {approval_id} refused: {why}; nothing enqueued").into(),
        );
    }
    if cards::load(&ctx.pool, &approval.card_ref)
        .await
        .context("loading the approval's card")?
        .is_none()
    {
        return Err(anyhow::anyhow!(
            "approval {approval_id} refused: unknown card {:?} (no row in cards); nothing enqueued",
            approval.card_ref
        )
        .into());
    }
    let status = table::touch_requested::<Approval>(&ctx.pool, approval_id)
        .await
        .context("recording the approval's submission request")?
        .ok_or_else(|| anyhow::anyhow!("unknown approval {approval_id}"))?;
    if !matches!(status.as_str(), "requested" | "unknown") {
        println!(
            "approval {approval_id} is already {status} (channel_ref {}); not submitted again",
            approval.tracking.channel_ref.as_deref().unwrap_or("-")
        );
        return Ok(());
    }
    let id = ctx
        .producer
        .enqueue(&SubmitApproval {
            approval_id,
            retries: 0,
        })
        .await
        .context(
            "enqueueing the approval submission (it stays requested; approval recovery submits \
             it after approvals.recovery_after_secs)",
        )?;
    println!(
        "approval {approval_id} ({status}, {} for card {}) enqueued for submission ({id}); \
         Idempotency-Key = {approval_id}",
        approval.kind, approval.card_ref
    );
    let recorded = Action::new(
        "enqueue_approval",
        "approval",
        vec![approval_id.to_string()],
        format!(
            "approval {approval_id} ({}) of card {} enqueued for submission by an operator",
            approval.kind, approval.card_ref
        ),
        reason,
    )
    .with_details(json!({"card_ref": approval.card_ref, "status": status}));
    operator::record_applied(&ctx.pool, &recorded).await;
    Ok(())
}
