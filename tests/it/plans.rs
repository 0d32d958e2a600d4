//! The plan guard (issue 18): every statement path of `src/` runs against a private cluster that
//! logs every executed plan (`auto_explain`) and plans with `enable_seqscan = off` and generic
//! plans (`plan_cache_mode = force_generic_plan`, what sqlx's cached prepared statements settle
//! on). The test fails on any plan that reads a guarded table whole, naming the statement
//! (rules: `plan_guard.rs`), and on any statement of `plan_drive::COVERAGE` that never ran.
//!
//! With seq scans disabled, the planner still picks one only where no index can serve the
//! statement, so the verdict does not depend on the tiny volumes of a test; `make bench-plans`
//! measures the same statements at production volumes.
//!
//! Set `CARDWORKER_PLAN_GUARD_LOG=FILE` to keep the cluster's plan log.

use cardworker::commands::investigate::CALLBACKS_SQL;
use sqlx::{Connection as _, PgConnection};

use crate::harness::{spawn_app_on, HARNESS_APPLICATION_NAME};
use crate::plan_drive::{self, Scale, COVERAGE};
use crate::plan_guard::{self, LoggedPlan, OLD_CALLBACKS_SQL};
use cardworker_test_kit::private::PrivatePg;

/// The server settings of the guard's cluster.
const GUARD_SETTINGS: &[(&str, &str)] = &[
    ("shared_preload_libraries", "auto_explain"),
    ("auto_explain.log_min_duration", "0"),
    ("auto_explain.log_nested_statements", "on"),
    ("auto_explain.log_format", "json"),
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
    ("logging_collector", "on"),
    ("log_destination", "jsonlog"),
    ("log_directory", "log"),
];

/// `application_name` of the session that runs the deliberately bad statements.
const CANARY: &str = "plan-guard-canary";

/// Statements that must be caught, run by the canary session: the pre-issue-18 forms.
const MUST_BE_CAUGHT: &[&str] = &[
    OLD_CALLBACKS_SQL,
    "SELECT count(*) FROM integration_logs WHERE created_at > now() - interval '15 minutes'",
];

/// Their fixed forms, also run by the canary: they must pass.
const MUST_PASS: &[&str] = &[
    CALLBACKS_SQL,
    "SELECT count(*) FROM integration_logs WHERE state <> 'pending' AND created_at > now() - interval '15 minutes'",
];

/// Runs [`MUST_BE_CAUGHT`] and [`MUST_PASS`] through prepared statements, as sqlx runs the
/// product's (five times, so that even a plan cache in `auto` mode would have gone generic).
async fn run_canary(url: &str) {
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
    let mut conn = PgConnection::connect_with(&options.application_name(CANARY))
        .await
        .expect("canary connection");
    for sql in MUST_BE_CAUGHT.iter().chain(MUST_PASS) {
        for _ in 0..5 {
            let q = sqlx::query(sql);
            let q = if sql.contains("$2") {
                q.bind("g-poll").bind(50_i64)
            } else {
                q
            };
            q.execute(&mut conn).await.expect(sql);
        }
    }
    conn.close().await.expect("close canary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_statement_path_of_src_runs_without_reading_a_big_table_whole() {
    let mut cluster = PrivatePg::start_with(GUARD_SETTINGS).expect("private cluster");
    let mut app = spawn_app_on(&cluster.admin_url(), |c| {
        plan_drive::configure(c, Scale::Small)
    })
    .await;
    plan_drive::drive(&app, "g", Scale::Small).await;
    run_canary(&app.db.url).await;
    let indexes = plan_guard::read_indexes(&app.db.pool).await;
    let db = app.db.name.clone();
    app.stop().await.expect("stop the worker");
    drop(app);
    cluster.try_stop().expect("stop the cluster");
    let log = cluster.read_logs(".json").expect("read the plan log");
    if let Some(path) = std::env::var_os("CARDWORKER_PLAN_GUARD_LOG") {
        std::fs::write(path, &log).expect("keep the plan log");
    }
    let plans: Vec<LoggedPlan> = plan_guard::parse_log(&log)
        .into_iter()
        .filter(|p| p.dbname == db)
        .collect();

    // The product's statements: everything but the harness's and the canary's sessions.
    let product: Vec<&LoggedPlan> = plans
        .iter()
        .filter(|p| p.application_name != CANARY && p.application_name != HARNESS_APPLICATION_NAME)
        .collect();
    let mut violations: Vec<String> = product
        .iter()
        .flat_map(|p| plan_guard::check(p, &indexes))
        .map(|v| v.to_string())
        .collect();
    violations.sort();
    violations.dedup();
    let missing: Vec<String> = COVERAGE
        .iter()
        .filter(|s| !product.iter().any(|p| s.matches(&p.statement())))
        .map(|s| format!("{} ({})", s.what, s.source))
        .collect();
    let distinct: std::collections::BTreeSet<String> =
        product.iter().map(|p| p.statement()).collect();
    // A fragment that two statements contain would let one stand in for the other.
    let ambiguous: Vec<String> = distinct
        .iter()
        .filter_map(|statement| {
            let named: Vec<&str> = COVERAGE
                .iter()
                .filter(|s| s.matches(statement))
                .map(|s| s.what)
                .collect();
            (named.len() > 1).then(|| format!("{named:?} all match: {statement}"))
        })
        .collect();
    println!(
        "plan guard: {} executions of {} distinct product statements judged",
        product.len(),
        distinct.len()
    );

    // The guard itself, on the real cluster: it catches the old forms and passes the fixed ones.
    let canary: Vec<&LoggedPlan> = plans
        .iter()
        .filter(|p| p.application_name == CANARY)
        .collect();
    let mut guard_problems = Vec::new();
    for sql in MUST_BE_CAUGHT {
        let folded = plan_guard::fold_whitespace(sql);
        let caught = canary
            .iter()
            .filter(|p| p.statement() == folded)
            .any(|p| !plan_guard::check(p, &indexes).is_empty());
        if !caught {
            guard_problems.push(format!("not caught: {folded}"));
        }
    }
    for sql in MUST_PASS {
        let folded = plan_guard::fold_whitespace(sql);
        let runs: Vec<_> = canary.iter().filter(|p| p.statement() == folded).collect();
        if runs.is_empty() {
            guard_problems.push(format!("the canary did not run: {folded}"));
        }
        for v in runs.iter().flat_map(|p| plan_guard::check(p, &indexes)) {
            guard_problems.push(format!("a fixed form is caught: {v}"));
        }
    }

    assert!(
        violations.is_empty(),
        "{} plan(s) read a guarded table whole:\n{}",
        violations.len(),
        violations.join("\n")
    );
    assert!(
        missing.is_empty(),
        "the drive never ran these statements of plan_drive::COVERAGE (drive them, or fix the \
         fragment):\n{}",
        missing.join("\n")
    );
    assert!(
        ambiguous.is_empty(),
        "plan_drive::COVERAGE entries that match the same statement (make the fragments \
         specific):\n{}",
        ambiguous.join("\n")
    );
    assert!(
        guard_problems.is_empty(),
        "the guard's own check failed:\n{}",
        guard_problems.join("\n")
    );
}

#[test]
fn every_file_of_src_with_sql_names_each_of_its_statements_in_the_coverage_list() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut short = Vec::new();
    for (file, sites) in plan_drive::call_sites(root, "src") {
        let named = COVERAGE.iter().filter(|s| s.source == file).count();
        if named < sites {
            short.push(format!(
                "{file}: {sites} sqlx::query* call sites, {named} statements in plan_drive::COVERAGE"
            ));
        }
    }
    assert!(
        short.is_empty(),
        "a statement the plan guard does not know of; add it to plan_drive::COVERAGE and drive \
         it (see plan_drive.rs):\n{}",
        short.join("\n")
    );
    for s in COVERAGE {
        assert!(root.join(s.source).exists(), "{}: no such file", s.source);
    }
}
