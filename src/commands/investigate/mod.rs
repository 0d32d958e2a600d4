//! What is on record for one card (`cardworker investigate`): its state, its timeline of changes
//! and failures (integration logs and audit events, online and archived, newest first), its
//! chains (with when each one's next poll is due), its payments and callbacks, the unchanged-poll
//! counts kept in Redis, its manual facts
//! (the operator actions on the card: `operator.*` events with who and why) and the latest
//! fleet-wide polling facts (circuit openings and closings, budget and maintenance actions).
//!
//! Unchanged polls are counted, not recorded: what Redis keeps of them is a tally in the card's
//! chain entry (how many since the last change or failure, and when the last one was) and
//! fleet-wide hourly counters (`crate::polling::unchanged`). After Redis lost its data, both
//! restart from zero, and the view says so ([`UnchangedView::explanation`]).
//!
//! # Layout
//! - this file: the read model (one query and one view type per section of the output); every
//!   query here is covered by the plan guard.
//! - `render`: its text rendering for people (`--format text`); JSON is the view types' serde.

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::operator::OUTCOME_SQL;
use crate::config::Task;
use crate::context::AppContext;
use crate::polling::chain;
use crate::polling::unchanged::{self, Since};
use crate::runner::redis_watch;
use crate::storage::cards::{self, Card};

mod render;
pub use render::render_text;

/// How many timeline entries, payments and callbacks are shown.
pub const LIMIT: i64 = 50;

/// The callbacks about a card (`$1`) or one of its payments, newest first (at most `$2`).
///
/// Both halves are lookups of `inbound_callbacks_resource_idx` (resource_type, resource_id), OR-ed
/// into one bitmap scan: the card's own rows, and its payments' rows, whose ids are collected
/// first by `ARRAY(SELECT …)` so that `resource_id = ANY (…)` is an index condition. Written as
/// `resource_id IN (SELECT …)`, the payment half cannot use the index: the planner then reads
/// every callback (a parallel seq scan of the whole table to return a few rows;
/// docs/BENCHMARKS.md "bench-plans").
pub const CALLBACKS_SQL: &str =
    "SELECT channel, callback_id, state, reason, resource_type, resource_id, deliveries,
        first_received_at, last_received_at, applied_at
   FROM inbound_callbacks
  WHERE (resource_type = 'card' AND resource_id = $1)
     OR (resource_type = 'payment'
         AND resource_id = ANY (ARRAY(SELECT payment_id::text FROM payments WHERE card_ref = $1)))
     OR (resource_type = 'approval'
         AND resource_id = ANY (ARRAY(SELECT approval_id::text FROM approvals WHERE card_ref = $1)))
  ORDER BY last_received_at DESC LIMIT $2";

/// Audit events kept per approval in `investigate` (its history), at most.
pub const APPROVAL_HISTORY: usize = 20;

/// Everything `investigate` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Investigation {
    /// The card as stored.
    pub card: Card,
    /// Per task: chain live or parked.
    pub chains: Vec<ChainView>,
    /// Changes and failures, newest first (at most [`LIMIT`]).
    pub timeline: Vec<TimelineEntry>,
    /// Unchanged polls per task: this card's tally, and the fleet's hourly counts.
    pub unchanged_polls: Vec<UnchangedView>,
    /// When Redis's counts began: the deployment's epoch marker, written when Redis was found
    /// empty (its data lost, or the deployment's first start). Nothing before it is counted.
    pub counts_since: Option<DateTime<Utc>>,
    /// The card's payments, newest first.
    pub payments: Vec<PaymentView>,
    /// The card's approvals, newest first, each with its history.
    pub approvals: Vec<ApprovalView>,
    /// Callbacks about the card, its payments or its approvals, newest first.
    pub callbacks: Vec<CallbackView>,
    /// Operator actions on this card (`operator.*` audit events), newest first.
    pub manual_facts: Vec<FactView>,
    /// The latest fleet-wide polling facts (circuit transitions, operator actions on tasks and
    /// maintenance), newest first: what else was going on.
    pub fleet_facts: Vec<FactView>,
    /// Says plainly how unchanged polls are kept.
    pub note: &'static str,
}

/// One task's chain.
#[derive(Debug, Clone, Serialize)]
pub struct ChainView {
    /// `carddata` or `card_status`.
    pub task: &'static str,
    /// `live`, `parked`, `finished` (nothing left to poll) or `none` (reconcile will start one).
    pub state: &'static str,
    /// The live chain id, if any.
    pub chain_id: Option<String>,
    /// When it was parked, if it is.
    pub parked_at: Option<DateTime<Utc>>,
    /// When the chain's next poll is due (Redis clock), read from the chain due set; `None`
    /// without a chain in Redis.
    pub next_poll_due_at: Option<DateTime<Utc>>,
    /// Whether that poll's job already exists (fed into apalis or running); false while it waits.
    pub next_poll_fed: bool,
}

/// One entry of the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineEntry {
    pub at: DateTime<Utc>,
    /// `integration_log` or `audit_event`.
    pub kind: &'static str,
    /// Whether the row is in an `*_archive` table.
    pub archived: bool,
    pub id: i64,
    pub correlation_id: Option<Uuid>,
    /// Log: the scenario; audit: the event type.
    pub what: String,
    /// Log: the state; audit: empty.
    pub state: Option<String>,
    /// Log: response summary / error; audit: its summary.
    pub summary: Option<String>,
    pub error: Option<String>,
    pub recovery: Option<String>,
    pub http_status: Option<i32>,
    pub duration_ms: Option<i32>,
}

/// Unchanged polls of one task.
#[derive(Debug, Clone, Serialize)]
pub struct UnchangedView {
    pub task: &'static str,
    /// This card's unchanged polls since [`Self::since`]; `None` without a chain entry (no live
    /// chain: nothing is being counted).
    pub card_count: Option<u64>,
    /// This card's last unchanged poll on its current chain.
    pub last_unchanged_at: Option<DateTime<Utc>>,
    /// When this card's count began.
    pub since: Option<DateTime<Utc>>,
    /// `change_or_failure` (every unchanged poll since the chain's last recorded change or
    /// failure is counted) or `chain_start` (the count began when the chain started, e.g. after
    /// Redis lost its data: earlier unchanged polls are not known).
    pub since_kind: Option<Since>,
    /// The same in one plain sentence.
    pub explanation: String,
    /// Every card, over the last [`crate::polling::unchanged::HOURS_KEPT`] UTC hours.
    pub all_cards_total: u64,
    /// Every card, per UTC hour (`YYYYMMDDHH`, count), newest first, hours with polls only.
    pub all_cards_by_hour: Vec<(String, u64)>,
}

impl UnchangedView {
    fn new(
        task: Task,
        entry: Option<unchanged::Entry>,
        hours: Vec<(String, u64)>,
        counts_since: Option<DateTime<Utc>>,
    ) -> Self {
        let tally = entry.as_ref().and_then(|e| e.tally.clone());
        let restart = counts_since
            .map(|at| format!(" Redis's counts restarted at {at} (it lost its data, or the deployment first started then)."))
            .unwrap_or_default();
        let explanation = match (&entry, &tally) {
            (None, _) => "no live chain in Redis, so nothing is counted for this card (a finished chain keeps no count; reconcile starts a missing one)".to_owned(),
            (Some(_), None) => "the chain entry predates per-card counting; its count starts with its next poll".to_owned(),
            (Some(_), Some(t)) => {
                let last = t
                    .last
                    .map(|l| format!("; the last one at {l}"))
                    .unwrap_or_else(|| "; none yet".to_owned());
                match t.since_kind {
                    Since::ChangeOrFailure => format!(
                        "{} unchanged polls since the chain's last recorded change or failure at {}{last}",
                        t.count, t.since
                    ),
                    Since::ChainStart => format!(
                        "{} unchanged polls since the chain started at {}{last}. The count restarted then (a first start, `enqueue`, reconcile, or Redis losing its data): unchanged polls before it are not known.{restart}",
                        t.count, t.since
                    ),
                }
            }
        };
        Self {
            task: task.label(),
            card_count: tally.as_ref().map(|t| t.count),
            last_unchanged_at: tally.as_ref().and_then(|t| t.last),
            since: tally.as_ref().map(|t| t.since),
            since_kind: tally.as_ref().map(|t| t.since_kind),
            explanation,
            all_cards_total: hours.iter().map(|(_, n)| n).sum(),
            all_cards_by_hour: hours.into_iter().filter(|(_, n)| *n > 0).collect(),
        }
    }
}

/// One payment.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct PaymentView {
    pub payment_id: Uuid,
    pub amount_minor: i64,
    pub currency: String,
    pub status: String,
    pub channel_ref: Option<String>,
    pub submissions: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One approval and its history.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ApprovalView {
    pub approval_id: Uuid,
    pub kind: String,
    pub amount_minor: Option<i64>,
    pub status: String,
    pub channel_ref: Option<String>,
    pub submissions: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Its audit events (submission, answers, recovery, callbacks, conflicts), oldest first.
    #[sqlx(skip)]
    pub history: Vec<ApprovalEvent>,
}

/// One event of an approval's history.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ApprovalEvent {
    #[serde(skip)]
    pub resource_id: String,
    pub at: DateTime<Utc>,
    pub event_type: String,
    pub summary: String,
    /// An operator action's outcome (`enqueue_approval`), as [`FactView::outcome`].
    pub outcome: Option<String>,
}

/// One inbound callback (the body is not shown).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct CallbackView {
    pub channel: String,
    pub callback_id: String,
    pub state: String,
    pub reason: Option<String>,
    pub resource_type: Option<String>,
    pub resource_id: Option<String>,
    pub deliveries: i32,
    pub first_received_at: DateTime<Utc>,
    pub last_received_at: DateTime<Utc>,
    pub applied_at: Option<DateTime<Utc>>,
}

/// One audit event that is a fact about polling rather than about a poll.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FactView {
    pub at: DateTime<Utc>,
    pub id: i64,
    /// `operator.unpark`, `gateway.circuit_opened`, …
    pub event_type: String,
    /// `operator:<user>` for an operator action, else `cardworker`.
    pub actor: String,
    /// `--reason`, when the operator gave one.
    pub reason: Option<String>,
    pub summary: String,
    /// An operator action's outcome: `applied`, `failed`, or `unknown` (requested, with no
    /// outcome on record: check whether it took effect); `None` for other events
    /// (`super::operator::OUTCOME_SQL`).
    pub outcome: Option<String>,
    /// The resource it is linked to here (the card, a task, `maintenance`).
    pub resource_type: String,
    pub resource_id: String,
}

/// What an operator action's outcome (`FactView::outcome`) says, for people; empty for an applied
/// one and for events that are not operator actions.
pub fn outcome_note(outcome: Option<&str>) -> &'static str {
    match outcome {
        Some("unknown") => {
            "outcome unknown: requested, and no outcome on record (the process stopped or \
             PostgreSQL failed before it was written); check whether it took effect"
        }
        Some("failed") => {
            "failed: the action returned an error (in the event's details, `outcome.error`); \
             check whether it took effect before running it again"
        }
        _ => "",
    }
}

/// How many fleet-wide facts are shown.
pub const FLEET_FACTS: i64 = 10;

/// What investigating a card can run into.
#[derive(Debug, thiserror::Error)]
pub enum InvestigateError {
    /// No such card.
    #[error("unknown card {0:?}: there is no row with that card_ref in cards")]
    UnknownCard(String),
    /// PostgreSQL or Redis.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

type LogRow = (
    i64,
    Uuid,
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i32>,
    Option<i32>,
    DateTime<Utc>,
    bool,
);

type AuditRow = (i64, Option<Uuid>, String, String, DateTime<Utc>, bool);

/// Gathers everything on record for `card_ref`.
pub async fn investigate(
    ctx: &AppContext,
    card_ref: &str,
) -> Result<Investigation, InvestigateError> {
    let pool = &ctx.pool;
    let card = cards::load(pool, card_ref)
        .await
        .context("loading the card")?
        .ok_or_else(|| InvestigateError::UnknownCard(card_ref.to_owned()))?;

    let logs: Vec<LogRow> = sqlx::query_as(
        "(SELECT id, correlation_id, scenario, state, response_summary, error, recovery_summary,
                 http_status, duration_ms, created_at, false AS archived
            FROM integration_logs WHERE resource_type = 'card' AND resource_id = $1
           ORDER BY created_at DESC LIMIT $2)
         UNION ALL
         (SELECT id, correlation_id, scenario, state, response_summary, error, recovery_summary,
                 http_status, duration_ms, created_at, true AS archived
            FROM integration_logs_archive WHERE resource_type = 'card' AND resource_id = $1
           ORDER BY created_at DESC LIMIT $2)",
    )
    .bind(card_ref)
    .bind(LIMIT)
    .fetch_all(pool)
    .await
    .context("reading the card's integration logs")?;
    let audits: Vec<AuditRow> = sqlx::query_as(
        "(SELECT e.id, e.correlation_id, e.event_type, e.summary, e.created_at, false AS archived
            FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
           WHERE r.resource_type = 'card' AND r.resource_id = $1
           ORDER BY r.created_at DESC LIMIT $2)
         UNION ALL
         (SELECT e.id, e.correlation_id, e.event_type, e.summary, e.created_at, true AS archived
            FROM audit_resources_archive r JOIN audit_events_archive e ON e.id = r.audit_event_id
           WHERE r.resource_type = 'card' AND r.resource_id = $1
           ORDER BY r.created_at DESC LIMIT $2)",
    )
    .bind(card_ref)
    .bind(LIMIT)
    .fetch_all(pool)
    .await
    .context("reading the card's audit events")?;
    let mut timeline: Vec<TimelineEntry> = logs
        .into_iter()
        .map(
            |(id, cid, scenario, state, resp, error, recovery, http, dur, at, archived)| {
                TimelineEntry {
                    at,
                    kind: "integration_log",
                    archived,
                    id,
                    correlation_id: Some(cid),
                    what: scenario,
                    state: Some(state),
                    summary: resp,
                    error,
                    recovery,
                    http_status: http,
                    duration_ms: dur,
                }
            },
        )
        .chain(
            audits.into_iter().map(
                |(id, cid, event_type, summary, at, archived)| TimelineEntry {
                    at,
                    kind: "audit_event",
                    archived,
                    id,
                    correlation_id: cid,
                    what: event_type,
                    state: None,
                    summary: Some(summary),
                    error: None,
                    recovery: None,
                    http_status: None,
                    duration_ms: None,
                },
            ),
        )
        .collect();
    // Newest first; on equal times the audit event (written after its log) comes first.
    timeline.sort_by(|a, b| b.at.cmp(&a.at).then(b.id.cmp(&a.id)));
    timeline.truncate(LIMIT as usize);

    let mut conn = ctx.redis.clone();
    let mut chains = Vec::new();
    for task in Task::ALL {
        let live = chain::live_chains(&mut conn, ctx.prefix(), task, &[card_ref.to_owned()])
            .await?
            .into_iter()
            .next()
            .flatten();
        let parked_at = card.parked_at(task);
        let state = if parked_at.is_some() {
            "parked"
        } else if live.is_some() {
            "live"
        } else if !card.wants_polling(task) {
            "finished"
        } else {
            "none"
        };
        let due = chain::next_due(&mut conn, ctx.prefix(), task, card_ref).await?;
        chains.push(ChainView {
            task: task.label(),
            state,
            chain_id: live,
            parked_at,
            next_poll_due_at: due.map(|(at, _)| at),
            next_poll_fed: due.is_some_and(|(_, fed)| fed),
        });
    }

    let (unchanged_polls, counts_since) = unchanged_counts(ctx, card_ref, Utc::now()).await?;

    let payments: Vec<PaymentView> = sqlx::query_as(
        "SELECT payment_id, amount_minor, currency, status, channel_ref, submissions, created_at,
                updated_at
           FROM payments WHERE card_ref = $1 ORDER BY created_at DESC LIMIT $2",
    )
    .bind(card_ref)
    .bind(LIMIT)
    .fetch_all(pool)
    .await
    .context("reading the card's payments")?;
    let mut approvals: Vec<ApprovalView> = sqlx::query_as(
        "SELECT approval_id, kind, amount_minor, status, channel_ref, submissions, created_at,
                updated_at
           FROM approvals WHERE card_ref = $1 ORDER BY created_at DESC LIMIT $2",
    )
    .bind(card_ref)
    .bind(LIMIT)
    .fetch_all(pool)
    .await
    .context("reading the card's approvals")?;
    if !approvals.is_empty() {
        // One lookup of audit_resources_resource_idx per approval (both leading columns pinned),
        // each bounded to the approval's latest APPROVAL_HISTORY events.
        let ids: Vec<String> = approvals
            .iter()
            .map(|a| a.approval_id.to_string())
            .collect();
        let events: Vec<ApprovalEvent> = sqlx::query_as(&format!(
            "SELECT h.resource_id, h.at, h.event_type, h.summary, h.outcome
               FROM unnest($1::text[]) AS ids(id)
               CROSS JOIN LATERAL (
                    SELECT r.resource_id, e.created_at AS at, e.event_type, e.summary,
                           {OUTCOME_SQL} AS outcome
                      FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
                     WHERE r.resource_type = 'approval' AND r.resource_id = ids.id
                     ORDER BY r.created_at DESC LIMIT $2) h
              ORDER BY h.at DESC"
        ))
        .bind(&ids)
        .bind(APPROVAL_HISTORY as i64)
        .fetch_all(pool)
        .await
        .context("reading the history of the card's approvals")?;
        for event in events.into_iter().rev() {
            if let Some(a) = approvals
                .iter_mut()
                .find(|a| a.approval_id.to_string() == event.resource_id)
            {
                a.history.push(event);
            }
        }
    }
    let callbacks: Vec<CallbackView> = sqlx::query_as(CALLBACKS_SQL)
        .bind(card_ref)
        .bind(LIMIT)
        .fetch_all(pool)
        .await
        .context("reading the card's callbacks")?;

    let manual_facts = facts(
        pool,
        "r.resource_type = 'card' AND r.resource_id = $1 AND e.event_type LIKE 'operator.%'",
        Some(card_ref),
        LIMIT,
    )
    .await
    .context("reading the card's manual facts")?;
    let fleet_facts = fleet_facts(pool, FLEET_FACTS)
        .await
        .context("reading the fleet's polling facts")?;

    Ok(Investigation {
        card,
        chains,
        timeline,
        unchanged_polls,
        counts_since,
        payments,
        approvals,
        callbacks,
        manual_facts,
        fleet_facts,
        note: NOTE,
    })
}

/// Audit events as facts, newest first: those whose resource link matches `filter` (which may
/// use `$1`, bound to `card_ref`), at most `limit`.
async fn facts(
    pool: &sqlx::PgPool,
    filter: &str,
    card_ref: Option<&str>,
    limit: i64,
) -> sqlx::Result<Vec<FactView>> {
    sqlx::query_as(&format!(
        "SELECT e.created_at AS at, e.id, e.event_type, e.actor, e.details->>'reason' AS reason,
                e.summary, {OUTCOME_SQL} AS outcome, r.resource_type, r.resource_id
           FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
          WHERE {filter}
          ORDER BY r.created_at DESC LIMIT $2"
    ))
    .bind(card_ref)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// The latest facts about the fleet's polling (circuit transitions, budget and maintenance
/// actions): one ordered lookup of `audit_resources_resource_idx` per fleet resource (each task,
/// and maintenance), merged. A single `resource_type IN (…) ORDER BY created_at` would let the
/// planner walk the whole `created_at` index backwards looking for the rare fleet rows.
pub async fn fleet_facts(pool: &sqlx::PgPool, limit: i64) -> sqlx::Result<Vec<FactView>> {
    let resources = Task::ALL
        .iter()
        .map(|t| ("task", t.label()))
        .chain([("maintenance", "maintenance")]);
    let parts: Vec<String> = resources
        .map(|(kind, id)| {
            format!(
                "(SELECT e.created_at AS at, e.id, e.event_type, e.actor,
                         e.details->>'reason' AS reason, e.summary, {OUTCOME_SQL} AS outcome,
                         r.resource_type, r.resource_id
                    FROM audit_resources r JOIN audit_events e ON e.id = r.audit_event_id
                   WHERE r.resource_type = '{kind}' AND r.resource_id = '{id}'
                   ORDER BY r.created_at DESC LIMIT $1)"
            )
        })
        .collect();
    sqlx::query_as(&format!(
        "SELECT * FROM ({}) f ORDER BY at DESC LIMIT $1",
        parts.join(" UNION ALL ")
    ))
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// What `investigate` says about how unchanged polls are kept.
pub const NOTE: &str = "unchanged polls are counted, not recorded: a successful poll that changed \
    nothing writes no database row. Redis keeps, per card and task, the count since the chain's \
    last change or failure (or since the chain started) and the time of the last one, in the \
    card's chain entry (gone when the chain ends), and fleet-wide totals per UTC hour for 48 h, \
    which each worker writes every 5 s (so they lag the polls by up to that). \
    After Redis loses its data, both restart from zero.";

/// The card's unchanged-poll tally per task and the fleet's hourly counts, and when Redis's
/// counts began (the epoch marker's time).
pub async fn unchanged_counts(
    ctx: &AppContext,
    card_ref: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<(Vec<UnchangedView>, Option<DateTime<Utc>>)> {
    let mut conn = ctx.redis.clone();
    let epoch: Option<String> = redis::cmd("GET")
        .arg(redis_watch::epoch_key(ctx.prefix()))
        .query_async(&mut conn)
        .await
        .context("reading the Redis epoch marker")?;
    let counts_since = epoch
        .and_then(|e| ulid::Ulid::from_string(&e).ok())
        .map(|u| DateTime::<Utc>::from(u.datetime()));
    let mut out = Vec::new();
    for task in Task::ALL {
        let entry = unchanged::entry(&mut conn, ctx.prefix(), task, card_ref).await?;
        let hours = unchanged::fleet_hours(&mut conn, ctx.prefix(), task, now).await?;
        out.push(UnchangedView::new(task, entry, hours, counts_since));
    }
    Ok((out, counts_since))
}
