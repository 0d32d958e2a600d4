//! `enqueue approval`: one approval row through the reliable path.

use anyhow::Context as _;
use cardworker_jobs::SubmitApproval;
use serde_json::json;

use super::operator::{self, Action, Operator};
use super::CommandError;
use crate::context::AppContext;
use crate::reliable::approval::{Approval, ApprovalRow};
use crate::reliable::recover;
use crate::reliable::{table, Kind as _};

/// Submits one approval row through the reliable path.
///
/// A decided approval is reported and not submitted again. Refused (exit 1, nothing queued,
/// nothing changed), with the reason the submission job gives (`Kind::refuse`): an unknown
/// approval, an unknown `kind`, a `limit_change` without an amount, a card that does not exist.
/// Only a `requested` approval is enqueued for submission; one that is `pending` or `unknown` is
/// never POSTed again before a query: it is queried now, or left to recovery while its attempt
/// may still be in flight, and it says which (see `enqueue_payment`). One `in_review` is left to
/// recovery's review queries.
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
    if approval.is_decided() {
        report_decided(&approval);
        return Ok(());
    }
    refuse_if_invalid(ctx, &approval).await?;
    let status = table::touch_requested::<Approval>(&ctx.pool, approval_id)
        .await
        .context("recording the approval's submission request")?
        .ok_or_else(|| anyhow::anyhow!("unknown approval {approval_id}"))?;
    if matches!(status.as_str(), "pending" | "unknown") {
        let asked = recover::query_now::<Approval>(ctx, approval_id)
            .await
            .context("asking the Gateway about the approval")?;
        println!(
            "approval {approval_id} ({status}): {}",
            super::payments::describe_asked("approval", &asked)
        );
        return Ok(());
    }
    if status != "requested" {
        println!(
            "approval {approval_id} is {status} (channel_ref {}); not submitted again: recovery \
             asks the Gateway for its decision",
            approval.tracking.channel_ref.as_deref().unwrap_or("-")
        );
        return Ok(());
    }
    enqueue(ctx, &approval, &status, reason).await
}

/// Says that the approval is decided: it is not submitted again.
fn report_decided(approval: &ApprovalRow) {
    println!(
        "approval {} is already {} (channel_ref {}{}); not submitted again",
        approval.approval_id,
        approval.tracking.status,
        approval.tracking.channel_ref.as_deref().unwrap_or("-"),
        approval
            .failure_reason
            .as_deref()
            .map(|r| format!(", reason: {r}"))
            .unwrap_or_default()
    );
}

/// Refuses (exit 1, nothing queued) an approval the submission job would refuse, with its reason.
async fn refuse_if_invalid(ctx: &AppContext, approval: &ApprovalRow) -> Result<(), CommandError> {
    let mut conn = ctx
        .pool
        .acquire()
        .await
        .context("connecting to PostgreSQL")?;
    if let Some(why) = Approval::refuse(&mut conn, approval)
        .await
        .context("checking the approval")?
    {
        let approval_id = approval.approval_id;
        return Err(
            anyhow::anyhow!("approval {approval_id} refused: {why}; nothing enqueued").into(),
        );
    }
    Ok(())
}

/// Enqueues the `requested` approval's submission, with its `operator.enqueue_approval` audit
/// event (not enqueued when the event cannot be written).
async fn enqueue(
    ctx: &AppContext,
    approval: &ApprovalRow,
    status: &str,
    reason: Option<String>,
) -> Result<(), CommandError> {
    let approval_id = approval.approval_id;
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
    let id = operator::carry_out(&ctx.pool, &recorded, &Operator::cli(), async {
        let id = ctx
            .producer
            .enqueue(&SubmitApproval {
                approval_id,
                retries: 0,
            })
            .await
            .context(
                "enqueueing the approval submission (it stays requested; approval recovery \
                 submits it after approvals.recovery_after_secs)",
            )?;
        Ok((id, json!({})))
    })
    .await
    .map_err(anyhow::Error::from)?;
    println!(
        "approval {approval_id} ({status}, {} for card {}) enqueued for submission ({id}); \
         Idempotency-Key = {approval_id}",
        approval.kind, approval.card_ref
    );
    Ok(())
}
