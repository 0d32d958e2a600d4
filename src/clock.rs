//! This process's wall clock, as the money path reads it for the timestamps it writes and
//! compares with nothing stored elsewhere (a recovery query's `started_at` and `finished_at`,
//! taken around the call it times).
//!
//! The money path never compares this clock with a time that PostgreSQL wrote: an attempt's
//! deadline, a row's `updated_at` and an attempt log's `started_at` are written with the
//! database's `now()` and compared with it, in SQL (`reliable::table`, `reliable::pending`). A
//! worker or a CLI host whose clock runs ahead or behind therefore decides exactly as one whose
//! clock is right.
//!
//! **Test hook:** env `CARDWORKER_TEST_CLOCK_OFFSET_SECS` (whole seconds, may be negative) moves
//! this clock by that much, so that the integration tests can run a worker or the CLI whose clock
//! is wrong. It is read once per process. Only the tests set it; it belongs to the harness's
//! `CARDWORKER_TEST_…` variables, which the configuration accepts and never suggests.

use std::sync::OnceLock;

use chrono::{DateTime, Duration, Utc};

/// The test hook's variable (module docs).
pub const TEST_OFFSET_ENV: &str = "CARDWORKER_TEST_CLOCK_OFFSET_SECS";

/// Now, on this process's clock (moved by the test hook when a test sets it).
pub fn now() -> DateTime<Utc> {
    Utc::now() + offset()
}

/// The test hook's offset: zero unless a test set [`TEST_OFFSET_ENV`] to whole seconds.
fn offset() -> Duration {
    static OFFSET: OnceLock<Duration> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        std::env::var(TEST_OFFSET_ENV)
            .ok()
            .and_then(|v| parse_offset(&v))
            .unwrap_or_else(Duration::zero)
    })
}

/// Whole seconds within a day either way; anything else is no offset.
fn parse_offset(value: &str) -> Option<Duration> {
    let secs: i64 = value.trim().parse().ok()?;
    (secs.abs() <= 86_400).then(|| Duration::seconds(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_offset_is_whole_seconds_either_way_and_anything_else_is_none() {
        assert_eq!(parse_offset("120"), Some(Duration::seconds(120)));
        assert_eq!(parse_offset(" -120 "), Some(Duration::seconds(-120)));
        assert_eq!(parse_offset("1.5"), None);
        assert_eq!(parse_offset("soon"), None);
        assert_eq!(parse_offset("86401"), None);
    }
}
