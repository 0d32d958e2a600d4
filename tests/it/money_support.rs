//! Helpers of the money tests (`payments`, `approvals`, `money_once`, `self_healing`): the rows
//! they submit, and what PostgreSQL holds about one of them.

use std::time::Duration;

use cardworker::context::AppContext;
use cardworker::{approvals, payments};
use cardworker_jobs::{SubmitApproval, SubmitPayment};
use sqlx::PgPool;
use uuid::Uuid;

use crate::harness::wait_until;

/// Inserts a `requested` payment of 12.34 CNY for `card_ref`.
pub async fn insert_payment(pool: &PgPool, card_ref: &str) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, $2, 1234, 'CNY')",
    )
    .bind(id)
    .bind(card_ref)
    .execute(pool)
    .await
    .expect("insert payment");
    id
}

/// Inserts a `requested` approval of `kind` (and `amount`, if any) for `card_ref`.
pub async fn insert_approval(
    pool: &PgPool,
    card_ref: &str,
    kind: &str,
    amount: Option<i64>,
) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO approvals (approval_id, card_ref, kind, amount_minor) VALUES ($1, $2, $3, $4)",
    )
    .bind(id)
    .bind(card_ref)
    .bind(kind)
    .bind(amount)
    .execute(pool)
    .await
    .expect("insert approval");
    id
}

/// Ages every row of `table` (`payments` or `approvals`) by an hour, its attempt deadline with
/// it (an attempt's 35 s after its last update): recovery finds them due.
pub async fn age(pool: &PgPool, table: &str) {
    sqlx::query(&format!(
        "UPDATE {table} SET updated_at = now() - interval '1 hour', \
         attempt_deadline = now() - interval '1 hour' + interval '35 seconds'"
    ))
    .execute(pool)
    .await
    .expect("age the rows");
}

/// The status of the row `id` of `table` (`payments` or `approvals`).
pub async fn status_in(pool: &PgPool, table: &str, id: Uuid) -> String {
    let column = if table == "payments" {
        "payment_id"
    } else {
        "approval_id"
    };
    sqlx::query_scalar(&format!("SELECT status FROM {table} WHERE {column} = $1"))
        .bind(id)
        .fetch_one(pool)
        .await
        .expect("status")
}

/// The payment's status.
pub async fn payment_status(pool: &PgPool, id: Uuid) -> String {
    status_in(pool, "payments", id).await
}

/// The approval's status.
pub async fn approval_status(pool: &PgPool, id: Uuid) -> String {
    status_in(pool, "approvals", id).await
}

/// States of the integration log rows of one scenario about `id` (a `resource_type`: `payment`
/// or `approval`), oldest first.
pub async fn log_states(
    pool: &PgPool,
    resource_type: &str,
    id: Uuid,
    scenario: &str,
) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT state FROM integration_logs
          WHERE resource_type = $1 AND resource_id = $2 AND scenario = $3 ORDER BY id",
    )
    .bind(resource_type)
    .bind(id.to_string())
    .bind(scenario)
    .fetch_all(pool)
    .await
    .expect("log states")
}

/// The audit events of `event_type` about `id` (a `resource_type`: `payment` or `approval`).
pub async fn audit_count(pool: &PgPool, resource_type: &str, id: Uuid, event_type: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id
          WHERE r.resource_type = $1 AND r.resource_id = $2 AND e.event_type = $3",
    )
    .bind(resource_type)
    .bind(id.to_string())
    .bind(event_type)
    .fetch_one(pool)
    .await
    .expect("audit events")
}

/// Waits up to `limit_secs` until the row `id` of `table` (`payments` or `approvals`) has
/// `status`.
pub async fn wait_for_status(pool: &PgPool, table: &str, id: Uuid, status: &str, limit_secs: u64) {
    let what = format!("{table} row {id} {status}");
    wait_until(Duration::from_secs(limit_secs), &what, || async {
        status_in(pool, table, id).await == status
    })
    .await;
}

/// One run of the payment submission job for `id`, as the worker runs its first try.
pub async fn submit_payment(
    ctx: &AppContext,
    id: Uuid,
) -> anyhow::Result<payments::submit::Submitted> {
    let job = SubmitPayment {
        payment_id: id,
        retries: 0,
    };
    payments::submit::submit(ctx, &job).await
}

/// One run of the approval submission job for `id`, as the worker runs its first try.
pub async fn submit_approval(
    ctx: &AppContext,
    id: Uuid,
) -> anyhow::Result<approvals::submit::Submitted> {
    let job = SubmitApproval {
        approval_id: id,
        retries: 0,
    };
    approvals::submit::submit(ctx, &job).await
}
