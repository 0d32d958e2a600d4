//! The description of a payment (spec section 1): `POST /v1/payments`, `accepted`/`rejected`
//! final, no waiting status; a 4xx is "not received" (retried with the same key while nothing
//! earlier can have reached the Gateway).

use serde::Serialize;
use serde_json::json;
use sqlx::FromRow;
use uuid::Uuid;

use super::kind::{impl_row, Answer, Arrival, Kind, Names, Tracking};
use super::pending::OutboxEvent;
use crate::context::AppContext;
use crate::gateway::{CallResult, PaymentQuery, PaymentRequest, PaymentResult};
use cardworker_jobs::SubmitPayment;

/// One payment, as stored.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, Serialize)]
pub struct Payment {
    /// Also the Gateway's `Idempotency-Key`, always.
    pub payment_id: Uuid,
    /// The card paid with.
    pub card_ref: String,
    /// Amount in minor units.
    pub amount_minor: i64,
    /// ISO currency.
    pub currency: String,
    /// `status` (`requested`, `pending`, `accepted`, `rejected` or `unknown`) and the rest of
    /// the reliable path's columns.
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub tracking: Tracking,
}

impl Payment {
    /// Accepted or rejected: the Gateway decided, and the payment is never submitted again.
    pub fn is_settled(&self) -> bool {
        PaymentCall::is_final(&self.tracking.status)
    }
}

impl_row!(Payment, payment_id);

/// The payment kind of reliable call.
#[derive(Debug, Clone, Copy)]
pub struct PaymentCall;

impl Kind for PaymentCall {
    const RESOURCE: &'static str = "payment";
    const TABLE: &'static str = "payments";
    const ID: &'static str = "payment_id";
    const COLUMNS: &'static str = "payment_id, card_ref, amount_minor, currency, status, \
         channel_ref, submissions, attempt_log_id, attempt_deadline, created_at, updated_at";
    const FINAL_SQL: &'static str = "'accepted', 'rejected'";
    const FINAL: &'static [&'static str] = &["accepted", "rejected"];
    const WAITING: Option<&'static str> = None;
    const CONFLICTING_CALLBACK_FAILS: bool = true;
    const NAMES: Names = Names {
        submit_scenario: "payment_submit",
        query_scenario: "payment_recovery_query",
        submit_started: "payment.submit_started",
        submit_refused: "payment.submit_refused",
        unknown: "payment.unknown",
        submit_failed: "payment.submit_failed",
        waiting: "payment.answered",
        attempt_closed: "payment.attempt_closed",
        recovered: "payment.recovered",
        resubmitted: "payment.resubmitted",
        recovery_query_failed: "payment.recovery_query_failed",
        recovery_skipped: "payment.recovery_skipped",
        conflict: "payment.conflict",
    };
    type Row = Payment;
    type Response = PaymentResult;
    type Job = SubmitPayment;

    fn job(id: Uuid, retries: u32) -> SubmitPayment {
        SubmitPayment {
            payment_id: id,
            retries,
        }
    }

    fn describe(p: &Payment) -> (String, String, serde_json::Value) {
        (
            format!(
                "POST /v1/payments payment_id={} card_ref={} amount_minor={} currency={}",
                p.payment_id, p.card_ref, p.amount_minor, p.currency
            ),
            format!(
                "payment {} ({} {}) for card {}",
                p.payment_id, p.amount_minor, p.currency, p.card_ref
            ),
            json!({ "payment_id": p.payment_id, "card_ref": p.card_ref }),
        )
    }

    async fn submit(
        ctx: &AppContext,
        p: &Payment,
        correlation_id: Uuid,
    ) -> CallResult<PaymentResult> {
        let request = PaymentRequest {
            payment_id: p.payment_id,
            card_ref: p.card_ref.clone(),
            amount_minor: p.amount_minor,
            currency: p.currency.clone(),
        };
        ctx.gateway.submit_payment(&request, correlation_id).await
    }

    async fn query(
        ctx: &AppContext,
        id: Uuid,
        correlation_id: Uuid,
    ) -> CallResult<Option<PaymentResult>> {
        ctx.gateway
            .query_payment(id, correlation_id)
            .await
            .map(|q| match q {
                PaymentQuery::Found(r) => Some(r),
                PaymentQuery::NotFound => None,
            })
    }

    fn answer(r: &PaymentResult) -> Answer {
        Answer {
            status: r.status.as_str(),
            channel_ref: r.channel_ref.clone(),
        }
    }

    fn decision_event(status: &str) -> &'static str {
        if status == "accepted" {
            "payment.accepted"
        } else {
            "payment.rejected"
        }
    }

    fn decided_event(
        p: &Payment,
        status: &str,
        channel_ref: Option<&str>,
        via: Arrival,
    ) -> OutboxEvent {
        OutboxEvent {
            aggregate_type: "payment",
            aggregate_id: p.payment_id.to_string(),
            event_type: Self::decision_event(status),
            payload: json!({
                "payment_id": p.payment_id,
                "card_ref": p.card_ref,
                "amount_minor": p.amount_minor,
                "currency": p.currency,
                "status": status,
                "channel_ref": channel_ref,
                "source": match via {
                    Arrival::Response => "submit",
                    Arrival::Query => "recovery",
                    Arrival::Callback => "callback",
                    Arrival::Refused => "refused",
                },
            }),
        }
    }
}
