//! Applying an observed card change, inside the caller's transaction: the optimistic card update,
//! one audit event with its resource link, and one outbox event.
//!
//! Polling calls these after writing its terminal integration log in the same transaction; a
//! channel callback calls them in its own transaction (with its `inbound_callbacks` row). Neither
//! function commits: the caller owns the transaction, so the change, its audit and its outbox event
//! are visible together or not at all.

use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::gateway::{CardData, CardStatus};
use crate::storage::cards::{self, Card, ReadyData};
use crate::storage::records::{self, AuditRecord};

/// Who observed the change.
#[derive(Debug, Clone)]
pub struct ChangeSource {
    /// `poll` or `callback` (free text, kept in the audit details and the outbox payload).
    pub kind: &'static str,
    /// The integration log row that recorded the observation, when there is one (polling).
    pub integration_log_id: Option<i64>,
    /// More about the source, e.g. the callback's channel and id (kept in the audit details).
    pub detail: Option<String>,
}

impl ChangeSource {
    /// A change observed by a poll recorded as integration log `log_id`.
    pub fn poll(log_id: i64) -> Self {
        Self {
            kind: "poll",
            integration_log_id: Some(log_id),
            detail: None,
        }
    }

    /// A change announced by a channel callback.
    pub fn callback(channel: &str, callback_id: &str) -> Self {
        Self {
            kind: "callback",
            integration_log_id: None,
            detail: Some(format!("channel={channel} callback_id={callback_id}")),
        }
    }
}

/// What applying a change did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The card was updated (to `version`), audited and announced.
    Changed {
        /// The card's new version.
        version: i64,
        /// The audit event written.
        audit_event_id: i64,
        /// The outbox event written.
        outbox_id: i64,
    },
    /// The card already had that value: nothing was written.
    Unchanged,
    /// Another writer changed the card since `card` was read (version mismatch): nothing was
    /// written. Reload the card and decide again.
    Conflict,
}

/// Applies a new card status observed for `card` (as read, with its version), in the caller's
/// transaction: the optimistic `UPDATE cards`, one `card.status_changed` audit event with its
/// `card` resource link, and one `card.status_changed` outbox event.
///
/// Writes nothing and returns [`Applied::Unchanged`] when the card already has `new_status`, or
/// [`Applied::Conflict`] when its version moved on (reload it and call again).
pub async fn apply_status(
    tx: &mut PgConnection,
    card: &Card,
    new_status: CardStatus,
    correlation_id: Uuid,
    source: &ChangeSource,
) -> sqlx::Result<Applied> {
    if card.status == new_status.as_str() {
        return Ok(Applied::Unchanged);
    }
    let Some(version) =
        cards::set_status(tx, &card.card_ref, card.version, new_status.as_str()).await?
    else {
        return Ok(Applied::Conflict);
    };
    let details = json!({
        "from": card.status,
        "to": new_status.as_str(),
        "version": version,
        "source": source.kind,
        "source_detail": source.detail,
    });
    record_change(
        tx,
        card,
        "card.status_changed",
        format!(
            "card {} status {} -> {} (seen by {})",
            card.card_ref, card.status, new_status, source.kind
        ),
        details,
        json!({
            "card_ref": card.card_ref,
            "from": card.status,
            "status": new_status.as_str(),
            "version": version,
            "correlation_id": correlation_id,
            "source": source.kind,
        }),
        version,
        correlation_id,
        source,
    )
    .await
}

/// Applies observed card data, in the caller's transaction. Only `pending -> ready` is a change
/// (ready data is never polled again); it sets the token, last four digits and expiry (never a
/// PAN or CVV), writes one `card.data_ready` audit event with its link and one outbox event.
pub async fn apply_card_data(
    tx: &mut PgConnection,
    card: &Card,
    data: &CardData,
    correlation_id: Uuid,
    source: &ChangeSource,
) -> sqlx::Result<Applied> {
    let CardData::Ready {
        card_token,
        pan_last4,
        expiry_month,
        expiry_year,
    } = data
    else {
        return Ok(Applied::Unchanged);
    };
    if card.data_state == "ready" {
        return Ok(Applied::Unchanged);
    }
    // The client only accepts month 1..=12 and year 2000..=9999, so both fit; the column type
    // still gets a checked conversion rather than a silent wrap.
    let ready = ReadyData {
        card_token: card_token.clone(),
        pan_last4: pan_last4.clone(),
        expiry_month: i16::try_from(*expiry_month).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        expiry_year: i16::try_from(*expiry_year).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
    };
    let Some(version) = cards::set_data_ready(tx, &card.card_ref, card.version, &ready).await?
    else {
        return Ok(Applied::Conflict);
    };
    record_change(
        tx,
        card,
        "card.data_ready",
        format!(
            "card {} data ready (last4 {}, expiry {:02}/{}; seen by {})",
            card.card_ref, ready.pan_last4, ready.expiry_month, ready.expiry_year, source.kind
        ),
        json!({
            "from": card.data_state,
            "to": "ready",
            "pan_last4": ready.pan_last4,
            "expiry_month": ready.expiry_month,
            "expiry_year": ready.expiry_year,
            "version": version,
            "source": source.kind,
            "source_detail": source.detail,
        }),
        json!({
            "card_ref": card.card_ref,
            "card_token": ready.card_token,
            "pan_last4": ready.pan_last4,
            "expiry_month": ready.expiry_month,
            "expiry_year": ready.expiry_year,
            "version": version,
            "correlation_id": correlation_id,
            "source": source.kind,
        }),
        version,
        correlation_id,
        source,
    )
    .await
}

/// The audit event (with its `card` resource link) and the outbox event of one applied change,
/// both named `event_type`.
#[allow(clippy::too_many_arguments)]
async fn record_change(
    tx: &mut PgConnection,
    card: &Card,
    event_type: &'static str,
    summary: String,
    details: serde_json::Value,
    outbox_payload: serde_json::Value,
    version: i64,
    correlation_id: Uuid,
    source: &ChangeSource,
) -> sqlx::Result<Applied> {
    let audit_event_id = records::insert_audit(
        tx,
        &AuditRecord {
            event_type,
            correlation_id: Some(correlation_id),
            summary,
            details,
            resource_type: "card",
            resource_id: card.card_ref.clone(),
        },
        source.integration_log_id,
    )
    .await?;
    let outbox_id =
        records::insert_outbox(tx, "card", &card.card_ref, event_type, &outbox_payload).await?;
    Ok(Applied::Changed {
        version,
        audit_event_id,
        outbox_id,
    })
}
