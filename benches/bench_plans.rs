//! `make bench-plans`: every product statement's plan at production volumes, custom and generic.
//!
//! 1. A private PostgreSQL cluster (the test kit's `private::PrivatePg`) with `auto_explain` preloaded.
//! 2. A real worker on it (`harness::spawn_app_on`) and the production volumes of issue 18,
//!    seeded with `generate_series` (secondary indexes dropped during the load and rebuilt,
//!    foreign-key triggers skipped, then `VACUUM (ANALYZE)`): 1M cards, 3M integration logs,
//!    3M audit events and 3M resource links over 90 days, 1M outbox rows, 500k payments,
//!    1M inbound callbacks; and an archive of 3M rows per archive table over the 90 days before.
//! 3. `auto_explain` on (`log_analyze`, `log_buffers`), `plan_cache_mode = force_custom_plan`,
//!    and the plan guard's drive (the test kit's `plan_drive`): every statement path of `src/`,
//!    through the product's own code. Then the same with `force_generic_plan` (what sqlx's cached
//!    prepared statements settle on). Both modes are set server-wide and reloaded, so they reach
//!    the product's pooled sessions.
//! 4. The queries of docs/RUNBOOK.md and docs/MAINTENANCE.md (every ```sql block), the statements
//!    issue 18 replaced, and the `(resource_type, resource_id, last_received_at DESC)` index
//!    candidate, each by `EXPLAIN (ANALYZE, BUFFERS)` (prepared, custom and generic, where they
//!    take parameters), median of 5 runs.
//! 5. A report (Markdown, on stdout): per product statement and mode the executions, median and
//!    max time, the buffers and plan shape of the slowest execution, and the plan guard's verdict
//!    at volume (seq scans allowed here: the real planner's choice). It exits non-zero when a
//!    statement reads a guarded table whole or a documented query takes 10 ms or more.
//!
//! The report is also written to `$CARGO_TARGET_DIR/bench-plans.md` (docs/BENCHMARKS.md keeps
//! the recorded run). The cluster, the harness, the drive and the plan checker are the plan
//! guard's own (the test kit's), so that the test and the bench judge the same statements by the
//! same rules.
//!
//! Env: `BENCH_PLANS_SCALE` (default 1; 0.01 for a quick trial of the machinery),
//! `CARDWORKER_BENCH_PLANS_LOG=FILE` keeps the plan log, `CARDWORKER_TEST_PG_BIN` and
//! `CARDWORKER_TEST_REDIS` as for the tests.

use cardworker_test_kit::{harness, plan_drive, plan_guard};

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context as _;
use cardworker::commands::investigate::CALLBACKS_SQL;
use serde_json::Value;
use sqlx::{Connection as _, PgConnection};

use cardworker_test_kit::private::PrivatePg;
use plan_drive::{Scale, COVERAGE};
use plan_guard::{LoggedPlan, OLD_CALLBACKS_SQL};

const SETTINGS: &[(&str, &str)] = &[
    ("shared_preload_libraries", "auto_explain"),
    // Off while seeding; switched on (0) before the drive.
    ("auto_explain.log_min_duration", "-1"),
    ("auto_explain.log_analyze", "on"),
    ("auto_explain.log_buffers", "on"),
    ("auto_explain.log_timing", "on"),
    ("auto_explain.log_nested_statements", "on"),
    ("auto_explain.log_format", "json"),
    ("logging_collector", "on"),
    ("log_destination", "jsonlog"),
    ("log_directory", "log"),
    ("log_rotation_size", "1GB"),
    ("shared_buffers", "512MB"),
    ("maintenance_work_mem", "512MB"),
    ("max_wal_size", "20GB"),
    ("checkpoint_timeout", "1h"),
    ("wal_level", "minimal"),
    ("max_wal_senders", "0"),
    // The explicit VACUUM (ANALYZE) after the load sets statistics and the visibility map; the
    // drive's few thousand writes do not move them.
    ("autovacuum", "off"),
];

/// `application_name` of the bench's own measuring session.
const BENCH_APP: &str = "plan-bench";
/// `application_name` of the session that runs the replaced statements through sqlx.
const CANARY: &str = "plan-guard-canary";

/// A typical card of the seed (a callback or two, a payment or none).
const TYPICAL_CARD: &str = "c-0500001";

/// The volumes of issue 18, times `BENCH_PLANS_SCALE` (default 1; 0.01 for a quick trial).
struct Volumes {
    cards: u64,
    logs: u64,
    outbox: u64,
    payments: u64,
    callbacks: u64,
}

impl Volumes {
    fn from_env() -> anyhow::Result<Self> {
        let scale: f64 = std::env::var("BENCH_PLANS_SCALE")
            .unwrap_or_else(|_| "1".to_owned())
            .parse()
            .context("BENCH_PLANS_SCALE must be a number")?;
        anyhow::ensure!(
            scale > 0.0 && scale <= 10.0,
            "BENCH_PLANS_SCALE must be in (0, 10]"
        );
        let n = |base: f64| ((base * scale) as u64).max(1000);
        Ok(Self {
            cards: n(1e6),
            logs: n(3e6),
            outbox: n(1e6),
            payments: n(5e5),
            callbacks: n(1e6),
        })
    }

    /// A seed statement with its `:name` placeholders replaced.
    fn apply(&self, sql: &str, t0: &str) -> String {
        sql.replace(":t0", &format!("'{t0}'::timestamptz"))
            .replace(":cards", &self.cards.to_string())
            .replace(":logs", &self.logs.to_string())
            .replace(":outbox", &self.outbox.to_string())
            .replace(":payments", &self.payments.to_string())
            .replace(":callbacks", &self.callbacks.to_string())
    }
}

/// The load, one statement per step: the online records spread evenly over the last 90 days,
/// the archive over the 90 days before (as `retention_days = 180` keeps it), ids in time order as
/// in production; `:name` is a volume of [`Volumes`], `:t0` the one instant the load started (so
/// that rows of different statements agree on their day). The last step gives the heavy
/// card `c-0000042` 100 callbacks of its own and 20 payments with 3 callbacks each.
const SEED: &[(&str, &str)] = &[
    (
        "cards",
        "
INSERT INTO cards (id, card_ref, data_state, card_token, pan_last4, expiry_month, expiry_year,
                   status, version, card_status_parked_at, created_at, updated_at)
SELECT i, 'c-' || lpad(i::text, 7, '0'),
       CASE WHEN i % 20 = 0 THEN 'pending' ELSE 'ready' END,
       CASE WHEN i % 20 = 0 THEN NULL ELSE 'tok_' || md5(i::text) END,
       CASE WHEN i % 20 = 0 THEN NULL ELSE lpad((i % 10000)::text, 4, '0') END,
       CASE WHEN i % 20 = 0 THEN NULL ELSE 1 + i % 12 END,
       CASE WHEN i % 20 = 0 THEN NULL ELSE 2027 + i % 5 END,
       (ARRAY['active','active','active','active','active','active','frozen','inactive',
              'cancelled','expired'])[1 + i % 10],
       i % 7,
       CASE WHEN i % 1000 = 5 THEN t + interval '1 day' END,
       t, t + interval '1 hour'
  FROM generate_series(1::bigint, :cards) i,
       LATERAL (SELECT :t0 - interval '90 days' + (i / :cards.0) * interval '90 days' AS t) x",
    ),
    (
        "integration_logs",
        "
INSERT INTO integration_logs (id, correlation_id, resource_type, resource_id, scenario, state,
                              request_summary, response_summary, http_status, error,
                              recovery_summary, started_at, finished_at, duration_ms, created_at)
SELECT i, md5('l' || i)::uuid, r.kind, r.id,
       CASE WHEN r.kind = 'payment' THEN 'payment_submit'
            ELSE (ARRAY['card_status_poll', 'carddata_poll', 'callback'])[1 + i % 3] END,
       s.state,
       'GET /v1/cards/' || r.id || '/status',
       '{\"card_ref\":\"' || r.id || '\",\"status\":\"frozen\"}',
       CASE WHEN s.state = 'failed' THEN 503 ELSE 200 END,
       CASE WHEN s.state = 'failed' THEN 'HTTP 503 from the Gateway' END,
       CASE WHEN s.state = 'failed' THEN 'next attempt in 20s (failure 1 of 10)' END,
       t - interval '40 milliseconds', CASE WHEN s.state <> 'pending' THEN t END,
       CASE WHEN s.state <> 'pending' THEN 40 END, t
  FROM generate_series(1::bigint, :logs) i,
       LATERAL (SELECT :t0 - interval '90 days' + (i / :logs.0) * interval '90 days' AS t) x,
       LATERAL (SELECT CASE WHEN i % 10 = 0 THEN 'payment' ELSE 'card' END AS kind,
                       CASE WHEN i % 10 = 0 THEN md5('p' || (1 + (i / 10) % :payments))::uuid::text
                            ELSE 'c-' || lpad((1 + (i * 7919) % :cards)::text, 7, '0') END AS id) r,
       LATERAL (SELECT CASE WHEN i % 200000 = 7 THEN 'pending' WHEN i % 25 = 0 THEN 'failed'
                            ELSE 'succeeded' END AS state) s",
    ),
    (
        "audit_events",
        "
INSERT INTO audit_events (id, event_type, correlation_id, integration_log_id, summary, details,
                          created_at)
SELECT i, (ARRAY['card.status_changed', 'card.data_ready', 'poll.failed'])[1 + i % 3],
       md5('l' || i)::uuid, i, 'status active -> frozen (version 3 -> 4) by poll',
       '{\"from\":\"active\",\"to\":\"frozen\",\"version\":4}'::jsonb,
       :t0 - interval '90 days' + (i / :logs.0) * interval '90 days'
  FROM generate_series(1::bigint, :logs) i",
    ),
    (
        "audit_resources",
        "
INSERT INTO audit_resources (id, audit_event_id, resource_type, resource_id, created_at)
SELECT i, i, CASE WHEN i % 10 = 0 THEN 'payment' ELSE 'card' END,
       CASE WHEN i % 10 = 0 THEN md5('p' || (1 + (i / 10) % :payments))::uuid::text
            ELSE 'c-' || lpad((1 + (i * 7919) % :cards)::text, 7, '0') END,
       :t0 - interval '90 days' + (i / :logs.0) * interval '90 days'
  FROM generate_series(1::bigint, :logs) i",
    ),
    (
        "outbox_events",
        "
INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, created_at,
                           published_at)
SELECT i, 'card', c, 'card.status_changed',
       jsonb_build_object('card_ref', c, 'status', 'frozen', 'version', i % 9),
       t, CASE WHEN i <= :outbox - 500 THEN t + interval '2 seconds' END
  FROM generate_series(1::bigint, :outbox) i,
       LATERAL (SELECT 'c-' || lpad((1 + (i * 7919) % :cards)::text, 7, '0') AS c,
                       :t0 - interval '90 days' + (i / :outbox.0) * interval '90 days' AS t) x",
    ),
    (
        "payments",
        "
INSERT INTO payments (payment_id, card_ref, amount_minor, currency, status, channel_ref,
                      submissions, created_at, updated_at)
SELECT md5('p' || i)::uuid, 'c-' || lpad((1 + (i * 31) % :cards)::text, 7, '0'),
       100 + i % 100000, 'CNY', s.status,
       CASE WHEN s.status IN ('accepted', 'rejected') THEN 'ch_' || i END,
       CASE WHEN s.status = 'requested' THEN 0 ELSE 1 END, t, t + interval '5 seconds'
  FROM generate_series(1::bigint, :payments) i,
       LATERAL (SELECT :t0 - interval '90 days' + (i / :payments.0) * interval '90 days' AS t) x,
       LATERAL (SELECT CASE WHEN i % 100 = 0 THEN 'unknown' WHEN i % 100 = 1 THEN 'pending'
                            WHEN i % 100 = 2 THEN 'requested' WHEN i % 10 = 3 THEN 'rejected'
                            ELSE 'accepted' END AS status) s",
    ),
    (
        "inbound_callbacks",
        "
INSERT INTO inbound_callbacks (id, channel, callback_id, body, state, reason, resource_type,
                               resource_id, deliveries, first_received_at, last_received_at,
                               applied_at)
SELECT i, CASE WHEN i % 2 = 0 THEN 'visa' ELSE 'mastercard' END, 'cb-' || i,
       CASE WHEN r.kind = 'card'
            THEN '{\"type\":\"card.status\",\"card_ref\":\"' || r.id || '\",\"status\":\"frozen\"}'
            ELSE '{\"type\":\"payment.result\",\"payment_id\":\"' || r.id
                 || '\",\"status\":\"accepted\",\"channel_ref\":\"ch_' || i || '\"}' END,
       CASE WHEN i % 100 = 0 THEN 'failed' ELSE 'applied' END,
       CASE WHEN i % 100 = 0 THEN 'unknown card ' || r.id END,
       r.kind, r.id, 1 + (i % 50 = 0)::int, t, t, CASE WHEN i % 100 <> 0 THEN t END
  FROM generate_series(1::bigint, :callbacks) i,
       LATERAL (SELECT :t0 - interval '90 days' + (i / :callbacks.0) * interval '90 days' AS t) x,
       LATERAL (SELECT CASE WHEN i % 2 = 0 THEN 'card' ELSE 'payment' END AS kind,
                       CASE WHEN i % 2 = 0 THEN 'c-' || lpad((1 + (i * 13) % :cards)::text, 7, '0')
                            ELSE md5('p' || (1 + (i * 17) % :payments))::uuid::text END AS id) r",
    ),
    (
        "integration_logs_archive",
        "
INSERT INTO integration_logs_archive (id, correlation_id, resource_type, resource_id, scenario,
                                      state, request_summary, response_summary, http_status,
                                      started_at, finished_at, duration_ms, created_at,
                                      archived_at)
SELECT 10000000 + i, md5('al' || i)::uuid, 'card',
       'c-' || lpad((1 + (i * 7919) % :cards)::text, 7, '0'),
       'card_status_poll', 'succeeded', 'GET /v1/cards/c-1/status',
       '{\"card_ref\":\"c-1\",\"status\":\"frozen\"}', 200,
       t - interval '40 milliseconds', t, 40, t, t + interval '31 days'
  FROM generate_series(1::bigint, :logs) i,
       LATERAL (SELECT :t0 - interval '180 days' + (i / :logs.0) * interval '90 days' AS t) x",
    ),
    (
        "audit_events_archive",
        "
INSERT INTO audit_events_archive (id, event_type, correlation_id, integration_log_id, summary,
                                  details, created_at, archived_at)
SELECT 10000000 + i, 'card.status_changed', md5('al' || i)::uuid, 10000000 + i,
       'status active -> frozen (version 3 -> 4) by poll',
       '{\"from\":\"active\",\"to\":\"frozen\",\"version\":4}'::jsonb, t,
       t + interval '31 days'
  FROM generate_series(1::bigint, :logs) i,
       LATERAL (SELECT :t0 - interval '180 days' + (i / :logs.0) * interval '90 days' AS t) x",
    ),
    (
        "audit_resources_archive",
        "
INSERT INTO audit_resources_archive (id, audit_event_id, resource_type, resource_id, created_at,
                                     archived_at)
SELECT 10000000 + i, 10000000 + i, 'card',
       'c-' || lpad((1 + (i * 7919) % :cards)::text, 7, '0'), t, t + interval '31 days'
  FROM generate_series(1::bigint, :logs) i,
       LATERAL (SELECT :t0 - interval '180 days' + (i / :logs.0) * interval '90 days' AS t) x",
    ),
    (
        "the heavy card c-0000042",
        "
WITH pay AS (
    INSERT INTO payments (payment_id, card_ref, amount_minor, currency, status, channel_ref,
                          submissions)
    SELECT md5('heavy' || k)::uuid, 'c-0000042', 500, 'CNY', 'accepted', 'ch_h' || k, 1
      FROM generate_series(1, 20) k
    RETURNING payment_id
), cb AS (
    SELECT 'card' AS kind, 'c-0000042' AS id, k FROM generate_series(1, 100) k
    UNION ALL
    SELECT 'payment', payment_id::text, k FROM pay, generate_series(1, 3) k
)
INSERT INTO inbound_callbacks (id, channel, callback_id, body, state, resource_type, resource_id,
                               first_received_at, last_received_at, applied_at)
SELECT :callbacks + row_number() OVER (), 'visa', 'cb-heavy-' || row_number() OVER (), '{}',
       'applied', kind, id, :t0 - k * interval '1 hour', :t0 - k * interval '1 hour',
       :t0 - k * interval '1 hour'
  FROM cb",
    ),
];

/// The product's tables (every table of the schema but sqlx's bookkeeping): their secondary
/// indexes are dropped during the load and rebuilt after it, and their sizes reported.
const TABLES_SQL: &str = "SELECT array_agg(tablename::text ORDER BY tablename) FROM pg_tables
  WHERE schemaname = current_schema() AND tablename <> '_sqlx_migrations'";

async fn product_tables(conn: &mut PgConnection) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar(TABLES_SQL).fetch_one(&mut *conn).await?)
}

/// The statements issue 18 replaced, and the index candidate, measured beside their successors.
/// (label, SQL, parameters as literals for `EXECUTE`, index to create first in the transaction).
type Reference = (
    &'static str,
    &'static str,
    &'static [&'static str],
    Option<&'static str>,
);

const CANDIDATE_INDEX: &str = "CREATE INDEX inbound_callbacks_resource_recent_idx
    ON inbound_callbacks (resource_type, resource_id, last_received_at DESC)";

fn references() -> Vec<Reference> {
    const HEAVY: &[&str] = &["'c-0000042'", "50"];
    const TYPICAL: &[&str] = &["'c-0500001'", "50"];
    vec![
        ("investigate callbacks, before: IN (SELECT …), heavy card", OLD_CALLBACKS_SQL, HEAVY, None),
        ("investigate callbacks, before: IN (SELECT …), typical card", OLD_CALLBACKS_SQL, TYPICAL, None),
        ("investigate callbacks, now: = ANY (ARRAY(SELECT …)), heavy card", CALLBACKS_SQL, HEAVY, None),
        ("investigate callbacks, now: = ANY (ARRAY(SELECT …)), typical card", CALLBACKS_SQL, TYPICAL, None),
        ("investigate callbacks, now, with the candidate index, heavy card", CALLBACKS_SQL, HEAVY, Some(CANDIDATE_INDEX)),
        ("investigate callbacks, now, with the candidate index, typical card", CALLBACKS_SQL, TYPICAL, Some(CANDIDATE_INDEX)),
        (
            "RUNBOOK rows written in 15 minutes, before: integration_logs by created_at alone",
            "SELECT count(*) FROM integration_logs WHERE created_at > now() - interval '15 minutes'",
            &[],
            None,
        ),
        (
            "MAINTENANCE backlog sizing, before: count(DISTINCT day) over the due part",
            "SELECT count(DISTINCT (created_at AT TIME ZONE 'Asia/Shanghai')::date) AS archive_days_due
               FROM integration_logs
              WHERE state <> 'pending'
                AND created_at < (date_trunc('day', now() AT TIME ZONE 'Asia/Shanghai')
                                  - make_interval(days => 30)) AT TIME ZONE 'Asia/Shanghai'",
            &[],
            None,
        ),
    ]
}

/// One measured statement (EXPLAIN ANALYZE, median of runs).
struct Measured {
    /// Planning + execution, median (ms).
    total_ms: f64,
    /// Execution, median (ms).
    exec_ms: f64,
    /// Shared buffers hit + read of the median run.
    buffers: (i64, i64),
    /// Plan shape.
    shape: String,
    /// The plan guard's verdict on it.
    violations: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let started = Instant::now();
    let mut cluster = PrivatePg::start_with(SETTINGS)?;
    eprintln!("private cluster on port {}", cluster.port());
    let mut app = harness::spawn_app_on(&cluster.admin_url(), |c| {
        plan_drive::configure(c, Scale::Production)
    })
    .await;
    let url = app.db.url.clone();
    let mut conn = connect(&url, harness::HARNESS_APPLICATION_NAME).await?;

    let volumes = Volumes::from_env()?;
    let seed_started = Instant::now();
    seed(&mut conn, &volumes).await?;
    let seed_secs = seed_started.elapsed().as_secs_f64();
    let sizes = sizes(&mut conn).await?;

    // auto_explain on, custom plans: the first drive.
    set_server(
        &mut conn,
        &[
            ("auto_explain.log_min_duration", "0"),
            ("plan_cache_mode", "force_custom_plan"),
        ],
    )
    .await?;
    marker(&mut conn, "custom").await?;
    let t = Instant::now();
    plan_drive::drive(&app, "custom", Scale::Production).await;
    eprintln!("drive (custom plans): {:.1} s", t.elapsed().as_secs_f64());
    set_server(&mut conn, &[("plan_cache_mode", "force_generic_plan")]).await?;
    marker(&mut conn, "generic").await?;
    let t = Instant::now();
    plan_drive::drive(&app, "generic", Scale::Production).await;
    eprintln!("drive (generic plans): {:.1} s", t.elapsed().as_secs_f64());
    marker(&mut conn, "end").await?;
    set_server(&mut conn, &[("plan_cache_mode", "auto")]).await?;
    app.stop().await.context("stopping the worker")?;

    // The documented queries and the references, on a session of their own.
    let mut bench = connect(&url, BENCH_APP).await?;
    let indexes = plan_guard::read_indexes(&app.db.pool).await;
    let docs = measure_docs(&mut bench, &indexes).await?;
    let mut refs = Vec::new();
    for (label, sql, params, index) in references() {
        for mode in ["force_custom_plan", "force_generic_plan"] {
            if params.is_empty() && mode == "force_generic_plan" {
                continue;
            }
            let m = measure(&mut bench, &indexes, sql, params, mode, index).await?;
            refs.push((label, mode, m));
        }
    }
    // The replaced callbacks read through sqlx (custom plan), for the plan guard's fixture.
    let mut canary = connect(&url, CANARY).await?;
    sqlx::query("SET plan_cache_mode = force_custom_plan")
        .execute(&mut canary)
        .await?;
    sqlx::query(OLD_CALLBACKS_SQL)
        .bind(TYPICAL_CARD)
        .bind(50_i64)
        .execute(&mut canary)
        .await?;
    canary.close().await?;
    bench.close().await?;
    conn.close().await?;
    let db = app.db.name.clone();
    drop(app);
    cluster.try_stop()?;
    let log = cluster.read_logs(".json")?;
    if let Some(path) = std::env::var_os("CARDWORKER_BENCH_PLANS_LOG") {
        std::fs::write(path, &log).context("keeping the plan log")?;
    }
    let plans: Vec<LoggedPlan> = plan_guard::parse_log(&log)
        .into_iter()
        .filter(|p| p.dbname == db)
        .collect();
    let mut out = String::new();
    let measured = Measurements {
        volumes,
        seed_secs,
        sizes,
        docs,
        refs,
    };
    let failures = report(&mut out, &plans, &indexes, &measured);
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".to_owned());
    let path = std::path::Path::new(&target).join("bench-plans.md");
    std::fs::write(&path, &out).context("writing the report")?;
    println!("\n{out}");
    eprintln!("report written to {}", path.display());
    eprintln!(
        "bench-plans: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{} problem(s):\n{}", failures.len(), failures.join("\n"))
    }
}

async fn connect(url: &str, application_name: &str) -> anyhow::Result<PgConnection> {
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    Ok(PgConnection::connect_with(&options.application_name(application_name)).await?)
}

/// `ALTER SYSTEM SET` and reload: reaches every session, pooled ones included, at its next
/// statement.
async fn set_server(conn: &mut PgConnection, settings: &[(&str, &str)]) -> anyhow::Result<()> {
    for (key, value) in settings {
        sqlx::raw_sql(&format!("ALTER SYSTEM SET {key} = '{value}'"))
            .execute(&mut *conn)
            .await
            .with_context(|| format!("ALTER SYSTEM SET {key}"))?;
    }
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut *conn)
        .await?;
    // The postmaster signals every backend; give them a moment to be signalled.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    Ok(())
}

/// A statement that shows in the plan log where a phase begins.
async fn marker(conn: &mut PgConnection, phase: &str) -> anyhow::Result<()> {
    sqlx::raw_sql(&format!("SELECT 'bench-plans phase {phase}'"))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

async fn seed(conn: &mut PgConnection, volumes: &Volumes) -> anyhow::Result<()> {
    sqlx::raw_sql(
        "SET session_replication_role = replica; SET maintenance_work_mem = '512MB';
         SET max_parallel_maintenance_workers = 2; SET synchronous_commit = off",
    )
    .execute(&mut *conn)
    .await?;
    let secondary: Vec<(String, String)> = sqlx::query_as(
        "SELECT i.relname::text, pg_get_indexdef(x.indexrelid)
           FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
           JOIN pg_class t ON t.oid = x.indrelid
          WHERE t.relname = ANY($1)
            AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid)",
    )
    .bind(product_tables(&mut *conn).await?)
    .fetch_all(&mut *conn)
    .await?;
    for (name, _) in &secondary {
        sqlx::raw_sql(&format!("DROP INDEX {name}"))
            .execute(&mut *conn)
            .await?;
    }
    let t0: String = sqlx::query_scalar("SELECT now()::text")
        .fetch_one(&mut *conn)
        .await?;
    for (what, sql) in SEED {
        let t = Instant::now();
        sqlx::raw_sql(&volumes.apply(sql, &t0))
            .execute(&mut *conn)
            .await
            .map_err(|e| anyhow::anyhow!("seeding {what}: {e:?}"))?;
        eprintln!("seeded {what}: {:.1} s", t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    for (_, def) in &secondary {
        sqlx::raw_sql(def)
            .execute(&mut *conn)
            .await
            .context("rebuilding an index")?;
    }
    eprintln!(
        "rebuilt {} secondary indexes: {:.1} s",
        secondary.len(),
        t.elapsed().as_secs_f64()
    );
    for table in [
        "cards",
        "integration_logs",
        "audit_events",
        "audit_resources",
        "outbox_events",
        "inbound_callbacks",
    ] {
        sqlx::raw_sql(&format!(
            "SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"
        ))
        .execute(&mut *conn)
        .await?;
    }
    let t = Instant::now();
    // One statement per call: VACUUM refuses to run in the implicit transaction of a
    // multi-statement string.
    for sql in ["SET session_replication_role = DEFAULT", "VACUUM (ANALYZE)"] {
        sqlx::raw_sql(sql).execute(&mut *conn).await.context(sql)?;
    }
    eprintln!("VACUUM (ANALYZE): {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// Per table: (rows, heap bytes, TOAST bytes, index bytes, per index (name, bytes)).
type Sizes = Vec<(String, i64, i64, i64, i64, Vec<(String, i64)>)>;

async fn sizes(conn: &mut PgConnection) -> anyhow::Result<Sizes> {
    let tables: Vec<(String, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT c.relname::text, c.reltuples::bigint, pg_relation_size(c.oid),
                coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0),
                pg_indexes_size(c.oid)
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE c.relkind = 'r' AND n.nspname = current_schema() AND c.relname = ANY($1)
          ORDER BY c.relname",
    )
    .bind(product_tables(&mut *conn).await?)
    .fetch_all(&mut *conn)
    .await?;
    let mut out = Vec::new();
    for (table, rows, heap, toast, idx) in tables {
        let per: Vec<(String, i64)> = sqlx::query_as(
            "SELECT i.relname::text, pg_relation_size(i.oid)
               FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
               JOIN pg_class t ON t.oid = x.indrelid
              WHERE t.relname = $1 ORDER BY i.relname",
        )
        .bind(&table)
        .fetch_all(&mut *conn)
        .await?;
        out.push((table, rows, heap, toast, idx, per));
    }
    Ok(out)
}

/// A documented query: its document, its text (comments removed), and whether its comments
/// state a measured time (`… 1.2 ms`).
struct DocQuery {
    doc: String,
    sql: String,
    timed: bool,
}

/// Every statement of the ```sql blocks of the two operator documents.
fn documented_queries() -> anyhow::Result<Vec<DocQuery>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for doc in ["docs/RUNBOOK.md", "docs/MAINTENANCE.md"] {
        let text =
            std::fs::read_to_string(root.join(doc)).with_context(|| format!("reading {doc}"))?;
        let mut in_sql = false;
        let mut current = String::new();
        let mut comments = String::new();
        for line in text.lines() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("```") {
                in_sql = !in_sql && trimmed.trim_start_matches('`').trim() == "sql";
                current.clear();
                comments.clear();
                continue;
            }
            if !in_sql {
                continue;
            }
            let (code, comment) = line.split_once("--").unwrap_or((line, ""));
            comments.push_str(comment);
            comments.push('\n');
            let code = code.trim_end();
            if code.trim().is_empty() {
                continue;
            }
            current.push_str(code);
            current.push('\n');
            if code.ends_with(';') {
                out.push(DocQuery {
                    doc: doc.to_owned(),
                    sql: current.trim().trim_end_matches(';').to_owned(),
                    timed: states_a_time(&comments),
                });
                current.clear();
                comments.clear();
            }
        }
    }
    Ok(out)
}

/// Whether `text` has a number followed by ` ms`.
fn states_a_time(text: &str) -> bool {
    text.match_indices(" ms")
        .any(|(i, _)| text[..i].ends_with(|c: char| c.is_ascii_digit()))
}

async fn measure_docs(
    conn: &mut PgConnection,
    indexes: &plan_guard::Indexes,
) -> anyhow::Result<Vec<(String, String, Measured)>> {
    let mut out = Vec::new();
    for q in documented_queries()? {
        let mut m = measure(conn, indexes, &q.sql, &[], "force_custom_plan", None)
            .await
            .with_context(|| format!("{}: {}", q.doc, q.sql))?;
        if !q.timed {
            m.violations
                .push("no measured time stated beside it".to_owned());
        }
        out.push((q.doc, q.sql, m));
    }
    Ok(out)
}

/// EXPLAIN (ANALYZE, BUFFERS) of `sql`, 5 times, median by total time. With parameters, through
/// `PREPARE` and `EXECUTE` under `plan_cache_mode = mode`. With `index`, inside a transaction that
/// creates it first and rolls back.
async fn measure(
    conn: &mut PgConnection,
    indexes: &plan_guard::Indexes,
    sql: &str,
    params: &[&str],
    mode: &str,
    index: Option<&str>,
) -> anyhow::Result<Measured> {
    if let Some(index) = index {
        sqlx::raw_sql(&format!("BEGIN; {index}; ANALYZE inbound_callbacks"))
            .execute(&mut *conn)
            .await?;
    }
    sqlx::raw_sql(&format!("SET plan_cache_mode = {mode}"))
        .execute(&mut *conn)
        .await?;
    let explained = if params.is_empty() {
        format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}")
    } else {
        sqlx::raw_sql(&format!("PREPARE bench_stmt AS {sql}"))
            .execute(&mut *conn)
            .await?;
        format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE bench_stmt({})",
            params.join(", ")
        )
    };
    let mut runs = Vec::new();
    for _ in 0..5 {
        let (plan,): (Value,) = sqlx::query_as(&explained).fetch_one(&mut *conn).await?;
        let top = plan.get(0).cloned().unwrap_or(Value::Null);
        let planning = top
            .get("Planning Time")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        let exec = top
            .get("Execution Time")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        runs.push((planning + exec, exec, top));
    }
    if !params.is_empty() {
        sqlx::raw_sql("DEALLOCATE bench_stmt")
            .execute(&mut *conn)
            .await?;
    }
    if index.is_some() {
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await?;
    }
    sqlx::raw_sql("RESET plan_cache_mode")
        .execute(&mut *conn)
        .await?;
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (total_ms, exec_ms, top) = runs.swap_remove(runs.len() / 2);
    let root = top.get("Plan").cloned().unwrap_or(Value::Null);
    let logged = LoggedPlan {
        application_name: BENCH_APP.to_owned(),
        dbname: String::new(),
        duration_ms: exec_ms,
        query: sql.to_owned(),
        plan: root.clone(),
    };
    Ok(Measured {
        total_ms,
        exec_ms,
        buffers: buffers(&root),
        shape: plan_guard::shape(&root),
        violations: plan_guard::check(&logged, indexes)
            .into_iter()
            .map(|v| format!("{}: {}", v.node, v.why))
            .collect(),
    })
}

fn buffers(node: &Value) -> (i64, i64) {
    let get = |k: &str| node.get(k).and_then(Value::as_i64).unwrap_or(0);
    (get("Shared Hit Blocks"), get("Shared Read Blocks"))
}

/// `writeln!` into the report, which cannot fail on a `String`.
macro_rules! outln {
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Per statement and mode: executions, durations, the slowest execution's buffers and shape,
/// and the plan guard's verdict.
#[derive(Default)]
struct Agg {
    durations: Vec<f64>,
    slowest: Option<(f64, (i64, i64), String)>,
    violations: Vec<String>,
}

fn label(statement: &str) -> (usize, String) {
    match COVERAGE.iter().position(|s| s.matches(statement)) {
        Some(i) => (
            i,
            format!("{} (`{}`)", COVERAGE[i].what, COVERAGE[i].source),
        ),
        None => {
            let short: String = statement.chars().take(70).collect();
            (COVERAGE.len(), format!("other: `{short}…`"))
        }
    }
}

fn ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.0}")
    }
}

/// What the bench measured besides the plan log.
struct Measurements {
    volumes: Volumes,
    seed_secs: f64,
    sizes: Sizes,
    /// (document, query, measurement).
    docs: Vec<(String, String, Measured)>,
    /// (label, plan cache mode, measurement).
    refs: Vec<(&'static str, &'static str, Measured)>,
}

/// Writes the report into `out`; returns the problems that fail the bench.
fn report(
    out: &mut String,
    plans: &[LoggedPlan],
    indexes: &plan_guard::Indexes,
    measured: &Measurements,
) -> Vec<String> {
    let Measurements {
        volumes,
        seed_secs,
        sizes,
        docs,
        refs,
    } = measured;
    let mut failures = Vec::new();
    // Phases by marker.
    let mut phase = "seed";
    let mut by: BTreeMap<(usize, String, &str), Agg> = BTreeMap::new();
    for p in plans {
        let statement = p.statement();
        if let Some(m) = statement.strip_prefix("SELECT 'bench-plans phase ") {
            phase = match m.trim_end_matches('\'') {
                "custom" => "custom",
                "generic" => "generic",
                _ => "end",
            };
            continue;
        }
        if !matches!(phase, "custom" | "generic")
            || p.application_name == harness::HARNESS_APPLICATION_NAME
        {
            continue;
        }
        let (order, name) = label(&statement);
        let agg = by.entry((order, name, phase)).or_default();
        agg.durations.push(p.duration_ms);
        let b = buffers(&p.plan);
        if agg
            .slowest
            .as_ref()
            .is_none_or(|(d, _, _)| p.duration_ms > *d)
        {
            agg.slowest = Some((p.duration_ms, b, plan_guard::shape(&p.plan)));
        }
        for v in plan_guard::check(p, indexes) {
            if !agg.violations.contains(&v.node) {
                agg.violations.push(v.node.clone());
                failures.push(format!("{v}"));
            }
        }
    }

    outln!(out, "## bench-plans results\n");
    outln!(
        out,
        "Volumes: {} cards, {} integration logs, audit events and resource links each (online, \
         and again in the archive tables), {} outbox rows, {} payments, {} inbound callbacks; \
         seeded in {seed_secs:.0} s (load, index rebuild, VACUUM ANALYZE).\n",
        volumes.cards,
        volumes.logs,
        volumes.outbox,
        volumes.payments,
        volumes.callbacks
    );
    outln!(out, "### Table sizes after the load\n");
    outln!(out, "| table | rows | heap | TOAST | indexes | per index |");
    outln!(out, "| --- | ---: | ---: | ---: | ---: | --- |");
    let mb = |b: i64| format!("{:.1} MB", b as f64 / 1_048_576.0);
    for (table, rows, heap, toast, idx, per) in sizes {
        let per: Vec<String> = per.iter().map(|(n, b)| format!("{n} {}", mb(*b))).collect();
        outln!(
            out,
            "| {table} | {rows} | {} | {} | {} | {} |",
            mb(*heap),
            mb(*toast),
            mb(*idx),
            per.join(", ")
        );
    }

    outln!(
        out,
        "\n### Product statements (every path of src/, auto_explain ANALYZE BUFFERS)\n"
    );
    outln!(out, "| statement | plan | n | median ms | max ms | buffers hit/read (slowest) | shape (slowest) | verdict |");
    outln!(out, "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |");
    for ((_, name, mode), agg) in &by {
        let mut d = agg.durations.clone();
        d.sort_by(f64::total_cmp);
        let median = d[d.len() / 2];
        let (max, (hit, read), shape) = agg.slowest.clone().unwrap_or_default();
        let shape: String = if shape.chars().count() > 220 {
            format!("{}…", shape.chars().take(220).collect::<String>())
        } else {
            shape
        };
        let verdict = if agg.violations.is_empty() {
            "index".to_owned()
        } else {
            format!("**{}**", agg.violations.join("; "))
        };
        outln!(
            out,
            "| {name} | {mode} | {} | {} | {} | {hit}/{read} | {shape} | {verdict} |",
            d.len(),
            ms(median),
            ms(max)
        );
    }
    let covered: Vec<&str> = COVERAGE
        .iter()
        .enumerate()
        .filter(|(i, _)| !by.keys().any(|(o, _, _)| o == i))
        .map(|(_, s)| s.what)
        .collect();
    for what in covered {
        failures.push(format!("not driven at volume: {what}"));
    }

    outln!(out, "\n### Queries of docs/RUNBOOK.md and docs/MAINTENANCE.md (median of 5, planning + execution)\n");
    outln!(
        out,
        "| document | query | ms | buffers hit/read | shape | verdict |"
    );
    outln!(out, "| --- | --- | ---: | ---: | --- | --- |");
    for (doc, sql, m) in docs {
        let q = plan_guard::fold_whitespace(sql);
        let q: String = q.chars().take(90).collect();
        let ok = m.total_ms < 10.0 && m.violations.is_empty();
        if !ok {
            failures.push(format!(
                "{doc}: {:.2} ms {:?}: {q}",
                m.total_ms, m.violations
            ));
        }
        outln!(
            out,
            "| {doc} | `{q}` | {} | {}/{} | {} | {} |",
            ms(m.total_ms),
            m.buffers.0,
            m.buffers.1,
            m.shape,
            if ok {
                "< 10 ms".to_owned()
            } else if m.total_ms >= 10.0 {
                "**≥ 10 ms**".to_owned()
            } else {
                format!("**{}**", m.violations.join("; "))
            }
        );
    }

    outln!(
        out,
        "\n### Replaced statements and the index candidate (median of 5, prepared)\n"
    );
    outln!(
        out,
        "| statement | plan | ms (exec) | buffers hit/read | shape |"
    );
    outln!(out, "| --- | --- | ---: | ---: | --- |");
    for (label, mode, m) in refs {
        let mode = mode.trim_start_matches("force_").trim_end_matches("_plan");
        outln!(
            out,
            "| {label} | {mode} | {} ({}) | {}/{} | {} |",
            ms(m.total_ms),
            ms(m.exec_ms),
            m.buffers.0,
            m.buffers.1,
            m.shape
        );
    }
    failures
}
