//! `enqueue payment`, `enqueue callback`.

use std::path::Path;

use crate::app::AppContext;
use crate::commands::CommandError;

/// Submits one payment row through the reliable path.
pub async fn enqueue_payment(
    _ctx: &AppContext,
    _payment_id: uuid::Uuid,
) -> Result<(), CommandError> {
    Err(anyhow::anyhow!("payments are not built yet").into())
}

/// Hands one channel callback to the callback job.
pub async fn enqueue_callback(
    _ctx: &AppContext,
    _channel: &str,
    _callback_id: &str,
    _body_file: &Path,
) -> Result<(), CommandError> {
    Err(anyhow::anyhow!("callbacks are not built yet").into())
}
