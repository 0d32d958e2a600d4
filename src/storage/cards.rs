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

/// Marks the task's chain as parked (survives a Redis loss; only `enqueue` clears it).
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

/// Clears the task's parked mark (explicit `cardworker enqueue`). Returns whether the card exists.
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

fn parked_column(task: Task) -> &'static str {
    match task {
        Task::Carddata => "carddata_parked_at",
        Task::CardStatus => "card_status_parked_at",
    }
}
