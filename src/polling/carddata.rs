//! `PollCardData`: polls `GET /v1/cards/{card_ref}/data` until the card data is ready.

use cardworker_jobs::PollCardData;
use uuid::Uuid;

use super::poll::PollTask;
use crate::cards::apply::{self, Applied, ChangeSource};
use crate::gateway::{CardData, GatewayClient, SentRead};
use crate::storage::cards::Card;

super::run_job::poll_run_job!(PollCardData, "poll.carddata");

impl PollTask for PollCardData {
    type Obs = CardData;
    const SCENARIO: &'static str = "carddata_poll";

    fn send(gateway: &GatewayClient, card_ref: &str, correlation_id: Uuid) -> SentRead<CardData> {
        gateway.send_card_data(card_ref, correlation_id)
    }

    fn is_change(card: &Card, obs: &CardData) -> bool {
        card.data_state != obs.state()
    }

    fn apply<'c>(
        tx: &'c mut sqlx::PgConnection,
        card: &'c Card,
        obs: &'c CardData,
        correlation_id: Uuid,
        source: &'c ChangeSource,
    ) -> impl std::future::Future<Output = sqlx::Result<Applied>> + Send + 'c {
        apply::apply_card_data(tx, card, obs, correlation_id, source)
    }

    fn ends_chain(obs: &CardData) -> bool {
        matches!(obs, CardData::Ready { .. })
    }

    fn describe(obs: &CardData) -> String {
        format!("data {}", obs.state())
    }
}
