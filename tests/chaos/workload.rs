//! The workload: 500 cards whose data and status the simulator changes at random (every change
//! journaled), payments and approvals created at a steady rate and submitted through the CLI,
//! and channel callbacks for some of them: duplicated, late, out of order (before the POST's
//! answer), and now and then one that contradicts a decision on record.

use std::sync::Arc;
use std::time::Duration;

use cardworker::gateway::{ApprovalStatus, CardStatus, PaymentStatus};
use cardworker::sim::PaymentBehaviour;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use rand::{Rng as _, SeedableRng as _};
use serde_json::json;
use uuid::Uuid;

use crate::journal::{Delivery, HARNESS_HEADER};
use crate::World;

/// Runs the workload until `until_ms` (run time).
pub async fn run(world: Arc<World>, seed: u64, until_ms: u64) {
    let mut seeds = StdRng::seed_from_u64(seed);
    let cards = tokio::spawn(change_cards(world.clone(), seeds.random(), until_ms));
    let money = tokio::spawn(create_money(world.clone(), seeds.random(), until_ms));
    let _ = cards.await;
    let _ = money.await;
}

fn uuid_from(rng: &mut StdRng) -> Uuid {
    uuid::Builder::from_random_bytes(rng.random()).into_uuid()
}

/// About three card changes a second, each recorded in the journal as the simulator makes it.
/// A card cancelled by the channel is also announced by a `card.status` callback.
async fn change_cards(world: Arc<World>, seed: u64, until_ms: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut n = 0u64;
    while world.journal.now_ms() < until_ms {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let Some(card) = world.cards.choose(&mut rng).cloned() else {
            return;
        };
        let Some(now) = world.gw.sim.card(&card) else {
            continue;
        };
        if now.data == cardworker::gateway::CardData::Pending && rng.random_bool(0.5) {
            let token = format!(
                "tok_{}",
                (0..16)
                    .map(|_| char::from(b'a' + rng.random_range(0..26u8)))
                    .collect::<String>()
            );
            let last4 = format!("{:04}", rng.random_range(0..10_000u32));
            let (month, year) = (
                rng.random_range(1..=12u32),
                rng.random_range(2028..=2033u32),
            );
            world
                .gw
                .sim
                .set_card_ready(&card, &token, &last4, month, year);
            world.journal.change(&card, "carddata", token);
            continue;
        }
        let next = match now.status {
            CardStatus::Active if rng.random_bool(0.03) => CardStatus::Cancelled,
            CardStatus::Inactive | CardStatus::Frozen => CardStatus::Active,
            CardStatus::Active => CardStatus::Frozen,
            _ => continue,
        };
        world.gw.sim.set_card_status(&card, next);
        world
            .journal
            .change(&card, "card_status", next.as_str().to_owned());
        if next == CardStatus::Cancelled {
            n += 1;
            let body = json!({"type": "card.status", "card_ref": card, "status": "cancelled"});
            let (late, dup) = (rng.random_bool(0.3), rng.random_bool(0.3));
            spawn_callback(
                &world,
                "cards",
                format!("cx-{n}"),
                body,
                ("card", card.clone(), false),
                late_delay(&mut rng, late),
                dup.then(|| Duration::from_millis(rng.random_range(500..20_000))),
            );
        }
    }
}

fn late_delay(rng: &mut StdRng, late: bool) -> Duration {
    if late {
        Duration::from_millis(rng.random_range(20_000..45_000))
    } else {
        Duration::from_millis(rng.random_range(200..5_000))
    }
}

/// Hands one callback to the ingress after `delay` (and again `dup` later), as a channel
/// would: redelivered until the ingress takes it (the CLI exits 0), at most 15 times.
fn spawn_callback(
    world: &Arc<World>,
    channel: &'static str,
    callback_id: String,
    body: serde_json::Value,
    (kind, resource_id, conflicting): (&'static str, String, bool),
    delay: Duration,
    dup: Option<Duration>,
) {
    let world = world.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let file = world.dir.join(format!("cb-{channel}-{callback_id}.json"));
        if std::fs::write(&file, body.to_string()).is_err() {
            return;
        }
        let file = file.to_string_lossy().into_owned();
        let times = if dup.is_some() { 2 } else { 1 };
        for i in 0..times {
            if i == 1 {
                tokio::time::sleep(dup.unwrap_or_default()).await;
            }
            let args = [
                "enqueue",
                "callback",
                "--channel",
                channel,
                "--callback-id",
                &callback_id,
                "--body-file",
                &file,
            ];
            if world.cli.run_until_ok(&args, 15).await.is_some() {
                world.journal.delivered(Delivery {
                    at_ms: world.journal.now_ms(),
                    channel: channel.to_owned(),
                    callback_id: callback_id.clone(),
                    kind,
                    resource_id: resource_id.clone(),
                    conflicting,
                });
            }
        }
    });
}

/// A payment or an approval about every 1.5 s.
async fn create_money(world: Arc<World>, seed: u64, until_ms: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    while world.journal.now_ms() < until_ms {
        tokio::time::sleep(Duration::from_millis(rng.random_range(1_000..2_000))).await;
        let card = world.cards.choose(&mut rng).cloned().unwrap_or_default();
        let id = uuid_from(&mut rng);
        let callback = rng.random_bool(0.4);
        let (late, dup, conflict) = (
            rng.random_bool(0.3),
            rng.random_bool(0.3),
            rng.random_bool(0.1),
        );
        let delay = late_delay(&mut rng, late);
        let dup = dup.then(|| Duration::from_millis(rng.random_range(500..20_000)));
        if rng.random_bool(0.6) {
            if rng.random_bool(0.25) {
                world
                    .gw
                    .sim
                    .set_payment_behaviour(id, PaymentBehaviour::Reject);
            }
            let amount = rng.random_range(100..100_000i64);
            let inserted = sqlx::query(
                "INSERT INTO payments (payment_id, card_ref, amount_minor, currency) VALUES ($1, $2, $3, 'CNY')",
            )
            .bind(id)
            .bind(&card)
            .bind(amount)
            .execute(&world.pool)
            .await;
            if inserted.is_err() {
                continue;
            }
            world.created("payment", id);
            let w = world.clone();
            tokio::spawn(async move {
                let id_s = id.to_string();
                w.cli
                    .run(&["enqueue", "payment", "--payment-id", &id_s])
                    .await;
                if callback {
                    decision_callback(w, "payment", id, (delay, dup, conflict)).await;
                }
            });
        } else {
            let kind = *["issue", "limit_change", "unfreeze"]
                .choose(&mut rng)
                .unwrap_or(&"issue");
            let amount = (kind == "limit_change").then(|| rng.random_range(1_000..500_000i64));
            let inserted = sqlx::query(
                "INSERT INTO approvals (approval_id, card_ref, kind, amount_minor) VALUES ($1, $2, $3, $4)",
            )
            .bind(id)
            .bind(&card)
            .bind(kind)
            .bind(amount)
            .execute(&world.pool)
            .await;
            if inserted.is_err() {
                continue;
            }
            world.created("approval", id);
            let w = world.clone();
            tokio::spawn(async move {
                let id_s = id.to_string();
                w.cli
                    .run(&["enqueue", "approval", "--approval-id", &id_s])
                    .await;
                if callback {
                    decision_callback(w, "approval", id, (delay, dup, conflict)).await;
                }
            });
        }
    }
}

/// The Gateway's decision on a payment or approval as it stands (`None`: none yet), read from
/// the simulator without counting as a worker's call.
pub async fn gateway_decision(world: &World, kind: &str, id: Uuid) -> Option<(String, String)> {
    match kind {
        "payment" => {
            let stored = world.gw.sim.payment_record(id)?.stored?;
            Some((stored.status.as_str().to_owned(), stored.channel_ref))
        }
        _ => {
            let r = reqwest::Client::new()
                .get(format!("{}/v1/approvals/{id}", world.gw.base_url))
                .header(HARNESS_HEADER, "1")
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .ok()?;
            if !r.status().is_success() {
                return None;
            }
            let v: cardworker::gateway::ApprovalResult = r.json().await.ok()?;
            (v.status != ApprovalStatus::InReview)
                .then(|| (v.status.as_str().to_owned(), v.channel_ref))
        }
    }
}

/// The channel's callback with the Gateway's decision, once there is one: after `delay`
/// (possibly before the worker heard the POST's answer: out of order), maybe delivered twice;
/// and, now and then, once the row is final, a second callback that contradicts it.
async fn decision_callback(
    world: Arc<World>,
    kind: &'static str,
    id: Uuid,
    (delay, dup, conflict): (Duration, Option<Duration>, bool),
) {
    tokio::time::sleep(delay).await;
    let mut decision = None;
    for _ in 0..20 {
        decision = gateway_decision(&world, kind, id).await;
        if decision.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let Some((status, channel_ref)) = decision else {
        return;
    };
    let channel = if kind == "payment" { "pay" } else { "appr" };
    let body = |status: &str| {
        if kind == "payment" {
            json!({"type": "payment.result", "payment_id": id, "status": status, "channel_ref": channel_ref})
        } else {
            json!({"type": "approval.result", "approval_id": id, "status": status, "channel_ref": channel_ref})
        }
    };
    spawn_callback(
        &world,
        channel,
        format!("{kind}-{id}"),
        body(&status),
        (kind, id.to_string(), false),
        Duration::ZERO,
        dup,
    );
    if !conflict {
        return;
    }
    // Only once the row is final in PostgreSQL: a contradiction that came first would be the
    // decision the worker applies, and the Gateway's would be the conflict.
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let recorded = world.money_status(kind, id).await;
        if recorded.as_deref() == Some(status.as_str()) {
            let other = match status.as_str() {
                "accepted" => PaymentStatus::Rejected.as_str(),
                "rejected" => PaymentStatus::Accepted.as_str(),
                "approved" => ApprovalStatus::Declined.as_str(),
                _ => ApprovalStatus::Approved.as_str(),
            };
            spawn_callback(
                &world,
                channel,
                format!("{kind}-{id}-contra"),
                body(other),
                (kind, id.to_string(), true),
                Duration::ZERO,
                None,
            );
            return;
        }
    }
}
