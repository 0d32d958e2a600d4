//! The submission job of any [`Kind`]: one row to its `POST`, through the reliable path.
//!
//! 1. One transaction locks the row. Only a `requested` row goes on: a row already `pending`
//!    has an open attempt (in flight, or its worker died mid-call: a killed pod's job comes back
//!    through apalis's orphan recovery), and an `unknown` one may have been acted on; neither is
//!    ever POSTed again before a query, which recovery (or `enqueue`) makes, and only a query
//!    answered 404 makes a row `requested` again. A final row, or one waiting for its decision
//!    (`in_review`), sends nothing either. A row the kind refuses (`Kind::refuse`: bad input, an
//!    unknown card) is made final with the reason in this transaction, once. Otherwise the
//!    transaction commits the `pending` integration log (with its audit event and link), sets
//!    the row `pending`, counts the submission and remembers the log as the row's open attempt,
//!    with its deadline ([`attempt_limit`] from now). Nothing is sent before this commit.
//! 2. The call, always with `Idempotency-Key = id` (the client sets it from the request; there is
//!    no other key anywhere), so a repeated submission can never act twice.
//! 3. One transaction locks the row again and finalises that log row with the change and its
//!    records:
//!    - a valid answer goes through [`decide`](super::decide::decide) (the first final decision wins; `in_review`
//!      waits; a different decision after a final one is a conflict, on record);
//!    - a refusal the kind reads as a decision (an approval's 4xx) is decided `failed` the same
//!      way;
//!    - **unknown** (timeout, dropped connection after sending, 5xx, 409 for a key the Gateway
//!      is still processing, unreadable 2xx): status `unknown`, never assumed failed; recovery
//!      settles it by asking the Gateway;
//!    - **not received** (refused before sending; a payment's 4xx): the status goes back to
//!      `requested`, and once that has committed a retry is scheduled through the intake with
//!      back-off, with the same key.
//!
//! A database error before the pending commit sends nothing and retries through the intake with
//! back-off. A database error after the call is retried briefly; if it persists, the pending row
//! stays and recovery settles the row from the Gateway's record.
//!
//! Steps 1 and 2 are here; step 3 (what the answer means and its one finalising transaction,
//! with its late-answer fallback) is `super::finish`; what a run reports ([`Submitted`]) and its
//! retry rules are `super::attempt`.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::attempt::{attempt_limit, backoff, Submitted, MAX_RETRIES};
use super::finish::{classify, record_outcome};
use super::kind::{Arrival, Kind, Row as _};
use super::pending::{begin_in, Pending, PendingCall, ReliableError};
use super::table;
use crate::context::AppContext;
use crate::storage::records::{insert_audit, AuditRecord};

/// Attempts at writing the outcome after the call before leaving it to recovery.
const FINISH_ATTEMPTS: u32 = 3;

/// A submission job's run: [`submit`], with a row that does not exist or cannot be submitted
/// made dead (it is on record; nothing was sent).
pub async fn run_job<K: Kind>(ctx: &AppContext, id: Uuid, retries: u32) -> anyhow::Result<()> {
    match submit::<K>(ctx, id, retries).await? {
        Submitted::UnknownRow => {
            anyhow::bail!("{} {id} does not exist; nothing was sent", K::RESOURCE)
        }
        Submitted::Refused(reason) => {
            // On record (final, with the reason): nothing to retry, so the job ends here.
            tracing::warn!(%id, %reason, "refused: made final with the reason; nothing was sent");
            Ok(())
        }
        other => {
            tracing::info!(outcome = ?other, "submission handled");
            Ok(())
        }
    }
}

/// Steps 1 to 3 of the module docs for row `id`, submission retry number `retries`.
pub async fn submit<K: Kind>(
    ctx: &AppContext,
    id: Uuid,
    retries: u32,
) -> anyhow::Result<Submitted> {
    let begun = match begin::<K>(ctx, id, attempt_limit(&ctx.config)).await {
        Ok(begun) => begun,
        Err(e) => return defer::<K>(ctx, id, retries, &e).await,
    };
    let (row, pending) = match begun {
        Begun::Done(done) => {
            if let Submitted::UnknownRow = &done {
                record_unknown_row::<K>(ctx, id).await;
            }
            return Ok(done);
        }
        Begun::Started { row, pending } => (row, pending),
    };

    let result = K::submit(ctx, &row, pending.correlation_id).await;
    let decision = classify::<K>(&row, retries, &result);

    let mut last_error = None;
    for attempt in 0..FINISH_ATTEMPTS {
        match record_outcome::<K>(ctx, &row, &pending, &result, &decision).await {
            Ok(submitted) => {
                // Only after the outcome committed: a retry that ran before it would find the
                // row `pending`, end, and leave it `requested` with no job once the commit landed.
                if let Some(delay) = decision.retry_in {
                    ctx.producer
                        .enqueue_after(&K::job(id, retries + 1), delay)
                        .await
                        .with_context(|| {
                            format!(
                                "{} {id} is back to requested, but its retry could not be \
                                 scheduled; recovery resubmits it after its recovery_after_secs \
                                 (or `cardworker enqueue {} --{}-id {id}` now)",
                                K::RESOURCE,
                                K::RESOURCE,
                                K::RESOURCE
                            )
                        })?;
                }
                return Ok(submitted);
            }
            Err(e) => {
                tracing::warn!(attempt, error = %e, "recording the submission outcome failed; retrying");
                last_error = Some(e);
                tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
            }
        }
    }
    Err(anyhow::anyhow!(
        "{} {id}: the Gateway's answer ({}) could not be recorded: {}; the pending log #{} \
         stays and recovery settles it from the Gateway's record once the attempt's deadline \
         has passed",
        K::RESOURCE,
        result.outcome.kind(),
        last_error.map_or_else(String::new, |e| e.to_string()),
        pending.log_id,
    ))
}

enum Begun<R> {
    Done(Submitted),
    Started { row: Box<R>, pending: Pending },
}

/// Step 1: one transaction; pending before the call. Only a `requested` row is sent: `pending`
/// and `unknown` rows are never POSTed again before a query (recovery's, or the one `enqueue`
/// asks for), and only a query answered 404 makes a row `requested` again.
async fn begin<K: Kind>(
    ctx: &AppContext,
    id: Uuid,
    limit: Duration,
) -> Result<Begun<K::Row>, ReliableError> {
    let mut tx = ctx.pool.begin().await?;
    let Some(row) = table::lock::<K>(&mut tx, id).await? else {
        return Ok(Begun::Done(Submitted::UnknownRow));
    };
    let status = row.status();
    if K::is_final(status) {
        return Ok(Begun::Done(Submitted::AlreadySettled(status.to_owned())));
    }
    if K::WAITING == Some(status) {
        return Ok(Begun::Done(Submitted::Waiting(status.to_owned())));
    }
    if status == "pending" {
        return Ok(Begun::Done(Submitted::AttemptOpen {
            log_id: row.attempt_log_id(),
            deadline: row.tracking().attempt_deadline,
        }));
    }
    if status != "requested" {
        return Ok(Begun::Done(Submitted::AwaitsQuery(status.to_owned())));
    }
    if let Some(reason) = K::refuse(&mut tx, &row).await? {
        refuse_in::<K>(&mut tx, &row, &reason, "submission").await?;
        tx.commit().await?;
        return Ok(Begun::Done(Submitted::Refused(reason)));
    }
    let (request_summary, audit_summary, mut audit_details) = K::describe(&row);
    if let Some(details) = audit_details.as_object_mut() {
        details.insert("submission".into(), json!(row.submissions() + 1));
        details.insert("status_before".into(), json!(status));
        details.insert("idempotency_key".into(), json!(id));
    }
    let call = PendingCall {
        correlation_id: Uuid::new_v4(),
        resource_type: K::RESOURCE,
        resource_id: id.to_string(),
        scenario: K::NAMES.submit_scenario,
        request_summary: format!("{request_summary} Idempotency-Key={id}"),
        audit_event: K::NAMES.submit_started,
        audit_summary: format!("submission #{} of {audit_summary}", row.submissions() + 1),
        audit_details,
    };
    let pending = begin_in(&mut tx, &call).await?;
    table::start_attempt::<K>(&mut tx, id, pending.log_id, limit).await?;
    tx.commit().await?;
    Ok(Begun::Started {
        row: Box::new(row),
        pending,
    })
}

/// A row the worker refuses to submit (`K::refuse`): made final with the reason (where the kind
/// has a refused status), one `<kind>.submit_refused` audit event and, when it changed the row,
/// the decision's outbox event, in the caller's transaction. Once final, nobody submits, queries
/// or refuses it again, so this is written once. `by` says who found it (`submission`,
/// `recovery`).
pub(super) async fn refuse_in<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    reason: &str,
    by: &str,
) -> Result<(), ReliableError> {
    let id = row.id();
    let reason = crate::gateway::redact_digits(reason);
    let changed = table::mark_refused::<K>(conn, id, &reason).await?;
    let final_note = match K::REFUSED {
        Some((status, _)) if changed => format!("; {} is {status} (final)", K::RESOURCE),
        _ => String::new(),
    };
    insert_audit(
        conn,
        &AuditRecord {
            event_type: K::NAMES.submit_refused,
            correlation_id: None,
            summary: format!(
                "{} {id} not submitted: {reason}; nothing was sent{final_note}",
                K::RESOURCE
            ),
            details: json!({ K::ID: id, "reason": reason, "found_by": by, "changed": changed }),
            resource_type: K::RESOURCE,
            resource_id: id.to_string(),
        },
        None,
    )
    .await?;
    if let (Some((status, _)), true) = (K::REFUSED, changed) {
        let mut event = K::decided_event(row, status, None, Arrival::Refused);
        if let Some(payload) = event.payload.as_object_mut() {
            payload.insert("reason".into(), json!(reason));
        }
        event.insert(conn).await?;
    }
    Ok(())
}

/// A database error before anything was sent: retry through the intake with back-off.
async fn defer<K: Kind>(
    ctx: &AppContext,
    id: Uuid,
    retries: u32,
    error: &ReliableError,
) -> anyhow::Result<Submitted> {
    if retries >= MAX_RETRIES {
        anyhow::bail!(
            "{} {id}: database unavailable before submission after {retries} retries ({error}); \
             nothing was sent; `cardworker enqueue {}` resubmits it",
            K::RESOURCE,
            K::RESOURCE
        );
    }
    let delay = backoff(retries);
    ctx.producer
        .enqueue_after(&K::job(id, retries + 1), delay)
        .await
        .with_context(|| {
            format!(
                "{} {id}: database error before submission ({error}) and the retry could not be scheduled",
                K::RESOURCE
            )
        })?;
    tracing::warn!(error = %error, retry_in_ms = delay.as_millis() as u64, "database error before the pending commit; nothing sent, retry scheduled");
    Ok(Submitted::Deferred(delay))
}

/// A row that does not exist is recorded (audit) before the job is made dead.
async fn record_unknown_row<K: Kind>(ctx: &AppContext, id: Uuid) {
    let written = async {
        let mut conn = ctx.pool.acquire().await?;
        insert_audit(
            &mut conn,
            &AuditRecord {
                event_type: K::NAMES.submit_refused,
                correlation_id: None,
                summary: format!(
                    "{} {id} not submitted: unknown {}; nothing was sent",
                    K::RESOURCE,
                    K::RESOURCE
                ),
                details: json!({ K::ID: id, "reason": format!("unknown {}", K::RESOURCE) }),
                resource_type: K::RESOURCE,
                resource_id: id.to_string(),
            },
            None,
        )
        .await
    }
    .await;
    if let Err(e) = written {
        tracing::error!(%id, error = %e, "could not record the refused submission");
    }
}
