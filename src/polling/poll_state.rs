//! A card's poll state as the due queue keeps it beside its due entry ([`PollState`]): the next
//! poll's failures and deferrals and the unchanged-poll tally, and how a finished poll changes it
//! ([`PollState::after`], [`Step`]).

use std::fmt::Write as _;

use chrono::{DateTime, Utc};

use crate::polling::unchanged::{parse_job_state, parse_tally, Since, Tally};

/// What a card's next poll needs from Redis, and what `investigate` shows of its polling.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PollState {
    /// Consecutive failures before the next poll (its back-off, and when it parks).
    pub failures: u32,
    /// Budget deferrals of the next poll that the state records: only a chain moved over from
    /// the release before carries any (its own count), and the card's next poll clears it. The
    /// polling workers count their own deferrals in the process (`backend::FetchPause`), since a
    /// deferral gives the card back without writing its state.
    pub deferrals: u32,
    /// The unchanged polls since the last recorded change or failure, or since the card's first
    /// poll here; `None` when the card has no state (the script then writes a fresh one with
    /// the poll's acknowledgement).
    pub tally: Option<Tally>,
}

impl PollState {
    /// Parses the state the script keeps (`unchanged|last|since|failures[.deferrals]`); an empty
    /// or malformed one is the state of a card polled for the first time.
    pub fn parse(raw: &str) -> Self {
        let mut fields = raw.split('|');
        match (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) {
            (Some(count), Some(last), Some(since), Some(state), None) => {
                let (failures, deferrals) = parse_job_state(state);
                Self {
                    failures,
                    deferrals,
                    tally: parse_tally(count, last, since),
                }
            }
            _ => Self::default(),
        }
    }
}

/// What a finished poll does to its card's state ([`PollState::after`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The tally is kept (a retry after an infrastructure error, a parked card waiting).
    Keep,
    /// A change or a failure was recorded: the tally starts again from 0, now.
    Reset,
    /// The poll was unchanged: one more in the tally, the last one now.
    Unchanged,
}

impl PollState {
    /// The state of the card's next poll, after a poll with this state ended by `step` at `now`
    /// with `failures` consecutive failures. A poll that ran clears the deferrals.
    pub fn after(&self, step: Step, failures: u32, now: DateTime<Utc>) -> PollState {
        let now = DateTime::from_timestamp(now.timestamp(), 0).unwrap_or(now);
        let mut tally = self.tally.clone().unwrap_or(Tally {
            count: 0,
            last: None,
            since: now,
            since_kind: Since::ChainStart,
        });
        match step {
            Step::Unchanged => {
                tally.count += 1;
                tally.last = Some(now);
            }
            Step::Reset => {
                tally.count = 0;
                tally.since = now;
                tally.since_kind = Since::ChangeOrFailure;
            }
            Step::Keep => {}
        }
        PollState {
            failures,
            deferrals: 0,
            tally: Some(tally),
        }
    }

    /// The state as the script keeps it (`unchanged|last|since|failures[.deferrals]`, times in
    /// base-36 unix seconds), [`PollState::parse`]'s inverse.
    pub fn to_raw(&self) -> String {
        // One buffer, written in place: this runs twice a poll (the fetch's payload and the
        // acknowledgement).
        let mut out = String::with_capacity(32);
        match &self.tally {
            Some(t) => {
                let _ = write!(out, "{}|", t.count);
                match t.last {
                    Some(last) => push_base36(&mut out, last.timestamp()),
                    None => out.push('0'),
                }
                out.push('|');
                out.push(match t.since_kind {
                    Since::ChangeOrFailure => 'c',
                    Since::ChainStart => 's',
                });
                push_base36(&mut out, t.since.timestamp());
            }
            None => out.push_str("0|0|s0"),
        }
        let _ = write!(out, "|{}", self.failures);
        if self.deferrals > 0 {
            let _ = write!(out, ".{}", self.deferrals);
        }
        out
    }
}

/// Appends `n` (unix seconds; a negative one as 0) in base 36, lowercase.
fn push_base36(out: &mut String, n: i64) {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut n = u64::try_from(n).unwrap_or(0);
    // 13 base-36 digits hold any u64.
    let mut digits = [0u8; 13];
    let mut first = digits.len();
    loop {
        first -= 1;
        digits[first] = DIGITS[(n % 36) as usize];
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.extend(digits[first..].iter().map(|&d| char::from(d)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_parses_its_failures_deferrals_and_tally_and_a_missing_or_malformed_one_is_fresh() {
        let state = PollState::parse("3|t0gmqo|ct0gmqa|2.4");
        assert_eq!((state.failures, state.deferrals), (2, 4));
        let tally = state.tally.clone().unwrap_or_else(|| panic!("a tally"));
        assert_eq!(tally.count, 3);
        assert!(tally.last.is_some());
        assert_eq!(
            PollState::parse(&state.to_raw()),
            state,
            "to_raw is parse's inverse"
        );
        for raw in [
            "3|t0gmqo|ct0gmqa|2.4",
            "0|0|st0gmqa|0",
            "12|t0gmqo|ct0gmqa|7",
        ] {
            assert_eq!(PollState::parse(raw).to_raw(), raw, "written back as read");
        }
        assert_eq!(PollState::default().to_raw(), "0|0|s0|0", "no tally");
        for raw in ["", "garbage", "1|2|3", "1|2|3|4|5"] {
            assert_eq!(PollState::parse(raw), PollState::default(), "{raw:?}");
        }
    }
}
