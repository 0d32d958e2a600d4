//! `cardworker gateway-sim`: the Gateway simulator as a process of its own (`make run`, load
//! tests), with the knobs of the command line.
//!
//! The simulator keeps its cards in memory, so a restarted one would answer "pending, inactive"
//! for every card and the worker would record a burst of changes that never happened (active
//! cards flipping back to inactive). `--seed-from-db` avoids that: before it listens, the
//! simulator loads each card's data and status from the database the worker writes to, and
//! carries on from there. The seeding lives here, not in the simulator's crate (`cardworker-sim`),
//! because the simulator depends only on the Gateway's wire types, never on storage.

use anyhow::Context as _;
use sqlx::PgPool;

use super::args::SimArgs;
use super::{shutdown_signal, CommandError};
use crate::config::Config;
use crate::gateway::{CardData, CardStatus};
use crate::storage::{self, cards::Card};
use cardworker_sim::{SimCardPatch, SimConfig, Simulator};

/// Cards read per query while seeding.
const SEED_PAGE: i64 = 1000;

/// Runs the simulator until SIGTERM or SIGINT.
pub async fn run(config: &Config, args: SimArgs) -> Result<(), CommandError> {
    let sim_config = SimConfig {
        latency_ms: args.latency_ms,
        latency_jitter_ms: args.latency_jitter_ms,
        error_rate: args.error_rate,
        garbage_rate: args.garbage_rate,
        change_rate: args.change_rate,
        approval_in_review_rate: args.approval_in_review_rate,
        approval_decline_rate: args.approval_decline_rate,
        approval_review_ms: args.approval_review_ms,
        ..SimConfig::default()
    };
    sim_config
        .validate()
        .map_err(|e| CommandError::Usage(format!("{e:#}")))?;
    let sim = Simulator::new(sim_config);
    if args.seed_from_db {
        let pool = storage::connect(&config.database).await?;
        let report = seed(&sim, &pool).await?;
        pool.close().await;
        tracing::info!(
            cards = report.seeded,
            ready = report.ready,
            skipped = report.skipped,
            "gateway simulator seeded from the database"
        );
    }
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding the gateway simulator to {}", args.listen))?;
    println!(
        "gateway simulator listening on http://{}",
        listener.local_addr().context("reading the bound address")?
    );
    sim.serve(listener, shutdown_signal()).await?;
    Ok(())
}

/// What [`seed`] loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SeedReport {
    /// Cards loaded into the simulator.
    pub seeded: u64,
    /// Of those, cards whose data is ready.
    pub ready: u64,
    /// Rows that could not be read as a Gateway card (left to the simulator's defaults).
    pub skipped: u64,
}

/// Loads every card of `pool` into `sim`: data and status as stored, behaviour untouched.
pub async fn seed(sim: &Simulator, pool: &PgPool) -> anyhow::Result<SeedReport> {
    let mut report = SeedReport::default();
    let mut after = 0;
    loop {
        let page = storage::cards::page(pool, after, SEED_PAGE)
            .await
            .context("reading cards to seed the gateway simulator")?;
        let Some(last) = page.last() else {
            return Ok(report);
        };
        after = last.id;
        for card in &page {
            match patch_of(card) {
                Ok(patch) => {
                    report.ready += u64::from(matches!(patch.data, Some(CardData::Ready { .. })));
                    sim.patch_card(&card.card_ref, &patch);
                    report.seeded += 1;
                }
                Err(why) => {
                    tracing::warn!(card_ref = %card.card_ref, %why, "card not seeded into the gateway simulator");
                    report.skipped += 1;
                }
            }
        }
    }
}

/// The simulator's view of a stored card: what the Gateway must answer for the worker to see
/// no change.
pub fn patch_of(card: &Card) -> Result<SimCardPatch, String> {
    let status: CardStatus = card
        .status
        .parse()
        .map_err(|_| format!("status {:?} is not a Gateway status", card.status))?;
    let data = match card.data_state.as_str() {
        "pending" => CardData::Pending,
        "ready" => ready_data(card)?,
        other => return Err(format!("data_state {other:?} is neither pending nor ready")),
    };
    Ok(SimCardPatch {
        data: Some(data),
        status: Some(status),
        behaviour: None,
        latency_ms: None,
    })
}

fn ready_data(card: &Card) -> Result<CardData, String> {
    let incomplete = || "data is ready but token, last4 or expiry is missing".to_owned();
    let month = |m: i16| u32::try_from(m).map_err(|_| format!("expiry month {m} is negative"));
    let year = |y: i16| u32::try_from(y).map_err(|_| format!("expiry year {y} is negative"));
    Ok(CardData::Ready {
        card_token: card.card_token.clone().ok_or_else(incomplete)?,
        pan_last4: card.pan_last4.clone().ok_or_else(incomplete)?,
        expiry_month: month(card.expiry_month.ok_or_else(incomplete)?)?,
        expiry_year: year(card.expiry_year.ok_or_else(incomplete)?)?,
    })
}

#[cfg(test)]
mod tests {
    use chrono::Utc;

    use super::*;

    fn card(data_state: &str, status: &str) -> Card {
        Card {
            id: 1,
            card_ref: "c-1".to_owned(),
            data_state: data_state.to_owned(),
            card_token: None,
            pan_last4: None,
            expiry_month: None,
            expiry_year: None,
            status: status.to_owned(),
            version: 0,
            carddata_parked_at: None,
            card_status_parked_at: None,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        }
    }

    #[test]
    fn a_pending_card_is_seeded_pending_with_its_status_and_no_behaviour() {
        for status in CardStatus::ALL {
            let patch = patch_of(&card("pending", status.as_str())).unwrap();
            assert_eq!(
                patch,
                SimCardPatch {
                    data: Some(CardData::Pending),
                    status: Some(status),
                    behaviour: None,
                    latency_ms: None,
                }
            );
        }
    }

    #[test]
    fn a_ready_card_is_seeded_with_its_token_last4_and_expiry() {
        let c = Card {
            card_token: Some("tok_abc".to_owned()),
            pan_last4: Some("4242".to_owned()),
            expiry_month: Some(12),
            expiry_year: Some(2030),
            ..card("ready", "active")
        };
        assert_eq!(
            patch_of(&c).unwrap().data,
            Some(CardData::Ready {
                card_token: "tok_abc".to_owned(),
                pan_last4: "4242".to_owned(),
                expiry_month: 12,
                expiry_year: 2030,
            })
        );
    }

    #[test]
    fn a_row_that_is_no_gateway_card_is_refused_with_the_reason() {
        let e = patch_of(&card("ready", "active")).unwrap_err();
        assert!(e.contains("missing"), "{e}");
        let e = patch_of(&card("pending", "lost")).unwrap_err();
        assert!(e.contains("\"lost\""), "{e}");
        let e = patch_of(&card("half", "active")).unwrap_err();
        assert!(e.contains("\"half\""), "{e}");
    }
}
