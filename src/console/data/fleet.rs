//! The fleet page: the stores, budgets and circuits, parked chains, maintenance, queues and live
//! workers, the chart and the latest fleet-wide facts. Each part is read on its own: a store that
//! does not answer leaves its parts out and says so, and the rest of the page is still shown.

use anyhow::Context as _;
use serde::Serialize;

use super::bounded::part;
use super::chart::{poll_chart, PollChart};
use super::queues::{queue_counts, QueueCounts, WorkerView};
use crate::budget::BudgetView;
use crate::commands::investigate::{FactView, FLEET_FACTS};
use crate::config::Task;
use crate::context::AppContext;
use crate::maintenance::run::Backlog;
use crate::maintenance::JobKind;

/// The fleet page.
#[derive(Debug, Clone, Serialize)]
pub struct Fleet {
    /// PostgreSQL answered.
    pub postgres_ok: bool,
    /// Redis answered.
    pub redis_ok: bool,
    /// Budgets and circuits (`None` when Redis did not answer).
    pub budget: Option<BudgetView>,
    /// Parked chains per task.
    pub parked: Vec<(&'static str, i64)>,
    /// The maintenance switch.
    pub maintenance: MaintenanceView,
    /// Per queue.
    pub queues: Vec<QueueCounts>,
    /// Live workers, by queue.
    pub workers: Vec<WorkerView>,
    /// Polls per hour by outcome (`None` when Redis did not answer).
    pub chart: Option<PollChart>,
    /// The latest fleet-wide facts (operator actions on tasks and maintenance, circuit
    /// transitions), newest first, each operator action with its outcome (`None` when PostgreSQL
    /// did not answer).
    pub facts: Option<Vec<FactView>>,
    /// Problems met while reading (shown on the page).
    pub errors: Vec<String>,
}

/// The maintenance switch and backlog.
#[derive(Debug, Clone, Serialize)]
pub struct MaintenanceView {
    /// `maintenance.enabled` (of this console's configuration).
    pub enabled: bool,
    /// The fleet-wide brake.
    pub paused: Option<bool>,
    /// Newest archived day (from the newest row of `integration_logs_archive`).
    pub last_archived_day: Option<String>,
    /// Per job, the backlog the next run would see, measured as `cardworker maintenance status`
    /// does (bounded index probes, also while maintenance is off: that is when an operator sizes
    /// it); `None` when it could not be measured.
    pub backlog: Vec<(&'static str, Option<Backlog>)>,
}

/// Reads the fleet page.
pub async fn fleet(ctx: &AppContext) -> Fleet {
    let mut errors = Vec::new();
    let postgres_ok = part("PostgreSQL", None, ping_postgres(ctx), &mut errors)
        .await
        .is_some();
    let redis_ok = part("Redis", None, ping_redis(ctx), &mut errors)
        .await
        .is_some();
    let e = &mut errors;
    let budget = part_of(
        redis_ok,
        "budget",
        Some("reading the budget"),
        ctx.budget.show(),
        e,
    );
    let budget = budget.await;
    let parked = part_of(postgres_ok, "parked", None, parked_counts(ctx), e).await;
    let queues = part_of(
        redis_ok,
        "queues",
        Some("reading the queues"),
        queue_counts(ctx),
        e,
    );
    let (queues, workers) = queues.await.unwrap_or_default();
    let doing = Some("reading the hourly poll counters");
    let chart = part_of(redis_ok, "polls per hour", doing, poll_chart(ctx), e).await;
    let facts = part_of(postgres_ok, "fleet facts", None, latest_facts(ctx), e).await;
    let maintenance = maintenance(ctx, postgres_ok, redis_ok, e).await;
    Fleet {
        postgres_ok,
        redis_ok,
        budget,
        parked: parked.unwrap_or_default(),
        maintenance,
        queues,
        workers,
        chart,
        facts,
        errors,
    }
}

/// [`part`], read only when its store answered: `None` without a word otherwise (the page says
/// that the store does not answer).
async fn part_of<T>(
    store_answers: bool,
    what: &str,
    doing: Option<&str>,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
    errors: &mut Vec<String>,
) -> Option<T> {
    if !store_answers {
        return None;
    }
    part(what, doing, f, errors).await
}

async fn ping_postgres(ctx: &AppContext) -> anyhow::Result<bool> {
    sqlx::query_scalar::<_, bool>("SELECT true")
        .fetch_one(&ctx.pool)
        .await
        .context("PostgreSQL")
}

async fn ping_redis(ctx: &AppContext) -> anyhow::Result<String> {
    let mut conn = ctx.redis.clone();
    redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .context("Redis")
}

/// Parked chains per task.
async fn parked_counts(ctx: &AppContext) -> anyhow::Result<Vec<(&'static str, i64)>> {
    let (d, s) = crate::storage::cards::count_parked(&ctx.pool)
        .await
        .context("counting parked chains")?;
    Ok(vec![
        (Task::Carddata.label(), d),
        (Task::CardStatus.label(), s),
    ])
}

/// The latest fleet-wide facts, each operator action with its outcome.
async fn latest_facts(ctx: &AppContext) -> anyhow::Result<Vec<FactView>> {
    crate::commands::investigate::fleet_facts(&ctx.pool, FLEET_FACTS)
        .await
        .context("reading the fleet's latest facts")
}

/// The maintenance switch, its brake (from Redis), the last archived day and each job's backlog
/// (from PostgreSQL).
async fn maintenance(
    ctx: &AppContext,
    postgres_ok: bool,
    redis_ok: bool,
    errors: &mut Vec<String>,
) -> MaintenanceView {
    let enabled = crate::maintenance::switch::enabled(&ctx.config.maintenance);
    let mut paused = None;
    if redis_ok {
        let mut conn = ctx.redis.clone();
        let brake = crate::maintenance::switch::is_paused(&mut conn, ctx.prefix());
        paused = part("maintenance brake", None, brake, errors).await;
    }
    let mut last_archived_day = None;
    let mut backlog = Vec::new();
    if postgres_ok {
        // The last day an archive run processed, as every run records it (fleet-wide, in Redis):
        // no read of the archive tables.
        let last = crate::maintenance::last_day::read(ctx, JobKind::Archive);
        last_archived_day = part("last archived day", None, last, errors)
            .await
            .flatten()
            .map(|l| l.day.format("%Y-%m-%d").to_string());
        for job in [JobKind::Archive, JobKind::Retention] {
            let doing = format!("{} days pending", job.label());
            let measured = crate::maintenance::run::backlog(ctx, job);
            let measured = part("maintenance backlog", Some(&doing), measured, errors).await;
            backlog.push((job.label(), measured));
        }
    }
    MaintenanceView {
        enabled,
        paused,
        last_archived_day,
        backlog,
    }
}
