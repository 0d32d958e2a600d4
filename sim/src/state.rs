//! The simulator's in-memory world ([`SimState`]): the cards, what it saw of each payment, the
//! request log, and the pure decisions taken on them (a card changing as it is read, a payment
//! submission recorded, a payment decided once and answered the same ever after).
//!
//! Nothing here sleeps, locks or speaks HTTP; randomness comes in as an [`Rng`], so every
//! decision is testable on its own.

use std::collections::{HashMap, VecDeque};

use rand::distr::Alphanumeric;
use rand::Rng;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::config::{CardBehaviour, PaymentBehaviour, SimConfig};
use cardworker_wire::{
    CallKind, CardData, CardStatus, PaymentRequest, PaymentResult, PaymentStatus,
};

/// How many requests [`super::Simulator::recent_requests`] keeps.
pub const REQUEST_LOG_CAPACITY: usize = 1000;

/// One simulated card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimCard {
    pub data: CardData,
    pub status: CardStatus,
    pub behaviour: CardBehaviour,
    /// This card's latency in ms, instead of the global `latency_ms` and jitter (a slow card).
    #[serde(default)]
    pub latency_ms: Option<u64>,
}

impl Default for SimCard {
    fn default() -> Self {
        Self {
            data: CardData::Pending,
            status: CardStatus::Inactive,
            behaviour: CardBehaviour::Normal,
            latency_ms: None,
        }
    }
}

/// A partial update of one card (`POST /sim/cards/{card_ref}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimCardPatch {
    pub data: Option<CardData>,
    pub status: Option<CardStatus>,
    pub behaviour: Option<CardBehaviour>,
    /// Sets the card's own latency (ms).
    pub latency_ms: Option<u64>,
}

/// What the simulator saw of one payment id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRecord {
    /// `POST /v1/payments` requests for this payment id.
    pub submissions: u64,
    /// The `Idempotency-Key` header of each submission, in order (`""` when absent).
    pub idempotency_keys: Vec<String>,
    /// What `GET /v1/payments/{id}` answers; `None` means 404.
    pub stored: Option<PaymentResult>,
    /// Behaviour for this payment, overriding `payment_mode`.
    pub behaviour: Option<PaymentBehaviour>,
}

/// One request as the simulator received it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub call: CallKind,
    pub path: String,
    pub correlation_id: Option<String>,
    pub accept: Option<String>,
    pub idempotency_key: Option<String>,
}

/// Everything the simulator knows, behind one lock in [`super::Simulator`].
#[derive(Debug, Default)]
pub(crate) struct SimState {
    pub(crate) config: SimConfig,
    pub(crate) cards: HashMap<String, SimCard>,
    pub(crate) payments: HashMap<Uuid, PaymentRecord>,
    pub(crate) approvals: super::approvals::Approvals,
    pub(crate) requests: VecDeque<RequestRecord>,
    /// The `Idempotency-Key`s of the `POST`s being processed now, with how many of each.
    pub(crate) posts_in_progress: HashMap<String, usize>,
}

impl SimState {
    pub(crate) fn new(config: SimConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The card, created (pending, inactive, normal) when first named.
    pub(crate) fn card_mut(&mut self, card_ref: &str) -> &mut SimCard {
        self.cards.entry(card_ref.to_owned()).or_default()
    }

    /// Applies a partial update to a card, creating it when needed; returns the card.
    pub(crate) fn patch_card(&mut self, card_ref: &str, patch: &SimCardPatch) -> SimCard {
        let card = self.card_mut(card_ref);
        if let Some(d) = &patch.data {
            card.data = d.clone();
        }
        if let Some(s) = patch.status {
            card.status = s;
        }
        if let Some(b) = patch.behaviour {
            card.behaviour = b;
        }
        if let Some(ms) = patch.latency_ms {
            card.latency_ms = Some(ms);
        }
        card.clone()
    }

    /// Serves one card read of `call`: creates the card when new and, unless the call is
    /// `disturbed` (outage or bad body) or the card has its own behaviour, lets it change with
    /// probability `change_rate`. Returns the card as answered.
    pub(crate) fn read_card(
        &mut self,
        card_ref: &str,
        call: CallKind,
        disturbed: bool,
        rng: &mut impl Rng,
    ) -> SimCard {
        let change_rate = self.config.change_rate;
        let card = self.card_mut(card_ref);
        if card.behaviour == CardBehaviour::Normal && !disturbed {
            maybe_change(card, call, change_rate, rng);
        }
        card.clone()
    }

    /// Appends to the request log, dropping the oldest beyond [`REQUEST_LOG_CAPACITY`].
    pub(crate) fn log_request(&mut self, rec: RequestRecord) {
        if self.requests.len() >= REQUEST_LOG_CAPACITY {
            self.requests.pop_front();
        }
        self.requests.push_back(rec);
    }

    /// Counts one `POST /v1/payments` with its `Idempotency-Key` (before any simulated
    /// trouble: the Gateway did receive it) and returns the behaviour that applies to it.
    pub(crate) fn record_submission(
        &mut self,
        payment_id: Uuid,
        idempotency_key: Option<&str>,
    ) -> PaymentBehaviour {
        let mode = self.config.payment_mode;
        let rec = self.payments.entry(payment_id).or_default();
        rec.submissions += 1;
        rec.idempotency_keys
            .push(idempotency_key.unwrap_or_default().to_owned());
        rec.behaviour.unwrap_or(mode)
    }

    /// Decides a submitted payment under `behaviour` (not [`PaymentBehaviour::ServerError`],
    /// which answers before this): the result to answer and, for a hang, how long to hold it.
    ///
    /// Idempotent: a payment already decided is answered as decided, whatever the behaviour
    /// now. `Forget` answers accepted without storing; the others store what they answer.
    pub(crate) fn decide_payment(
        &mut self,
        req: &PaymentRequest,
        behaviour: PaymentBehaviour,
    ) -> (PaymentResult, Option<u64>) {
        let hang_ms = self.config.hang_ms;
        let hang = (behaviour == PaymentBehaviour::Hang).then_some(hang_ms);
        let rec = self.payments.entry(req.payment_id).or_default();
        let fresh = |status| PaymentResult {
            payment_id: req.payment_id,
            status,
            channel_ref: format!("ch_{}", req.payment_id.simple()),
        };
        match (&rec.stored, behaviour) {
            (Some(stored), _) => (stored.clone(), hang),
            (None, PaymentBehaviour::Forget) => (fresh(PaymentStatus::Accepted), None),
            (None, b) => {
                let status = if b == PaymentBehaviour::Reject {
                    PaymentStatus::Rejected
                } else {
                    PaymentStatus::Accepted
                };
                let r = fresh(status);
                rec.stored = Some(r.clone());
                (r, hang)
            }
        }
    }

    /// What `GET /v1/payments/{id}` answers; `None` is 404.
    pub(crate) fn stored_payment(&self, payment_id: Uuid) -> Option<PaymentResult> {
        self.payments
            .get(&payment_id)
            .and_then(|p| p.stored.clone())
    }

    pub(crate) fn set_payment_behaviour(&mut self, payment_id: Uuid, behaviour: PaymentBehaviour) {
        self.payments.entry(payment_id).or_default().behaviour = Some(behaviour);
    }

    /// From now on the payment is unknown to `GET` (its record and count stay).
    pub(crate) fn forget_payment(&mut self, payment_id: Uuid) {
        if let Some(p) = self.payments.get_mut(&payment_id) {
            p.stored = None;
        }
    }

    /// Stores a result as if the payment had been submitted earlier.
    pub(crate) fn store_payment(&mut self, result: PaymentResult) {
        let id = result.payment_id;
        self.payments.entry(id).or_default().stored = Some(result);
    }
}

fn random_token(rng: &mut impl Rng) -> String {
    let s: String = rng
        .sample_iter(&Alphanumeric)
        .take(16)
        .map(char::from)
        .collect();
    format!("tok_{s}")
}

/// Maybe changes the card (with probability `change_rate`) as a read of `call` is served.
///
/// A data read turns a pending card ready (a token, four digits, an expiry; never a full card
/// number); a ready card stays as it is. A status read moves inactive or frozen to active, and
/// active to frozen (or, 2 % of the time, cancelled); a final status never changes.
pub(crate) fn maybe_change(
    card: &mut SimCard,
    call: CallKind,
    change_rate: f64,
    rng: &mut impl Rng,
) {
    if rng.random::<f64>() >= change_rate {
        return;
    }
    match call {
        CallKind::Carddata => {
            if card.data == CardData::Pending {
                card.data = CardData::Ready {
                    card_token: random_token(rng),
                    pan_last4: format!("{:04}", rng.random_range(0..10_000u32)),
                    expiry_month: rng.random_range(1..=12),
                    expiry_year: rng.random_range(2028..=2033),
                };
            }
        }
        _ => {
            card.status = match card.status {
                CardStatus::Inactive | CardStatus::Frozen => CardStatus::Active,
                CardStatus::Active if rng.random::<f64>() < 0.02 => CardStatus::Cancelled,
                CardStatus::Active => CardStatus::Frozen,
                final_status => final_status,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng as _;

    use super::*;
    use crate::config::GarbageKind;

    const READS: usize = 1000;

    fn rng() -> StdRng {
        StdRng::seed_from_u64(7)
    }

    fn state(change_rate: f64) -> SimState {
        SimState::new(SimConfig {
            change_rate,
            ..SimConfig::default()
        })
    }

    fn request(payment_id: Uuid) -> PaymentRequest {
        PaymentRequest {
            payment_id,
            card_ref: "c-1".to_owned(),
            amount_minor: 1234,
            currency: "CNY".to_owned(),
        }
    }

    /// Submits like the route does: record, then decide.
    fn submit(st: &mut SimState, id: Uuid) -> (PaymentResult, Option<u64>) {
        let key = id.to_string();
        let behaviour = st.record_submission(id, Some(&key));
        st.decide_payment(&request(id), behaviour)
    }

    #[test]
    fn a_card_first_read_is_created_pending_inactive_and_normal() {
        let mut st = state(0.0);
        let card = st.read_card("c-1", CallKind::Carddata, false, &mut rng());
        assert_eq!(card, SimCard::default());
        assert_eq!(card.data, CardData::Pending);
        assert_eq!(card.status, CardStatus::Inactive);
        assert_eq!(st.cards.get("c-1"), Some(&card));
    }

    #[test]
    fn a_cards_data_goes_pending_to_ready_with_a_token_and_last4_and_never_a_full_pan() {
        let mut rng = rng();
        for i in 0..200 {
            let mut st = state(1.0);
            let card_ref = format!("c-{i}");
            let card = st.read_card(&card_ref, CallKind::Carddata, false, &mut rng);
            let CardData::Ready {
                card_token,
                pan_last4,
                expiry_month,
                expiry_year,
            } = &card.data
            else {
                panic!("change_rate 1 makes a pending card ready: {card:?}");
            };
            let token = card_token.strip_prefix("tok_").expect("a tok_ token");
            assert_eq!(token.len(), 16);
            assert!(token.chars().all(|c| c.is_ascii_alphanumeric()));
            assert_eq!(pan_last4.len(), 4);
            assert!(pan_last4.chars().all(|c| c.is_ascii_digit()));
            assert!((1..=12).contains(expiry_month));
            assert!((2028..=2033).contains(expiry_year));
            // No run of more than four digits anywhere in what the card holds: no PAN.
            let json = serde_json::to_string(&card).unwrap();
            let longest_digit_run = json
                .split(|c: char| !c.is_ascii_digit())
                .map(str::len)
                .max()
                .unwrap_or(0);
            assert!(longest_digit_run <= 4, "{json}");
            assert!(!json.contains("\"pan\"") && !json.contains("cvv"), "{json}");
        }
    }

    #[test]
    fn a_ready_card_keeps_its_data_on_every_later_read() {
        let mut st = state(1.0);
        let mut rng = rng();
        let first = st.read_card("c-1", CallKind::Carddata, false, &mut rng);
        assert_ne!(first.data, CardData::Pending);
        for _ in 0..READS {
            let again = st.read_card("c-1", CallKind::Carddata, false, &mut rng);
            assert_eq!(again.data, first.data);
        }
    }

    #[test]
    fn change_rate_zero_never_changes_a_card() {
        let mut st = state(0.0);
        let mut rng = rng();
        st.card_mut("c-1").status = CardStatus::Active;
        let before = st.cards["c-1"].clone();
        for _ in 0..READS {
            for call in [CallKind::Carddata, CallKind::CardStatus] {
                assert_eq!(st.read_card("c-1", call, false, &mut rng), before);
            }
        }
    }

    #[test]
    fn change_rate_one_always_changes_a_status_that_is_not_final() {
        let mut rng = rng();
        for _ in 0..READS {
            for from in [CardStatus::Inactive, CardStatus::Active, CardStatus::Frozen] {
                let mut st = state(1.0);
                st.card_mut("c-1").status = from;
                let to = st
                    .read_card("c-1", CallKind::CardStatus, false, &mut rng)
                    .status;
                let expected: &[CardStatus] = match from {
                    CardStatus::Active => &[CardStatus::Frozen, CardStatus::Cancelled],
                    _ => &[CardStatus::Active],
                };
                assert!(expected.contains(&to), "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn a_final_status_never_changes_even_at_change_rate_one() {
        let mut rng = rng();
        for fin in [CardStatus::Cancelled, CardStatus::Expired] {
            let mut st = state(1.0);
            st.card_mut("c-1").status = fin;
            for _ in 0..READS {
                let card = st.read_card("c-1", CallKind::CardStatus, false, &mut rng);
                assert_eq!(card.status, fin);
            }
        }
    }

    #[test]
    fn a_status_read_changes_only_the_status_and_a_data_read_only_the_data() {
        let mut st = state(1.0);
        let mut rng = rng();
        let after_status = st.read_card("c-1", CallKind::CardStatus, false, &mut rng);
        assert_eq!(after_status.data, CardData::Pending);
        assert_eq!(after_status.status, CardStatus::Active);
        let after_data = st.read_card("c-1", CallKind::Carddata, false, &mut rng);
        assert_eq!(after_data.status, CardStatus::Active);
        assert_ne!(after_data.data, CardData::Pending);
    }

    #[test]
    fn a_disturbed_read_or_a_card_with_its_own_behaviour_never_changes_the_card() {
        let mut rng = rng();
        let mut st = state(1.0);
        for _ in 0..READS {
            let card = st.read_card("c-1", CallKind::CardStatus, true, &mut rng);
            assert_eq!(card, SimCard::default());
        }
        for behaviour in [
            CardBehaviour::Fail,
            CardBehaviour::Garbage(GarbageKind::BadValue),
        ] {
            st.card_mut("c-2").behaviour = behaviour;
            for call in [CallKind::Carddata, CallKind::CardStatus] {
                let card = st.read_card("c-2", call, false, &mut rng);
                assert_eq!(
                    (card.data, card.status),
                    (CardData::Pending, CardStatus::Inactive)
                );
            }
        }
    }

    #[test]
    fn a_card_patch_changes_only_what_it_names_and_creates_the_card() {
        let mut st = state(0.0);
        let card = st.patch_card(
            "c-9",
            &SimCardPatch {
                status: Some(CardStatus::Frozen),
                ..SimCardPatch::default()
            },
        );
        assert_eq!(
            card,
            SimCard {
                status: CardStatus::Frozen,
                ..SimCard::default()
            }
        );
        let card = st.patch_card(
            "c-9",
            &SimCardPatch {
                behaviour: Some(CardBehaviour::Fail),
                ..SimCardPatch::default()
            },
        );
        assert_eq!(card.status, CardStatus::Frozen);
        assert_eq!(card.behaviour, CardBehaviour::Fail);
    }

    #[test]
    fn the_request_log_keeps_only_the_last_capacity_requests_oldest_first() {
        let mut st = state(0.0);
        for i in 0..REQUEST_LOG_CAPACITY + 5 {
            st.log_request(RequestRecord {
                call: CallKind::CardStatus,
                path: format!("/v1/cards/c-{i}/status"),
                correlation_id: None,
                accept: None,
                idempotency_key: None,
            });
        }
        assert_eq!(st.requests.len(), REQUEST_LOG_CAPACITY);
        assert_eq!(st.requests.front().unwrap().path, "/v1/cards/c-5/status");
        assert_eq!(
            st.requests.back().unwrap().path,
            format!("/v1/cards/c-{}/status", REQUEST_LOG_CAPACITY + 4)
        );
    }

    #[test]
    fn the_same_payment_submitted_twice_stores_one_record_with_two_submissions_and_the_same_answer()
    {
        let mut st = state(0.0);
        let id = Uuid::new_v4();
        let (first, _) = submit(&mut st, id);
        let (second, _) = submit(&mut st, id);
        assert_eq!(first, second);
        assert_eq!(first.status, PaymentStatus::Accepted);
        assert_eq!(first.payment_id, id);
        assert_eq!(st.payments.len(), 1);
        let rec = &st.payments[&id];
        assert_eq!(rec.submissions, 2);
        assert_eq!(rec.idempotency_keys, vec![id.to_string(), id.to_string()]);
        assert_eq!(rec.stored.as_ref(), Some(&first));
    }

    #[test]
    fn a_decided_payment_is_answered_as_decided_whatever_its_behaviour_becomes() {
        let mut st = state(0.0);
        let id = Uuid::new_v4();
        st.set_payment_behaviour(id, PaymentBehaviour::Reject);
        let (first, _) = submit(&mut st, id);
        assert_eq!(first.status, PaymentStatus::Rejected);
        for b in [
            PaymentBehaviour::Accept,
            PaymentBehaviour::Forget,
            PaymentBehaviour::Hang,
        ] {
            st.set_payment_behaviour(id, b);
            assert_eq!(submit(&mut st, id).0, first);
        }
        assert_eq!(st.stored_payment(id), Some(first));
    }

    #[test]
    fn forget_answers_accepted_but_a_later_query_is_not_found() {
        let mut st = state(0.0);
        let id = Uuid::new_v4();
        st.set_payment_behaviour(id, PaymentBehaviour::Forget);
        let (answer, hang) = submit(&mut st, id);
        assert_eq!(answer.status, PaymentStatus::Accepted);
        assert_eq!(hang, None);
        assert_eq!(st.stored_payment(id), None, "a query answers 404");
        assert_eq!(
            st.payments[&id].submissions, 1,
            "but the submission counted"
        );
    }

    #[test]
    fn forget_payment_makes_a_stored_payment_unknown_and_store_payment_makes_it_known() {
        let mut st = state(0.0);
        let id = Uuid::new_v4();
        let (stored, _) = submit(&mut st, id);
        st.forget_payment(id);
        assert_eq!(st.stored_payment(id), None);
        st.store_payment(stored.clone());
        assert_eq!(st.stored_payment(id), Some(stored));
        assert_eq!(st.stored_payment(Uuid::new_v4()), None);
    }

    #[test]
    fn hang_stores_accepted_and_holds_the_answer_for_hang_ms() {
        let mut st = SimState::new(SimConfig {
            payment_mode: PaymentBehaviour::Hang,
            hang_ms: 1234,
            ..SimConfig::default()
        });
        let id = Uuid::new_v4();
        let (answer, hang) = submit(&mut st, id);
        assert_eq!(answer.status, PaymentStatus::Accepted);
        assert_eq!(hang, Some(1234));
        assert_eq!(st.stored_payment(id), Some(answer));
    }

    #[test]
    fn a_payment_behaviour_overrides_the_payment_mode_for_that_payment_only() {
        let mut st = SimState::new(SimConfig {
            payment_mode: PaymentBehaviour::Reject,
            ..SimConfig::default()
        });
        let special = Uuid::new_v4();
        st.set_payment_behaviour(special, PaymentBehaviour::Accept);
        assert_eq!(submit(&mut st, special).0.status, PaymentStatus::Accepted);
        assert_eq!(
            submit(&mut st, Uuid::new_v4()).0.status,
            PaymentStatus::Rejected
        );
    }

    #[test]
    fn a_submission_without_an_idempotency_key_is_recorded_as_an_empty_key() {
        let mut st = state(0.0);
        let id = Uuid::new_v4();
        st.record_submission(id, None);
        assert_eq!(st.payments[&id].idempotency_keys, vec![String::new()]);
    }

    #[test]
    fn the_channel_ref_is_derived_from_the_payment_id() {
        let mut st = state(0.0);
        let id = Uuid::new_v4();
        assert_eq!(
            submit(&mut st, id).0.channel_ref,
            format!("ch_{}", id.simple())
        );
    }
}
