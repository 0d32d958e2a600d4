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
//!    - a valid answer goes through [`decide`] (the first final decision wins; `in_review`
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
//! One file on purpose (just over 600 lines): the three steps of one submission (pending commit,
//! call, finalisation with its late-answer fallback) read in order, and each step's error
//! handling depends on the step before it.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::decide::{decide, Arrival, Decided};
use super::{table, Kind, Row as _};
use crate::backoff::{Backoff, Jitter};
use crate::context::AppContext;
use crate::gateway::{CallResult, Outcome};
use crate::storage::records::{insert_audit, insert_terminal_log, AuditRecord, LogRecord};
use crate::storage::reliable::{
    begin_in, FinalState, Finish, OutboxEvent, Pending, PendingCall, ReliableError,
};

/// Retries through the intake for a request that was not received or a database error before
/// the pending commit, after which the job gives up (the row stays `requested`, visible and
/// resubmittable by `cardworker enqueue payment|approval`).
pub const MAX_RETRIES: u32 = 8;

/// First back-off delay; doubles per retry up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_secs(2);
/// Longest back-off delay.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Attempts at writing the outcome after the call before leaving it to recovery.
const FINISH_ATTEMPTS: u32 = 3;

/// What one run of [`submit`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Submitted {
    /// No such row: recorded (audit), nothing sent.
    UnknownRow,
    /// The row cannot be submitted (bad input, unknown card): made final with the reason (where
    /// the kind has a refused status), on record (audit), nothing sent.
    Refused(String),
    /// Already decided (final): nothing sent.
    AlreadySettled(String),
    /// Submitted before and waiting for its decision (`in_review`): nothing sent.
    Waiting(String),
    /// `pending`: an earlier attempt is open (in flight, or its worker died mid-call). Nothing
    /// sent: whether the Gateway has it is for recovery to ask, never to assume.
    AttemptOpen {
        /// The open attempt's `pending` log.
        log_id: Option<i64>,
        /// Until when the attempt may still be in flight (recovery leaves it alone until then).
        deadline: Option<chrono::DateTime<chrono::Utc>>,
    },
    /// `unknown`: the Gateway may have acted. Nothing sent: a row is POSTed again only after a
    /// query answered 404 (recovery's, or the one `enqueue` asks for).
    AwaitsQuery(String),
    /// A database error before the pending commit: nothing sent, retry scheduled after this.
    Deferred(Duration),
    /// The Gateway answered (or refused the request, which for some kinds is a decision).
    Answered {
        /// The attempt's log row.
        log_id: i64,
        /// What it answered (`accepted`, `in_review`, `failed`, …).
        status: String,
    },
    /// The Gateway may have acted; the row is `unknown` until recovery settles it.
    Unknown {
        /// The attempt's log row.
        log_id: i64,
    },
    /// The request certainly had no effect.
    Failed {
        /// The attempt's log row.
        log_id: i64,
        /// The row's status afterwards (`requested` or `unknown`).
        status: String,
        /// When the retry is due, if one was scheduled.
        retry_in: Option<Duration>,
    },
}

/// The back-off before retry number `retries + 1`: from `BASE_BACKOFF` doubling up to
/// `MAX_BACKOFF`, jittered by ±20 % and still at most `MAX_BACKOFF`.
pub fn backoff(retries: u32) -> Duration {
    Backoff::new(BASE_BACKOFF, MAX_BACKOFF, Jitter::Proportional(0.2)).delay(retries + 1)
}

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

/// The time limit of a submission job (the Gateway timeout bounds the call; the rest is two
/// short transactions). An attempt whose pending commit is older than this has certainly ended:
/// it is the attempt's deadline, before which recovery leaves a `pending` row alone.
pub fn attempt_limit(config: &crate::config::Config) -> Duration {
    config.gateway.timeout() + Duration::from_secs(30)
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

/// What the answer means for the row, decided before the finalising transaction.
struct Decision {
    state: FinalState,
    change: Change,
    retry_in: Option<Duration>,
    recovery_summary: String,
}

enum Change {
    /// A status the Gateway gave (a decision, or the waiting status), with its reference.
    Answer(&'static str, Option<String>),
    /// A status of ours: `requested` (not received) or `unknown`.
    Mark(&'static str),
}

fn classify<K: Kind>(row: &K::Row, retries: u32, result: &CallResult<K::Response>) -> Decision {
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
async fn record_outcome<K: Kind>(
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
    let log_id = pending.log_id;
    let mut applied = None;
    let mut recovery = decision.recovery_summary.clone();
    let current = table::lock::<K>(conn, id)
        .await?
        .ok_or(ReliableError::Domain(anyhow::anyhow!(
            "{} {id} disappeared during its submission",
            K::RESOURCE
        )))?;
    let (changed, audit_event, outbox, submitted) = match &decision.change {
        Change::Answer(status, channel_ref) => {
            let decided = decide::<K>(
                conn,
                &current,
                status,
                channel_ref.as_deref(),
                Arrival::Response,
                (Some(pending.correlation_id), Some(log_id)),
            )
            .await?;
            let event = if K::is_final(status) {
                K::decision_event(status)
            } else {
                K::NAMES.waiting
            };
            let changed = matches!(decided, Decided::Applied | Decided::Waiting);
            if matches!(decided, Decided::Applied) {
                applied = Some(*status);
            }
            if let Decided::Conflict { recorded } = &decided {
                recovery = format!("{recovery}; not applied: the final decision {recorded} stays");
            }
            let submitted = Submitted::Answered {
                log_id,
                status: (*status).to_owned(),
            };
            // `decide` wrote the decision's outbox event.
            (changed, event, None, submitted)
        }
        Change::Mark(status) => {
            let changed = table::mark_attempt_outcome::<K>(conn, id, log_id, status).await?;
            let (event, submitted) = if decision.state == FinalState::Unknown {
                (K::NAMES.unknown, Submitted::Unknown { log_id })
            } else {
                (
                    K::NAMES.submit_failed,
                    Submitted::Failed {
                        log_id,
                        status: (*status).to_owned(),
                        retry_in: decision.retry_in,
                    },
                )
            };
            let outbox = changed.then(|| OutboxEvent {
                aggregate_type: K::RESOURCE,
                aggregate_id: id.to_string(),
                event_type: event,
                payload: json!({
                    K::ID: id,
                    "card_ref": row.card_ref(),
                    "status": status,
                    "source": "submit",
                }),
            });
            (changed, event, outbox, submitted)
        }
    };
    if !changed {
        let now = table::load::<K>(&mut *conn, id).await?;
        recovery = format!(
            "{recovery}; {} not changed by this attempt (now {}): settled meanwhile or \
             superseded by a newer attempt",
            K::RESOURCE,
            now.as_ref().map_or("gone", |r| r.status())
        );
    }
    let finish = Finish {
        state: decision.state,
        response_summary: result.response_summary.clone(),
        http_status: result.http_status,
        error: result.outcome.failure().map(|f| f.reason.clone()),
        recovery_summary: Some(recovery.clone()),
        audit_event,
        audit_summary: format!(
            "{} {id} submission: {} ({})",
            K::RESOURCE,
            result.outcome.kind(),
            recovery
        ),
        audit_details: json!({
            K::ID: id,
            "outcome": result.outcome.kind(),
            "http_status": result.http_status,
            "changed": changed,
        }),
        outbox,
    };
    Ok((finish, submitted, applied))
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
