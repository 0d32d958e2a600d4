//! The statements on a kind's table (`payments`, `approvals`).
//!
//! Each operation is one statement for every kind: the table, id column, columns and final
//! statuses come from the [`Kind`]'s constants (never from input), so the two tables are kept by
//! the same rules, and each statement's plan is checked for both (`test-kit/src/plan_drive.rs`).
//! Every writer of a row (the submission attempt, recovery, a callback) locks the row first and
//! the integration log second, so that they serialise without deadlocks.

use std::time::Duration;

use sqlx::{PgConnection, PgExecutor, PgPool};
use uuid::Uuid;

use super::kind::{Kind, Row as _, Thresholds};

/// The columns of [`super::kind::Tracking`] that are about time, computed by PostgreSQL with the row,
/// on the database's clock: the clock that wrote `attempt_deadline` and `updated_at` (`now()`).
/// A host whose clock is ahead or behind (a CLI host, a worker) then decides as one whose clock
/// is right; this host's clock is never compared with a stored time.
pub const ON_DB_CLOCK: &str =
    "COALESCE(status = 'pending' AND attempt_deadline > now(), false) AS in_flight, \
     GREATEST(floor(extract(epoch FROM now() - updated_at) * 1000), 0)::int8 AS idle_ms";

/// Loads one row (`None` when unknown).
pub async fn load<'e, K: Kind>(
    exec: impl PgExecutor<'e>,
    id: Uuid,
) -> sqlx::Result<Option<K::Row>> {
    sqlx::query_as::<_, K::Row>(&format!(
        "SELECT {}, {ON_DB_CLOCK} FROM {} WHERE {} = $1",
        K::COLUMNS,
        K::TABLE,
        K::ID
    ))
    .bind(id)
    .fetch_optional(exec)
    .await
}

/// Loads and locks one row for the caller's transaction.
pub async fn lock<K: Kind>(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<Option<K::Row>> {
    sqlx::query_as::<_, K::Row>(&format!(
        "SELECT {}, {ON_DB_CLOCK} FROM {} WHERE {} = $1 FOR UPDATE",
        K::COLUMNS,
        K::TABLE,
        K::ID
    ))
    .bind(id)
    .fetch_optional(conn)
    .await
}

/// A submission attempt begins: `pending`, one more submission, the attempt's log remembered,
/// and its deadline (`limit` from now: the job's own time limit, after which the attempt has
/// certainly ended).
pub async fn start_attempt<K: Kind>(
    conn: &mut PgConnection,
    id: Uuid,
    log_id: i64,
    limit: Duration,
) -> sqlx::Result<()> {
    sqlx::query(&format!(
        "UPDATE {} SET status = 'pending', submissions = submissions + 1, attempt_log_id = $2,
                attempt_deadline = now() + make_interval(secs => $3), updated_at = now()
          WHERE {} = $1",
        K::TABLE,
        K::ID
    ))
    .bind(id)
    .bind(log_id)
    .bind(secs(limit))
    .execute(conn)
    .await
    .map(|_| ())
}

/// A row the worker refuses to submit is made final (`K::REFUSED`'s status) with its reason,
/// unless it is final already. Returns whether it changed the row.
pub async fn mark_refused<K: Kind>(
    conn: &mut PgConnection,
    id: Uuid,
    reason: &str,
) -> sqlx::Result<bool> {
    let Some((status, column)) = K::REFUSED else {
        return Ok(false);
    };
    let done = sqlx::query(&format!(
        "UPDATE {} SET status = $2, {column} = $3, updated_at = now()
          WHERE {} = $1 AND status NOT IN ({})",
        K::TABLE,
        K::ID,
        K::FINAL_SQL
    ))
    .bind(id)
    .bind(status)
    .bind(crate::storage::fault::clean(reason))
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Writes the Gateway's answer (a final decision, or the waiting status) unless the row is final
/// already. Returns whether it changed the row. Only [`super::decide::decide`] calls it.
pub(super) async fn write_answer<K: Kind>(
    conn: &mut PgConnection,
    id: Uuid,
    status: &str,
    channel_ref: Option<&str>,
) -> sqlx::Result<bool> {
    let done = sqlx::query(&format!(
        "UPDATE {} SET status = $2, channel_ref = COALESCE($3, channel_ref), updated_at = now()
          WHERE {} = $1 AND status NOT IN ({})",
        K::TABLE,
        K::ID,
        K::FINAL_SQL
    ))
    .bind(id)
    .bind(status)
    .bind(channel_ref)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Sets a non-final status (`requested`, `unknown`), but only while `attempt_log_id` is still the
/// latest attempt and the row still `pending`: an older attempt's failure never overrides a newer
/// attempt or a decision. Returns whether it changed the row.
pub async fn mark_attempt_outcome<K: Kind>(
    conn: &mut PgConnection,
    id: Uuid,
    attempt_log_id: i64,
    status: &'static str,
) -> sqlx::Result<bool> {
    debug_assert!(matches!(status, "requested" | "unknown"));
    let done = sqlx::query(&format!(
        "UPDATE {} SET status = $3, updated_at = now()
          WHERE {} = $1 AND attempt_log_id = $2 AND status = 'pending'",
        K::TABLE,
        K::ID
    ))
    .bind(id)
    .bind(attempt_log_id)
    .bind(status)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// Moves an undecided row to the back of recovery's line (its `updated_at` orders the partial
/// index scans), so that one row the Gateway cannot answer for does not starve the others.
pub async fn touch<K: Kind>(conn: &mut PgConnection, id: Uuid) -> sqlx::Result<()> {
    sqlx::query(&format!(
        "UPDATE {} SET updated_at = now()
          WHERE {} = $1 AND status NOT IN ({})",
        K::TABLE,
        K::ID,
        K::FINAL_SQL
    ))
    .bind(id)
    .execute(conn)
    .await
    .map(|_| ())
}

/// The Gateway never saw the row (recovery's query answered 404): nothing is open any more, so it
/// is `requested` again (and at the back of recovery's line) for its resubmission.
pub async fn reopen_for_resubmission<K: Kind>(
    conn: &mut PgConnection,
    id: Uuid,
) -> sqlx::Result<()> {
    sqlx::query(&format!(
        "UPDATE {} SET status = 'requested', updated_at = now()
          WHERE {} = $1 AND status IN ('requested', 'pending', 'unknown')",
        K::TABLE,
        K::ID
    ))
    .bind(id)
    .execute(conn)
    .await
    .map(|_| ())
}

/// `enqueue payment|approval`'s commit before the enqueue: a `requested` row is touched, so that
/// recovery, which resubmits `requested` rows untouched for its threshold, counts from now (the
/// job just enqueued is the one expected). Returns the row's status.
pub async fn touch_requested<'e, K: Kind>(
    exec: impl PgExecutor<'e>,
    id: Uuid,
) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(&format!(
        "UPDATE {} SET updated_at = CASE WHEN status = 'requested' THEN now() ELSE updated_at END
          WHERE {} = $1
      RETURNING status",
        K::TABLE,
        K::ID
    ))
    .bind(id)
    .fetch_optional(exec)
    .await
}

/// Recovery's work, oldest first, at most `batch`: undecided rows (`requested`, `pending`,
/// `unknown`) untouched for `thresholds.undecided` along `<table>_unsettled_idx`, except a
/// `pending` row before its attempt's deadline (its POST may still be on the wire), then, for a
/// kind with a waiting status, rows in it untouched for `thresholds.waiting` along
/// `<table>_in_review_idx`. The predicates repeat the partial indexes', so each scan is an index
/// range scan.
pub async fn due<K: Kind>(
    pool: &PgPool,
    thresholds: Thresholds,
    batch: i64,
) -> sqlx::Result<Vec<Uuid>> {
    let mut due: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT {} FROM {}
          WHERE status IN ('requested', 'pending', 'unknown')
            AND updated_at < now() - make_interval(secs => $1)
            AND (status <> 'pending' OR attempt_deadline IS NULL OR attempt_deadline <= now())
          ORDER BY updated_at
          LIMIT $2",
        K::ID,
        K::TABLE
    ))
    .bind(secs(thresholds.undecided))
    .bind(batch)
    .fetch_all(pool)
    .await?;
    let left = batch - due.len() as i64;
    if let (Some(waiting), true) = (K::WAITING, left > 0) {
        let more: Vec<Uuid> = sqlx::query_scalar(&format!(
            "SELECT {} FROM {}
              WHERE status = '{waiting}'
                AND updated_at < now() - make_interval(secs => $1)
              ORDER BY updated_at
              LIMIT $2",
            K::ID,
            K::TABLE
        ))
        .bind(secs(thresholds.waiting))
        .bind(left)
        .fetch_all(pool)
        .await?;
        due.extend(more);
    }
    Ok(due)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Whether a row is still due under the lock (a new attempt, a callback or another pod may have
/// moved it since the scan): not final, not an attempt still in flight, untouched long enough.
/// Both times are the database's, read with the row ([`ON_DB_CLOCK`]).
pub fn still_due<K: Kind>(row: &K::Row, thresholds: Thresholds) -> bool {
    let after = thresholds.of::<K>(row.status());
    let idle_ms = u128::try_from(row.tracking().idle_ms).unwrap_or(0);
    !K::is_final(row.status()) && !row.attempt_in_flight() && idle_ms >= after.as_millis()
}
