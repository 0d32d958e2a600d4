//! A card's payments and callbacks, as `cardworker investigate --card-ref` shows them.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{FromRow, PgPool};

use super::store::{self, Payment};

/// One `inbound_callbacks` row.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, Serialize)]
pub struct CallbackRecord {
    /// The channel.
    pub channel: String,
    /// Unique within the channel.
    pub callback_id: String,
    /// `applied` or `failed`.
    pub state: String,
    /// Why it failed.
    pub reason: Option<String>,
    /// How many times it was delivered.
    pub deliveries: i32,
    /// First delivery.
    pub first_received_at: DateTime<Utc>,
    /// Latest delivery.
    pub last_received_at: DateTime<Utc>,
    /// When it was applied.
    pub applied_at: Option<DateTime<Utc>>,
}

/// What is on record for one card on the reliable paths.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CardReliableRecords {
    /// The card's payments, newest first.
    pub payments: Vec<Payment>,
    /// Callbacks about the card or about its payments, newest first.
    pub callbacks: Vec<CallbackRecord>,
}

/// Loads a card's payments and callbacks (index lookups by card and by resource).
pub async fn for_card(pool: &PgPool, card_ref: &str) -> sqlx::Result<CardReliableRecords> {
    let payments = store::for_card(pool, card_ref).await?;
    let payment_ids: Vec<String> = payments.iter().map(|p| p.payment_id.to_string()).collect();
    let callbacks = sqlx::query_as::<_, CallbackRecord>(
        "SELECT channel, callback_id, state, reason, deliveries, first_received_at,
                last_received_at, applied_at
           FROM inbound_callbacks
          WHERE (resource_type = 'card' AND resource_id = $1)
             OR (resource_type = 'payment' AND resource_id = ANY($2))
          ORDER BY last_received_at DESC",
    )
    .bind(card_ref)
    .bind(&payment_ids)
    .fetch_all(pool)
    .await?;
    Ok(CardReliableRecords {
        payments,
        callbacks,
    })
}

impl CardReliableRecords {
    /// Text lines for the human-readable `investigate` output.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!("payments ({}):\n", self.payments.len()));
        for p in &self.payments {
            out.push_str(&format!(
                "  {} {} {} {} channel_ref={} submissions={} updated {}\n",
                p.payment_id,
                p.amount_minor,
                p.currency,
                p.status,
                p.channel_ref.as_deref().unwrap_or("-"),
                p.submissions,
                p.updated_at
            ));
        }
        out.push_str(&format!("callbacks ({}):\n", self.callbacks.len()));
        for c in &self.callbacks {
            out.push_str(&format!(
                "  {}/{} {} deliveries={}{} last {}\n",
                c.channel,
                c.callback_id,
                c.state,
                c.deliveries,
                c.reason
                    .as_deref()
                    .map(|r| format!(" reason={r}"))
                    .unwrap_or_default(),
                c.last_received_at
            ));
        }
        out
    }
}
