//! What one Gateway call answers, decided without HTTP: the dice rolled before every call
//! ([`roll`]: latency, outage, bad body) and the bodies ([`card_answer`], [`payment_garbage`]).
//! `http.rs` only turns an [`Answer`] into a response.

use rand::Rng;
use serde_json::{json, Value};
use uuid::Uuid;

use super::config::{CardBehaviour, GarbageKind, SimConfig};
use super::state::SimCard;
use cardworker_wire::{CallKind, CardData};

/// Trouble rolled for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disturbance {
    /// Answer 503.
    Error,
    /// Answer 200 with a bad body of this kind.
    Garbage(GarbageKind),
}

/// The dice of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Roll {
    /// `latency_ms` plus a uniform jitter in `0..=latency_jitter_ms`.
    pub(crate) delay_ms: u64,
    /// `None` means answer normally; an outage wins over a bad body.
    pub(crate) disturbance: Option<Disturbance>,
}

/// Rolls latency and the global error / garbage dice of `cfg` for one call.
pub(crate) fn roll(cfg: &SimConfig, rng: &mut impl Rng) -> Roll {
    let jitter = if cfg.latency_jitter_ms > 0 {
        rng.random_range(0..=cfg.latency_jitter_ms)
    } else {
        0
    };
    let error = rng.random::<f64>() < cfg.error_rate;
    let garbage = if rng.random::<f64>() < cfg.garbage_rate {
        Some(GarbageKind::ALL[rng.random_range(0..GarbageKind::ALL.len())])
    } else {
        None
    };
    Roll {
        delay_ms: cfg.latency_ms.saturating_add(jitter),
        disturbance: if error {
            Some(Disturbance::Error)
        } else {
            garbage.map(Disturbance::Garbage)
        },
    }
}

/// A Gateway answer before it becomes HTTP.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Answer {
    /// 503 with `{"error": "simulated outage"}`.
    Unavailable,
    /// 200 with an HTML body.
    NotJson,
    /// 200 with this JSON body.
    Json(Value),
}

/// The trouble a card read answers with, from the card's own `behaviour` and the `rolled` dice:
/// a failing card or a rolled outage is an outage; otherwise the card's own garbage kind wins
/// over a rolled one; `None` answers the card.
pub(crate) fn card_disturbance(
    behaviour: CardBehaviour,
    rolled: Option<Disturbance>,
) -> Option<Disturbance> {
    match (behaviour, rolled) {
        (CardBehaviour::Fail, _) | (_, Some(Disturbance::Error)) => Some(Disturbance::Error),
        (CardBehaviour::Garbage(k), _) | (_, Some(Disturbance::Garbage(k))) => {
            Some(Disturbance::Garbage(k))
        }
        (CardBehaviour::Normal, None) => None,
    }
}

/// The answer to a read of `call` about `card` (as [`super::state::SimState::read_card`]
/// returned it) under the `rolled` dice: 503, a bad body or the card's body, as
/// [`card_disturbance`] decides.
pub(crate) fn card_answer(
    card_ref: &str,
    call: CallKind,
    card: &SimCard,
    rolled: Option<Disturbance>,
) -> Answer {
    let garbage = match card_disturbance(card.behaviour, rolled) {
        Some(Disturbance::Error) => return Answer::Unavailable,
        Some(Disturbance::Garbage(k)) => Some(k),
        None => None,
    };
    let field = if call == CallKind::Carddata {
        "state"
    } else {
        "status"
    };
    Answer::Json(match garbage {
        Some(GarbageKind::NotJson) => return Answer::NotJson,
        Some(GarbageKind::MissingField) => json!({ "card_ref": card_ref }),
        Some(GarbageKind::BadValue) => json!({ "card_ref": card_ref, field: "weird" }),
        Some(GarbageKind::OtherRef) => card_body(&format!("{card_ref}-other"), call, card),
        None => card_body(card_ref, call, card),
    })
}

/// The well-formed body of a read of `call` about `card`, naming `card_ref`.
pub(crate) fn card_body(card_ref: &str, call: CallKind, card: &SimCard) -> Value {
    if call == CallKind::Carddata {
        match &card.data {
            CardData::Pending => json!({"card_ref": card_ref, "state": "pending"}),
            CardData::Ready {
                card_token,
                pan_last4,
                expiry_month,
                expiry_year,
            } => json!({
                "card_ref": card_ref,
                "state": "ready",
                "card_token": card_token,
                "pan_last4": pan_last4,
                "expiry_month": expiry_month,
                "expiry_year": expiry_year,
            }),
        }
    } else {
        json!({"card_ref": card_ref, "status": card.status.as_str()})
    }
}

/// A bad 200 body of `kind` for a payment call about `payment_id`.
pub(crate) fn payment_garbage(kind: GarbageKind, payment_id: Uuid) -> Answer {
    Answer::Json(match kind {
        GarbageKind::NotJson => return Answer::NotJson,
        GarbageKind::MissingField => json!({ "payment_id": payment_id }),
        GarbageKind::BadValue => {
            json!({ "payment_id": payment_id, "status": "weird", "channel_ref": "ch_x" })
        }
        GarbageKind::OtherRef => {
            json!({ "payment_id": Uuid::new_v4(), "status": "accepted", "channel_ref": "ch_x" })
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use rand::rngs::StdRng;
    use rand::SeedableRng as _;

    use super::*;
    use cardworker_wire::{CardStatus, PaymentResult};

    const ROLLS: usize = 2000;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(11)
    }

    fn cfg(error_rate: f64, garbage_rate: f64) -> SimConfig {
        SimConfig {
            error_rate,
            garbage_rate,
            ..SimConfig::default()
        }
    }

    fn ready() -> SimCard {
        SimCard {
            data: CardData::Ready {
                card_token: "tok_abc".to_owned(),
                pan_last4: "4242".to_owned(),
                expiry_month: 12,
                expiry_year: 2030,
            },
            status: CardStatus::Active,
            behaviour: CardBehaviour::Normal,
            latency_ms: None,
        }
    }

    fn keys(v: &Value) -> BTreeSet<&str> {
        v.as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect()
    }

    #[test]
    fn error_rate_one_always_answers_503_whatever_the_card_or_the_garbage_rate() {
        let mut rng = rng();
        for _ in 0..ROLLS {
            let r = roll(&cfg(1.0, 1.0), &mut rng);
            assert_eq!(r.disturbance, Some(Disturbance::Error));
            for call in [CallKind::Carddata, CallKind::CardStatus] {
                for behaviour in [
                    CardBehaviour::Normal,
                    CardBehaviour::Garbage(GarbageKind::OtherRef),
                ] {
                    let card = SimCard {
                        behaviour,
                        ..ready()
                    };
                    assert_eq!(
                        card_answer("c-1", call, &card, r.disturbance),
                        Answer::Unavailable
                    );
                }
            }
        }
    }

    #[test]
    fn rates_zero_never_disturb_a_call() {
        let mut rng = rng();
        for _ in 0..ROLLS {
            assert_eq!(roll(&cfg(0.0, 0.0), &mut rng).disturbance, None);
        }
    }

    #[test]
    fn garbage_rate_one_always_rolls_a_bad_body_and_in_time_every_kind() {
        let mut rng = rng();
        let mut seen = Vec::new();
        for _ in 0..ROLLS {
            match roll(&cfg(0.0, 1.0), &mut rng).disturbance {
                Some(Disturbance::Garbage(k)) => {
                    if !seen.contains(&k) {
                        seen.push(k);
                    }
                }
                other => panic!("garbage_rate 1 rolled {other:?}"),
            }
        }
        assert_eq!(seen.len(), GarbageKind::ALL.len(), "{seen:?}");
    }

    #[test]
    fn latency_is_the_base_plus_at_most_the_jitter() {
        let mut rng = rng();
        let c = SimConfig {
            latency_ms: 30,
            latency_jitter_ms: 5,
            ..SimConfig::default()
        };
        let delays: BTreeSet<u64> = (0..ROLLS).map(|_| roll(&c, &mut rng).delay_ms).collect();
        assert_eq!(delays, (30..=35).collect());
        let fixed = SimConfig {
            latency_ms: 30,
            ..SimConfig::default()
        };
        assert_eq!(roll(&fixed, &mut rng).delay_ms, 30);
    }

    #[test]
    fn a_failing_card_answers_503_without_any_disturbance() {
        let card = SimCard {
            behaviour: CardBehaviour::Fail,
            ..ready()
        };
        for call in [CallKind::Carddata, CallKind::CardStatus] {
            assert_eq!(card_answer("c-1", call, &card, None), Answer::Unavailable);
        }
    }

    #[test]
    fn the_disturbance_of_a_card_read_is_the_cards_behaviour_first_then_the_dice() {
        let rolled_garbage = Some(Disturbance::Garbage(GarbageKind::BadValue));
        let own_garbage = CardBehaviour::Garbage(GarbageKind::NotJson);
        for (behaviour, rolled, expected) in [
            (CardBehaviour::Normal, None, None),
            (CardBehaviour::Normal, rolled_garbage, rolled_garbage),
            (
                CardBehaviour::Normal,
                Some(Disturbance::Error),
                Some(Disturbance::Error),
            ),
            (CardBehaviour::Fail, None, Some(Disturbance::Error)),
            (
                CardBehaviour::Fail,
                rolled_garbage,
                Some(Disturbance::Error),
            ),
            (
                own_garbage,
                None,
                Some(Disturbance::Garbage(GarbageKind::NotJson)),
            ),
            (
                own_garbage,
                rolled_garbage,
                Some(Disturbance::Garbage(GarbageKind::NotJson)),
            ),
            (
                own_garbage,
                Some(Disturbance::Error),
                Some(Disturbance::Error),
            ),
        ] {
            assert_eq!(
                card_disturbance(behaviour, rolled),
                expected,
                "{behaviour:?} + {rolled:?}"
            );
        }
    }

    #[test]
    fn a_cards_own_garbage_kind_wins_over_a_rolled_one() {
        let card = SimCard {
            behaviour: CardBehaviour::Garbage(GarbageKind::NotJson),
            ..ready()
        };
        let rolled = Some(Disturbance::Garbage(GarbageKind::BadValue));
        assert_eq!(
            card_answer("c-1", CallKind::CardStatus, &card, rolled),
            Answer::NotJson
        );
    }

    #[test]
    fn each_garbage_kind_yields_the_card_body_it_names() {
        for call in [CallKind::Carddata, CallKind::CardStatus] {
            let field = if call == CallKind::Carddata {
                "state"
            } else {
                "status"
            };
            let answer = |k| card_answer("c-1", call, &ready(), Some(Disturbance::Garbage(k)));

            assert_eq!(answer(GarbageKind::NotJson), Answer::NotJson);

            let Answer::Json(missing) = answer(GarbageKind::MissingField) else {
                panic!("missing_field is JSON");
            };
            assert_eq!(missing, json!({"card_ref": "c-1"}));

            let Answer::Json(bad) = answer(GarbageKind::BadValue) else {
                panic!("bad_value is JSON");
            };
            assert_eq!(bad, json!({"card_ref": "c-1", field: "weird"}));

            let Answer::Json(other) = answer(GarbageKind::OtherRef) else {
                panic!("other_ref is JSON");
            };
            assert_eq!(other["card_ref"], "c-1-other");
            // Otherwise well-formed: only the reference is wrong.
            assert_eq!(other, card_body("c-1-other", call, &ready()));
        }
    }

    #[test]
    fn a_ready_card_body_carries_the_token_last4_and_expiry_and_nothing_else() {
        let body = card_body("c-1", CallKind::Carddata, &ready());
        assert_eq!(
            keys(&body),
            BTreeSet::from([
                "card_ref",
                "state",
                "card_token",
                "pan_last4",
                "expiry_month",
                "expiry_year"
            ])
        );
        let data: CardData = serde_json::from_value(body).unwrap();
        assert_eq!(data, ready().data);
    }

    #[test]
    fn a_pending_card_body_and_a_status_body_follow_the_contract() {
        let pending = SimCard::default();
        assert_eq!(
            card_answer("c-1", CallKind::Carddata, &pending, None),
            Answer::Json(json!({"card_ref": "c-1", "state": "pending"}))
        );
        for status in CardStatus::ALL {
            let card = SimCard {
                status,
                ..SimCard::default()
            };
            assert_eq!(
                card_answer("c-1", CallKind::CardStatus, &card, None),
                Answer::Json(json!({"card_ref": "c-1", "status": status.as_str()}))
            );
        }
    }

    #[test]
    fn each_garbage_kind_yields_the_payment_body_it_names() {
        let id = Uuid::new_v4();
        assert_eq!(payment_garbage(GarbageKind::NotJson, id), Answer::NotJson);
        assert_eq!(
            payment_garbage(GarbageKind::MissingField, id),
            Answer::Json(json!({"payment_id": id}))
        );
        assert_eq!(
            payment_garbage(GarbageKind::BadValue, id),
            Answer::Json(json!({"payment_id": id, "status": "weird", "channel_ref": "ch_x"}))
        );
        let Answer::Json(other) = payment_garbage(GarbageKind::OtherRef, id) else {
            panic!("other_ref is JSON");
        };
        let parsed: PaymentResult = serde_json::from_value(other).expect("well-formed");
        assert_ne!(parsed.payment_id, id, "names another payment");
    }
}
