//! [`Simulator`]: the shared state behind the server (one lock for the [`SimState`], one for the
//! [`Counters`]) and the Rust control methods the tests and benches steer it with.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::http::{header, HeaderMap};
use tokio::sync::watch;
use uuid::Uuid;

use super::answer::{self, Disturbance};
use super::approvals::ApprovalRecord;
use super::config::{
    clamp01, CardBehaviour, GarbageKind, PaymentBehaviour, SimConfig, SimConfigPatch,
};
use super::state::{PaymentRecord, RequestRecord, SimCard, SimCardPatch, SimState};
use super::stats::{CardReads, Counters, SimStats};
use cardworker_wire::{
    CallKind, CardData, CardStatus, PaymentResult, CORRELATION_HEADER, IDEMPOTENCY_HEADER,
};

#[derive(Debug)]
struct Inner {
    state: Mutex<SimState>,
    counters: Mutex<Counters>,
    /// Becomes `true` when the server shuts down, cutting every sleep short.
    stopping: watch::Sender<bool>,
}

/// The simulator: shared state plus the axum app. Clones share the same state.
#[derive(Debug, Clone)]
pub struct Simulator {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts one call in flight from creation to drop (and, for a card call, per card).
pub(crate) struct InFlight {
    inner: Arc<Inner>,
    call: CallKind,
    card_ref: Option<String>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut counters = lock(&self.inner.counters);
        counters.exit(self.call);
        if let Some(card_ref) = &self.card_ref {
            counters.exit_card(self.call, card_ref);
        }
    }
}

impl Default for Simulator {
    fn default() -> Self {
        Self::new(SimConfig::default())
    }
}

impl Simulator {
    pub fn new(config: SimConfig) -> Self {
        let (stopping, _) = watch::channel(false);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(SimState::new(config)),
                counters: Mutex::new(Counters::default()),
                stopping,
            }),
        }
    }

    // ----- config -----

    pub fn config(&self) -> SimConfig {
        lock(&self.inner.state).config.clone()
    }

    /// Applies a partial update and returns the new config; refuses rates outside 0..=1.
    pub fn update_config(&self, patch: &SimConfigPatch) -> anyhow::Result<SimConfig> {
        let mut st = lock(&self.inner.state);
        let next = patch.apply(&st.config);
        next.validate()?;
        st.config = next.clone();
        Ok(next)
    }

    pub fn set_latency(&self, latency_ms: u64, jitter_ms: u64) {
        let mut st = lock(&self.inner.state);
        st.config.latency_ms = latency_ms;
        st.config.latency_jitter_ms = jitter_ms;
    }

    /// Sets the 503 rate (clamped to 0..=1).
    pub fn set_error_rate(&self, rate: f64) {
        lock(&self.inner.state).config.error_rate = clamp01(rate);
    }

    /// Sets the bad-body rate (clamped to 0..=1).
    pub fn set_garbage_rate(&self, rate: f64) {
        lock(&self.inner.state).config.garbage_rate = clamp01(rate);
    }

    /// Sets the card change rate (clamped to 0..=1).
    pub fn set_change_rate(&self, rate: f64) {
        lock(&self.inner.state).config.change_rate = clamp01(rate);
    }

    pub fn set_payment_mode(&self, mode: PaymentBehaviour) {
        lock(&self.inner.state).config.payment_mode = mode;
    }

    // ----- cards -----

    /// The card as stored, without creating it.
    pub fn card(&self, card_ref: &str) -> Option<SimCard> {
        lock(&self.inner.state).cards.get(card_ref).cloned()
    }

    fn with_card(&self, card_ref: &str, f: impl FnOnce(&mut SimCard)) {
        f(lock(&self.inner.state).card_mut(card_ref));
    }

    /// Applies a partial update to a card, creating it when needed.
    pub fn patch_card(&self, card_ref: &str, patch: &SimCardPatch) -> SimCard {
        lock(&self.inner.state).patch_card(card_ref, patch)
    }

    pub fn set_card_status(&self, card_ref: &str, status: CardStatus) {
        self.with_card(card_ref, |c| c.status = status);
    }

    pub fn set_card_ready(
        &self,
        card_ref: &str,
        card_token: &str,
        pan_last4: &str,
        expiry_month: u32,
        expiry_year: u32,
    ) {
        let data = CardData::Ready {
            card_token: card_token.to_owned(),
            pan_last4: pan_last4.to_owned(),
            expiry_month,
            expiry_year,
        };
        self.with_card(card_ref, |c| c.data = data);
    }

    pub fn set_card_pending(&self, card_ref: &str) {
        self.with_card(card_ref, |c| c.data = CardData::Pending);
    }

    pub fn set_card_behaviour(&self, card_ref: &str, behaviour: CardBehaviour) {
        self.with_card(card_ref, |c| c.behaviour = behaviour);
    }

    /// This card answers after `latency_ms` instead of the global latency (`None`: the global
    /// latency again).
    pub fn set_card_latency(&self, card_ref: &str, latency_ms: Option<u64>) {
        self.with_card(card_ref, |c| c.latency_ms = latency_ms);
    }

    /// Every call about this card answers 503.
    pub fn fail_card(&self, card_ref: &str) {
        self.set_card_behaviour(card_ref, CardBehaviour::Fail);
    }

    /// Every call about this card answers 200 with a body that is not JSON.
    pub fn garbage_card(&self, card_ref: &str) {
        self.set_card_behaviour(card_ref, CardBehaviour::Garbage(GarbageKind::NotJson));
    }

    /// Back to the global rates for this card.
    pub fn heal_card(&self, card_ref: &str) {
        self.set_card_behaviour(card_ref, CardBehaviour::Normal);
    }

    // ----- payments -----

    pub fn set_payment_behaviour(&self, payment_id: Uuid, behaviour: PaymentBehaviour) {
        lock(&self.inner.state).set_payment_behaviour(payment_id, behaviour);
    }

    /// Makes `GET /v1/payments/{id}` answer 404 from now on.
    pub fn forget_payment(&self, payment_id: Uuid) {
        lock(&self.inner.state).forget_payment(payment_id);
    }

    /// Stores a result as if the payment had been submitted earlier.
    pub fn store_payment(&self, result: PaymentResult) {
        lock(&self.inner.state).store_payment(result);
    }

    pub fn payment_record(&self, payment_id: Uuid) -> Option<PaymentRecord> {
        lock(&self.inner.state).payments.get(&payment_id).cloned()
    }

    /// What the simulator saw of this approval.
    pub fn approval_record(&self, approval_id: Uuid) -> Option<ApprovalRecord> {
        lock(&self.inner.state).approvals.get(&approval_id).cloned()
    }

    /// How many times this payment was submitted.
    pub fn submissions(&self, payment_id: Uuid) -> u64 {
        self.payment_record(payment_id).map_or(0, |p| p.submissions)
    }

    // ----- observation -----

    /// The last [`super::REQUEST_LOG_CAPACITY`] requests, oldest first.
    pub fn recent_requests(&self) -> Vec<RequestRecord> {
        lock(&self.inner.state).requests.iter().cloned().collect()
    }

    /// The correlation ids of the recent requests, oldest first (`None` when absent).
    pub fn correlation_ids(&self) -> Vec<Option<String>> {
        lock(&self.inner.state)
            .requests
            .iter()
            .map(|r| r.correlation_id.clone())
            .collect()
    }

    pub fn stats(&self) -> SimStats {
        lock(&self.inner.counters).snapshot()
    }

    /// Sets every peak to the current in-flight count.
    pub fn reset_peaks(&self) {
        lock(&self.inner.counters).reset_peaks();
    }

    /// Starts recording, from now on, when each card was first read per poll kind and how often
    /// (dropping what an earlier call recorded): the per-card view a bench needs to time a burst.
    /// Off until called, since the record keeps one entry per card and kind.
    pub fn record_card_reads(&self) {
        lock(&self.inner.counters).record_card_reads();
    }

    /// The reads of `call` recorded since [`Simulator::record_card_reads`], by card.
    pub fn card_reads(&self, call: CallKind) -> std::collections::HashMap<String, CardReads> {
        lock(&self.inner.counters).card_reads(call)
    }

    // ----- for the routes -----

    /// Runs `f` on the state under its lock.
    pub(crate) fn with_state<R>(&self, f: impl FnOnce(&mut SimState) -> R) -> R {
        f(&mut lock(&self.inner.state))
    }

    /// Counts one call of `call` in flight until the guard drops.
    pub(crate) fn in_flight(&self, call: CallKind) -> InFlight {
        lock(&self.inner.counters).enter(call);
        InFlight {
            inner: Arc::clone(&self.inner),
            call,
            card_ref: None,
        }
    }

    /// Counts one card call of `call` about `card_ref` in flight until the guard drops.
    pub(crate) fn in_flight_card(&self, call: CallKind, card_ref: &str) -> InFlight {
        let mut counters = lock(&self.inner.counters);
        counters.enter(call);
        counters.enter_card(call, card_ref);
        InFlight {
            inner: Arc::clone(&self.inner),
            call,
            card_ref: Some(card_ref.to_owned()),
        }
    }

    /// Counts an answer that carries `disturbance` (nothing for `None`) in the stats.
    pub(crate) fn count_disturbance(&self, call: CallKind, disturbance: Option<Disturbance>) {
        if let Some(d) = disturbance {
            lock(&self.inner.counters).disturbed(call, d);
        }
    }

    /// Logs one request with the headers the contract names.
    pub(crate) fn record(&self, call: CallKind, path: String, headers: &HeaderMap) {
        let rec = RequestRecord {
            call,
            path,
            correlation_id: header_value(headers, CORRELATION_HEADER),
            accept: header_value(headers, header::ACCEPT.as_str()),
            idempotency_key: header_value(headers, IDEMPOTENCY_HEADER),
        };
        lock(&self.inner.state).log_request(rec);
    }

    /// Sleeps `ms`, or less when the server stops.
    pub(crate) async fn sleep(&self, ms: u64) {
        if ms == 0 {
            return;
        }
        let mut stopping = self.inner.stopping.subscribe();
        if *stopping.borrow() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(ms)) => {}
            _ = stopping.changed() => {}
        }
    }

    /// Latency, then the global error / garbage dice. `None` means answer normally.
    pub(crate) async fn prelude(&self) -> Option<Disturbance> {
        self.prelude_with(None).await
    }

    /// [`Simulator::prelude`] with `latency_ms` (a card's own) instead of the global latency.
    pub(crate) async fn prelude_with(&self, latency_ms: Option<u64>) -> Option<Disturbance> {
        let roll = answer::roll(&self.config(), &mut rand::rng());
        self.sleep(latency_ms.unwrap_or(roll.delay_ms)).await;
        roll.disturbance
    }

    /// The card's own latency, if it has one (without creating the card).
    pub(crate) fn card_latency(&self, card_ref: &str) -> Option<u64> {
        lock(&self.inner.state)
            .cards
            .get(card_ref)
            .and_then(|c| c.latency_ms)
    }

    /// Cuts every pending and future sleep short (the server is shutting down).
    pub(crate) fn stop_sleeping(&self) {
        self.inner.stopping.send_replace(true);
    }
}

/// One `POST` being processed under its `Idempotency-Key`, from [`Simulator::begin_post`] to
/// drop.
pub(crate) struct PostInProgress {
    inner: Arc<Inner>,
    key: String,
}

impl Drop for PostInProgress {
    fn drop(&mut self) {
        let mut state = lock(&self.inner.state);
        if let Some(n) = state.posts_in_progress.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                state.posts_in_progress.remove(&self.key);
            }
        }
    }
}

impl Simulator {
    /// A `POST` with `key` begins. `None` when another `POST` with the same key is still being
    /// processed and `conflict_concurrent_posts` is on: it is then answered 409 without acting.
    pub(crate) fn begin_post(&self, key: &str) -> Option<PostInProgress> {
        let mut state = lock(&self.inner.state);
        let busy = state.posts_in_progress.contains_key(key);
        if busy && state.config.conflict_concurrent_posts {
            return None;
        }
        *state.posts_in_progress.entry(key.to_owned()).or_default() += 1;
        Some(PostInProgress {
            inner: self.inner.clone(),
            key: key.to_owned(),
        })
    }
}

/// A header as text (lossy), `None` when absent.
pub(crate) fn header_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setters_clamp_rates_into_zero_to_one() {
        let sim = Simulator::default();
        sim.set_error_rate(2.0);
        sim.set_garbage_rate(-1.0);
        sim.set_change_rate(f64::NAN);
        let c = sim.config();
        assert_eq!(
            (c.error_rate, c.garbage_rate, c.change_rate),
            (1.0, 0.0, 0.0)
        );
    }

    #[test]
    fn an_out_of_range_config_patch_is_refused_and_changes_nothing() {
        let sim = Simulator::default();
        let before = sim.config();
        let patch = SimConfigPatch {
            latency_ms: Some(1),
            change_rate: Some(1.5),
            ..SimConfigPatch::default()
        };
        let err = sim.update_config(&patch).unwrap_err();
        assert!(err.to_string().contains("change_rate"), "{err}");
        assert_eq!(sim.config(), before);

        let ok = SimConfigPatch {
            latency_ms: Some(1),
            ..SimConfigPatch::default()
        };
        assert_eq!(sim.update_config(&ok).unwrap().latency_ms, 1);
        assert_eq!(sim.config().latency_ms, 1);
    }

    #[test]
    fn an_in_flight_guard_counts_until_it_drops_and_the_peak_stays() {
        let sim = Simulator::default();
        let a = sim.in_flight(CallKind::Carddata);
        let b = sim.in_flight(CallKind::Carddata);
        assert_eq!(sim.stats().in_flight, 2);
        drop((a, b));
        let s = sim.stats();
        assert_eq!(s.in_flight, 0);
        assert_eq!(s.peak_in_flight, 2);
        sim.reset_peaks();
        assert_eq!(sim.stats().peak_in_flight, 0);
    }

    #[test]
    fn clones_share_one_state() {
        let sim = Simulator::default();
        let other = sim.clone();
        other.set_card_status("c-1", CardStatus::Frozen);
        assert_eq!(sim.card("c-1").unwrap().status, CardStatus::Frozen);
        assert_eq!(sim.card("c-2"), None, "card() does not create");
    }

    #[test]
    fn a_request_is_logged_with_its_correlation_accept_and_idempotency_headers() {
        let sim = Simulator::default();
        let mut headers = HeaderMap::new();
        headers.insert(CORRELATION_HEADER, "corr-1".parse().unwrap());
        headers.insert(header::ACCEPT, "application/json".parse().unwrap());
        sim.record(CallKind::PaymentSubmit, "/v1/payments".into(), &headers);
        sim.record(
            CallKind::CardStatus,
            "/v1/cards/c-1/status".into(),
            &HeaderMap::new(),
        );
        let log = sim.recent_requests();
        assert_eq!(log.len(), 2);
        assert_eq!(log[0].correlation_id.as_deref(), Some("corr-1"));
        assert_eq!(log[0].accept.as_deref(), Some("application/json"));
        assert_eq!(log[0].idempotency_key, None);
        assert_eq!(sim.correlation_ids(), vec![Some("corr-1".to_owned()), None]);
    }

    #[tokio::test]
    async fn a_sleep_ends_at_once_when_the_simulator_stops() {
        let sim = Simulator::default();
        let sleeper = tokio::spawn({
            let sim = sim.clone();
            async move { sim.sleep(60_000).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        sim.stop_sleeping();
        tokio::time::timeout(Duration::from_secs(5), sleeper)
            .await
            .expect("the sleep was cut short")
            .unwrap();
        // And later sleeps do not wait at all.
        tokio::time::timeout(Duration::from_secs(1), sim.sleep(60_000))
            .await
            .expect("no sleep after stop");
    }
}
