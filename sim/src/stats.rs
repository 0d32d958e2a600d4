//! In-flight accounting: how many Gateway calls are being served now, the peaks since the last
//! reset and the totals, overall and per call kind. Load tests read [`SimStats`] to prove that
//! concurrency limits held.
//!
//! It also counts the trouble the simulator made on purpose (503s and bad 2xx bodies, from the
//! global rates or a card's or payment's own behaviour), so that a user can hold them against
//! the worker's `cardworker_poll_outcomes_total{outcome="persisted_failure"}`: every injected
//! error or garbage answer to a poll is one failed or unknown poll on the worker's side.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::answer::Disturbance;
use cardworker_wire::CallKind;

/// In-flight accounting (`GET /sim/stats`). Keys are call kinds (`carddata`, `card_status`,
/// `payment_submit`, `payment_query`, `approval_submit`, `approval_query`); a kind appears once it
/// was called (or disturbed).
///
/// What a checker holds against the worker's budget (peaks since start or the last
/// `POST /sim/stats/reset-peaks`):
/// - `peak_in_flight_polls` <= `polling.total_limit` (card reads only: payments and approvals are
///   not polls and hold no polling token);
/// - `peak_per_call["carddata"]` <= `polling.carddata.limit`, `peak_per_call["card_status"]` <=
///   `polling.card_status.limit` (the effective limits: an override counts);
/// - `peak_same_card` <= 1, and `peak_same_card_per_call[kind]` <= 1 for each poll kind: no card
///   is ever polled twice at once by one task (a card's data and status polls may overlap).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SimStats {
    /// Gateway calls being served now.
    pub in_flight: u64,
    /// The most calls served at once since start or the last peak reset.
    pub peak_in_flight: u64,
    /// Calls being served now, per call kind.
    pub in_flight_per_call: HashMap<String, u64>,
    /// The peak per call kind.
    pub peak_per_call: HashMap<String, u64>,
    /// Every call received, per call kind.
    pub calls_total: HashMap<String, u64>,
    /// Calls answered with a simulated outage (503) on purpose, per call kind: the global
    /// `error_rate`, a failing card, a payment set to `server_error`.
    pub injected_errors_total: HashMap<String, u64>,
    /// Calls answered 200 with a bad body on purpose (not JSON, a missing field, another
    /// reference, a value outside the lists), per call kind: `garbage_rate` or a garbage card.
    pub garbage_answers_total: HashMap<String, u64>,
    /// The most calls of one kind about one card ever in flight at once (2 or more: that card
    /// was polled twice at once).
    #[serde(default)]
    pub peak_same_card: u64,
    /// [`SimStats::peak_same_card`] per call kind.
    #[serde(default)]
    pub peak_same_card_per_call: HashMap<String, u64>,
    /// Card reads (`carddata` and `card_status` together) being served now: the polls the
    /// worker's total budget covers.
    #[serde(default)]
    pub in_flight_polls: u64,
    /// The peak of [`SimStats::in_flight_polls`].
    #[serde(default)]
    pub peak_in_flight_polls: u64,
    /// Calls being served now per card, then per call kind (cards with none are left out).
    #[serde(default)]
    pub in_flight_per_card: BTreeMap<String, HashMap<String, u64>>,
}

/// One card's reads of one poll kind since the record started ([`Simulator::record_card_reads`]).
///
/// [`Simulator::record_card_reads`]: super::Simulator::record_card_reads
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CardReads {
    /// When the first read arrived (before any simulated latency).
    pub first: Instant,
    /// How many reads arrived.
    pub count: u64,
}

/// The counters behind [`SimStats`], keyed by [`CallKind`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    in_flight: u64,
    peak_in_flight: u64,
    per_call: HashMap<CallKind, u64>,
    peak_per_call: HashMap<CallKind, u64>,
    calls_total: HashMap<CallKind, u64>,
    injected_errors: HashMap<CallKind, u64>,
    garbage_answers: HashMap<CallKind, u64>,
    /// Calls in flight per (call kind, card).
    per_card: HashMap<(CallKind, String), u64>,
    peak_same_card: u64,
    peak_same_card_per_call: HashMap<CallKind, u64>,
    /// Card reads in flight now, and their peak.
    polls: u64,
    peak_polls: u64,
    /// Every card's reads per poll kind while recording (`None`: not recording, so that a
    /// long-running simulator keeps no entry per card and kind).
    card_reads: Option<HashMap<(CallKind, String), CardReads>>,
}

impl Counters {
    /// One call of `call` starts being served.
    pub(crate) fn enter(&mut self, call: CallKind) {
        self.in_flight += 1;
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        let now = {
            let n = self.per_call.entry(call).or_insert(0);
            *n += 1;
            *n
        };
        let peak = self.peak_per_call.entry(call).or_insert(0);
        *peak = (*peak).max(now);
        *self.calls_total.entry(call).or_insert(0) += 1;
    }

    /// One call of `call` is done (never below zero).
    pub(crate) fn exit(&mut self, call: CallKind) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(n) = self.per_call.get_mut(&call) {
            *n = n.saturating_sub(1);
        }
    }

    /// One call of `call` was answered with `disturbance` (an outage or a bad body) on purpose.
    pub(crate) fn disturbed(&mut self, call: CallKind, disturbance: Disturbance) {
        let counter = match disturbance {
            Disturbance::Error => &mut self.injected_errors,
            Disturbance::Garbage(_) => &mut self.garbage_answers,
        };
        *counter.entry(call).or_insert(0) += 1;
    }

    /// One call of `call` about `card_ref` starts (on top of [`Counters::enter`]).
    pub(crate) fn enter_card(&mut self, call: CallKind, card_ref: &str) {
        let n = self
            .per_card
            .entry((call, card_ref.to_owned()))
            .or_insert(0);
        *n += 1;
        let n = *n;
        self.peak_same_card = self.peak_same_card.max(n);
        let peak = self.peak_same_card_per_call.entry(call).or_insert(0);
        *peak = (*peak).max(n);
        if matches!(call, CallKind::Carddata | CallKind::CardStatus) {
            self.polls += 1;
            self.peak_polls = self.peak_polls.max(self.polls);
            if let Some(reads) = &mut self.card_reads {
                reads
                    .entry((call, card_ref.to_owned()))
                    .or_insert(CardReads {
                        first: Instant::now(),
                        count: 0,
                    })
                    .count += 1;
            }
        }
    }

    /// Starts recording every card's reads afresh (what was recorded before is dropped).
    pub(crate) fn record_card_reads(&mut self) {
        self.card_reads = Some(HashMap::new());
    }

    /// The recorded reads of `call`, by card (empty when not recording).
    pub(crate) fn card_reads(&self, call: CallKind) -> HashMap<String, CardReads> {
        self.card_reads
            .iter()
            .flatten()
            .filter(|((kind, _), _)| *kind == call)
            .map(|((_, card), reads)| (card.clone(), *reads))
            .collect()
    }

    /// One call of `call` about `card_ref` is done.
    pub(crate) fn exit_card(&mut self, call: CallKind, card_ref: &str) {
        let key = (call, card_ref.to_owned());
        if let Some(n) = self.per_card.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_card.remove(&key);
            }
            if matches!(call, CallKind::Carddata | CallKind::CardStatus) {
                self.polls = self.polls.saturating_sub(1);
            }
        }
    }

    /// Sets every peak to the current in-flight count.
    pub(crate) fn reset_peaks(&mut self) {
        self.peak_in_flight = self.in_flight;
        self.peak_per_call = self.per_call.clone();
        self.peak_same_card = self.per_card.values().copied().max().unwrap_or(0);
        self.peak_same_card_per_call.clear();
        for ((call, _), n) in &self.per_card {
            let peak = self.peak_same_card_per_call.entry(*call).or_insert(0);
            *peak = (*peak).max(*n);
        }
        self.peak_polls = self.polls;
    }

    pub(crate) fn snapshot(&self) -> SimStats {
        let named = |m: &HashMap<CallKind, u64>| {
            m.iter()
                .map(|(k, v)| (k.as_str().to_owned(), *v))
                .collect::<HashMap<_, _>>()
        };
        SimStats {
            in_flight: self.in_flight,
            peak_in_flight: self.peak_in_flight,
            in_flight_per_call: named(&self.per_call),
            peak_per_call: named(&self.peak_per_call),
            calls_total: named(&self.calls_total),
            injected_errors_total: named(&self.injected_errors),
            garbage_answers_total: named(&self.garbage_answers),
            peak_same_card: self.peak_same_card,
            peak_same_card_per_call: named(&self.peak_same_card_per_call),
            in_flight_polls: self.polls,
            peak_in_flight_polls: self.peak_polls,
            in_flight_per_card: {
                let mut cards: BTreeMap<String, HashMap<String, u64>> = BTreeMap::new();
                for ((call, card), n) in &self.per_card {
                    cards
                        .entry(card.clone())
                        .or_default()
                        .insert(call.as_str().to_owned(), *n);
                }
                cards
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(m: &HashMap<String, u64>, call: CallKind) -> u64 {
        m.get(call.as_str()).copied().unwrap_or(0)
    }

    #[test]
    fn the_same_card_peak_counts_concurrent_calls_about_one_card_only() {
        let mut c = Counters::default();
        c.enter_card(CallKind::CardStatus, "c-1");
        c.enter_card(CallKind::CardStatus, "c-2");
        c.enter_card(CallKind::Carddata, "c-1");
        assert_eq!(c.snapshot().peak_same_card, 1);
        c.enter_card(CallKind::CardStatus, "c-1");
        assert_eq!(c.snapshot().peak_same_card, 2);
        c.exit_card(CallKind::CardStatus, "c-1");
        c.exit_card(CallKind::CardStatus, "c-1");
        c.reset_peaks();
        assert_eq!(c.snapshot().peak_same_card, 1);
    }

    #[test]
    fn poll_peaks_count_card_reads_per_card_and_per_kind_and_leave_payments_out() {
        let mut c = Counters::default();
        c.enter_card(CallKind::Carddata, "c-1");
        c.enter_card(CallKind::CardStatus, "c-1");
        c.enter_card(CallKind::CardStatus, "c-2");
        c.enter_card(CallKind::CardStatus, "c-2");
        c.enter(CallKind::PaymentSubmit);
        let s = c.snapshot();
        assert_eq!(s.in_flight_polls, 4);
        assert_eq!(s.peak_in_flight_polls, 4);
        assert_eq!(get(&s.peak_same_card_per_call, CallKind::CardStatus), 2);
        assert_eq!(get(&s.peak_same_card_per_call, CallKind::Carddata), 1);
        assert_eq!(get(&s.in_flight_per_card["c-1"], CallKind::Carddata), 1);
        assert_eq!(get(&s.in_flight_per_card["c-2"], CallKind::CardStatus), 2);
        c.exit_card(CallKind::CardStatus, "c-2");
        c.exit_card(CallKind::CardStatus, "c-2");
        c.exit_card(CallKind::Carddata, "c-1");
        c.reset_peaks();
        let s = c.snapshot();
        assert_eq!(s.in_flight_polls, 1);
        assert_eq!(s.peak_in_flight_polls, 1);
        assert_eq!(get(&s.peak_same_card_per_call, CallKind::CardStatus), 1);
        assert_eq!(get(&s.peak_same_card_per_call, CallKind::Carddata), 0);
        assert!(!s.in_flight_per_card.contains_key("c-2"));
    }

    #[test]
    fn card_reads_are_recorded_per_kind_and_card_only_once_started() {
        let mut c = Counters::default();
        c.enter_card(CallKind::Carddata, "c-0");
        assert!(c.card_reads(CallKind::Carddata).is_empty());
        c.record_card_reads();
        c.enter_card(CallKind::Carddata, "c-1");
        c.enter_card(CallKind::CardStatus, "c-1");
        c.enter_card(CallKind::Carddata, "c-1");
        c.enter_card(CallKind::PaymentQuery, "c-1");
        let data = c.card_reads(CallKind::Carddata);
        assert_eq!(data.len(), 1);
        assert_eq!(data["c-1"].count, 2);
        let status = c.card_reads(CallKind::CardStatus);
        assert_eq!(status["c-1"].count, 1);
        assert!(data["c-1"].first <= status["c-1"].first);
        assert!(c.card_reads(CallKind::PaymentQuery).is_empty());
        c.record_card_reads();
        assert!(c.card_reads(CallKind::Carddata).is_empty());
    }

    #[test]
    fn peaks_remember_the_highest_in_flight_after_the_calls_finish() {
        let mut c = Counters::default();
        for _ in 0..3 {
            c.enter(CallKind::Carddata);
        }
        c.enter(CallKind::CardStatus);
        c.enter(CallKind::CardStatus);
        for _ in 0..3 {
            c.exit(CallKind::Carddata);
        }
        c.exit(CallKind::CardStatus);
        c.enter(CallKind::Carddata);

        let s = c.snapshot();
        assert_eq!(s.in_flight, 2);
        assert_eq!(s.peak_in_flight, 5);
        assert_eq!(get(&s.in_flight_per_call, CallKind::Carddata), 1);
        assert_eq!(get(&s.in_flight_per_call, CallKind::CardStatus), 1);
        assert_eq!(get(&s.peak_per_call, CallKind::Carddata), 3);
        assert_eq!(get(&s.peak_per_call, CallKind::CardStatus), 2);
    }

    #[test]
    fn totals_count_every_call_and_never_go_down() {
        let mut c = Counters::default();
        for _ in 0..4 {
            c.enter(CallKind::PaymentSubmit);
            c.exit(CallKind::PaymentSubmit);
        }
        c.enter(CallKind::PaymentQuery);
        c.reset_peaks();
        let s = c.snapshot();
        assert_eq!(get(&s.calls_total, CallKind::PaymentSubmit), 4);
        assert_eq!(get(&s.calls_total, CallKind::PaymentQuery), 1);
        assert_eq!(get(&s.in_flight_per_call, CallKind::PaymentSubmit), 0);
    }

    #[test]
    fn reset_peaks_lowers_every_peak_to_what_is_in_flight_now() {
        let mut c = Counters::default();
        for _ in 0..4 {
            c.enter(CallKind::Carddata);
        }
        c.enter(CallKind::CardStatus);
        for _ in 0..3 {
            c.exit(CallKind::Carddata);
        }
        c.exit(CallKind::CardStatus);
        c.reset_peaks();
        let s = c.snapshot();
        assert_eq!(s.peak_in_flight, 1);
        assert_eq!(get(&s.peak_per_call, CallKind::Carddata), 1);
        assert_eq!(get(&s.peak_per_call, CallKind::CardStatus), 0);

        // New peaks grow again from there.
        c.enter(CallKind::Carddata);
        assert_eq!(c.snapshot().peak_in_flight, 2);
        assert_eq!(get(&c.snapshot().peak_per_call, CallKind::Carddata), 2);
    }

    #[test]
    fn an_exit_without_an_enter_never_goes_below_zero() {
        let mut c = Counters::default();
        c.exit(CallKind::Carddata);
        c.enter(CallKind::CardStatus);
        c.exit(CallKind::CardStatus);
        c.exit(CallKind::CardStatus);
        let s = c.snapshot();
        assert_eq!(s.in_flight, 0);
        assert_eq!(get(&s.in_flight_per_call, CallKind::CardStatus), 0);
    }

    #[test]
    fn injected_errors_and_garbage_answers_are_counted_apart_per_call_kind() {
        use crate::config::GarbageKind;
        let mut c = Counters::default();
        c.disturbed(CallKind::Carddata, Disturbance::Error);
        c.disturbed(CallKind::Carddata, Disturbance::Error);
        c.disturbed(
            CallKind::Carddata,
            Disturbance::Garbage(GarbageKind::NotJson),
        );
        c.disturbed(
            CallKind::CardStatus,
            Disturbance::Garbage(GarbageKind::BadValue),
        );
        c.disturbed(CallKind::PaymentSubmit, Disturbance::Error);
        let s = c.snapshot();
        assert_eq!(get(&s.injected_errors_total, CallKind::Carddata), 2);
        assert_eq!(get(&s.garbage_answers_total, CallKind::Carddata), 1);
        assert_eq!(get(&s.injected_errors_total, CallKind::CardStatus), 0);
        assert_eq!(get(&s.garbage_answers_total, CallKind::CardStatus), 1);
        assert_eq!(get(&s.injected_errors_total, CallKind::PaymentSubmit), 1);
        // Disturbances are not calls: the call counters are the routes' business.
        assert!(s.calls_total.is_empty());
    }

    #[test]
    fn stats_are_keyed_by_the_metric_names_of_the_call_kinds() {
        let mut c = Counters::default();
        for call in CallKind::ALL {
            c.enter(call);
        }
        let s = c.snapshot();
        let mut names: Vec<&str> = s.calls_total.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "approval_query",
                "approval_submit",
                "card_status",
                "carddata",
                "payment_query",
                "payment_submit"
            ]
        );
    }
}
