//! The recovery pass of any [`Kind`]: settles rows left `pending` (a worker died mid-call) or
//! `unknown` (the Gateway may have acted), resubmits `requested` rows whose submission job never
//! came (lost with Redis), and asks again about rows waiting for their decision (`in_review`).
//!
//! Work is found in the kind's table itself ([`table::due`], along its partial indexes), never by
//! scanning `integration_logs` or Redis; a run takes a bounded batch and the cron brings the
//! next. A `pending` row is left alone until its attempt's deadline (`attempt_deadline`, the
//! submission job's own time limit): before it the POST may still be on the wire, and a 404 then
//! proves nothing. [`query_now`] is the same step for one row, for `enqueue payment|approval`. A `requested` row is asked about too before it is resubmitted: whatever its history, the
//! Gateway's record decides, so a row is submitted again only when the Gateway never saw it.
//!
//! The query is a read: repeating it is harmless and it acts on nothing, so it is recorded on the
//! **terminal** path (one finished log row, written with its consequence), not with a pending row
//! of its own. A crash mid-query loses nothing: the row is still undecided and the next run asks
//! again. For each row, one transaction writes:
//! - an answer: the query log (`succeeded`), the decision through [`decide`] (the first final
//!   decision wins; `in_review` waits), the dead attempt's `pending` log closed (`succeeded`),
//!   audit, outbox;
//! - 404 for a `requested`/`pending`/`unknown` row (the Gateway never saw it): the query log, the
//!   dead attempt's log closed (`failed`), the row back to `requested` (nothing is open any
//!   more), and a resubmission through the submission job — the reliable path again, pending
//!   first, with the same `Idempotency-Key` (there is no other key). A row never submitted gets
//!   the job's whole retry budget; one submitted before gets one attempt per recovery period. A
//!   404 is never read as a decision; for an `in_review` row it is kept on record and asked again.
//!   A row the submission job would refuse (`Kind::refuse`) is refused here instead, in the same
//!   transaction: final with its reason, never resubmitted, never asked about again;
//! - a failed or unknown query: the query log (`failed`/`unknown`) saying it is left for the next
//!   run; the row is moved to the back of the line.

use anyhow::Context as _;
use chrono::Utc;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::attempt::MAX_RETRIES;
use super::decide::{close_open_attempt, decide, Decided};
use super::kind::{Arrival, Kind, Row as _, Thresholds};
use super::pending::FinalState;
use super::submit::refuse_in;
use super::table;
use crate::context::AppContext;
use crate::gateway::{CallResult, Outcome};
use crate::storage::fault::DbFault;
use crate::storage::records::{
    insert_audit, insert_terminal_log, AuditRecord, LogRecord, LogState,
};

/// What one recovery run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Undecided rows examined.
    pub examined: usize,
    /// Settled (a final decision) from the Gateway's record.
    pub settled: usize,
    /// Unknown to the Gateway: resubmitted with the same key.
    pub resubmitted: usize,
    /// Unknown to the Gateway and refused by the worker (bad input, unknown card): made final
    /// with the reason, never sent.
    pub refused: usize,
    /// The Gateway could not answer, or the row is still waiting: left for the next run.
    pub left: usize,
    /// Changed meanwhile by another path: nothing done.
    pub skipped: usize,
}

/// One recovery pass over at most `batch` rows due under `thresholds`.
pub async fn recover<K: Kind>(
    ctx: &AppContext,
    thresholds: Thresholds,
    batch: i64,
) -> anyhow::Result<RecoveryReport> {
    let due = table::due::<K>(&ctx.pool, thresholds, batch)
        .await
        .with_context(|| format!("finding undecided rows of {}", K::TABLE))?;
    settle_rows::<K>(ctx, due, thresholds).await
}

/// What [`query_now`] did with one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    /// Its attempt may still be in flight (`pending` before its deadline): no query, nothing
    /// sent; recovery asks once the deadline has passed.
    InFlight {
        /// The attempt's deadline.
        deadline: Option<chrono::DateTime<Utc>>,
    },
    /// Asked the Gateway now; what recovery's step did with the answer.
    Queried(RecoveryReport),
}

/// `enqueue payment|approval` on a row that is `pending` or `unknown`: the recovery step for
/// this one row now, whatever `recovery_after_secs` says, except while its attempt may still be
/// in flight. Never a POST before the query; a 404 resubmits it through the job, with the same
/// key, as recovery does.
pub async fn query_now<K: Kind>(ctx: &AppContext, id: Uuid) -> anyhow::Result<Asked> {
    let row = table::load::<K>(&ctx.pool, id)
        .await
        .with_context(|| format!("loading {} {id}", K::RESOURCE))?;
    if let Some(row) = &row {
        if row.attempt_in_flight() {
            return Ok(Asked::InFlight {
                deadline: row.tracking().attempt_deadline,
            });
        }
    }
    let now = Thresholds {
        undecided: std::time::Duration::ZERO,
        waiting: std::time::Duration::ZERO,
    };
    Ok(Asked::Queried(settle_rows::<K>(ctx, vec![id], now).await?))
}

/// The recovery step for each of `ids`, one after another.
async fn settle_rows<K: Kind>(
    ctx: &AppContext,
    ids: Vec<Uuid>,
    thresholds: Thresholds,
) -> anyhow::Result<RecoveryReport> {
    let mut report = RecoveryReport::default();
    for id in ids {
        report.examined += 1;
        // The submissions sent before the query: an answer about an older attempt than the row's
        // latest one is stale (a POST that went out while the query was on the wire).
        let sent_before = table::load::<K>(&ctx.pool, id)
            .await
            .with_context(|| format!("loading {} {id}", K::RESOURCE))?
            .map(|row| row.submissions());
        let correlation_id = Uuid::new_v4();
        let result = K::query(ctx, id, correlation_id).await;
        let step = match settle_one::<K>(ctx, id, correlation_id, thresholds, sent_before, &result)
            .await
        {
            Ok(step) => step,
            // A record PostgreSQL refuses would fail the same way every run: the others of the
            // batch go on (the next run asks about this one again).
            Err(e) if crate::storage::fault::classify_chain(&e) == DbFault::Deterministic => {
                tracing::error!(%id, error = %format!("{e:#}"), "recovery of this row could not be recorded; the others go on");
                report.left += 1;
                continue;
            }
            Err(e) => {
                return Err(e.context(format!("recording the recovery of {} {id}", K::RESOURCE)))
            }
        };
        match step {
            Step::Settled => report.settled += 1,
            Step::Refused => report.refused += 1,
            Step::Resubmit { submitted_before } => {
                // After the commit: if this enqueue is lost, the row is still undecided and the
                // next run asks again.
                let retries = if submitted_before { MAX_RETRIES } else { 0 };
                ctx.producer
                    .enqueue(&K::job(id, retries))
                    .await
                    .with_context(|| format!("resubmitting {} {id}", K::RESOURCE))?;
                report.resubmitted += 1;
            }
            Step::Left => report.left += 1,
            Step::Skipped => report.skipped += 1,
        }
    }
    Ok(report)
}

/// What recovery's step does with one row.
enum Step {
    Settled,
    Refused,
    Resubmit { submitted_before: bool },
    Left,
    Skipped,
}

/// What the step found: how the query's log row ends, what it says happens next, and the step.
struct Judged {
    state: LogState,
    summary: String,
    step: Step,
}

/// What carrying out a step wrote besides the query's log.
#[derive(Default)]
struct Carried {
    /// The dead attempt's `pending` log it closed.
    closed: Option<i64>,
    /// Whether the decision moved the row (so it need not be touched).
    moved: bool,
    /// The final status applied now (counted after the commit).
    applied: Option<&'static str>,
}

/// The recovery step for one row, in one transaction: judge the answer, refuse what cannot be
/// submitted, write the query's log, carry the step out, audit it, commit, then count.
async fn settle_one<K: Kind>(
    ctx: &AppContext,
    id: Uuid,
    correlation_id: Uuid,
    thresholds: Thresholds,
    sent_before: Option<i32>,
    result: &CallResult<Option<K::Response>>,
) -> anyhow::Result<Step> {
    let mut tx = ctx.pool.begin().await?;
    let Some(row) = table::lock::<K>(&mut tx, id).await? else {
        return Ok(Step::Skipped);
    };
    let mut judged = judge::<K>(&row, thresholds, sent_before, result);
    // What the submission job would refuse is refused here, in this transaction, and never
    // resubmitted: a final row is never asked about again.
    let refusal = match judged.step {
        Step::Resubmit { .. } => K::refuse(&mut tx, &row).await?,
        _ => None,
    };
    if let Some(reason) = &refusal {
        judged.step = Step::Refused;
        judged.summary = format!(
            "the Gateway never saw this {} (404), and it cannot be submitted: {reason}; made \
             final, never sent",
            K::RESOURCE
        );
    }
    let query_log = insert_query_log::<K>(&mut tx, id, correlation_id, result, &judged).await?;
    let carried = carry_out::<K>(
        &mut tx,
        &row,
        &judged.step,
        result,
        (correlation_id, query_log),
        refusal.as_deref(),
    )
    .await?;
    if matches!(judged.step, Step::Left) && !carried.moved {
        table::touch::<K>(&mut tx, id).await?;
    }
    audit_step::<K>(
        &mut tx,
        &row,
        &judged,
        result,
        (correlation_id, query_log),
        carried.closed,
    )
    .await?;
    tx.commit().await?;
    // Counted after the commit, so that a rolled-back settlement never counts.
    if let Some(status) = carried.applied {
        K::count_decision(status, Arrival::Query);
    }
    Ok(judged.step)
}

/// What the query's answer means for the locked `row`: nothing when the row changed meanwhile
/// (submitted again while the query was on the wire, or no longer due), otherwise
/// [`judge_answer`].
fn judge<K: Kind>(
    row: &K::Row,
    thresholds: Thresholds,
    sent_before: Option<i32>,
    result: &CallResult<Option<K::Response>>,
) -> Judged {
    let status_before = row.status();
    if sent_before.is_some_and(|sent| sent != row.submissions()) {
        Judged {
            state: log_state(&result.outcome),
            summary: format!(
                "{} submitted again while the query was on the wire (now {status_before}); its                  answer is about the earlier attempt, and recovery did nothing",
                K::RESOURCE
            ),
            step: Step::Skipped,
        }
    } else if !table::still_due::<K>(row, thresholds) {
        Judged {
            state: log_state(&result.outcome),
            summary: format!(
                "{} changed meanwhile (now {status_before}); recovery did nothing",
                K::RESOURCE
            ),
            step: Step::Skipped,
        }
    } else {
        judge_answer::<K>(row, result)
    }
}

/// What the Gateway's record says about a row still due: settled, still waiting, never seen (a
/// resubmission, except for a waiting row: a 404 is never a decision), or no answer.
fn judge_answer<K: Kind>(row: &K::Row, result: &CallResult<Option<K::Response>>) -> Judged {
    let status_before = row.status();
    let waiting = K::WAITING == Some(status_before);
    let (state, summary, step) = match &result.outcome {
        Outcome::Valid(Some(r)) => {
            let answer = K::answer(r);
            if K::is_final(answer.status) {
                (
                    LogState::Succeeded,
                    format!(
                        "the Gateway's record says {}: {} settled by recovery",
                        answer.status,
                        K::RESOURCE
                    ),
                    Step::Settled,
                )
            } else {
                (
                    LogState::Succeeded,
                    format!(
                        "the Gateway's record says {}: waiting for the decision; asked again \
                         later",
                        answer.status
                    ),
                    Step::Left,
                )
            }
        }
        Outcome::Valid(None) if waiting => (
            LogState::Succeeded,
            format!(
                "the Gateway answered 404 for a {} that was {status_before}: a 404 is never \
                 read as a decision; left {status_before}, asked again later",
                K::RESOURCE
            ),
            Step::Left,
        ),
        Outcome::Valid(None) => (
            LogState::Succeeded,
            format!(
                "the Gateway never saw this {} (404): resubmitted through the reliable path \
                 with Idempotency-Key = {}",
                K::RESOURCE,
                row.id()
            ),
            Step::Resubmit {
                submitted_before: row.submissions() > 0,
            },
        ),
        Outcome::Failed(_) | Outcome::Unknown(_) => (
            log_state(&result.outcome),
            format!(
                "the Gateway could not answer: {} left {status_before}; the next recovery run \
                 asks again",
                K::RESOURCE
            ),
            Step::Left,
        ),
    };
    Judged {
        state,
        summary,
        step,
    }
}

/// The query's own terminal log row, with what the step does next. Returns its id.
async fn insert_query_log<K: Kind>(
    conn: &mut PgConnection,
    id: Uuid,
    correlation_id: Uuid,
    result: &CallResult<Option<K::Response>>,
    judged: &Judged,
) -> sqlx::Result<i64> {
    // The query's own times, taken around the call on this host's clock (compared with nothing
    // stored).
    let finished_at = crate::clock::now();
    let started_at = finished_at
        - chrono::Duration::from_std(result.elapsed).unwrap_or_else(|_| chrono::Duration::zero());
    insert_terminal_log(
        conn,
        &LogRecord {
            correlation_id,
            resource_type: K::RESOURCE,
            resource_id: id.to_string(),
            scenario: K::NAMES.query_scenario,
            state: judged.state,
            request_summary: result.request_summary.clone(),
            response_summary: result.response_summary.clone(),
            http_status: result.http_status,
            error: result.outcome.failure().map(|f| f.reason.clone()),
            recovery_summary: Some(judged.summary.clone()),
            started_at,
            finished_at,
        },
    )
    .await
}

/// Carries the step out on the locked `row`: an answer decided (and the dead attempt's log
/// closed), a 404's row reopened for its resubmission, or a refused row made final.
/// `query` is the query's correlation id and log row.
async fn carry_out<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    step: &Step,
    result: &CallResult<Option<K::Response>>,
    query: (Uuid, i64),
    refusal: Option<&str>,
) -> anyhow::Result<Carried> {
    let (correlation_id, query_log) = query;
    let mut carried = Carried::default();
    match (step, &result.outcome) {
        (Step::Settled | Step::Left, Outcome::Valid(Some(r))) => {
            let answer = K::answer(r);
            let decided = decide::<K>(
                conn,
                row,
                answer.status,
                Some(&answer.channel_ref),
                Arrival::Query,
                (Some(correlation_id), Some(query_log)),
            )
            .await?;
            carried.moved = matches!(decided, Decided::Applied | Decided::Waiting);
            if matches!(decided, Decided::Applied) {
                carried.applied = Some(answer.status);
            }
            carried.closed = close_open_attempt::<K>(
                conn,
                row,
                FinalState::Succeeded,
                format!(
                    "(from recovery query log #{query_log}) {}",
                    result.response_summary
                ),
                format!(
                    "the worker stopped before the answer; settled by recovery: {}",
                    answer.status
                ),
            )
            .await?;
        }
        (Step::Resubmit { .. }, _) => {
            carried.closed = close_open_attempt::<K>(
                conn,
                row,
                FinalState::Failed,
                format!("(from recovery query log #{query_log}) the Gateway never saw it (404)"),
                "resubmitted by recovery with the same Idempotency-Key".to_owned(),
            )
            .await?;
            table::reopen_for_resubmission::<K>(conn, row.id()).await?;
        }
        (Step::Refused, _) => {
            carried.closed = close_open_attempt::<K>(
                conn,
                row,
                FinalState::Failed,
                format!("(from recovery query log #{query_log}) the Gateway never saw it (404)"),
                "refused by recovery: it cannot be submitted".to_owned(),
            )
            .await?;
            if let Some(reason) = refusal {
                refuse_in::<K>(conn, row, reason, "recovery").await?;
            }
        }
        _ => {}
    }
    Ok(carried)
}

/// The step's audit event, linked to the query's log row.
async fn audit_step<K: Kind>(
    conn: &mut PgConnection,
    row: &K::Row,
    judged: &Judged,
    result: &CallResult<Option<K::Response>>,
    query: (Uuid, i64),
    closed: Option<i64>,
) -> sqlx::Result<()> {
    let (correlation_id, query_log) = query;
    let id = row.id();
    let event_type = match judged.step {
        Step::Settled | Step::Refused => K::NAMES.recovered,
        Step::Resubmit { .. } => K::NAMES.resubmitted,
        Step::Left if result.outcome.is_valid() => K::NAMES.recovery_skipped,
        Step::Left => K::NAMES.recovery_query_failed,
        Step::Skipped => K::NAMES.recovery_skipped,
    };
    insert_audit(
        conn,
        &AuditRecord {
            event_type,
            correlation_id: Some(correlation_id),
            summary: format!("{} {id} recovery: {}", K::RESOURCE, judged.summary),
            details: json!({
                K::ID: id,
                "status_before": row.status(),
                "query_outcome": result.outcome.kind(),
                "closed_attempt_log": closed,
            }),
            resource_type: K::RESOURCE,
            resource_id: id.to_string(),
        },
        Some(query_log),
    )
    .await?;
    Ok(())
}

fn log_state<T>(outcome: &Outcome<T>) -> LogState {
    match outcome {
        Outcome::Valid(_) => LogState::Succeeded,
        Outcome::Failed(_) => LogState::Failed,
        Outcome::Unknown(_) => LogState::Unknown,
    }
}
