//! The `cards` table: reads, and changes under an optimistic version check.
//!
//! Every change is `UPDATE … WHERE card_ref = $1 AND version = $seen`, so that a callback and a
//! poll observing the same card at once cannot overwrite each other: the loser sees zero rows,
//! reloads and decides again.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgConnection, PgExecutor};

use crate::config::Task;

/// One card, as stored. Serialized (for `investigate --format json`) without its row id and
/// parked marks, which investigate shows per chain.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, serde::Serialize)]
pub struct Card {
    /// Row id.
    #[serde(skip)]
    pub id: i64,
    /// The card reference (unique).
    pub card_ref: String,
    /// `pending` or `ready`.
    pub data_state: String,
    /// Token from the channel once ready (never a PAN).
    pub card_token: Option<String>,
    /// Last four digits.
    pub pan_last4: Option<String>,
    /// Expiry month.
    pub expiry_month: Option<i16>,
    /// Expiry year.
    pub expiry_year: Option<i16>,
    /// `inactive`, `active`, `frozen`, `cancelled` or `expired`.
    pub status: String,
    /// Optimistic concurrency version.
    pub version: i64,
    /// When the card-data chain was parked, if it is.
    #[serde(skip)]
    pub carddata_parked_at: Option<DateTime<Utc>>,
    /// When the card_status chain was parked, if it is.
    #[serde(skip)]
    pub card_status_parked_at: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

impl Card {
    /// When this task's chain was parked, if it is.
    pub fn parked_at(&self, task: Task) -> Option<DateTime<Utc>> {
        match task {
            Task::Carddata => self.carddata_parked_at,
            Task::CardStatus => self.card_status_parked_at,
        }
    }

    /// Whether this task should keep polling the card: data still pending, or status not final.
    pub fn wants_polling(&self, task: Task) -> bool {
        match task {
            Task::Carddata => self.data_state == "pending",
            Task::CardStatus => !matches!(self.status.as_str(), "cancelled" | "expired"),
        }
    }

    /// Whether a poll of this task should call the Gateway: the chain is not parked and the card
    /// still wants polling.
    pub fn is_pollable(&self, task: Task) -> bool {
        self.parked_at(task).is_none() && self.wants_polling(task)
    }
}

const COLUMNS: &str =
    "id, card_ref, data_state, card_token, pan_last4, expiry_month, expiry_year, \
     status, version, carddata_parked_at, card_status_parked_at, created_at, updated_at";

/// Loads one card (a read; `None` for an unknown card).
pub async fn load<'e>(exec: impl PgExecutor<'e>, card_ref: &str) -> sqlx::Result<Option<Card>> {
    sqlx::query_as::<_, Card>(&format!("SELECT {COLUMNS} FROM cards WHERE card_ref = $1"))
        .bind(card_ref)
        .fetch_optional(exec)
        .await
}

/// The cards of `card_refs` that exist, by the unique index on `card_ref` (one lookup per
/// batch of overdue chains in reconcile). Deciding which of them should be polled is
/// [`Card::is_pollable`]'s job, in Rust: putting that predicate into the query would let a
/// generic plan walk a partial index of every pollable card instead.
pub async fn load_many<'e>(
    exec: impl PgExecutor<'e>,
    card_refs: &[String],
) -> sqlx::Result<Vec<Card>> {
    sqlx::query_as::<_, Card>(&format!(
        "SELECT {COLUMNS} FROM cards WHERE card_ref = ANY($1)"
    ))
    .bind(card_refs)
    .fetch_all(exec)
    .await
}

/// Up to `limit` cards with a row id above `after_id`, in id order: one page of the whole table
/// (the local simulator seeds itself from it; reconcile has its own, narrower query).
pub async fn page<'e>(
    exec: impl PgExecutor<'e>,
    after_id: i64,
    limit: i64,
) -> sqlx::Result<Vec<Card>> {
    sqlx::query_as::<_, Card>(&format!(
        "SELECT {COLUMNS} FROM cards WHERE id > $1 ORDER BY id LIMIT $2"
    ))
    .bind(after_id)
    .bind(limit)
    .fetch_all(exec)
    .await
}

/// The card data a change writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadyData {
    /// Token.
    pub card_token: String,
    /// Last four digits.
    pub pan_last4: String,
    /// Expiry month.
    pub expiry_month: i16,
    /// Expiry year.
    pub expiry_year: i16,
}

/// Sets the card's data to ready if its version is still `seen`. Returns the new version, or
/// `None` when another writer changed the card first.
pub async fn set_data_ready(
    conn: &mut PgConnection,
    card_ref: &str,
    seen: i64,
    data: &ReadyData,
) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(
        "UPDATE cards SET data_state = 'ready', card_token = $3, pan_last4 = $4,
                expiry_month = $5, expiry_year = $6, version = version + 1, updated_at = now()
          WHERE card_ref = $1 AND version = $2
      RETURNING version",
    )
    .bind(card_ref)
    .bind(seen)
    .bind(&data.card_token)
    .bind(&data.pan_last4)
    .bind(data.expiry_month)
    .bind(data.expiry_year)
    .fetch_optional(conn)
    .await
}

/// Sets the card's status if its version is still `seen`. Returns the new version, or `None`
/// when another writer changed the card first.
pub async fn set_status(
    conn: &mut PgConnection,
    card_ref: &str,
    seen: i64,
    status: &str,
) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(
        "UPDATE cards SET status = $3, version = version + 1, updated_at = now()
          WHERE card_ref = $1 AND version = $2
      RETURNING version",
    )
    .bind(card_ref)
    .bind(seen)
    .bind(status)
    .fetch_optional(conn)
    .await
}

/// Marks the task's chain as parked (survives a Redis loss). Its retry (one poll after
/// `polling.<task>.parked_retry_secs`), `enqueue` and `unpark` clear it.
pub async fn park(conn: &mut PgConnection, card_ref: &str, task: Task) -> sqlx::Result<()> {
    let column = parked_column(task);
    sqlx::query(&format!(
        "UPDATE cards SET {column} = now() WHERE card_ref = $1"
    ))
    .bind(card_ref)
    .execute(conn)
    .await
    .map(|_| ())
}

/// Clears the task's parked mark (a successful retry, `cardworker enqueue`). Returns whether the
/// card exists.
pub async fn unpark<'e>(
    exec: impl PgExecutor<'e>,
    card_ref: &str,
    task: Task,
) -> sqlx::Result<bool> {
    let column = parked_column(task);
    let done = sqlx::query(&format!(
        "UPDATE cards SET {column} = NULL WHERE card_ref = $1"
    ))
    .bind(card_ref)
    .execute(exec)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Which parked chains an operator un-parks (`cardworker unpark`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParkedSelector {
    /// One card.
    CardRef(String),
    /// Every parked chain of the task.
    All,
    /// The chains parked before this instant.
    ParkedBefore(DateTime<Utc>),
}

/// Clears the parked mark of up to `limit` parked chains of `task` that `which` selects, oldest
/// parked first, in the caller's transaction; returns their card refs. Rows another transaction
/// holds are skipped (a concurrent `unpark` takes them), so repeated batches make progress and
/// a second run finds nothing.
pub async fn unpark_batch(
    conn: &mut PgConnection,
    task: Task,
    which: &ParkedSelector,
    limit: i64,
) -> sqlx::Result<Vec<String>> {
    let column = parked_column(task);
    let (filter, bound) = match which {
        ParkedSelector::CardRef(r) => ("card_ref = $2", Bound::Text(r.clone())),
        ParkedSelector::All => ("true", Bound::None),
        // The bound is exclusive: "parked before".
        ParkedSelector::ParkedBefore(ts) => ("{column} < $2", Bound::At(*ts)),
    };
    let sql = format!(
        "UPDATE cards SET {column} = NULL
          WHERE id IN (SELECT id FROM cards
                        WHERE {column} IS NOT NULL AND {filter}
                        ORDER BY {column}, id LIMIT $1
                        FOR UPDATE SKIP LOCKED)
      RETURNING card_ref",
        filter = filter.replace("{column}", column)
    );
    let query = sqlx::query_scalar(&sql).bind(limit);
    match bound {
        Bound::Text(r) => query.bind(r).fetch_all(conn).await,
        Bound::At(ts) => query.bind(ts).fetch_all(conn).await,
        Bound::None => query.fetch_all(conn).await,
    }
}

/// The second parameter of [`unpark_batch`]'s statement, if it has one.
enum Bound {
    Text(String),
    At(DateTime<Utc>),
    None,
}

/// Parked chains per task, counted on the partial indexes of parked cards (for
/// `cardworker_parked_chains`).
pub async fn count_parked<'e>(exec: impl PgExecutor<'e>) -> sqlx::Result<(i64, i64)> {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL),
                (SELECT count(*) FROM cards WHERE card_status_parked_at IS NOT NULL)",
    )
    .fetch_one(exec)
    .await
}

/// Up to `limit` cards whose `task` chain was parked longer ago than `older_than` and that still
/// want polling, oldest parked first: parked chains whose retry is overdue (reconcile restarts
/// those whose chain Redis lost).
pub async fn overdue_parked<'e>(
    exec: impl PgExecutor<'e>,
    task: Task,
    older_than: std::time::Duration,
    limit: i64,
) -> sqlx::Result<Vec<String>> {
    let column = parked_column(task);
    let wants = match task {
        Task::Carddata => "data_state = 'pending'",
        Task::CardStatus => "status NOT IN ('cancelled', 'expired')",
    };
    let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    sqlx::query_scalar(&format!(
        "SELECT card_ref FROM cards
          WHERE {column} IS NOT NULL AND {column} < now() - $1 * interval '1 millisecond'
            AND {wants}
          ORDER BY {column} LIMIT $2"
    ))
    .bind(ms as f64)
    .bind(limit)
    .fetch_all(exec)
    .await
}

fn parked_column(task: Task) -> &'static str {
    match task {
        Task::Carddata => "carddata_parked_at",
        Task::CardStatus => "card_status_parked_at",
    }
}
