//! Archive and retention, measured against real PostgreSQL and Redis: off means no query
//! on the record tables; on means exactly one ended Shanghai day per run, crash-safe, pausable,
//! one run across pods, one job per cron tick.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use cardworker::app;
use cardworker::config::Config;
use cardworker::context::AppContext;
use cardworker::maintenance::{self, day, session::LOCK_KEY, JobKind};
use cardworker::runner::spawn::enqueue_tick;
use cardworker_jobs::{RunArchive, RunRetention};
use chrono::{DateTime, Days, NaiveDate, Utc};
use sqlx::{Connection as _, PgConnection, PgPool};

use crate::harness::{metric_value, spawn_app, spawn_app_with, wait_until, TestApp};

const LIMIT: Duration = Duration::from_secs(20);
/// A schedule that does not fire during a test.
const NEVER: &str = "0 0 0 1 1 *";

/// Maintenance on, schedules out of the way, archive after 1 day, retention after 1 day.
fn on(c: &mut Config) {
    c.maintenance.enabled = true;
    c.maintenance.archive_cron = NEVER.to_owned();
    c.maintenance.retention_cron = NEVER.to_owned();
    c.maintenance.archive_after_days = 1;
    c.maintenance.retention_days = 1;
    c.maintenance.batch_size = 2;
}

fn today() -> NaiveDate {
    day::today()
}

fn ago(days: u64) -> NaiveDate {
    today().checked_sub_days(Days::new(days)).unwrap()
}

/// Tag of the rows seeded for `ago(k)`.
fn tag(k: u64) -> String {
    format!("day-{k}")
}

/// Seeds day `ago(k)` with: finished logs at 16:00:00Z (day start), +5 h and 15:59:59Z (one
/// second before the day ends), one pending log, and two audit events (at the day's first and last
/// second) with one link each. Returns the number of finished logs.
async fn seed_day(pool: &PgPool, k: u64) -> i64 {
    let (start, end) = day::bounds(ago(k));
    let last = end - chrono::Duration::seconds(1);
    assert_eq!(last.format("%H:%M:%S").to_string(), "15:59:59");
    assert_eq!(start.format("%H:%M:%S").to_string(), "16:00:00");
    let finished = [start, start + chrono::Duration::hours(5), last];
    for at in finished {
        insert_log(pool, &tag(k), "succeeded", at).await;
    }
    insert_log(pool, &tag(k), "pending", start + chrono::Duration::hours(1)).await;
    for at in [start, last] {
        let event: i64 = sqlx::query_scalar(
            "INSERT INTO audit_events (event_type, summary, created_at)
             VALUES ('card.status_changed', $1, $2) RETURNING id",
        )
        .bind(tag(k))
        .bind(at)
        .fetch_one(pool)
        .await
        .unwrap();
        let link =
            "INSERT INTO audit_resources (audit_event_id, resource_type, resource_id, created_at)
             VALUES ($1, 'card', $2, $3)";
        insert_tagged(pool, link, event, &tag(k), at).await;
    }
    finished.len() as i64
}

/// Runs the insert `sql` with `$1` = `id`, `$2` = `tag` and `$3` = `at`.
async fn insert_tagged(pool: &PgPool, sql: &str, id: i64, tag: &str, at: DateTime<Utc>) {
    sqlx::query(sql)
        .bind(id)
        .bind(tag)
        .bind(at)
        .execute(pool)
        .await
        .unwrap();
}

async fn insert_log(pool: &PgPool, tag: &str, state: &str, at: DateTime<Utc>) {
    let finished_at = (state != "pending").then_some(at);
    sqlx::query(
        "INSERT INTO integration_logs
           (correlation_id, resource_type, resource_id, scenario, state, started_at, finished_at,
            created_at)
         VALUES (gen_random_uuid(), 'card', $1, 'carddata_poll', $2, $3, $4, $3)",
    )
    .bind(tag)
    .bind(state)
    .bind(at)
    .bind(finished_at)
    .execute(pool)
    .await
    .unwrap();
}

/// Rows per (table, tag), online and archived.
async fn placement(pool: &PgPool) -> BTreeMap<(String, String), i64> {
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT 'integration_logs', resource_id, count(*) FROM integration_logs GROUP BY 2
         UNION ALL SELECT 'integration_logs_archive', resource_id, count(*) FROM integration_logs_archive GROUP BY 2
         UNION ALL SELECT 'audit_events', summary, count(*) FROM audit_events GROUP BY 2
         UNION ALL SELECT 'audit_events_archive', summary, count(*) FROM audit_events_archive GROUP BY 2
         UNION ALL SELECT 'audit_resources', resource_id, count(*) FROM audit_resources GROUP BY 2
         UNION ALL SELECT 'audit_resources_archive', resource_id, count(*) FROM audit_resources_archive GROUP BY 2",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter().map(|(t, g, n)| ((t, g), n)).collect()
}

fn at(p: &BTreeMap<(String, String), i64>, table: &str, k: u64) -> i64 {
    p.get(&(table.to_owned(), tag(k))).copied().unwrap_or(0)
}

/// Asserts where day `ago(k)` is: archived (finished rows in the archive, the pending log online)
/// or online (everything online).
fn assert_day(p: &BTreeMap<(String, String), i64>, k: u64, archived: bool) {
    let (online_logs, archived_logs, online_audit, archived_audit) =
        if archived { (1, 3, 0, 2) } else { (4, 0, 2, 0) };
    let what = format!("day ago({k}) archived={archived}: {p:?}");
    assert_eq!(at(p, "integration_logs", k), online_logs, "{what}");
    assert_eq!(
        at(p, "integration_logs_archive", k),
        archived_logs,
        "{what}"
    );
    assert_eq!(at(p, "audit_events", k), online_audit, "{what}");
    assert_eq!(at(p, "audit_events_archive", k), archived_audit, "{what}");
    assert_eq!(at(p, "audit_resources", k), online_audit, "{what}");
    assert_eq!(
        at(p, "audit_resources_archive", k),
        archived_audit,
        "{what}"
    );
}

async fn metrics(app: &TestApp) -> String {
    app.get("/metrics").await.1
}

/// One sample of the app's `/metrics`.
async fn metric(app: &TestApp, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_value(&metrics(app).await, name, labels)
}

async fn runs(app: &TestApp, job: &str, result: &str) -> f64 {
    let labels = [("job", job), ("result", result)];
    metric(app, "cardworker_maintenance_runs_total", &labels).await
}

/// Enqueues one run of `job` through the producer and waits until it was counted with `result`.
async fn run_via_job(app: &TestApp, job: JobKind, result: &str) {
    let before = runs(app, job.label(), result).await;
    let enqueued = match job {
        JobKind::Archive => app.producer().enqueue(&RunArchive::default()).await,
        JobKind::Retention => app.producer().enqueue(&RunRetention::default()).await,
    };
    enqueued.unwrap();
    let what = format!("the {} run", job.label());
    wait_until(LIMIT, &what, || async {
        runs(app, job.label(), result).await >= before + 1.0
    })
    .await;
}

/// The scan and tuple counters of the record and archive tables.
async fn table_stats(url: &str) -> Vec<(String, Vec<i64>)> {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut conn)
        .await
        .unwrap();
    type Row = (String, i64, i64, i64, i64, i64, i64, i64);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT relname::text, seq_scan, coalesce(idx_scan, 0), seq_tup_read,
                coalesce(idx_tup_fetch, 0), n_tup_ins, n_tup_upd, n_tup_del
         FROM pg_stat_user_tables
         WHERE relname IN ('integration_logs', 'audit_events', 'audit_resources',
                           'integration_logs_archive', 'audit_events_archive',
                           'audit_resources_archive')
         ORDER BY relname",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    rows.into_iter()
        .map(|(t, a, b, c, d, e, f, g)| (t, vec![a, b, c, d, e, f, g]))
        .collect()
}

#[tokio::test]
async fn with_maintenance_off_queued_runs_are_acknowledged_without_touching_the_tables() {
    let mut app = spawn_app().await;
    // Seed through a connection of its own that then exits, so its counters are published.
    let mut seeder = PgConnection::connect(&app.db.url).await.unwrap();
    for k in [3, 4] {
        let (start, _) = day::bounds(ago(k));
        sqlx::query(
            "INSERT INTO integration_logs (correlation_id, resource_type, resource_id, scenario,
               state, started_at, finished_at, created_at)
             VALUES (gen_random_uuid(), 'card', 'c-1', 'carddata_poll', 'succeeded', $1, $1, $1)",
        )
        .bind(start)
        .execute(&mut seeder)
        .await
        .unwrap();
    }
    seeder.close().await.unwrap();
    let url = app.db.url.clone();
    wait_until(LIMIT, "the seed's counters to be published", || async {
        table_stats(&url)
            .await
            .iter()
            .any(|(t, v)| t == "integration_logs" && v[4] == 2)
    })
    .await;
    let before = table_stats(&url).await;

    let text = metrics(&app).await;
    assert_eq!(
        metric_value(&text, "cardworker_maintenance_enabled", &[]),
        0.0
    );
    app.producer()
        .enqueue(&RunArchive::default())
        .await
        .unwrap();
    app.producer()
        .enqueue(&RunRetention::default())
        .await
        .unwrap();
    wait_until(LIMIT, "both runs acknowledged as disabled", || async {
        runs(&app, "archive", "skipped_disabled").await == 1.0
            && runs(&app, "retention", "skipped_disabled").await == 1.0
    })
    .await;
    let dead = [("queue", "archive"), ("result", "dead")];
    assert_eq!(
        metric(&app, "cardworker_jobs_finished_total", &dead).await,
        0.0,
        "no error, so no retry and no dead job"
    );

    // PostgreSQL 15 publishes a backend's counters late, at the latest when it exits: stop the
    // worker, close its pool, and wait until every backend but the harness's own has left the
    // database (a backend flushes its counters before it leaves pg_stat_activity).
    app.stop().await.unwrap();
    app.ctx.pool.close().await;
    let db = app.db.name.clone();
    wait_until(LIMIT, "the worker's backends to exit", || async {
        let mut conn = PgConnection::connect(&url).await.unwrap();
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = $1 AND pid <> pg_backend_pid()
                AND application_name IS DISTINCT FROM $2",
        )
        .bind(&db)
        .bind(crate::harness::HARNESS_APPLICATION_NAME)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        conn.close().await.unwrap();
        others == 0
    })
    .await;
    let after = table_stats(&url).await;
    assert_eq!(after.len(), 6, "{after:?}");
    assert_eq!(before, after, "maintenance off must not query the tables");

    // The measurement itself can see a query: one count(*) moves the counters.
    let mut probe = PgConnection::connect(&url).await.unwrap();
    sqlx::query("SELECT count(*) FROM integration_logs")
        .execute(&mut probe)
        .await
        .unwrap();
    probe.close().await.unwrap();
    wait_until(LIMIT, "the probe's scan to be counted", || async {
        table_stats(&url).await != after
    })
    .await;
}

#[tokio::test]
async fn each_archive_run_moves_exactly_the_oldest_due_shanghai_day() {
    let app = spawn_app_with(on).await;
    let pool = &app.db.pool;
    // Five Shanghai days: 4, 3 and 2 days ago are due (archive_after_days = 1); yesterday and
    // today are not.
    for k in [0, 1, 2, 3, 4] {
        seed_day(pool, k).await;
    }
    let text = metrics(&app).await;
    assert_eq!(
        metric_value(&text, "cardworker_maintenance_enabled", &[]),
        1.0
    );
    for result in [
        "processed",
        "nothing_due",
        "skipped_busy",
        "skipped_paused",
        "failed",
    ] {
        assert!(
            text.contains(&format!(
                "cardworker_maintenance_runs_total{{job=\"retention\",result=\"{result}\"}}"
            )),
            "series registered at start-up: {result}"
        );
    }

    for (run, k) in [(1, 4), (2, 3), (3, 2)] {
        run_via_job(&app, JobKind::Archive, "processed").await;
        let p = placement(pool).await;
        for other in 0..=4 {
            assert_day(&p, other, other >= k);
        }
        let text = metrics(&app).await;
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_last_day",
                &[("job", "archive")]
            ),
            day::yyyymmdd(ago(k)) as f64
        );
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_days_pending",
                &[("job", "archive")]
            ),
            (3 - run) as f64
        );
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_rows_total",
                &[
                    ("job", "archive"),
                    ("table", "integration_logs"),
                    ("action", "archived")
                ]
            ),
            (3 * run) as f64
        );
    }
    // Yesterday and today are not due; pending logs stay online.
    run_via_job(&app, JobKind::Archive, "nothing_due").await;
    let p = placement(pool).await;
    for k in 0..=4 {
        assert_day(&p, k, k >= 2);
    }
    let pending_online: i64 =
        sqlx::query_scalar("SELECT count(*) FROM integration_logs WHERE state = 'pending'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(pending_online, 5);
}

/// Maintenance on, batch size 1: a run moves one row per transaction.
async fn one_row_batches() -> TestApp {
    spawn_app_with(|c| {
        on(c);
        c.maintenance.batch_size = 1;
    })
    .await
}

/// Seeds `n` finished logs on day `ago(4)`, one second apart; returns their ids in order.
async fn seed_logs(pool: &PgPool, n: i64) -> Vec<i64> {
    let (start, _) = day::bounds(ago(4));
    for i in 0..n {
        insert_log(
            pool,
            &tag(4),
            "succeeded",
            start + chrono::Duration::seconds(i),
        )
        .await;
    }
    sqlx::query_scalar("SELECT id FROM integration_logs ORDER BY created_at")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Locks one log row in a transaction of the test, so that the run blocks right there.
async fn hold_row(url: &str, id: i64) -> PgConnection {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut conn).await.unwrap();
    sqlx::query("SELECT id FROM integration_logs WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// Waits until the maintenance session waits for a row lock.
async fn wait_blocked(pool: &PgPool) {
    wait_until(
        LIMIT,
        "the maintenance session to wait on the held row",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = 'cardworker-maintenance' AND datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(pool)
            .await
            .unwrap()
                == 1
        },
    )
    .await;
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[tokio::test]
async fn a_run_killed_halfway_and_rerun_leaves_exactly_one_copy_of_each_row() {
    let app = one_row_batches().await;
    let pool = app.db.pool.clone();
    let ids = seed_logs(&pool, 8).await;
    let held = hold_row(&app.db.url, ids[3]).await;

    let ctx = app.ctx.clone();
    let run = tokio::spawn(async move { maintenance::run_job(&ctx, JobKind::Archive).await });
    wait_blocked(&pool).await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs_archive").await,
        3
    );
    // Kill the run's session mid-batch, as a crashed pod or a DBA would.
    let killed = count(
        &pool,
        "SELECT count(*) FROM pg_stat_activity, pg_terminate_backend(pid)
         WHERE application_name = 'cardworker-maintenance' AND datname = current_database()",
    )
    .await;
    assert_eq!(killed, 1);
    assert!(run.await.unwrap().is_err(), "the killed run fails");
    drop(held);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs").await,
        5
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs_archive").await,
        3
    );

    let report = maintenance::run_job(&app.ctx, JobKind::Archive)
        .await
        .unwrap();
    assert_eq!(report.result, "processed");
    assert_eq!(report.day, Some(ago(4)));
    assert!(report.day_finished);
    assert_eq!(report.rows_of("integration_logs"), 5);
    // Exactly one copy of each row, all in the archive.
    let copies: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT id, count(*) FROM (SELECT id FROM integration_logs
                                   UNION ALL SELECT id FROM integration_logs_archive) x
         GROUP BY id ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(copies, ids.iter().map(|id| (*id, 1)).collect::<Vec<_>>());
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs").await,
        0
    );
    assert_eq!(runs(&app, "archive", "failed").await, 1.0);
}

#[tokio::test]
async fn a_statement_over_the_timeout_fails_the_run_and_keeps_finished_batches() {
    let app = spawn_app_with(|c| {
        on(c);
        c.maintenance.batch_size = 1;
        c.maintenance.statement_timeout_ms = 300;
    })
    .await;
    let pool = app.db.pool.clone();
    let ids = seed_logs(&pool, 4).await;
    let held = hold_row(&app.db.url, ids[2]).await;
    let err = maintenance::run_job(&app.ctx, JobKind::Archive)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("statement timeout"), "{err:#}");
    drop(held);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs_archive").await,
        2
    );
    let report = maintenance::run_job(&app.ctx, JobKind::Archive)
        .await
        .unwrap();
    assert_eq!(report.rows_of("integration_logs"), 2);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs_archive").await,
        4
    );
}

#[tokio::test]
async fn a_pause_during_a_run_stops_it_at_the_next_batch_boundary() {
    let app = one_row_batches().await;
    let pool = app.db.pool.clone();
    let ids = seed_logs(&pool, 8).await;
    let mut held = hold_row(&app.db.url, ids[3]).await;

    let ctx = app.ctx.clone();
    let run = tokio::spawn(async move { maintenance::run_job(&ctx, JobKind::Archive).await });
    wait_blocked(&pool).await;
    // Pause while the 4th batch waits, then let that batch finish.
    maintenance::set_paused(&mut app.ctx.redis.clone(), app.ctx.prefix(), true)
        .await
        .unwrap();
    sqlx::query("ROLLBACK").execute(&mut held).await.unwrap();
    let report = run.await.unwrap().unwrap();
    assert_eq!(report.result, "processed");
    assert!(report.stopped_by_pause);
    assert!(!report.day_finished);
    assert_eq!(
        report.rows_of("integration_logs"),
        4,
        "stopped after batch 4"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs_archive").await,
        4
    );

    // Paused: later runs are no-ops that touch nothing.
    run_via_job(&app, JobKind::Archive, "skipped_paused").await;
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs").await,
        4
    );

    // Resumed: the next run finishes the same day.
    maintenance::set_paused(&mut app.ctx.redis.clone(), app.ctx.prefix(), false)
        .await
        .unwrap();
    let report = maintenance::run_job(&app.ctx, JobKind::Archive)
        .await
        .unwrap();
    assert_eq!(report.day, Some(ago(4)));
    assert!(report.day_finished);
    assert_eq!(report.rows_of("integration_logs"), 4);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM integration_logs").await,
        0
    );
}

#[tokio::test]
async fn a_run_that_finds_another_in_progress_is_skipped_busy() {
    let app = spawn_app_with(on).await;
    let pool = app.db.pool.clone();
    seed_day(&pool, 4).await;
    let mut other = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(LOCK_KEY)
        .execute(&mut other)
        .await
        .unwrap();
    run_via_job(&app, JobKind::Archive, "skipped_busy").await;
    run_via_job(&app, JobKind::Retention, "skipped_busy").await;
    assert_day(&placement(&pool).await, 4, false);
    other.close().await.unwrap();
    run_via_job(&app, JobKind::Archive, "processed").await;
    assert_day(&placement(&pool).await, 4, true);
}

/// Inserts archived rows for day `ago(k)` straight into the archive tables: 3 logs, 2 events, 2
/// links.
async fn seed_archive_day(pool: &PgPool, k: u64, first_id: i64) {
    let (start, end) = day::bounds(ago(k));
    let times = [
        start,
        start + chrono::Duration::hours(3),
        end - chrono::Duration::seconds(1),
    ];
    let log =
        "INSERT INTO integration_logs_archive (id, correlation_id, resource_type, resource_id,
               scenario, state, started_at, finished_at, created_at)
             VALUES ($1, gen_random_uuid(), 'card', $2, 'carddata_poll', 'failed', $3, $3, $3)";
    for (i, t) in times.into_iter().enumerate() {
        insert_tagged(pool, log, first_id + i as i64, &tag(k), t).await;
    }
    let event = "INSERT INTO audit_events_archive (id, event_type, summary, created_at)
             VALUES ($1, 'poll.failed', $2, $3)";
    let link =
        "INSERT INTO audit_resources_archive (id, audit_event_id, resource_type, resource_id,
               created_at)
             VALUES ($1, $1, 'card', $2, $3)";
    for (i, t) in [times[0], times[2]].into_iter().enumerate() {
        let id = first_id + i as i64;
        insert_tagged(pool, event, id, &tag(k), t).await;
        insert_tagged(pool, link, id, &tag(k), t).await;
    }
}

async fn archived_rows(pool: &PgPool, k: u64) -> i64 {
    let p = placement(pool).await;
    at(&p, "integration_logs_archive", k)
        + at(&p, "audit_events_archive", k)
        + at(&p, "audit_resources_archive", k)
}

#[tokio::test]
async fn retention_deletes_nothing_with_cleanup_off_and_exactly_one_day_with_cleanup_on() {
    let app = spawn_app_with(on).await;
    let pool = app.db.pool.clone();
    // 4 and 3 days ago are expired (retention_days = 1); yesterday is not.
    for (k, id) in [(4, 100), (3, 200), (1, 300)] {
        seed_archive_day(&pool, k, id).await;
    }

    // Cleanup off: nothing deleted, the same day reported on every run.
    for run in 1..=2 {
        run_via_job(&app, JobKind::Retention, "processed").await;
        for k in [4, 3, 1] {
            assert_eq!(archived_rows(&pool, k).await, 7);
        }
        let text = metrics(&app).await;
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_rows_total",
                &[("job", "retention"), ("action", "expired_kept")]
            ),
            (7 * run) as f64
        );
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_rows_total",
                &[("action", "deleted")]
            ),
            0.0
        );
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_last_day",
                &[("job", "retention")]
            ),
            day::yyyymmdd(ago(4)) as f64
        );
        assert_eq!(
            metric_value(
                &text,
                "cardworker_maintenance_days_pending",
                &[("job", "retention")]
            ),
            2.0
        );
    }

    // Cleanup on (same database and prefix): one day per run, oldest first.
    let mut config = (*app.ctx.config).clone();
    config.maintenance.cleanup_enabled = true;
    let ctx: Arc<AppContext> = AppContext::connect(config).await.unwrap();
    let report = maintenance::run_job(&ctx, JobKind::Retention)
        .await
        .unwrap();
    assert_eq!((report.result, report.day), ("processed", Some(ago(4))));
    assert_eq!(report.days_pending, Some(1));
    assert_eq!(archived_rows(&pool, 4).await, 0);
    assert_eq!(archived_rows(&pool, 3).await, 7);
    assert_eq!(archived_rows(&pool, 1).await, 7);
    let report = maintenance::run_job(&ctx, JobKind::Retention)
        .await
        .unwrap();
    assert_eq!(report.day, Some(ago(3)));
    assert_eq!(archived_rows(&pool, 3).await, 0);
    let report = maintenance::run_job(&ctx, JobKind::Retention)
        .await
        .unwrap();
    assert_eq!(report.result, "nothing_due");
    assert_eq!(archived_rows(&pool, 1).await, 7);
}

#[tokio::test]
async fn two_workers_enqueueing_on_the_same_cron_tick_produce_one_job() {
    let app = spawn_app_with(on).await;
    // A second worker process of the same deployment (same database and prefix).
    let ctx2 = AppContext::connect((*app.ctx.config).clone())
        .await
        .unwrap();
    let second = app::start(ctx2.clone()).await.unwrap();
    let (stop2, stopped2) = tokio::sync::oneshot::channel::<()>();
    let join2 = tokio::spawn(second.wait(async move {
        let _ = stopped2.await;
    }));

    let tick = Utc::now().timestamp();
    let (a, b) = tokio::join!(
        enqueue_tick::<RunArchive>(&app.ctx, tick),
        enqueue_tick::<RunArchive>(&ctx2, tick)
    );
    assert_eq!(
        [a.unwrap(), b.unwrap()].iter().filter(|e| **e).count(),
        1,
        "one enqueue wins the tick"
    );
    let total = |text: &str| {
        metric_value(
            text,
            "cardworker_maintenance_runs_total",
            &[("job", "archive")],
        )
    };
    wait_until(LIMIT, "the tick's run", || async {
        total(&metrics(&app).await) == 1.0
    })
    .await;
    // Nothing more queued or running for archive (both workers have fetched all there was):
    // still one run.
    wait_until(LIMIT, "the archive queue idle", || {
        app.queue_idle("archive")
    })
    .await;
    assert_eq!(total(&metrics(&app).await), 1.0);

    let _ = stop2.send(());
    join2.await.unwrap().unwrap();
}

#[tokio::test]
async fn maintenance_status_sizes_the_backlog_while_off_and_names_the_last_day_after_a_run() {
    // Off, as before a rollout: the status still measures what the first runs would do.
    let mut app = spawn_app_with(|c| {
        on(c);
        c.maintenance.enabled = false;
    })
    .await;
    let pool = &app.db.pool;
    for k in [0, 2, 3, 5] {
        seed_day(pool, k).await;
    }
    let status = maintenance::status::status(&app.ctx).await.unwrap();
    assert!(!status.enabled && !status.cleanup_enabled && !status.paused);
    let archive = &status.jobs["archive"];
    assert_eq!(archive.days_pending, 3, "{status:?}");
    assert_eq!(archive.next_day, Some(ago(5)));
    assert_eq!(archive.due_before, ago(1));
    assert_eq!(archive.last_day, None);
    let retention = &status.jobs["retention"];
    assert_eq!((retention.days_pending, retention.next_day), (0, None));

    // The same, as an operator sees it (JSON, through the binary), with the brake set.
    maintenance::set_paused(&mut app.ctx.redis.clone(), app.ctx.prefix(), true)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cardworker.toml");
    std::fs::write(&path, app.ctx.config.to_toml_string().unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(["maintenance", "status", "--format", "json", "--config"])
        .arg(&path)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["enabled"], false);
    assert_eq!(json["paused"], true);
    assert_eq!(json["jobs"]["archive"]["days_pending"], 3);
    assert_eq!(
        json["jobs"]["archive"]["next_day"],
        ago(5).to_string().as_str()
    );
    assert!(json["jobs"]["archive"]["last_day"].is_null());
    assert_eq!(json["jobs"]["retention"]["days_pending"], 0);
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_cardworker"))
        .args(["maintenance", "status", "--config"])
        .arg(&path)
        .env_remove("CARDWORKER_CONFIG")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("paused=true") && text.contains("3 days pending"),
        "{text}"
    );
    maintenance::set_paused(&mut app.ctx.redis.clone(), app.ctx.prefix(), false)
        .await
        .unwrap();
    app.stop().await.unwrap();

    // A run (another pod, maintenance on) records its day fleet-wide: same database and prefix.
    let mut config = (*app.ctx.config).clone();
    config.maintenance.enabled = true;
    let pod = AppContext::connect(config).await.unwrap();
    let report = maintenance::run_job(&pod, JobKind::Archive).await.unwrap();
    assert_eq!((report.result, report.day), ("processed", Some(ago(5))));
    let status = maintenance::status::status(&app.ctx).await.unwrap();
    let archive = &status.jobs["archive"];
    assert_eq!(archive.last_day, Some(ago(5)));
    assert_eq!(archive.last_day_finished, Some(true));
    assert_eq!((archive.next_day, archive.days_pending), (Some(ago(3)), 2));
    assert_eq!(status.jobs["retention"].next_day, Some(ago(5)));
}
