//! The fleet-wide Gateway circuit breaker of each polling task, kept in Redis next to the budget.
//!
//! Why here: a poll is admitted by one script call that takes its two tokens, and an open
//! circuit is one more reason not to admit it. Folding the breaker into that call (its Lua,
//! `circuit.lua`, is prepended to `budget.lua`) keeps it atomic across the fleet and free of
//! extra round trips: the check rides on the acquire, and the poll's outcome rides on the
//! lease release ([`super::Budget::finish`]). A healthy fleet pays one `HMGET` inside each of the
//! two calls; see docs/DESIGN.md for the whole cost.
//!
//! States: **closed** (calls flow; outcomes are counted in a window shared by the fleet),
//! **open** (no Gateway call: polls are deferred, nothing is written to PostgreSQL),
//! **half-open** (after the cool-down, `polling.circuit.half_open_probes` polls go through as
//! probes: a success closes the circuit, a failure opens it again with twice the cool-down, up to
//! `max_cooldown_secs`). An operator may force it open (it then stays open, without probes, until
//! forced closed) or closed ([`super::Budget::force_circuit`]).
//!
//! This module knows circuits only: what a transition means for polling (the audit events, the
//! warn logs) is `polling::circuit`.

use chrono::{DateTime, TimeZone as _, Utc};
use serde::Serialize;

use crate::config::{CircuitConfig, Task};
use crate::telemetry::metrics as m;

/// The Lua functions of the breaker, prepended to the budget's script.
pub(super) const LUA: &str = include_str!("circuit.lua");

/// The `reason` label of `cardworker_poll_deferred_total` for a poll deferred by an open circuit.
pub const CIRCUIT_OPEN_REASON: &str = "gateway_circuit_open";

/// Every `to` label of `cardworker_gateway_circuit_transitions_total`.
pub const TRANSITION_LABELS: [&str; 3] = ["open", "half_open", "closed"];

/// The circuit's key names, which [`crate::keys`] owns.
pub use crate::keys::{circuit_key, window_key};

/// `[polling.circuit]` as the script reads it (one packed argument).
pub(super) fn packed(c: &CircuitConfig) -> String {
    format!(
        "{},{},{},{},{},{},{},{},{}",
        u8::from(c.enabled),
        c.window_calls,
        c.window_secs.saturating_mul(1000),
        c.min_calls,
        c.min_failing_cards,
        c.failure_percent,
        c.cooldown_secs.saturating_mul(1000),
        c.max_cooldown_secs.saturating_mul(1000),
        c.half_open_probes
    )
}

/// What one poll told the circuit about the Gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallReport {
    /// A valid answer (changed or not).
    Ok,
    /// Failed, unknown or timed out: it counts against the Gateway.
    Failed,
    /// No Gateway call was made (stale job, parked card, cut off before the call).
    NoCall,
}

impl CallReport {
    /// As the script reads it.
    pub(super) fn lua(self) -> &'static str {
        match self {
            CallReport::Ok => "ok",
            CallReport::Failed => "fail",
            CallReport::NoCall => "none",
        }
    }
}

/// A change of a circuit's state, seen by exactly one process (the script call that made it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Closed -> open: the Gateway failed broadly. The window when it opened.
    Opened {
        /// Outcomes that counted.
        calls: u64,
        /// Of which failed.
        failures: u64,
    },
    /// Open -> half-open: the cool-down ended; probes go through.
    HalfOpen,
    /// Half-open -> open: a probe failed.
    Reopened {
        /// The new cool-down.
        cooldown_ms: u64,
    },
    /// Half-open -> closed: a probe succeeded; the outage is over.
    Closed {
        /// How long the circuit was not closed.
        duration_ms: u64,
        /// Probe rounds that failed during the outage.
        reopens: u64,
        /// The window when it opened: outcomes that counted.
        open_calls: u64,
        /// Of which failed.
        open_failures: u64,
    },
}

impl Transition {
    /// The `to` label of `cardworker_gateway_circuit_transitions_total`.
    pub fn to(self) -> &'static str {
        match self {
            Transition::Opened { .. } | Transition::Reopened { .. } => "open",
            Transition::HalfOpen => "half_open",
            Transition::Closed { .. } => "closed",
        }
    }

    /// Counts it (once, by the process whose call made it).
    pub(super) fn count(self, task: Task) {
        metrics::counter!(m::GATEWAY_CIRCUIT_TRANSITIONS, "task" => task.label(), "to" => self.to())
            .increment(1);
    }

    /// Parses a transition as the script answers it (`name`, then its numbers).
    pub(super) fn parse(name: &str, n: &[u64]) -> Option<Transition> {
        let at = |i: usize| n.get(i).copied().unwrap_or(0);
        match name {
            "opened" => Some(Transition::Opened {
                calls: at(0),
                failures: at(1),
            }),
            "half_open" => Some(Transition::HalfOpen),
            "reopened" => Some(Transition::Reopened { cooldown_ms: at(0) }),
            "closed" => Some(Transition::Closed {
                duration_ms: at(0),
                reopens: at(1),
                open_calls: at(2),
                open_failures: at(3),
            }),
            _ => None,
        }
    }
}

/// The state of one circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CircuitState {
    /// Calls flow.
    Closed,
    /// No calls until the cool-down ends (or, when forced, until an operator closes it).
    Open,
    /// Probes go through.
    HalfOpen,
}

impl CircuitState {
    /// As shown and stored.
    pub fn label(self) -> &'static str {
        match self {
            CircuitState::Closed => "closed",
            CircuitState::Open => "open",
            CircuitState::HalfOpen => "half_open",
        }
    }

    pub(super) fn parse(raw: &str) -> CircuitState {
        match raw {
            "open" => CircuitState::Open,
            "half_open" => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }
}

/// One entry of a circuit's window list: `f<ms>:<card_ref>` (a failed call about that card) or
/// `s<ms>` (a valid answer), `ms` on the Redis clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowEntry {
    /// A failed call.
    pub failed: bool,
    /// When it was counted (unix ms, Redis clock).
    pub at_ms: i64,
}

/// A window entry that is not `f<ms>:<card_ref>` or `s<ms>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a circuit window entry: {0:?}")]
pub struct BadWindowEntry(pub String);

impl WindowEntry {
    /// Parses a stored entry; anything else (an unknown kind, a multi-byte first character, a
    /// time that is not an integer) is an error, never a panic.
    pub fn parse(raw: &str) -> Result<Self, BadWindowEntry> {
        let bad = || BadWindowEntry(raw.chars().take(64).collect());
        let (failed, rest) = if let Some(rest) = raw.strip_prefix('f') {
            (true, rest)
        } else if let Some(rest) = raw.strip_prefix('s') {
            (false, rest)
        } else {
            return Err(bad());
        };
        let ts = rest.split(':').next().unwrap_or_default();
        let at_ms = ts.parse::<i64>().map_err(|_| bad())?;
        Ok(Self { failed, at_ms })
    }
}

/// The outcomes that count right now (younger than `polling.circuit.window_secs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WindowView {
    /// Outcomes in the window that count.
    pub calls: u64,
    /// Of which failed.
    pub failures: u64,
}

/// One task's circuit, as `budget show` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CircuitView {
    /// `closed`, `open` or `half_open`.
    pub state: CircuitState,
    /// Forced open by an operator (`cardworker circuit open`).
    pub forced: bool,
    /// When the outage began (open or half-open), on the Redis clock.
    pub since: Option<DateTime<Utc>>,
    /// When an open circuit lets probes through (not set when forced).
    pub probes_from: Option<DateTime<Utc>>,
    /// The current cool-down in seconds (open or half-open).
    pub cooldown_secs: Option<u64>,
    /// Failed probe rounds in this outage.
    pub reopens: u64,
    /// The window now. While closed and healthy it holds only old successes.
    pub window: WindowView,
}

impl CircuitView {
    /// 1 when open or half-open, 0 when closed (`cardworker_gateway_circuit_open`).
    pub fn gauge(&self) -> f64 {
        if self.state == CircuitState::Closed {
            0.0
        } else {
            1.0
        }
    }

    /// Reads a circuit from its hash (flat field/value list), its window entries and Redis's
    /// `now` (ms), counting the window entries younger than `window_ms`.
    pub(super) fn from_raw(
        flat: &[String],
        window: &[String],
        now_ms: i64,
        window_ms: i64,
    ) -> Self {
        let field = |name: &str| {
            flat.chunks_exact(2)
                .find(|kv| kv[0] == name)
                .map(|kv| kv[1].as_str())
        };
        let num = |name: &str| field(name).and_then(|v| v.parse::<i64>().ok());
        let at = |ms: Option<i64>| ms.and_then(|ms| Utc.timestamp_millis_opt(ms).single());
        let state = CircuitState::parse(field("state").unwrap_or("closed"));
        let forced = field("forced") == Some("1");
        let open = state != CircuitState::Closed;
        let mut view = WindowView::default();
        for e in window {
            // An entry that does not parse (written by hand, or by a release that wrote another
            // form) counts as nothing: one bad entry never breaks a scrape or `budget show`.
            let Ok(entry) = WindowEntry::parse(e) else {
                continue;
            };
            if entry.at_ms >= now_ms.saturating_sub(window_ms) {
                view.calls += 1;
                if entry.failed {
                    view.failures += 1;
                }
            }
        }
        CircuitView {
            state,
            forced,
            since: if open { at(num("since")) } else { None },
            probes_from: if state == CircuitState::Open && !forced {
                at(num("until"))
            } else {
                None
            },
            cooldown_secs: if open && !forced {
                num("cooldown").map(|ms| u64::try_from(ms / 1000).unwrap_or(0))
            } else {
                None
            },
            reopens: num("reopens")
                .and_then(|n| u64::try_from(n).ok())
                .unwrap_or(0),
            window: view,
        }
    }
}

/// What forcing a circuit found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Forced {
    /// The state before.
    pub before: CircuitState,
    /// Whether it had been forced open before.
    pub was_forced: bool,
    /// How long the outage had lasted (0 when it was closed).
    pub outage_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arbitrary text, as Redis could hold it (bytes made text the way a reader would see them):
    /// multi-byte characters, separators, digits and garbage, from a seeded generator.
    fn arbitrary(rng: &mut rand::rngs::StdRng) -> String {
        use rand::Rng as _;
        let len = rng.random_range(0..24);
        let mut bytes: Vec<u8> = Vec::with_capacity(len * 2);
        for _ in 0..len {
            match rng.random_range(0..6) {
                0 => bytes.extend_from_slice("é".as_bytes()),
                1 => bytes.extend_from_slice("🦀".as_bytes()),
                2 => bytes.push(
                    *b"fs:|.-0123456789"
                        .get(rng.random_range(0..16))
                        .unwrap_or(&b'f'),
                ),
                _ => bytes.push(rng.random()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[test]
    fn no_window_entry_or_circuit_field_panics_the_reader_whatever_redis_holds() {
        use rand::SeedableRng as _;
        let mut rng = rand::rngs::StdRng::seed_from_u64(29);
        for _ in 0..20_000 {
            let raw = arbitrary(&mut rng);
            let _ = WindowEntry::parse(&raw);
            let flat = vec![
                "state".to_owned(),
                arbitrary(&mut rng),
                "since".to_owned(),
                arbitrary(&mut rng),
                "cooldown".to_owned(),
                arbitrary(&mut rng),
                arbitrary(&mut rng),
            ];
            let window = vec![raw, arbitrary(&mut rng)];
            let _ = CircuitView::from_raw(&flat, &window, i64::MIN, i64::MAX);
            let _ = CircuitView::from_raw(&flat, &window, 0, 60_000);
            let _ = CircuitState::parse(&arbitrary(&mut rng));
            let _ = Transition::parse(&arbitrary(&mut rng), &[u64::MAX, 0]);
        }
    }

    #[test]
    fn a_window_entry_is_a_failure_or_a_success_with_its_time_and_nothing_else() {
        assert_eq!(
            WindowEntry::parse("f1700000000000:c-1"),
            Ok(WindowEntry {
                failed: true,
                at_ms: 1_700_000_000_000
            })
        );
        assert_eq!(
            WindowEntry::parse("s5"),
            Ok(WindowEntry {
                failed: false,
                at_ms: 5
            })
        );
        for bad in ["", "é5", "🦀", "x5", "f", "sabc", "f:c-1"] {
            assert!(WindowEntry::parse(bad).is_err(), "{bad:?}");
        }
        // A bad entry counts as nothing in the view.
        let view = CircuitView::from_raw(&[], &strings(&["é1", "f10:c-1", "s10"]), 10, 5);
        assert_eq!(
            view.window,
            WindowView {
                calls: 2,
                failures: 1
            }
        );
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_packed_config_is_in_the_order_the_script_reads() {
        assert_eq!(
            packed(&CircuitConfig::default()),
            "1,20,60000,10,3,50,10000,120000,2"
        );
        let off = CircuitConfig {
            enabled: false,
            ..CircuitConfig::default()
        };
        assert!(packed(&off).starts_with("0,"));
    }

    #[test]
    fn transitions_parse_from_the_script_answer_and_name_their_target_state() {
        assert_eq!(
            Transition::parse("opened", &[24, 20]),
            Some(Transition::Opened {
                calls: 24,
                failures: 20
            })
        );
        assert_eq!(
            Transition::parse("closed", &[61_000, 2, 24, 20]).map(Transition::to),
            Some("closed")
        );
        assert_eq!(
            Transition::parse("reopened", &[20_000]).map(Transition::to),
            Some("open")
        );
        assert_eq!(
            Transition::parse("half_open", &[]),
            Some(Transition::HalfOpen)
        );
        assert_eq!(Transition::parse("", &[]), None);
    }

    #[test]
    fn a_view_counts_only_the_window_entries_younger_than_the_window() {
        let flat = strings(&[
            "state", "open", "since", "1000", "until", "11000", "cooldown", "10000", "reopens",
            "1", "fails", "3",
        ]);
        let window = strings(&["f9000:c-1", "f8500:c-2", "s8000", "f100:c-1"]);
        let v = CircuitView::from_raw(&flat, &window, 9_500, 5_000);
        assert_eq!(v.state, CircuitState::Open);
        assert_eq!(
            v.window,
            WindowView {
                calls: 3,
                failures: 2
            }
        );
        assert_eq!(v.cooldown_secs, Some(10));
        assert_eq!(v.reopens, 1);
        assert_eq!(v.probes_from.map(|t| t.timestamp_millis()), Some(11_000));
        assert_eq!(v.gauge(), 1.0);
    }

    #[test]
    fn an_absent_circuit_is_closed_with_an_empty_window() {
        let v = CircuitView::from_raw(&[], &[], 1, 1000);
        assert_eq!(v.state, CircuitState::Closed);
        assert_eq!(v.since, None);
        assert_eq!(v.gauge(), 0.0);
        assert_eq!(v.window, WindowView::default());
    }

    #[test]
    fn a_forced_circuit_shows_no_probe_time_nor_cool_down() {
        let flat = strings(&["state", "open", "forced", "1", "since", "5", "until", "0"]);
        let v = CircuitView::from_raw(&flat, &[], 10, 1000);
        assert!(v.forced);
        assert_eq!(v.probes_from, None);
        assert_eq!(v.cooldown_secs, None);
    }
}
