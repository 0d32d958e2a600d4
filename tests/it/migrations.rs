//! The embedded migrations create the schema operators rely on (spec section 5), and applying
//! them again changes nothing.

use std::process::Command;

use crate::harness::TestDb;

#[tokio::test]
async fn migrations_create_every_table_and_rerunning_them_is_a_no_op() {
    let db = TestDb::new().await; // migrated once by the harness
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
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
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
