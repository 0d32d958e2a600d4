//! Unchanged polls: counted, not recorded. What Redis keeps of them is a tally in the card's poll
//! state in the due queue (how many since the last change or failure, and when the last one was)
//! and fleet-wide hourly counters (`crate::polling::unchanged`). After Redis lost its data, both restart from
//! zero, and the view says so ([`UnchangedView::explanation`]).

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::config::Task;
use crate::context::AppContext;
use crate::polling::due_queue::PollState;
use crate::polling::lease;
use crate::polling::unchanged::{self, Since};
use crate::runner::redis_watch;

/// Unchanged polls of one task.
#[derive(Debug, Clone, Serialize)]
pub struct UnchangedView {
    pub task: &'static str,
    /// This card's unchanged polls since [`Self::since`]; `None` when the due queue does not hold
    /// the card (nothing is being counted).
    pub card_count: Option<u64>,
    /// This card's last unchanged poll since its count began.
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
        entry: Option<PollState>,
        hours: Vec<(String, u64)>,
        counts_since: Option<DateTime<Utc>>,
    ) -> Self {
        let tally = entry.as_ref().and_then(|e| e.tally.clone());
        let restart = counts_since
            .map(|at| format!(" Redis's counts restarted at {at} (it lost its data, or the deployment first started then)."))
            .unwrap_or_default();
        let explanation = match (&entry, &tally) {
            (None, _) => "the card is not in the due queue, so nothing is counted for it (a finished card keeps no count; reconcile adds a missing one)".to_owned(),
            (Some(_), None) => "the card has no count yet; it starts with its next poll".to_owned(),
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

/// What `investigate` says about how unchanged polls are kept.
pub const NOTE: &str = "unchanged polls are counted, not recorded: a successful poll that changed \
    nothing writes no database row. Redis keeps, per card and task, the count since the card's \
    last change or failure (or since its polling started) and the time of the last one, in the \
    card's poll state (gone when its polling ends), and fleet-wide totals per UTC hour for 48 h, \
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
        let entry = lease::due_queue(ctx.prefix(), task)
            .entry(&mut conn, card_ref)
            .await?
            .map(|(_, state)| state);
        let hours = unchanged::fleet_hours(&mut conn, ctx.prefix(), task, now).await?;
        out.push(UnchangedView::new(task, entry, hours, counts_since));
    }
    Ok((out, counts_since))
}
