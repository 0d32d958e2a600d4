//! Applying a parsed callback inside the delivery's transaction: a card status through the same
//! status-change function as polling, a payment or approval decision through the decide-once path
//! of `crate::reliable`, each with its terminal integration log and audit event.

use std::str::FromStr as _;

use cardworker_jobs::ProcessCallback;
use chrono::Utc;
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use super::body::CallbackBody;
use crate::cards::{apply_status, Applied, ChangeSource};
use crate::gateway::CardStatus;
use crate::reliable::approval::Approval;
use crate::reliable::decide::{close_open_attempt, decide};
use crate::reliable::payment::PaymentCall;
use crate::reliable::pending::FinalState;
use crate::reliable::{table, Arrival, Decided, Kind, Row as _};
use crate::storage::cards;
use crate::storage::records::LogState;
use crate::storage::records::{insert_audit, insert_terminal_log, AuditRecord, LogRecord};

/// How the reason of a callback that contradicts a final decision begins. Such a callback is
/// final too (a final decision never changes): a later delivery is counted, not processed again,
/// so its conflict is audited once.
pub const CONTRADICTION: &str = "contradicts the recorded result";

/// Version conflicts tolerated in one delivery before it is failed (and retried).
const MAX_VERSION_CONFLICTS: u32 = 10;

/// Applies a parsed callback. `Ok(Err(reason))` is a callback that cannot be applied.
pub(super) async fn apply(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    body: &CallbackBody,
) -> anyhow::Result<Result<(&'static str, String, bool), String>> {
    match body {
        CallbackBody::CardStatus { card_ref, status } => {
            apply_card_status(conn, job, row_id, card_ref, status).await
        }
        CallbackBody::PaymentResult {
            payment_id,
            status,
            channel_ref,
        } => {
            apply_decision::<PaymentCall>(conn, job, row_id, *payment_id, status, channel_ref).await
        }
        CallbackBody::ApprovalResult {
            approval_id,
            status,
            channel_ref,
        } => apply_decision::<Approval>(conn, job, row_id, *approval_id, status, channel_ref).await,
    }
}

/// A `card.status` callback through the same status-change function as polling, under the
/// optimistic version check: on a conflict the card is reloaded and decided again.
async fn apply_card_status(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    card_ref: &str,
    status: &str,
) -> anyhow::Result<Result<(&'static str, String, bool), String>> {
    let source = format!("callback {}/{}", job.channel, job.callback_id);
    let started_at = Utc::now();
    let Ok(new_status) = CardStatus::from_str(status) else {
        return Ok(Err(format!("malformed body: card status {status:?}")));
    };
    let change_source = change_source(job);
    let mut conflicts = 0;
    loop {
        let Some(card) = cards::load(&mut *conn, card_ref).await? else {
            return Ok(Err(format!("unknown card {card_ref}")));
        };
        let correlation_id = Uuid::new_v4();
        // The same status-change function as polling: one optimistic update, one audit
        // event, one outbox event, whoever observed the change.
        match apply_status(conn, &card, new_status, correlation_id, &change_source).await? {
            Applied::Changed {
                version,
                audit_event_id,
                ..
            } => {
                let summary = format!(
                    "status {} -> {status} (version {} -> {version}) by {source}",
                    card.status, card.version
                );
                let log_id = insert_callback_log(
                    conn,
                    job,
                    row_id,
                    "card",
                    card_ref,
                    started_at,
                    correlation_id,
                    summary,
                )
                .await?;
                link_audit(conn, audit_event_id, log_id).await?;
                return Ok(Ok(("card", card_ref.to_owned(), true)));
            }
            Applied::Unchanged => {
                record(
                    conn,
                    job,
                    row_id,
                    "card",
                    card_ref,
                    started_at,
                    format!(
                        "status already {status} (version {}): nothing changed",
                        card.version
                    ),
                    "callback.applied",
                    false,
                )
                .await?;
                return Ok(Ok(("card", card_ref.to_owned(), false)));
            }
            Applied::Conflict => {
                // Another writer (a poll, another callback) changed the card since we
                // read it: reload and decide again on the current state.
                conflicts += 1;
                if conflicts >= MAX_VERSION_CONFLICTS {
                    anyhow::bail!("card {card_ref}: {conflicts} version conflicts in a row");
                }
            }
        }
    }
}

/// Where a callback's card change came from, as its audit event says.
fn change_source(job: &ProcessCallback) -> ChangeSource {
    ChangeSource {
        kind: "callback",
        integration_log_id: None,
        detail: Some(format!(
            "channel={} callback_id={}",
            job.channel, job.callback_id
        )),
    }
}

/// Links a change's audit event (written by `crate::cards`) to the callback's log row.
async fn link_audit(conn: &mut PgConnection, audit_event_id: i64, log_id: i64) -> sqlx::Result<()> {
    sqlx::query("UPDATE audit_events SET integration_log_id = $2 WHERE id = $1")
        .bind(audit_event_id)
        .bind(log_id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A decision callback (`payment.result`, `approval.result`) through the one decide-once path
/// of `crate::reliable`: the first final decision wins; the same one again changes nothing; a
/// different one after a final one is a conflict, on record (a payment's callback is then
/// failed with the reason, an approval's is processed with its conflict kept).
async fn apply_decision<K: Kind>(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    id: Uuid,
    status: &str,
    channel_ref: &str,
) -> anyhow::Result<Result<(&'static str, String, bool), String>> {
    let source = format!("callback {}/{}", job.channel, job.callback_id);
    let started_at = Utc::now();
    let Some(row) = table::lock::<K>(conn, id).await? else {
        return Ok(Err(format!("unknown {} {id}", K::RESOURCE)));
    };
    let decided = decide::<K>(
        conn,
        &row,
        status,
        Some(channel_ref),
        Arrival::Callback,
        (None, None),
    )
    .await?;
    let (summary, event, changed) = match decided {
        Decided::Applied | Decided::Waiting => {
            close_open_attempt::<K>(
                conn,
                &row,
                FinalState::Succeeded,
                format!("(from {source}) status={status} channel_ref={channel_ref}"),
                format!("settled by {source}"),
            )
            .await?;
            (
                format!(
                    "{} {} -> {status} (channel_ref {channel_ref}) by {source}",
                    K::RESOURCE,
                    row.status()
                ),
                K::decision_event(status),
                true,
            )
        }
        Decided::Repeated => (
            format!("{} already {status}: nothing changed", K::RESOURCE),
            "callback.applied",
            false,
        ),
        Decided::Conflict { recorded } if K::CONFLICTING_CALLBACK_FAILS => {
            return Ok(Err(format!(
                "{CONTRADICTION}: {} {id} is {recorded}, callback says {status}",
                K::RESOURCE
            )));
        }
        Decided::Conflict { recorded } => (
            format!(
                "{} {id} is {recorded}; callback says {status}: not applied, kept as a conflict",
                K::RESOURCE
            ),
            "callback.applied",
            false,
        ),
    };
    record(
        conn,
        job,
        row_id,
        K::RESOURCE,
        &id.to_string(),
        started_at,
        summary,
        event,
        changed,
    )
    .await?;
    Ok(Ok((K::RESOURCE, id.to_string(), changed)))
}

/// The change's terminal integration log (`succeeded`, scenario `callback`). Returns its id.
#[allow(clippy::too_many_arguments)]
async fn insert_callback_log(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    resource_type: &'static str,
    resource_id: &str,
    started_at: chrono::DateTime<Utc>,
    correlation_id: Uuid,
    summary: String,
) -> sqlx::Result<i64> {
    insert_terminal_log(
        conn,
        &LogRecord {
            correlation_id,
            resource_type,
            resource_id: resource_id.to_owned(),
            scenario: "callback",
            state: LogState::Succeeded,
            request_summary: format!(
                "callback {}/{} (inbound_callbacks #{row_id})",
                job.channel, job.callback_id
            ),
            response_summary: summary,
            http_status: None,
            error: None,
            recovery_summary: None,
            started_at,
            finished_at: Utc::now(),
        },
    )
    .await
}

/// The records of an applied callback: terminal log, audit event (`event_type`) and link. The
/// outbox event of a change is written by whoever applied it.
#[allow(clippy::too_many_arguments)]
async fn record(
    conn: &mut PgConnection,
    job: &ProcessCallback,
    row_id: i64,
    resource_type: &'static str,
    resource_id: &str,
    started_at: chrono::DateTime<Utc>,
    summary: String,
    event_type: &'static str,
    changed: bool,
) -> anyhow::Result<()> {
    let correlation_id = Uuid::new_v4();
    let log_id = insert_callback_log(
        conn,
        job,
        row_id,
        resource_type,
        resource_id,
        started_at,
        correlation_id,
        summary.clone(),
    )
    .await?;
    insert_audit(
        conn,
        &AuditRecord {
            event_type,
            correlation_id: Some(correlation_id),
            summary,
            details: json!({
                "channel": job.channel,
                "callback_id": job.callback_id,
                "inbound_callback_id": row_id,
                "changed": changed,
            }),
            resource_type,
            resource_id: resource_id.to_owned(),
        },
        Some(log_id),
    )
    .await?;
    Ok(())
}
