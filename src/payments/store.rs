//! The `payments` table: the row type and the reads the commands need. Every statement on it is
//! `crate::reliable::table`'s (shared with `approvals`), over [`PaymentCall`].

use sqlx::PgExecutor;
use uuid::Uuid;

pub use crate::reliable::payment::Payment;
use crate::reliable::payment::PaymentCall;
use crate::reliable::table;

/// Loads one payment (`None` when unknown).
pub async fn load<'e>(
    exec: impl PgExecutor<'e>,
    payment_id: Uuid,
) -> sqlx::Result<Option<Payment>> {
    table::load::<PaymentCall>(exec, payment_id).await
}

/// `enqueue payment`'s commit before the enqueue (`table::touch_requested`). Returns the
/// payment's status.
pub async fn touch_requested<'e>(
    exec: impl PgExecutor<'e>,
    payment_id: Uuid,
) -> sqlx::Result<Option<String>> {
    table::touch_requested::<PaymentCall>(exec, payment_id).await
}
