//! `SubmitPayment`: one payment row to `POST /v1/payments`, through the reliable path.
//!
//! 1. One transaction locks the payment, commits the `pending` integration log (with its audit
//!    event and link), sets the payment `pending`, counts the submission and remembers the log
//!    as the payment's open attempt. Nothing is sent before this commit. A payment already
//!    `pending` has an open attempt (in flight, or its worker died mid-call: a killed pod's job
//!    comes back through apalis's orphan recovery): nothing is sent, and payment recovery asks
//!    the Gateway about it, so a crash never turns into a second submission.
//! 2. The call, always with `Idempotency-Key = payment_id` (the client sets it from the request;
//!    there is no other key anywhere), so a repeated submission can never pay twice.
//! 3. One transaction finalises that log row with the payment change and the outbox event:
//!    - a valid answer settles the payment (`accepted`/`rejected`, channel_ref);
//!    - **unknown** (timeout, dropped connection after sending, 5xx, unreadable 2xx): status
//!      `unknown`, never assumed failed; recovery settles it by asking the Gateway;
//!    - **failed** (refused before sending, 4xx): the Gateway did not act on *this* request. If
//!      no earlier attempt can have reached it (the payment was `requested`), the status goes
//!      back to `requested` and a retry is scheduled through the intake with back-off, with the
//!      same key. If an earlier attempt may have reached it (`pending`/`unknown` before), the
//!      status becomes `unknown`, so that recovery asks the Gateway instead of anyone assuming.
//!
//! A database error before the pending commit sends nothing and retries through the intake with
//! back-off. A database error after the call is retried briefly; if it persists, the pending row
//! stays and recovery settles the payment from the Gateway's record.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cardworker_jobs::SubmitPayment;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::store::{self, Payment};
use crate::backoff::{Backoff, Jitter};
use crate::config::Config;
use crate::context::AppContext;
use crate::gateway::{CallResult, Outcome, PaymentRequest, PaymentResult};
use crate::runner::RunJob;
use crate::storage::records::{insert_audit, insert_terminal_log, AuditRecord, LogRecord};
use crate::storage::reliable::{
    begin_in, FinalState, Finish, OutboxEvent, Pending, PendingCall, ReliableError,
};

/// Retries through the intake for a failed submission or a database error before the pending
/// commit, after which the job gives up (the payment stays `requested`, visible and resubmittable
/// by `cardworker enqueue payment`).
pub const MAX_RETRIES: u32 = 8;

/// First back-off delay; doubles per retry up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_secs(2);
/// Longest back-off delay.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Attempts at writing the outcome after the call before leaving it to recovery.
const FINISH_ATTEMPTS: u32 = 3;

impl RunJob for SubmitPayment {
    const KIND: &'static str = "payment";

    fn concurrency(config: &Config) -> usize {
        config.payments.concurrency as usize
    }

    /// The Gateway timeout bounds the call; the rest is two short transactions.
    fn timeout(config: &Config) -> Duration {
        config.gateway.timeout() + Duration::from_secs(30)
    }

    #[tracing::instrument(name = "job.submit_payment", skip_all, fields(payment_id = %self.payment_id, retries = self.retries))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        match submit(&ctx, &self).await? {
            Submitted::UnknownPayment => {
                anyhow::bail!(
                    "payment {} does not exist; nothing was sent",
                    self.payment_id
                )
            }
            other => {
                tracing::info!(outcome = ?other, "payment submission handled");
                Ok(())
            }
        }
    }
}

/// What one run of [`submit`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Submitted {
    /// No such payment: recorded (audit), nothing sent.
    UnknownPayment,
    /// Already accepted or rejected: nothing sent.
    AlreadySettled(String),
    /// `pending`: an earlier attempt is open (in flight, or its worker died mid-call). Nothing
    /// sent: whether the Gateway has it is for payment recovery to ask, never to assume.
    AttemptOpen {
        /// The open attempt's `pending` log.
        log_id: Option<i64>,
    },
    /// A database error before the pending commit: nothing sent, retry scheduled after this.
    Deferred(Duration),
    /// The Gateway answered; the payment is settled (or was settled meanwhile by another path).
    Answered {
        /// The attempt's log row.
        log_id: i64,
        /// `accepted` or `rejected`.
        status: String,
    },
    /// The Gateway may have acted; the payment is `unknown` until recovery settles it.
    Unknown {
        /// The attempt's log row.
        log_id: i64,
    },
    /// The request certainly had no effect.
    Failed {
        /// The attempt's log row.
        log_id: i64,
        /// The payment's status afterwards (`requested` or `unknown`).
        status: String,
        /// When the retry is due, if one was scheduled.
        retry_in: Option<Duration>,
    },
}

/// The back-off before retry number `retries + 1`: from [`BASE_BACKOFF`] doubling up to
/// [`MAX_BACKOFF`], jittered by ±20 % and still at most [`MAX_BACKOFF`].
pub fn backoff(retries: u32) -> Duration {
    Backoff::new(BASE_BACKOFF, MAX_BACKOFF, Jitter::Proportional(0.2)).delay(retries + 1)
}

/// Steps 1 to 3 of the module docs for one payment.
pub async fn submit(ctx: &AppContext, job: &SubmitPayment) -> anyhow::Result<Submitted> {
    let begun = match begin(ctx, job.payment_id).await {
        Ok(begun) => begun,
        Err(e) => return defer(ctx, job, &e).await,
    };
    let (payment, prior_status, pending) = match begun {
        Begun::Unknown => {
            record_unknown_payment(ctx, job.payment_id).await;
            return Ok(Submitted::UnknownPayment);
        }
        Begun::Settled(status) => return Ok(Submitted::AlreadySettled(status)),
        Begun::Open(log_id) => return Ok(Submitted::AttemptOpen { log_id }),
        Begun::Started {
            payment,
            prior_status,
            pending,
        } => (payment, prior_status, pending),
    };

    let request = PaymentRequest {
        payment_id: payment.payment_id,
        card_ref: payment.card_ref.clone(),
        amount_minor: payment.amount_minor,
        currency: payment.currency.clone(),
    };
    // The client sets `Idempotency-Key` from `request.payment_id`: one key per payment, ever.
    let result = ctx
        .gateway
        .submit_payment(&request, pending.correlation_id)
        .await;

    let decision = decide(&payment, &prior_status, job, &result);
    let retry_note = match decision.retry_in {
        // Scheduled before the outcome commits: if that commit is lost, the retry finds the
        // payment `pending` (an open attempt) and sends nothing; recovery asks the Gateway and
        // resubmits if it never saw the payment.
        Some(delay) => {
            let next = SubmitPayment {
                payment_id: payment.payment_id,
                retries: job.retries + 1,
            };
            match ctx.producer.enqueue_after(&next, delay).await {
                Ok(_) => None,
                Err(e) => Some(format!(
                    "the retry could not be scheduled ({e}); `cardworker enqueue payment --payment-id {}` resubmits it with the same key",
                    payment.payment_id
                )),
            }
        }
        None => None,
    };

    let mut last_error = None;
    for attempt in 0..FINISH_ATTEMPTS {
        match record_outcome(
            ctx,
            &payment,
            &pending,
            &result,
            &decision,
            retry_note.as_deref(),
        )
        .await
        {
            Ok(()) => {
                if let Some(note) = retry_note {
                    anyhow::bail!("payment {}: {note}", payment.payment_id);
                }
                return Ok(decision.submitted(pending.log_id));
            }
            Err(e) => {
                tracing::warn!(attempt, error = %e, "recording the payment outcome failed; retrying");
                last_error = Some(e);
                tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
            }
        }
    }
    Err(anyhow::anyhow!(
        "payment {}: the Gateway's answer ({}) could not be recorded: {}; the pending log #{} \
         stays and payment recovery settles the payment from the Gateway's record",
        payment.payment_id,
        result.outcome.kind(),
        last_error.map_or_else(String::new, |e| e.to_string()),
        pending.log_id,
    ))
}

enum Begun {
    Unknown,
    Settled(String),
    Open(Option<i64>),
    Started {
        payment: Box<Payment>,
        prior_status: String,
        pending: Pending,
    },
}

/// Step 1: one transaction; pending before the call.
async fn begin(ctx: &AppContext, payment_id: Uuid) -> Result<Begun, ReliableError> {
    let mut tx = ctx.pool.begin().await?;
    let Some(payment) = store::lock(&mut tx, payment_id).await? else {
        return Ok(Begun::Unknown);
    };
    if payment.is_settled() {
        return Ok(Begun::Settled(payment.status));
    }
    if payment.status == "pending" {
        return Ok(Begun::Open(payment.attempt_log_id));
    }
    let submission = payment.submissions + 1;
    let call = PendingCall {
        correlation_id: Uuid::new_v4(),
        resource_type: "payment",
        resource_id: payment_id.to_string(),
        scenario: "payment_submit",
        request_summary: format!(
            "POST /v1/payments payment_id={payment_id} card_ref={} amount_minor={} currency={} \
             Idempotency-Key={payment_id}",
            payment.card_ref, payment.amount_minor, payment.currency
        ),
        audit_event: "payment.submit_started",
        audit_summary: format!(
            "submission #{submission} of payment {payment_id} ({} {}) for card {}",
            payment.amount_minor, payment.currency, payment.card_ref
        ),
        audit_details: json!({
            "payment_id": payment_id,
            "card_ref": payment.card_ref,
            "submission": submission,
            "status_before": payment.status,
            "idempotency_key": payment_id,
        }),
    };
    let pending = begin_in(&mut tx, &call).await?;
    sqlx::query(
        "UPDATE payments
            SET status = 'pending', submissions = submissions + 1, attempt_log_id = $2,
                updated_at = now()
          WHERE payment_id = $1",
    )
    .bind(payment_id)
    .bind(pending.log_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    let prior_status = payment.status.clone();
    Ok(Begun::Started {
        payment: Box::new(payment),
        prior_status,
        pending,
    })
}

/// A database error before anything was sent: retry through the intake with back-off.
async fn defer(
    ctx: &AppContext,
    job: &SubmitPayment,
    error: &ReliableError,
) -> anyhow::Result<Submitted> {
    if job.retries >= MAX_RETRIES {
        anyhow::bail!(
            "payment {}: database unavailable before submission after {} retries ({error}); \
             nothing was sent; `cardworker enqueue payment` resubmits it",
            job.payment_id,
            job.retries
        );
    }
    let delay = backoff(job.retries);
    let next = SubmitPayment {
        payment_id: job.payment_id,
        retries: job.retries + 1,
    };
    ctx.producer
        .enqueue_after(&next, delay)
        .await
        .with_context(|| {
            format!(
                "payment {}: database error before submission ({error}) and the retry could not be scheduled",
                job.payment_id
            )
        })?;
    tracing::warn!(error = %error, retry_in_ms = delay.as_millis() as u64, "database error before the pending commit; nothing sent, retry scheduled");
    Ok(Submitted::Deferred(delay))
}

/// An unknown payment is recorded (audit) before the job is made dead.
async fn record_unknown_payment(ctx: &AppContext, payment_id: Uuid) {
    let written = async {
        let mut conn = ctx.pool.acquire().await?;
        insert_audit(
            &mut conn,
            &AuditRecord {
                event_type: "payment.submit_refused",
                correlation_id: None,
                summary: format!("payment {payment_id} does not exist; nothing was sent"),
                details: json!({ "payment_id": payment_id, "reason": "unknown payment" }),
                resource_type: "payment",
                resource_id: payment_id.to_string(),
            },
            None,
        )
        .await
    }
    .await;
    if let Err(e) = written {
        tracing::error!(%payment_id, error = %e, "could not record the unknown payment");
    }
}

/// What the answer means for the payment, decided before the finalising transaction.
struct Decision {
    state: FinalState,
    change: Change,
    retry_in: Option<Duration>,
    recovery_summary: String,
}

enum Change {
    Settle(PaymentResult),
    Mark(&'static str),
}

impl Decision {
    fn submitted(&self, log_id: i64) -> Submitted {
        match (&self.change, self.state) {
            (Change::Settle(r), _) => Submitted::Answered {
                log_id,
                status: r.status.as_str().to_owned(),
            },
            (Change::Mark(_), FinalState::Unknown) => Submitted::Unknown { log_id },
            (Change::Mark(status), _) => Submitted::Failed {
                log_id,
                status: (*status).to_owned(),
                retry_in: self.retry_in,
            },
        }
    }
}

fn decide(
    payment: &Payment,
    prior_status: &str,
    job: &SubmitPayment,
    result: &CallResult<PaymentResult>,
) -> Decision {
    match &result.outcome {
        Outcome::Valid(r) => Decision {
            state: FinalState::Succeeded,
            change: Change::Settle(r.clone()),
            retry_in: None,
            recovery_summary: format!("settled: {}", r.status),
        },
        Outcome::Unknown(_) => Decision {
            state: FinalState::Unknown,
            change: Change::Mark("unknown"),
            retry_in: None,
            recovery_summary: "the Gateway may have acted: payment left unknown; payment \
                               recovery asks GET /v1/payments/{id} and settles it"
                .to_owned(),
        },
        Outcome::Failed(_) if prior_status == "requested" => {
            if job.retries < MAX_RETRIES {
                let delay = backoff(job.retries);
                Decision {
                    state: FinalState::Failed,
                    change: Change::Mark("requested"),
                    retry_in: Some(delay),
                    recovery_summary: format!(
                        "not received by the Gateway: payment back to requested; retry {} of {MAX_RETRIES} in {} ms with the same Idempotency-Key",
                        job.retries + 1,
                        delay.as_millis()
                    ),
                }
            } else {
                Decision {
                    state: FinalState::Failed,
                    change: Change::Mark("requested"),
                    retry_in: None,
                    recovery_summary: format!(
                        "not received by the Gateway: payment back to requested; gave up after {MAX_RETRIES} retries; `cardworker enqueue payment --payment-id {}` resubmits it with the same key",
                        payment.payment_id
                    ),
                }
            }
        }
        Outcome::Failed(_) => Decision {
            state: FinalState::Failed,
            change: Change::Mark("unknown"),
            retry_in: None,
            recovery_summary: format!(
                "this request was not received, but an earlier attempt (status was {prior_status}) \
                 may have been: payment left unknown for recovery"
            ),
        },
    }
}

/// Step 3: the payment change, the finalised log row, its audit event and the outbox event, in
/// one transaction. If recovery or a callback already closed this attempt's log (the attempt
/// was slower than them), the answer is kept as a terminal record instead.
async fn record_outcome(
    ctx: &AppContext,
    payment: &Payment,
    pending: &Pending,
    result: &CallResult<PaymentResult>,
    decision: &Decision,
    retry_note: Option<&str>,
) -> Result<(), ReliableError> {
    let mut tx = ctx.pool.begin().await?;
    let finish = apply_change(&mut tx, payment, pending, result, decision, retry_note).await?;
    match pending.finish_in(&mut tx, &finish).await {
        Ok(()) => {
            tx.commit().await?;
            Ok(())
        }
        Err(ReliableError::NotPending(log_id)) => {
            tx.rollback().await?;
            let mut tx = ctx.pool.begin().await?;
            let mut finish =
                apply_change(&mut tx, payment, pending, result, decision, retry_note).await?;
            finish.recovery_summary = Some(format!(
                "late answer: pending log #{log_id} of this attempt had already been closed by \
                 another path; {}",
                finish.recovery_summary.unwrap_or_default()
            ));
            write_terminal(&mut tx, pending, result, &finish).await?;
            tx.commit().await?;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Applies the decided payment change and builds the finalisation that records it.
async fn apply_change(
    conn: &mut PgConnection,
    payment: &Payment,
    pending: &Pending,
    result: &CallResult<PaymentResult>,
    decision: &Decision,
    retry_note: Option<&str>,
) -> Result<Finish, ReliableError> {
    let id = payment.payment_id;
    let mut recovery = decision.recovery_summary.clone();
    if let Some(note) = retry_note {
        recovery = format!("{recovery}; {note}");
    }
    let (changed, audit_event, outbox) = match &decision.change {
        Change::Settle(r) => {
            let changed = store::settle(conn, id, r.status, &r.channel_ref).await?;
            let event = match r.status {
                crate::gateway::PaymentStatus::Accepted => "payment.accepted",
                crate::gateway::PaymentStatus::Rejected => "payment.rejected",
            };
            let outbox =
                changed.then(|| store::settled_event(payment, r.status, &r.channel_ref, "submit"));
            (changed, event, outbox)
        }
        Change::Mark(status) => {
            let changed = store::mark_attempt_outcome(conn, id, pending.log_id, status).await?;
            let event = if decision.state == FinalState::Unknown {
                "payment.unknown"
            } else {
                "payment.submit_failed"
            };
            let outbox = changed.then(|| OutboxEvent {
                aggregate_type: "payment",
                aggregate_id: id.to_string(),
                event_type: event,
                payload: json!({
                    "payment_id": id,
                    "card_ref": payment.card_ref,
                    "status": status,
                    "source": "submit",
                }),
            });
            (changed, event, outbox)
        }
    };
    if !changed {
        let now = store::load(&mut *conn, id).await?.map(|p| p.status);
        recovery = format!(
            "{recovery}; payment not changed by this attempt (now {}): settled meanwhile or \
             superseded by a newer attempt",
            now.as_deref().unwrap_or("gone")
        );
    }
    Ok(Finish {
        state: decision.state,
        response_summary: result.response_summary.clone(),
        http_status: result.http_status,
        error: result.outcome.failure().map(|f| f.reason.clone()),
        recovery_summary: Some(recovery.clone()),
        audit_event,
        audit_summary: format!(
            "payment {id} submission: {} ({})",
            result.outcome.kind(),
            recovery
        ),
        audit_details: json!({
            "payment_id": id,
            "outcome": result.outcome.kind(),
            "http_status": result.http_status,
            "changed": changed,
        }),
        outbox,
    })
}

/// The fallback of a late answer: a terminal log row with the same audit and outbox.
async fn write_terminal(
    conn: &mut PgConnection,
    pending: &Pending,
    result: &CallResult<PaymentResult>,
    finish: &Finish,
) -> Result<(), ReliableError> {
    let log_id = insert_terminal_log(
        conn,
        &LogRecord {
            correlation_id: pending.correlation_id,
            resource_type: "payment",
            resource_id: pending.resource_id.clone(),
            scenario: "payment_submit",
            state: finish.state.log_state(),
            request_summary: result.request_summary.clone(),
            response_summary: finish.response_summary.clone(),
            http_status: finish.http_status,
            error: finish.error.clone(),
            recovery_summary: finish.recovery_summary.clone(),
            started_at: pending.started_at,
            finished_at: chrono::Utc::now(),
        },
    )
    .await?;
    insert_audit(
        conn,
        &AuditRecord {
            event_type: finish.audit_event,
            correlation_id: Some(pending.correlation_id),
            summary: finish.audit_summary.clone(),
            details: finish.audit_details.clone(),
            resource_type: "payment",
            resource_id: pending.resource_id.clone(),
        },
        Some(log_id),
    )
    .await?;
    if let Some(event) = &finish.outbox {
        event.insert(conn).await?;
    }
    Ok(())
}
