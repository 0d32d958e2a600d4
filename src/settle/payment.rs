//! The description of a payment (spec section 1): `POST /v1/payments`, `accepted`/`rejected`
//! final, no waiting status; a 4xx is "not received" (retried with the same key while nothing
//! earlier can have reached the Gateway).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sqlx::FromRow;
use uuid::Uuid;

use super::{Answer, Kind, Names, Row, Via};
use crate::context::AppContext;
use crate::gateway::{CallResult, PaymentQuery, PaymentRequest, PaymentResult};
use crate::storage::reliable::OutboxEvent;
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
    /// `requested`, `pending`, `accepted`, `rejected` or `unknown`.
    pub status: String,
    /// The channel's reference once settled.
    pub channel_ref: Option<String>,
    /// Submissions sent to the Gateway.
    pub submissions: i32,
    /// The `pending` log of the latest submission attempt (closed once the attempt ends).
    pub attempt_log_id: Option<i64>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed (recovery picks unsettled payments by it).
    pub updated_at: DateTime<Utc>,
}

impl Payment {
    /// Accepted or rejected: the Gateway decided, and the payment is never submitted again.
    pub fn is_settled(&self) -> bool {
        PaymentCall::is_final(&self.status)
    }
}

impl Row for Payment {
    fn id(&self) -> Uuid {
        self.payment_id
    }
    fn card_ref(&self) -> &str {
        &self.card_ref
    }
    fn status(&self) -> &str {
        &self.status
    }
    fn submissions(&self) -> i32 {
        self.submissions
    }
    fn attempt_log_id(&self) -> Option<i64> {
        self.attempt_log_id
    }
    fn updated_at(&self) -> DateTime<Utc> {
        self.updated_at
    }
}

/// The payment kind of reliable call.
#[derive(Debug, Clone, Copy)]
pub struct PaymentCall;

impl Kind for PaymentCall {
    const RESOURCE: &'static str = "payment";
    const TABLE: &'static str = "payments";
    const ID: &'static str = "payment_id";
    const COLUMNS: &'static str = "payment_id, card_ref, amount_minor, currency, status, \
                                   channel_ref, submissions, attempt_log_id, created_at, updated_at";
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
        via: Via,
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
                    Via::Response => "submit",
                    Via::Query => "recovery",
                    Via::Callback => "callback",
                },
            }),
        }
    }
}
