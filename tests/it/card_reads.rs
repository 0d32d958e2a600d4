//! The polls' batched card reads (`cardworker::storage::card_reads`, issue 16): reads made at once
//! share one query, and each still gets exactly the answer it would have had alone.

use cardworker::storage::card_reads::CardReads;
use cardworker::storage::fault::{self, DbFault};
use futures::future::join_all;

use crate::harness::{wait_until, TestDb};

async fn insert_cards(db: &TestDb, refs: &[&str]) {
    sqlx::query("INSERT INTO cards (card_ref) SELECT unnest($1::text[])")
        .bind(refs)
        .execute(&db.pool)
        .await
        .expect("insert cards");
}

#[tokio::test]
async fn reads_made_at_once_each_get_their_own_card_or_none() {
    let db = TestDb::new().await;
    insert_cards(&db, &["c-1", "c-2", "c-3"]).await;
    let reads = CardReads::new(db.pool.clone());
    // On this current-thread runtime every read below is queued before the reading task runs, so
    // they travel in one query: known cards, unknown ones, and one card asked for twice (both
    // polling tasks of a card can run at once).
    let asked = ["c-1", "nope-1", "c-2", "c-1", "nope-2", "c-3"];
    let answers = join_all(asked.iter().map(|r| reads.load(r))).await;
    for (asked, answer) in asked.iter().zip(answers) {
        let card = answer.expect("a read");
        match card {
            Some(card) => assert_eq!(&card.card_ref, asked),
            None => assert!(asked.starts_with("nope-"), "{asked} not found"),
        }
    }
}

#[tokio::test]
async fn a_card_ref_postgres_refuses_fails_only_its_own_read_of_a_shared_query() {
    // A NUL byte fails the whole `card_ref = ANY($1)`: the others of that query must still get
    // their cards, and the refused one its own deterministic error (which a poll turns into an
    // ended chain, as for an unknown card).
    let db = TestDb::new().await;
    insert_cards(&db, &["c-1", "c-2"]).await;
    let reads = CardReads::new(db.pool.clone());
    let asked = ["c-1", "bad\0ref", "c-2", "nope"];
    let answers = join_all(asked.iter().map(|r| reads.load(r))).await;
    let mut answers = answers.into_iter();
    let c1 = answers.next().expect("c-1").expect("c-1 is read");
    assert_eq!(c1.map(|c| c.card_ref).as_deref(), Some("c-1"));
    let refused = answers.next().expect("bad").expect_err("refused");
    assert_eq!(
        fault::classify(&refused),
        DbFault::Deterministic,
        "{refused}"
    );
    let c2 = answers.next().expect("c-2").expect("c-2 is read");
    assert_eq!(c2.map(|c| c.card_ref).as_deref(), Some("c-2"));
    assert!(answers.next().expect("nope").expect("a read").is_none());
}

/// Sessions of the test database other than the asking one (only those named `name`, if given).
async fn sessions(db: &TestDb, name: Option<&str>) -> i64 {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = $1 AND pid <> pg_backend_pid()
            AND ($2::text IS NULL OR application_name = $2)",
    )
    .bind(&db.name)
    .bind(name)
    .fetch_one(&mut conn)
    .await
    .expect("activity");
    conn.close().await.expect("close");
    n
}

/// Sequential and index scans of `cards` as PostgreSQL has published them.
async fn card_scans(db: &TestDb) -> (i64, i64) {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    let scans = sqlx::query_as(
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relname = 'cards'",
    )
    .fetch_one(&mut conn)
    .await
    .expect("scans");
    conn.close().await.expect("close");
    scans
}

#[tokio::test]
async fn reads_made_at_once_share_one_query() {
    const READER: &str = "cardworker-card-reads-under-test";
    let db = TestDb::new().await;
    insert_cards(&db, &["c-1", "c-2", "c-3"]).await;
    // Whatever the harness's sessions did to `cards` (the inserts above) is published once they
    // exit.
    db.pool.close().await;
    wait_until(
        std::time::Duration::from_secs(20),
        "the harness's sessions to exit",
        || async { sessions(&db, None).await == 0 },
    )
    .await;
    // The reads' own sessions, with index scans priced out so that each query of theirs is
    // exactly one sequential scan of `cards` in PostgreSQL's table counters (nothing else scans
    // `cards` here). A session publishes its counters when it exits.
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().expect("url");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(
            options
                .application_name(READER)
                .options([("enable_indexscan", "off"), ("enable_bitmapscan", "off")]),
        )
        .await
        .expect("reads' pool");
    let before = card_scans(&db).await;
    let reads = CardReads::new(pool.clone());
    let asked = ["c-1", "nope-1", "c-2", "c-1", "nope-2", "c-3"];
    let answers = join_all(asked.iter().map(|r| reads.load(r))).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    drop(reads);
    pool.close().await;
    // A closed pool's idle session may linger; ending it makes it publish its counters now (a
    // backend flushes its statistics when it exits).
    {
        use sqlx::Connection as _;
        let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
        )
        .bind(READER)
        .execute(&mut conn)
        .await
        .expect("terminate the reads' sessions");
        conn.close().await.expect("close");
    }
    wait_until(
        std::time::Duration::from_secs(20),
        "the reads' sessions to exit and publish their counters",
        || async { sessions(&db, Some(READER)).await == 0 },
    )
    .await;
    let after = card_scans(&db).await;
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (1, 0),
        "{} reads made at once: one query (one sequential scan of cards)",
        asked.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_made_within_the_linger_of_each_other_share_one_query() {
    let db = TestDb::new().await;
    insert_cards(&db, &["c-1", "c-2", "c-3", "c-4"]).await;
    // A linger far above the gap below, so that a loaded machine cannot split the query.
    let reads = CardReads::lingering(db.pool.clone(), std::time::Duration::from_secs(2));
    // The first read comes alone, with every query slot free; the other three 50 ms later.
    let first = reads.load("c-1");
    let rest = async {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        join_all(["c-2", "c-3", "c-4"].map(|r| reads.load(r))).await
    };
    let (first, rest) = tokio::join!(first, rest);
    let first = first.expect("c-1 is read").expect("c-1 exists");
    assert_eq!(first.card_ref, "c-1");
    for (asked, answer) in ["c-2", "c-3", "c-4"].iter().zip(rest) {
        let card = answer.expect("a read").expect("the card exists");
        assert_eq!(&card.card_ref, asked);
    }
    assert_eq!(
        reads.queries(),
        1,
        "four reads within the linger go to PostgreSQL in one query"
    );
}
