//! The polls' batched card reads (`cardworker::storage::card_reads`, issue 16): reads made at once
//! share one query, and each still gets exactly the answer it would have had alone.

use cardworker::storage::card_reads::CardReads;
use cardworker::storage::fault::{self, DbFault};
use futures::future::join_all;

use crate::harness::TestDb;

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
