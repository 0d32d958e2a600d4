//! What the pages show, read from the same PostgreSQL and Redis as the workers. Every read is
//! bounded (a page never scans a table or a key space), and a store that does not answer is shown
//! as such instead of failing the page.

use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::budget::BudgetView;
use crate::commands::investigate::{FactView, FLEET_FACTS};
use crate::config::Task;
use crate::context::AppContext;
use crate::gateway::redact_digits;
use crate::maintenance::run::Backlog;
use crate::maintenance::JobKind;
use crate::polling::poll::{PERSISTED_CHANGE, PERSISTED_FAILURE, SKIPPED_UNCHANGED};
use crate::polling::unchanged;
use crate::queue::dead::{self, DeadEntry};
use crate::queue::QueueName;

/// How long a page waits for one store before showing it as not answering.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(3);
/// Rows shown per list.
pub const LIST_LIMIT: i64 = 200;
/// Dead entries shown per queue.
pub const DEAD_LIMIT: usize = 50;

/// One queue's counts, in the words an operator of Sidekiq or Oban reads them.
#[derive(Debug, Clone, Serialize)]
pub struct QueueCounts {
    /// Short name.
    pub queue: String,
    /// Jobs due now and not yet running: intake entries (for a polling queue, its chains) due
    /// now, and jobs handed to apalis but not yet fetched by a worker.
    pub waiting: u64,
    /// Jobs due later: intake entries and chains not yet due (a chain's next poll), and apalis's
    /// scheduled set.
    pub scheduled: u64,
    /// Jobs a worker fetched and is running (the inflight sets of the queue's workers).
    pub running: u64,
    /// The dead set.
    pub dead: u64,
}

/// One live worker (an apalis worker of one queue in one process).
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// The queue.
    pub queue: String,
    /// Its name (`<kind>-<pod>-<ulid>`).
    pub name: String,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_secs: i64,
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

/// Polls per UTC hour by outcome, fleet-wide and both tasks together, over the last
/// [`unchanged::HOURS_KEPT`] hours: read from the hourly counters every worker writes (the unchanged polls'
/// and the recorded ones', `crate::polling::unchanged`), a few MGETs whatever the fleet's size.
#[derive(Debug, Clone, Serialize)]
pub struct PollChart {
    /// Oldest hour first: the hour (`YYYYMMDDHH`, UTC) and its polls per outcome, in the order of
    /// [`OUTCOMES`].
    pub hours: Vec<(String, [u64; 3])>,
}

impl PollChart {
    /// Every hour's polls of outcome `i` (an index into [`OUTCOMES`]) added up.
    pub fn total(&self, i: usize) -> u64 {
        self.hours.iter().map(|(_, n)| n[i]).sum()
    }
}

/// The chart's outcomes, as `cardworker_poll_outcomes_total` labels them.
pub const OUTCOMES: [&str; 3] = [SKIPPED_UNCHANGED, PERSISTED_CHANGE, PERSISTED_FAILURE];

/// Reads the chart's counters.
pub async fn poll_chart(ctx: &AppContext) -> anyhow::Result<PollChart> {
    let now = Utc::now();
    let mut conn = ctx.redis.clone();
    // Newest hour first, as the counters are read.
    let mut hours: Vec<(String, [u64; 3])> = Vec::new();
    for task in Task::ALL {
        for (i, outcome) in OUTCOMES.iter().enumerate() {
            let counts = if i == 0 {
                unchanged::fleet_hours(&mut conn, ctx.prefix(), task, now).await?
            } else {
                unchanged::fleet_outcome_hours(&mut conn, ctx.prefix(), task, outcome, now).await?
            };
            if hours.is_empty() {
                hours = counts.iter().map(|(h, _)| (h.clone(), [0; 3])).collect();
            }
            for ((_, slot), (_, n)) in hours.iter_mut().zip(counts) {
                slot[i] += n;
            }
        }
    }
    hours.reverse();
    Ok(PollChart { hours })
}

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

pub async fn bounded<T>(
    what: &str,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(STORE_TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!(
            "{what}: no answer within {} s",
            STORE_TIMEOUT.as_secs()
        )),
    }
}

/// The queues of the deployment, by short name.
pub fn queues(ctx: &AppContext) -> Vec<QueueName> {
    crate::workers::queue_names(ctx.prefix())
}

/// Reads the fleet page.
pub async fn fleet(ctx: &AppContext) -> Fleet {
    let mut errors = Vec::new();
    let pg = bounded("PostgreSQL", async {
        sqlx::query_scalar::<_, bool>("SELECT true")
            .fetch_one(&ctx.pool)
            .await
            .context("PostgreSQL")
    })
    .await;
    let postgres_ok = pg.is_ok();
    if let Err(e) = pg {
        errors.push(format!("{e:#}"));
    }
    let mut conn = ctx.redis.clone();
    let ping = bounded("Redis", async {
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .context("Redis")
    })
    .await;
    let redis_ok = ping.is_ok();
    if let Err(e) = ping {
        errors.push(format!("{e:#}"));
    }

    let budget = if redis_ok {
        match bounded("budget", ctx.budget.show()).await {
            Ok(v) => Some(v),
            Err(e) => {
                errors.push(format!("reading the budget: {e:#}"));
                None
            }
        }
    } else {
        None
    };

    let mut parked = Vec::new();
    if postgres_ok {
        match bounded("parked", async {
            crate::storage::cards::count_parked(&ctx.pool)
                .await
                .context("counting parked chains")
        })
        .await
        {
            Ok((d, s)) => {
                parked.push((Task::Carddata.label(), d));
                parked.push((Task::CardStatus.label(), s));
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
    }

    let mut queues_out = Vec::new();
    let mut workers = Vec::new();
    if redis_ok {
        match bounded("queues", queue_counts(ctx)).await {
            Ok((q, w)) => {
                queues_out = q;
                workers = w;
            }
            Err(e) => errors.push(format!("reading the queues: {e:#}")),
        }
    }

    let chart = if redis_ok {
        match bounded("polls per hour", poll_chart(ctx)).await {
            Ok(c) => Some(c),
            Err(e) => {
                errors.push(format!("reading the hourly poll counters: {e:#}"));
                None
            }
        }
    } else {
        None
    };

    let facts = if postgres_ok {
        match bounded("fleet facts", async {
            crate::commands::investigate::fleet_facts(&ctx.pool, FLEET_FACTS)
                .await
                .context("reading the fleet's latest facts")
        })
        .await
        {
            Ok(f) => Some(f),
            Err(e) => {
                errors.push(format!("{e:#}"));
                None
            }
        }
    } else {
        None
    };

    let maintenance = maintenance(ctx, postgres_ok, redis_ok, &mut errors).await;
    Fleet {
        postgres_ok,
        redis_ok,
        budget,
        parked,
        maintenance,
        queues: queues_out,
        workers,
        chart,
        facts,
        errors,
    }
}

async fn maintenance(
    ctx: &AppContext,
    postgres_ok: bool,
    redis_ok: bool,
    errors: &mut Vec<String>,
) -> MaintenanceView {
    let enabled = crate::maintenance::switch::enabled(&ctx.config.maintenance);
    let paused = if redis_ok {
        let mut conn = ctx.redis.clone();
        match bounded(
            "maintenance brake",
            crate::maintenance::switch::is_paused(&mut conn, ctx.prefix()),
        )
        .await
        {
            Ok(p) => Some(p),
            Err(e) => {
                errors.push(format!("{e:#}"));
                None
            }
        }
    } else {
        None
    };
    let mut last_archived_day = None;
    let mut backlog = Vec::new();
    if postgres_ok {
        // The last day an archive run processed, as every run records it (fleet-wide, in Redis):
        // no read of the archive tables.
        match bounded(
            "last archived day",
            crate::maintenance::last_day::read(ctx, JobKind::Archive),
        )
        .await
        {
            Ok(last) => {
                last_archived_day = last.map(|l| l.day.format("%Y-%m-%d").to_string());
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
        for job in [JobKind::Archive, JobKind::Retention] {
            let measured = match bounded(
                "maintenance backlog",
                crate::maintenance::run::backlog(ctx, job),
            )
            .await
            {
                Ok(b) => Some(b),
                Err(e) => {
                    errors.push(format!("{} days pending: {e:#}", job.label()));
                    None
                }
            };
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

/// Counts of every queue and its live workers: one pipeline, then one for the inflight sets of
/// the workers it found.
pub async fn queue_counts(ctx: &AppContext) -> anyhow::Result<(Vec<QueueCounts>, Vec<WorkerView>)> {
    let names = queues(ctx);
    let now_ms = Utc::now().timestamp_millis();
    let fed = cardworker_jobs::chain::FED;
    let mut pipe = redis::pipe();
    for q in &names {
        pipe.cmd("ZCOUNT").arg(&q.intake).arg("-inf").arg(now_ms);
        pipe.cmd("ZCOUNT")
            .arg(&q.intake)
            .arg(format!("({now_ms}"))
            .arg("+inf");
        match &q.chains {
            // The chain due set: a waiting chain's score is its due ms, a fed one's FED + due.
            Some(chains) => {
                pipe.cmd("ZCOUNT").arg(&chains.due).arg("-inf").arg(now_ms);
                pipe.cmd("ZCOUNT")
                    .arg(&chains.due)
                    .arg(format!("({now_ms}"))
                    .arg(format!("({fed}"));
            }
            None => {
                pipe.cmd("ECHO").arg(0);
                pipe.cmd("ECHO").arg(0);
            }
        }
        pipe.cmd("LLEN").arg(format!("{}:active", q.apalis));
        pipe.cmd("ZCARD").arg(format!("{}:scheduled", q.apalis));
        pipe.cmd("SCARD").arg(format!("{}:dead", q.apalis));
        pipe.cmd("ZRANGE")
            .arg(format!("{}:workers", q.apalis))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES");
    }
    type Row = (u64, u64, u64, u64, u64, u64, u64, Vec<(String, f64)>);
    let mut conn = ctx.redis.clone();
    let rows: Vec<Row> = pipe
        .query_async(&mut conn)
        .await
        .context("reading queue counts")?;
    let now = Utc::now().timestamp();
    let mut counts = Vec::new();
    let mut workers = Vec::new();
    let mut inflight = redis::pipe();
    for (q, (due, later, chains_due, chains_later, fed_jobs, retries, dead, ws)) in
        names.iter().zip(rows)
    {
        counts.push(QueueCounts {
            queue: q.short.clone(),
            waiting: due + chains_due + fed_jobs,
            scheduled: later + chains_later + retries,
            running: 0,
            dead,
        });
        for (name, beat) in ws {
            inflight
                .cmd("SCARD")
                .arg(format!("{}:inflight:{name}", q.apalis));
            workers.push(WorkerView {
                queue: q.short.clone(),
                name,
                heartbeat_age_secs: (now - beat as i64).max(0),
            });
        }
    }
    if !workers.is_empty() {
        let running: Vec<u64> = inflight
            .query_async(&mut conn)
            .await
            .context("reading the workers' running jobs")?;
        for (w, n) in workers.iter().zip(running) {
            if let Some(c) = counts.iter_mut().find(|c| c.queue == w.queue) {
                c.running += n;
            }
        }
    }
    workers.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((counts, workers))
}

/// One queue on the queues page.
#[derive(Debug, Clone, Serialize)]
pub struct QueueDead {
    /// Short name.
    pub queue: String,
    /// Dead jobs in all.
    pub total: u64,
    /// The newest [`DEAD_LIMIT`], payload and reason with card numbers masked.
    pub entries: Vec<DeadEntry>,
}

/// Reads the dead set of every queue (card numbers masked).
pub async fn dead_sets(ctx: &AppContext) -> anyhow::Result<Vec<QueueDead>> {
    let mut out = Vec::new();
    let mut conn = ctx.redis.clone();
    for q in queues(ctx) {
        let (total, mut entries) =
            bounded("dead set", dead::list(&mut conn, &q, DEAD_LIMIT)).await?;
        for e in &mut entries {
            e.payload = e.payload.as_deref().map(redact_digits);
            e.reason = e.reason.as_deref().map(redact_digits);
        }
        out.push(QueueDead {
            queue: q.short.clone(),
            total,
            entries,
        });
    }
    Ok(out)
}

/// One parked chain.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ParkedView {
    /// The card.
    pub card_ref: String,
    /// When it was parked.
    pub parked_at: DateTime<Utc>,
    /// When its last failed poll was recorded.
    pub failed_at: Option<DateTime<Utc>>,
    /// The last failed poll's error (masked).
    pub error: Option<String>,
    /// The last failed poll's HTTP status.
    pub http_status: Option<i32>,
}

/// The parked chains of `task` (newest parked first, at most [`LIST_LIMIT`]) and their count.
pub async fn parked(ctx: &AppContext, task: Task) -> anyhow::Result<(i64, Vec<ParkedView>)> {
    let (column, scenario) = match task {
        Task::Carddata => ("carddata_parked_at", "carddata_poll"),
        Task::CardStatus => ("card_status_parked_at", "card_status_poll"),
    };
    let total: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM cards WHERE {column} IS NOT NULL"
    ))
    .fetch_one(&ctx.pool)
    .await
    .context("counting parked chains")?;
    let mut rows: Vec<ParkedView> = sqlx::query_as(&format!(
        "SELECT c.card_ref, c.{column} AS parked_at, l.created_at AS failed_at, l.error,
                l.http_status
           FROM cards c
           LEFT JOIN LATERAL (
                SELECT created_at, error, http_status FROM integration_logs
                 WHERE resource_type = 'card' AND resource_id = c.card_ref
                   AND scenario = $1 AND state IN ('failed', 'unknown')
                 ORDER BY created_at DESC LIMIT 1) l ON true
          WHERE c.{column} IS NOT NULL
          ORDER BY c.{column} DESC LIMIT $2"
    ))
    .bind(scenario)
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading parked chains")?;
    for r in &mut rows {
        r.error = r.error.as_deref().map(redact_digits);
    }
    Ok((total, rows))
}

/// A payment that needs attention.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StuckPayment {
    /// The payment.
    pub payment_id: uuid::Uuid,
    /// Its card.
    pub card_ref: String,
    /// Minor units.
    pub amount_minor: i64,
    /// ISO 4217.
    pub currency: String,
    /// `unknown`, or `requested`/`pending` past `payments.recovery_after_secs`.
    pub status: String,
    /// Submissions sent.
    pub submissions: i32,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// A callback that failed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct FailedCallback {
    /// The channel.
    pub channel: String,
    /// Its id within the channel.
    pub callback_id: String,
    /// Why it failed (masked).
    pub reason: Option<String>,
    /// What it is about.
    pub resource_type: Option<String>,
    /// Which one.
    pub resource_id: Option<String>,
    /// The card, when the callback is about a card or a payment of one.
    pub card_ref: Option<String>,
    /// Deliveries received.
    pub deliveries: i32,
    /// Last delivery.
    pub last_received_at: DateTime<Utc>,
}

/// An approval that needs attention.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct StuckApproval {
    /// The approval.
    pub approval_id: uuid::Uuid,
    /// Its card.
    pub card_ref: String,
    /// `issue`, `limit_change`, `unfreeze`.
    pub kind: String,
    /// `requested`/`pending`/`unknown` past `approvals.recovery_after_secs`, or `in_review` past
    /// `approvals.review_query_secs`.
    pub status: String,
    /// Submissions sent.
    pub submissions: i32,
    /// Last change (or last query while in review).
    pub updated_at: DateTime<Utc>,
}

/// The money page.
#[derive(Debug, Clone, Serialize)]
pub struct Money {
    /// `payments.recovery_after_secs`: past it a pending payment is overdue.
    pub threshold_secs: u64,
    /// Payments `unknown`, or still `requested`/`pending` past the threshold, oldest first.
    pub payments: Vec<StuckPayment>,
    /// Approvals undecided past `approvals.recovery_after_secs` or in review past
    /// `approvals.review_query_secs`, oldest first.
    pub approvals: Vec<StuckApproval>,
    /// Failed callbacks, newest first.
    pub callbacks: Vec<FailedCallback>,
}

/// A uuid as text that PostgreSQL's `uuid` input always accepts (32 hex digits, with or without
/// the four dashes, either case): the only stored text a page casts to `uuid`. A callback's
/// `resource_id` is stored as the channel sent it, so it may hold anything; the cast comes after
/// this match (`CASE` evaluates its result only for the branch that matched), so no stored text
/// can make a page's query fail.
pub const UUID_TEXT: &str =
    "^[0-9A-Fa-f]{8}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{4}-?[0-9A-Fa-f]{12}$";

/// Reads the money page.
pub async fn money(ctx: &AppContext) -> anyhow::Result<Money> {
    let threshold_secs = ctx.config.payments.recovery_after_secs;
    let payments: Vec<StuckPayment> = sqlx::query_as(
        "SELECT payment_id, card_ref, amount_minor, currency, status, submissions, updated_at
           FROM payments
          WHERE status = 'unknown'
             OR (status IN ('requested', 'pending')
                 AND updated_at < now() - $1 * interval '1 second')
          ORDER BY updated_at LIMIT $2",
    )
    .bind(threshold_secs as f64)
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading payments that need attention")?;
    // Two range scans, of approvals_unsettled_idx and approvals_in_review_idx.
    let approvals: Vec<StuckApproval> = sqlx::query_as(
        "SELECT approval_id, card_ref, kind, status, submissions, updated_at
           FROM approvals
          WHERE (status IN ('requested', 'pending', 'unknown')
                 AND updated_at < now() - $1 * interval '1 second')
             OR (status = 'in_review' AND updated_at < now() - $2 * interval '1 second')
          ORDER BY updated_at LIMIT $3",
    )
    .bind(ctx.config.approvals.recovery_after_secs as f64)
    .bind(ctx.config.approvals.review_query_secs as f64)
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading approvals that need attention")?;
    let mut callbacks: Vec<FailedCallback> = sqlx::query_as(&format!(
        "SELECT cb.channel, cb.callback_id, cb.reason, cb.resource_type, cb.resource_id,
                CASE WHEN cb.resource_type = 'card' THEN cb.resource_id ELSE p.card_ref END
                  AS card_ref,
                cb.deliveries, cb.last_received_at
           FROM inbound_callbacks cb
           LEFT JOIN payments p
             ON p.payment_id = CASE WHEN cb.resource_type = 'payment'
                                     AND cb.resource_id ~ '{UUID_TEXT}'
                                    THEN cb.resource_id::uuid END
          WHERE cb.state = 'failed'
          ORDER BY cb.last_received_at DESC LIMIT $1"
    ))
    .bind(LIST_LIMIT)
    .fetch_all(&ctx.pool)
    .await
    .context("reading failed callbacks")?;
    for c in &mut callbacks {
        c.reason = c.reason.as_deref().map(redact_digits);
    }
    Ok(Money {
        threshold_secs,
        payments,
        approvals,
        callbacks,
    })
}
