//! The embedded migrations create the schema operators rely on (spec section 5), and applying
//! them again changes nothing; a test database is a clone of the harness's template of exactly
//! these migrations, which concurrently starting tests build once.

use std::process::Command;

use sqlx::{Connection as _, PgConnection};

use crate::harness::{self, assert_success, TestDb};

#[tokio::test]
async fn migrations_create_every_table_and_rerunning_them_is_a_no_op() {
    // Created empty and migrated once by the harness (not cloned from its template).
    let db = TestDb::new_migrated().await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("tables");
    for t in [
        "audit_events",
        "audit_events_archive",
        "audit_resources",
        "audit_resources_archive",
        "cards",
        "inbound_callbacks",
        "integration_logs",
        "integration_logs_archive",
        "outbox_events",
        "payments",
    ] {
        assert!(tables.iter().any(|x| x == t), "{t} missing from {tables:?}");
    }

    // Through the binary, twice: idempotent.
    for _ in 0..2 {
        let out = Command::new(env!("CARGO_BIN_EXE_cardworker"))
            .arg("migrate")
            .env("CARDWORKER__DATABASE__URL", &db.url)
            .env_remove("CARDWORKER_CONFIG")
            .output()
            .expect("run migrate");
        assert_success(&out, "cardworker migrate");
    }
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(
        applied as usize,
        cardworker::storage::MIGRATOR.iter().count()
    );
}

#[tokio::test]
async fn a_card_and_a_payment_are_created_with_the_documented_inserts() {
    let db = TestDb::new().await;
    sqlx::query("INSERT INTO cards (card_ref) VALUES ('c-1')")
        .execute(&db.pool)
        .await
        .expect("card insert from spec section 5");
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) \
         VALUES ('6f1c1c1e-6a57-4c55-9a3e-0d7c1b1f9a10', 'c-1', 1234, 'CNY')",
    )
    .execute(&db.pool)
    .await
    .expect("payment insert from spec section 5");
    let dup = sqlx::query("INSERT INTO cards (card_ref) VALUES ('c-1')")
        .execute(&db.pool)
        .await;
    assert!(dup.is_err(), "card_ref is unique");
    let (state, status, version): (String, String, i64) =
        sqlx::query_as("SELECT data_state, status, version FROM cards WHERE card_ref = 'c-1'")
            .fetch_one(&db.pool)
            .await
            .expect("read back");
    assert_eq!(
        (state.as_str(), status.as_str(), version),
        ("pending", "inactive", 0)
    );
}

#[tokio::test]
async fn archive_walks_use_the_created_at_indexes() {
    let db = TestDb::new().await;
    // Each query archive and retention walk a table with (as `maintenance::archive`,
    // `maintenance::session` and `maintenance::retention` send them), and the index it must use.
    // Sequential scans are priced out so that the plan shows whether an index can serve the
    // query at all, whatever the (empty) tables' statistics say: a predicate the partial index
    // does not cover (`state <> 'pending'`) would leave a sequential scan.
    let walks = [
        (
            "integration_logs_finished_created_idx",
            "SELECT min(created_at) FROM integration_logs
              WHERE state <> 'pending' AND created_at < '2026-06-01'",
        ),
        (
            "integration_logs_finished_created_idx",
            "SELECT id FROM integration_logs
              WHERE state <> 'pending' AND created_at >= '2026-05-01' AND created_at < '2026-05-02'
              ORDER BY created_at LIMIT 1000",
        ),
        (
            "audit_events_created_idx",
            "SELECT min(created_at) FROM audit_events WHERE created_at < '2026-06-01'",
        ),
        (
            "audit_events_created_idx",
            "SELECT id, created_at FROM audit_events
              WHERE created_at >= '2026-05-01' AND created_at < '2026-05-02'
              ORDER BY created_at LIMIT 1000",
        ),
        (
            "audit_resources_created_idx",
            "SELECT id FROM audit_resources
              WHERE created_at >= '2026-05-01' AND created_at < '2026-05-02'
              ORDER BY created_at LIMIT 1000",
        ),
    ];
    let mut tx = db.pool.begin().await.expect("begin");
    sqlx::query("SET LOCAL enable_seqscan = off")
        .execute(&mut *tx)
        .await
        .expect("set");
    for (index, walk) in walks {
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {walk}"))
            .fetch_all(&mut *tx)
            .await
            .expect("explain");
        let plan = plan.join("\n");
        assert!(
            plan.contains(index) && !plan.contains("Seq Scan"),
            "{walk}\nis not served by {index}:\n{plan}"
        );
    }
}

/// The applied migrations of a database: (version, checksum) in order.
async fn applied(pool: &sqlx::PgPool) -> Vec<(i64, Vec<u8>)> {
    sqlx::query_as("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .expect("applied migrations")
}

/// This build's migrations: (version, checksum) in order.
fn embedded() -> Vec<(i64, Vec<u8>)> {
    cardworker::storage::MIGRATOR
        .iter()
        .map(|m| (m.version, m.checksum.to_vec()))
        .collect()
}

#[tokio::test]
async fn a_test_database_is_a_clone_of_the_template_of_this_builds_migrations() {
    let db = TestDb::new().await;
    assert_eq!(applied(&db.pool).await, embedded());
    let admin = sqlx::PgPool::connect(&harness::admin_url())
        .await
        .expect("admin");
    let (is_template, allows_connections): (bool, bool) =
        sqlx::query_as("SELECT datistemplate, datallowconn FROM pg_database WHERE datname = $1")
            .bind(harness::template_name())
            .fetch_one(&admin)
            .await
            .expect("the template exists");
    admin.close().await;
    assert!(is_template && !allows_connections);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn test_processes_starting_at_once_build_one_template_and_each_clones_it_complete() {
    let admin = harness::admin_url();
    let template = format!(
        "cw_tmpl_race_{}",
        ulid::Ulid::new().to_string().to_lowercase()
    );
    // Dropped when the test ends, also on a failure.
    struct Template(String, String);
    impl Drop for Template {
        fn drop(&mut self) {
            let (admin, name) = (self.0.clone(), self.1.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
                    let mut conn = PgConnection::connect(&admin).await.expect("admin");
                    for name in [format!("{name}_wip"), name] {
                        let _ =
                            sqlx::query(&format!("ALTER DATABASE {name} WITH IS_TEMPLATE false"))
                                .execute(&mut conn)
                                .await;
                        let _ =
                            sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                                .execute(&mut conn)
                                .await;
                    }
                });
            })
            .join();
        }
    }
    let _template = Template(admin.clone(), template.clone());

    // One admin session per would-be process, each checking, building or waiting, then cloning.
    let clones = (0..6).map(|i| {
        let (admin, template) = (admin.clone(), template.clone());
        tokio::spawn(async move {
            let mut conn = PgConnection::connect(&admin).await.expect("admin");
            let built = harness::ensure_template_named(&mut conn, &admin, &template).await;
            let clone = format!("{template}_clone_{i}");
            sqlx::query(&format!("CREATE DATABASE {clone} TEMPLATE {template}"))
                .execute(&mut conn)
                .await
                .expect("clone the template");
            let url = format!("{}/{clone}", &admin[..admin.rfind('/').expect("admin url")]);
            let pool = sqlx::PgPool::connect(&url)
                .await
                .expect("connect to the clone");
            let migrations = applied(&pool).await;
            pool.close().await;
            sqlx::query(&format!("DROP DATABASE {clone} WITH (FORCE)"))
                .execute(&mut conn)
                .await
                .expect("drop the clone");
            conn.close().await.expect("close");
            (built, migrations)
        })
    });
    let mut builders = 0;
    for clone in futures::future::join_all(clones).await {
        let (built, migrations) = clone.expect("clone task");
        builders += usize::from(built);
        assert_eq!(migrations, embedded());
    }
    assert_eq!(builders, 1, "one session builds the template");
    let mut conn = PgConnection::connect(&admin).await.expect("admin");
    assert!(!harness::database_exists(&mut conn, &format!("{template}_wip")).await);
    conn.close().await.expect("close");
}
