//! `PollCardData`: polls `GET /v1/cards/{card_ref}/data` until the card data is ready.

use std::sync::Arc;
use std::time::Duration;

use cardworker_jobs::PollCardData;
use uuid::Uuid;

use super::poll::{self, PollTask};
use crate::cards::apply::{self, Applied, ChangeSource};
use crate::config::{Config, Task};
use crate::context::AppContext;
use crate::gateway::{CallResult, CardData, GatewayClient};
use crate::runner::{JobError, RunJob};
use crate::storage::cards::Card;

impl RunJob for PollCardData {
    fn concurrency(config: &Config) -> usize {
        config.polling.task(Task::Carddata).limit as usize
    }

    fn timeout(config: &Config) -> Duration {
        config.polling.handler_timeout()
    }

    #[tracing::instrument(name = "poll.carddata", skip_all, fields(card_ref = %self.card_ref, chain = %self.state.chain, failures = self.state.failures))]
    async fn run(self, ctx: Arc<AppContext>) -> anyhow::Result<()> {
        poll::run_poll(self, ctx).await.map(|_| ())
    }

    async fn after_abnormal_end(self, ctx: Arc<AppContext>, error: JobError) {
        poll::after_abnormal_end(self, ctx, error).await;
    }

    fn carry<F>(job: F) -> futures::future::BoxFuture<'static, F::Output>
    where
        F: std::future::Future + Send + 'static,
    {
        Box::pin(super::circuit::carry(job))
    }
}

impl PollTask for PollCardData {
    type Obs = CardData;
    const SCENARIO: &'static str = "carddata_poll";

    async fn call(
        gateway: &GatewayClient,
        card_ref: &str,
        correlation_id: Uuid,
    ) -> CallResult<CardData> {
        gateway.card_data(card_ref, correlation_id).await
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
