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
/// Built by [`Limit::new`], from a TOML integer (`TryFrom<i64>`) or parsed from text
/// ([`FromStr`]: plain decimal digits, surrounding whitespace ignored); each refuses anything
/// out of range with [`LimitError`]. It serialises as the bare number, and deserialises through
/// the same check.
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
            .map_err(|_| LimitError::Refused)?
            .try_into()
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

    fn try_from(n: i64) -> Result<Self, Self::Error> {
        u32::try_from(n)
            .map_err(|_| LimitError::Refused)?
            .try_into()
    }
}

impl From<Limit> for u32 {
    fn from(l: Limit) -> u32 {
        l.0
    }
}

impl From<Limit> for u64 {
    fn from(l: Limit) -> u64 {
        l.0.into()
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
        l.0.into()
    }
}

impl PartialEq<u32> for Limit {
    fn eq(&self, n: &u32) -> bool {
        self.0 == *n
    }
}

impl PartialOrd<u32> for Limit {
    fn partial_cmp(&self, n: &u32) -> Option<std::cmp::Ordering> {
        self.0.partial_cmp(n)
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
