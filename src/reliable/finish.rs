//! Step 3 of a submission (`super::submit`): what the Gateway's answer means for the row
//! (`classify`, decided before any transaction), and the one transaction that applies it and
//! finalises the attempt's `pending` log row with its audit and outbox events
//! (`record_outcome`). When recovery or a callback closed that log first (the attempt was
//! slower than them), the answer is kept as a terminal record instead.

use std::time::Duration;

use serde_json::json;
use sqlx::PgConnection;

use super::attempt::{backoff, Submitted, MAX_RETRIES};
use super::decide::{decide, Decided};
use super::kind::{Arrival, Kind, Row as _};
use super::pending::{FinalState, Finish, OutboxEvent, Pending, ReliableError};
use super::table;
use crate::context::AppContext;
use crate::gateway::{CallResult, Outcome};
use crate::storage::records::{insert_audit, insert_terminal_log, AuditRecord, LogRecord};

/// What the answer means for the row, decided before the finalising transaction.
pub(super) struct Decision {
    /// How the attempt's log row ends.
    state: FinalState,
    /// The change to the row.
    change: Change,
    /// When the retry is due, if one is scheduled (after the outcome committed).
    pub(super) retry_in: Option<Duration>,
    /// What happens next, as the log row and the audit event say.
    recovery_summary: String,
}

enum Change {
    /// A status the Gateway gave (a decision, or the waiting status), with its reference.
    Answer(&'static str, Option<String>),
    /// A status of ours: `requested` (not received) or `unknown`.
    Mark(&'static str),
}

/// What the answer `result` of submission retry number `retries` means for `row`.
pub(super) fn classify<K: Kind>(
    row: &K::Row,
    retries: u32,
    result: &CallResult<K::Response>,
) -> Decision {
    let id = row.id();
    let prior = row.status();
    match &result.outcome {
        Outcome::Valid(r) => {
            let answer = K::answer(r);
            Decision {
                state: FinalState::Succeeded,
                recovery_summary: if K::is_final(answer.status) {
                    format!("settled: {}", answer.status)
                } else {
                    format!("answered {}: waiting for the decision", answer.status)
                },
                change: Change::Answer(answer.status, Some(answer.channel_ref)),
                retry_in: None,
            }
        }
        Outcome::Unknown(_) => Decision {
            state: FinalState::Unknown,
            change: Change::Mark("unknown"),
            retry_in: None,
            recovery_summary: format!(
                "the Gateway may have acted: {} left unknown; recovery asks the Gateway's record \
                 and settles it",
                K::RESOURCE
            ),
        },
        Outcome::Failed(_) => match K::refusal(result.http_status) {
            Some(status) => Decision {
                state: FinalState::Failed,
                change: Change::Answer(status, None),
                retry_in: None,
                recovery_summary: format!("the Gateway refused the request: {status} (final)"),
            },
            None if prior == "requested" => {
                let retry_in = (retries < MAX_RETRIES).then(|| backoff(retries));
                let next = match retry_in {
                    Some(delay) => format!(
                        "retry {} of {MAX_RETRIES} in {} ms with the same Idempotency-Key",
                        retries + 1,
                        delay.as_millis()
                    ),
                    None => format!(
                        "gave up after {MAX_RETRIES} retries; `cardworker enqueue {} --{}-id {id}` \
                         resubmits it with the same key",
                        K::RESOURCE,
                        K::RESOURCE
                    ),
                };
                Decision {
                    state: FinalState::Failed,
                    change: Change::Mark("requested"),
                    retry_in,
                    recovery_summary: format!(
                        "not received by the Gateway: {} back to requested; {next}",
                        K::RESOURCE
                    ),
                }
            }
            None => Decision {
                state: FinalState::Failed,
                change: Change::Mark("unknown"),
                retry_in: None,
                recovery_summary: format!(
                    "this request was not received, but an earlier attempt (status was {prior}) \
                     may have been: {} left unknown for recovery",
                    K::RESOURCE
                ),
            },
        },
    }
}

/// Step 3: the change, the finalised log row, its audit event and the outbox event, in one
/// transaction. If recovery or a callback already closed this attempt's log (the attempt was
/// slower than them), the answer is kept as a terminal record instead.
pub(super) async fn record_outcome<K: Kind>(
    ctx: &AppContext,
    row: &K::Row,
    pending: &Pending,
    result: &CallResult<K::Response>,
    decision: &Decision,
) -> Result<Submitted, ReliableError> {
    let mut tx = ctx.pool.begin().await?;
    let (finish, submitted, applied) =
        apply_change::<K>(&mut tx, row, pending, result, decision).await?;
    match pending.finish_in(&mut tx, &finish).await {
        Ok(()) => {
            tx.commit().await?;
            count_applied::<K>(applied, Arrival::Response);
            Ok(submitted)
        }
        Err(ReliableError::NotPending(log_id)) => {
            tx.rollback().await?;
            let mut tx = ctx.pool.begin().await?;
            let (mut finish, submitted, applied) =
                apply_change::<K>(&mut tx, row, pending, result, decision).await?;
            finish.recovery_summary = Some(format!(
                "late answer: pending log #{log_id} of this attempt had already been closed by \
                 another path; {}",
                finish.recovery_summary.unwrap_or_default()
            ));
            write_terminal::<K>(&mut tx, pending, result, &finish).await?;
            tx.commit().await?;
            count_applied::<K>(applied, Arrival::Response);
            Ok(submitted)
        }
        Err(e) => Err(e),
    }
}

/// Counts a final decision this attempt applied, once its transaction committed.
fn count_applied<K: Kind>(applied: Option<&str>, via: Arrival) {
    if let Some(status) = applied {
        K::count_decision(status, via);
    }
}

/// What applying the decided change did to the row.
struct Applied {
    /// Whether this attempt changed the row.
    changed: bool,
    /// The audit event type of the finalisation.
    audit_event: &'static str,
    /// The outbox event to write with it (`decide` writes a decision's own).
    outbox: Option<OutboxEvent>,
    /// What the run reports.
    submitted: Submitted,
    /// The final status applied now (counted after the commit).
    applied: Option<&'static str>,
    /// The recovery summary, with what became of the change.
    recovery: String,
}

/// Applies the decided change to the row (locked first) and builds the finalisation that
/// records it, with the final status it applied (to be counted after the commit).
async fn apply_change<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    pending: &Pending,
    result: &CallResult<K::Response>,
    decision: &Decision,
) -> Result<(Finish, Submitted, Option<&'static str>), ReliableError> {
    let id = row.id();
    let current = table::lock::<K>(conn, id)
        .await?
        .ok_or(ReliableError::Domain(anyhow::anyhow!(
            "{} {id} disappeared during its submission",
            K::RESOURCE
        )))?;
    let mut done = match &decision.change {
        Change::Answer(status, channel_ref) => {
            apply_answer::<K>(
                conn,
                &current,
                pending,
                decision,
                status,
                channel_ref.as_deref(),
            )
            .await?
        }
        Change::Mark(status) => apply_mark::<K>(conn, row, pending, decision, status).await?,
    };
    if !done.changed {
        let now = table::load::<K>(&mut *conn, id).await?;
        done.recovery = format!(
            "{}; {} not changed by this attempt (now {}): settled meanwhile or \
             superseded by a newer attempt",
            done.recovery,
            K::RESOURCE,
            now.as_ref().map_or("gone", |r| r.status())
        );
    }
    let finish = Finish {
        state: decision.state,
        response_summary: result.response_summary.clone(),
        http_status: result.http_status,
        error: result.outcome.failure().map(|f| f.reason.clone()),
        recovery_summary: Some(done.recovery.clone()),
        audit_event: done.audit_event,
        audit_summary: format!(
            "{} {id} submission: {} ({})",
            K::RESOURCE,
            result.outcome.kind(),
            done.recovery
        ),
        audit_details: json!({
            K::ID: id,
            "outcome": result.outcome.kind(),
            "http_status": result.http_status,
            "changed": done.changed,
        }),
        outbox: done.outbox,
    };
    Ok((finish, done.submitted, done.applied))
}

/// A status the Gateway gave, through [`decide`] on the `current` row (which writes a
/// decision's outbox event).
async fn apply_answer<K: Kind>(
    conn: &mut PgConnection,
    current: &K::Row,
    pending: &Pending,
    decision: &Decision,
    status: &'static str,
    channel_ref: Option<&str>,
) -> Result<Applied, ReliableError> {
    let decided = decide::<K>(
        conn,
        current,
        status,
        channel_ref,
        Arrival::Response,
        (Some(pending.correlation_id), Some(pending.log_id)),
    )
    .await?;
    let audit_event = if K::is_final(status) {
        K::decision_event(status)
    } else {
        K::NAMES.waiting
    };
    let recovery = match &decided {
        Decided::Conflict { recorded } => format!(
            "{}; not applied: the final decision {recorded} stays",
            decision.recovery_summary
        ),
        _ => decision.recovery_summary.clone(),
    };
    Ok(Applied {
        changed: matches!(decided, Decided::Applied | Decided::Waiting),
        audit_event,
        outbox: None,
        submitted: Submitted::Answered {
            log_id: pending.log_id,
            status: status.to_owned(),
        },
        applied: matches!(decided, Decided::Applied).then_some(status),
        recovery,
    })
}

/// A status of ours (`requested`, `unknown`) on the attempt's own row, with its outbox event
/// when it changed the row.
async fn apply_mark<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    pending: &Pending,
    decision: &Decision,
    status: &'static str,
) -> Result<Applied, ReliableError> {
    let id = row.id();
    let log_id = pending.log_id;
    let changed = table::mark_attempt_outcome::<K>(conn, id, log_id, status).await?;
    let (audit_event, submitted) = if decision.state == FinalState::Unknown {
        (K::NAMES.unknown, Submitted::Unknown { log_id })
    } else {
        (
            K::NAMES.submit_failed,
            Submitted::Failed {
                log_id,
                status: status.to_owned(),
                retry_in: decision.retry_in,
            },
        )
    };
    let outbox = changed.then(|| OutboxEvent {
        aggregate_type: K::RESOURCE,
        aggregate_id: id.to_string(),
        event_type: audit_event,
        payload: json!({
            K::ID: id,
            "card_ref": row.card_ref(),
            "status": status,
            "source": "submit",
        }),
    });
    Ok(Applied {
        changed,
        audit_event,
        outbox,
        submitted,
        applied: None,
        recovery: decision.recovery_summary.clone(),
    })
}

/// The fallback of a late answer: a terminal log row with the same audit and outbox.
async fn write_terminal<K: Kind>(
    conn: &mut PgConnection,
    pending: &Pending,
    result: &CallResult<K::Response>,
    finish: &Finish,
) -> Result<(), ReliableError> {
    let log_id = insert_terminal_log(
        conn,
        &LogRecord {
            correlation_id: pending.correlation_id,
            resource_type: K::RESOURCE,
            resource_id: pending.resource_id.clone(),
            scenario: K::NAMES.submit_scenario,
            state: finish.state.log_state(),
            request_summary: result.request_summary.clone(),
            response_summary: finish.response_summary.clone(),
            http_status: finish.http_status,
            error: finish.error.clone(),
            recovery_summary: finish.recovery_summary.clone(),
            started_at: pending.started_at,
            // On the clock of `started_at` (the database's): the call's own duration after it.
            finished_at: pending.started_at
                + chrono::Duration::from_std(result.elapsed)
                    .unwrap_or_else(|_| chrono::Duration::zero()),
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
            resource_type: K::RESOURCE,
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
