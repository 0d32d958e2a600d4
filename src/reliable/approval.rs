//! The description of an approval (spec section 7): `POST /v1/approvals`, `approved`/`declined`/
//! `failed` final, `in_review` waiting; a 4xx is the Gateway refusing the request, which is the
//! final status `failed`. An approval with an unknown `kind`, or a `limit_change` without an
//! amount, is never sent.

use serde::Serialize;
use serde_json::json;
use sqlx::{FromRow, PgConnection};
use uuid::Uuid;

use super::kind::{impl_row, Answer, Arrival, Kind, Names, Tracking};
use super::pending::OutboxEvent;
use crate::context::AppContext;
use crate::gateway::{ApprovalQuery, ApprovalRequest, ApprovalResult, CallResult, APPROVAL_KINDS};
use crate::telemetry::metrics::APPROVAL_DECISIONS;
use cardworker_jobs::SubmitApproval;

/// One approval, as stored.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, Serialize)]
pub struct ApprovalRow {
    /// Also the Gateway's `Idempotency-Key`, always.
    pub approval_id: Uuid,
    /// The card it is about.
    pub card_ref: String,
    /// `issue`, `limit_change` or `unfreeze` (anything else is refused, never sent).
    pub kind: String,
    /// The new limit in minor units (`limit_change` only).
    pub amount_minor: Option<i64>,
    /// Why the worker refused to submit it (then `status` is the final `failed`).
    pub failure_reason: Option<String>,
    /// `status` (`requested`, `pending`, `in_review`, `approved`, `declined`, `failed` or
    /// `unknown`) and the rest of the reliable path's columns.
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub tracking: Tracking,
}

impl ApprovalRow {
    /// Why this approval's own columns cannot be submitted (bad input), if they cannot. Its card
    /// is checked by [`Approval::refuse`], which the job and the CLI ask.
    pub fn refusal(&self) -> Option<String> {
        if !APPROVAL_KINDS.contains(&self.kind.as_str()) {
            return Some(format!(
                "unknown kind {:?} (expected one of {})",
                crate::gateway::redact_digits(&self.kind),
                APPROVAL_KINDS.join(", ")
            ));
        }
        match (self.kind.as_str(), self.amount_minor) {
            ("limit_change", None) => Some("a limit_change needs amount_minor".to_owned()),
            ("limit_change", Some(a)) if a <= 0 => Some(format!(
                "a limit_change needs a positive amount_minor, not {a}"
            )),
            _ => None,
        }
    }

    /// Approved, declined or failed.
    pub fn is_decided(&self) -> bool {
        Approval::is_final(&self.tracking.status)
    }
}

impl_row!(ApprovalRow, approval_id);

/// The approval kind of reliable call.
#[derive(Debug, Clone, Copy)]
pub struct Approval;

impl Kind for Approval {
    const RESOURCE: &'static str = "approval";
    const TABLE: &'static str = "approvals";
    const ID: &'static str = "approval_id";
    const COLUMNS: &'static str =
        "approval_id, card_ref, kind, amount_minor, failure_reason, status, channel_ref, \
         submissions, attempt_log_id, attempt_deadline, created_at, updated_at";
    const FINAL_SQL: &'static str = "'approved', 'declined', 'failed'";
    const FINAL: &'static [&'static str] = &["approved", "declined", "failed"];
    const WAITING: Option<&'static str> = Some("in_review");
    const CONFLICTING_CALLBACK_FAILS: bool = false;
    const NAMES: Names = Names {
        submit_scenario: "approval_submit",
        query_scenario: "approval_recovery_query",
        submit_started: "approval.submit_started",
        submit_refused: "approval.submit_refused",
        unknown: "approval.unknown",
        submit_failed: "approval.submit_failed",
        waiting: "approval.in_review",
        attempt_closed: "approval.attempt_closed",
        recovered: "approval.recovered",
        resubmitted: "approval.resubmitted",
        recovery_query_failed: "approval.recovery_query_failed",
        recovery_skipped: "approval.recovery_skipped",
        conflict: "approval.conflict",
    };
    type Row = ApprovalRow;
    type Response = ApprovalResult;
    type Job = SubmitApproval;

    fn job(id: Uuid, retries: u32) -> SubmitApproval {
        SubmitApproval {
            approval_id: id,
            retries,
        }
    }

    const REFUSED: Option<(&'static str, &'static str)> = Some(("failed", "failure_reason"));

    async fn refuse(conn: &mut PgConnection, row: &ApprovalRow) -> sqlx::Result<Option<String>> {
        if let Some(why) = row.refusal() {
            return Ok(Some(why));
        }
        if crate::storage::cards::load(&mut *conn, &row.card_ref)
            .await?
            .is_none()
        {
            return Ok(Some(format!(
                "unknown card {:?} (no row in cards)",
                crate::gateway::redact_digits(&row.card_ref)
            )));
        }
        Ok(None)
    }

    fn describe(a: &ApprovalRow) -> (String, String, serde_json::Value) {
        let amount = a
            .amount_minor
            .map_or_else(String::new, |m| format!(" amount_minor={m}"));
        (
            format!(
                "POST /v1/approvals approval_id={} card_ref={} kind={}{amount}",
                a.approval_id, a.card_ref, a.kind
            ),
            format!(
                "approval {} ({}{amount}) for card {}",
                a.approval_id, a.kind, a.card_ref
            ),
            json!({ "approval_id": a.approval_id, "card_ref": a.card_ref, "kind": a.kind }),
        )
    }

    async fn submit(
        ctx: &AppContext,
        a: &ApprovalRow,
        correlation_id: Uuid,
    ) -> CallResult<ApprovalResult> {
        let request = ApprovalRequest {
            approval_id: a.approval_id,
            card_ref: a.card_ref.clone(),
            kind: a.kind.clone(),
            amount_minor: if a.kind == "limit_change" {
                a.amount_minor
            } else {
                None
            },
        };
        ctx.gateway.submit_approval(&request, correlation_id).await
    }

    async fn query(
        ctx: &AppContext,
        id: Uuid,
        correlation_id: Uuid,
    ) -> CallResult<Option<ApprovalResult>> {
        ctx.gateway
            .query_approval(id, correlation_id)
            .await
            .map(|q| match q {
                ApprovalQuery::Found(r) => Some(r),
                ApprovalQuery::NotFound => None,
            })
    }

    fn answer(r: &ApprovalResult) -> Answer {
        Answer {
            status: r.status.as_str(),
            channel_ref: r.channel_ref.clone(),
        }
    }

    fn refusal(http_status: Option<u16>) -> Option<&'static str> {
        http_status
            .filter(|s| (400..500).contains(s))
            .map(|_| "failed")
    }

    fn decision_event(_status: &str) -> &'static str {
        "approval.decided"
    }

    fn decided_event(
        a: &ApprovalRow,
        status: &str,
        channel_ref: Option<&str>,
        via: Arrival,
    ) -> OutboxEvent {
        OutboxEvent {
            aggregate_type: "approval",
            aggregate_id: a.approval_id.to_string(),
            event_type: "approval.decided",
            payload: json!({
                "approval_id": a.approval_id,
                "card_ref": a.card_ref,
                "kind": a.kind,
                "amount_minor": a.amount_minor,
                "status": status,
                "channel_ref": channel_ref,
                "via": via.as_str(),
            }),
        }
    }

    fn count_decision(status: &str, via: Arrival) {
        let status = match status {
            "approved" => "approved",
            "declined" => "declined",
            _ => "failed",
        };
        metrics::counter!(APPROVAL_DECISIONS, "status" => status, "via" => via.as_str())
            .increment(1);
    }
}

/// Registers every `cardworker_approval_decisions_total{status,via}` series at zero.
pub fn register_metrics() {
    for status in Approval::FINAL {
        for via in [Arrival::Response, Arrival::Query, Arrival::Callback] {
            let _ =
                metrics::counter!(APPROVAL_DECISIONS, "status" => *status, "via" => via.as_str());
        }
    }
}
