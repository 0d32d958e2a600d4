//! `PollCardStatus`: polls `GET /v1/cards/{card_ref}/status` until the status is final
//! (`cancelled` or `expired`).

use cardworker_jobs::PollCardStatus;
use uuid::Uuid;

use super::poll::PollTask;
use crate::cards::apply::{self, Applied, ChangeSource};
use crate::gateway::{CardStatus, GatewayClient, SentRead};
use crate::storage::cards::Card;

super::run_job::poll_run_job!(PollCardStatus, "poll.card_status");

impl PollTask for PollCardStatus {
    type Obs = CardStatus;
    const SCENARIO: &'static str = "card_status_poll";

    fn send(gateway: &GatewayClient, card_ref: &str, correlation_id: Uuid) -> SentRead<CardStatus> {
        gateway.send_card_status(card_ref, correlation_id)
    }

    fn is_change(card: &Card, obs: &CardStatus) -> bool {
        card.status != obs.as_str()
    }

    fn apply<'c>(
        tx: &'c mut sqlx::PgConnection,
        card: &'c Card,
        obs: &'c CardStatus,
        correlation_id: Uuid,
        source: &'c ChangeSource,
    ) -> impl std::future::Future<Output = sqlx::Result<Applied>> + Send + 'c {
        apply::apply_status(tx, card, *obs, correlation_id, source)
    }

    fn ends_chain(obs: &CardStatus) -> bool {
        obs.is_final()
    }

    fn describe(obs: &CardStatus) -> String {
        format!("status {obs}")
    }
}
