//! [`Limit`], a polling limit: `polling.total_limit`, each task's `limit` and a runtime override
//! (`budget set`, the console, the value read back from Redis). Its only constructors check the
//! range, so a held `Limit` is always in `1..=`[`LIMIT_CEILING`] and nothing else checks it again.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Hard ceiling for every polling limit (`total_limit`, a task's `limit`, a runtime override).
pub const LIMIT_CEILING: u32 = 256;

/// A polling limit, an integer in `1..=`[`LIMIT_CEILING`].
///
/// Built by [`Limit::new`] or parsed from text ([`FromStr`]: plain decimal digits, surrounding
/// whitespace ignored); both refuse anything out of range with [`LimitError`]. It serialises as
/// the bare number, and deserialises through the same check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Limit(u32);

/// Why a value is not a [`Limit`]. The message is what is allowed; the caller names the key and
/// the value given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// A number outside `1..=`[`LIMIT_CEILING`], or text that is not plain decimal digits.
    #[error("must be an integer in 1..={LIMIT_CEILING}")]
    Refused,
}

impl Limit {
    /// The smallest limit.
    pub const MIN: Limit = Limit(1);

    /// The largest limit, [`LIMIT_CEILING`].
    pub const MAX: Limit = Limit(LIMIT_CEILING);

    /// `n` as a limit, if it is in `1..=`[`LIMIT_CEILING`].
    pub const fn new(n: u32) -> Result<Limit, LimitError> {
        if n >= 1 && n <= LIMIT_CEILING {
            Ok(Limit(n))
        } else {
            Err(LimitError::Refused)
        }
    }

    /// The number, for arithmetic and for Redis.
    pub const fn get(self) -> u32 {
        self.0
    }
}

impl FromStr for Limit {
    type Err = LimitError;

    /// Plain decimal digits, surrounding whitespace ignored: refuses `0`, `-1`, `+1`, `3.5`,
    /// `abc`, `inf`, `1e9`, `100000` and the empty string.
    fn from_str(raw: &str) -> Result<Self, Self::Err> {
        let digits = raw.trim();
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(LimitError::Refused);
        }
        digits
            .parse::<u32>()
            .map_err(|_| LimitError::Refused)
            .and_then(Limit::new)
    }
}

impl TryFrom<u32> for Limit {
    type Error = LimitError;

    fn try_from(n: u32) -> Result<Self, Self::Error> {
        Limit::new(n)
    }
}

impl TryFrom<i64> for Limit {
    type Error = LimitError;

    /// A TOML integer as a limit.
    fn try_from(n: i64) -> Result<Self, Self::Error> {
        u32::try_from(n)
            .map_err(|_| LimitError::Refused)
            .and_then(Limit::new)
    }
}

impl From<Limit> for u32 {
    fn from(l: Limit) -> u32 {
        l.0
    }
}

impl From<Limit> for u64 {
    fn from(l: Limit) -> u64 {
        u64::from(l.0)
    }
}

impl From<Limit> for usize {
    /// Always lossless: a limit is at most [`LIMIT_CEILING`].
    fn from(l: Limit) -> usize {
        usize::from(u16::try_from(l.0).unwrap_or(u16::MAX))
    }
}

impl From<Limit> for f64 {
    fn from(l: Limit) -> f64 {
        f64::from(l.0)
    }
}

impl PartialEq<u32> for Limit {
    fn eq(&self, n: &u32) -> bool {
        self.0 == *n
    }
}

impl PartialEq<Limit> for u32 {
    fn eq(&self, l: &Limit) -> bool {
        *self == l.0
    }
}

impl PartialOrd<u32> for Limit {
    fn partial_cmp(&self, n: &u32) -> Option<std::cmp::Ordering> {
        self.0.partial_cmp(n)
    }
}

impl PartialOrd<Limit> for u32 {
    fn partial_cmp(&self, l: &Limit) -> Option<std::cmp::Ordering> {
        self.partial_cmp(&l.0)
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_and_the_ceiling_are_limits() {
        assert_eq!(Limit::new(1).map(Limit::get), Ok(1));
        assert_eq!(Limit::new(256).map(Limit::get), Ok(256));
        assert_eq!("1".parse::<Limit>().map(Limit::get), Ok(1));
        assert_eq!("256".parse::<Limit>().map(Limit::get), Ok(256));
        assert_eq!(Limit::MIN.get(), 1);
        assert_eq!(Limit::MAX.get(), LIMIT_CEILING);
    }

    #[test]
    fn zero_and_anything_above_the_ceiling_are_refused() {
        for n in [0, 257, 100_000, u32::MAX] {
            assert_eq!(Limit::new(n), Err(LimitError::Refused), "{n}");
        }
        for n in [0_i64, -1, 257, 100_000, i64::MIN, i64::MAX] {
            assert_eq!(Limit::try_from(n), Err(LimitError::Refused), "{n}");
        }
    }

    #[test]
    fn every_form_the_spec_refuses_is_refused_as_text() {
        for raw in [
            "0",
            "-1",
            "+1",
            "3.5",
            "abc",
            "inf",
            "NaN",
            "1e9",
            "257",
            "100000",
            "99999999999999999999",
            "",
            " ",
        ] {
            assert_eq!(raw.parse::<Limit>(), Err(LimitError::Refused), "{raw:?}");
        }
    }

    #[test]
    fn text_is_plain_digits_with_surrounding_whitespace_ignored() {
        for (raw, want) in [("8", 8), (" 4 ", 4), ("\t3\n", 3), ("007", 7)] {
            assert_eq!(raw.parse::<Limit>().map(Limit::get), Ok(want), "{raw:?}");
        }
    }

    #[test]
    fn the_refusal_says_what_is_allowed() {
        assert_eq!(
            LimitError::Refused.to_string(),
            "must be an integer in 1..=256"
        );
    }

    #[test]
    fn a_limit_shows_and_serialises_as_its_number() {
        let l = Limit::new(8).expect("in range");
        assert_eq!(l.to_string(), "8");
        assert_eq!(serde_json::to_string(&l).expect("serialise"), "8");
    }

    #[test]
    fn deserialising_checks_the_range() {
        assert_eq!(
            serde_json::from_str::<Limit>("4").expect("in range").get(),
            4
        );
        for bad in ["0", "257", "-1", "3.5", "\"4\""] {
            assert!(serde_json::from_str::<Limit>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_limit_compares_with_a_bare_number() {
        let l = Limit::new(8).expect("in range");
        assert_eq!(l, 8);
        assert_eq!(8, l);
        assert!(l < 9 && 7 < l);
        assert!(LIMIT_CEILING >= l);
    }
}
