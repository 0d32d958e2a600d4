//! Asia/Shanghai calendar-day arithmetic (spec section 5): a row's archive day is the Shanghai
//! day of its `created_at`, and day D covers `[D 00:00+08:00, D+1 00:00+08:00)`.

use chrono::{DateTime, Days, NaiveDate, TimeZone as _, Utc};
use chrono_tz::Asia::Shanghai;

/// The Shanghai calendar day of an instant.
pub fn day_of(at: DateTime<Utc>) -> NaiveDate {
    at.with_timezone(&Shanghai).date_naive()
}

/// Today in Shanghai.
pub fn today() -> NaiveDate {
    day_of(Utc::now())
}

/// The instant day `d` begins in Shanghai (00:00 local time).
pub fn start_of(d: NaiveDate) -> DateTime<Utc> {
    let midnight = d.and_hms_opt(0, 0, 0).unwrap_or_default();
    // Shanghai has had no DST since 1991; `earliest` still gives a defined answer for any
    // historical gap or fold instead of panicking.
    Shanghai
        .from_local_datetime(&midnight)
        .earliest()
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_else(|| midnight.and_utc())
}

/// `[start, end)` of day `d`, as UTC instants.
pub fn bounds(d: NaiveDate) -> (DateTime<Utc>, DateTime<Utc>) {
    (
        start_of(d),
        start_of(d.checked_add_days(Days::new(1)).unwrap_or(d)),
    )
}

/// The first instant that is NOT due when days are due once `D + after_days < today`:
/// a row is due exactly when `created_at < cutoff(today, after_days)`.
pub fn cutoff(today: NaiveDate, after_days: u32) -> DateTime<Utc> {
    start_of(
        today
            .checked_sub_days(Days::new(u64::from(after_days)))
            .unwrap_or(NaiveDate::MIN),
    )
}

/// A day as the integer `YYYYMMDD` (the `cardworker_maintenance_last_day` gauge).
pub fn yyyymmdd(d: NaiveDate) -> i64 {
    use chrono::Datelike as _;
    i64::from(d.year()) * 10_000 + i64::from(d.month()) * 100 + i64::from(d.day())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn the_shanghai_day_changes_at_sixteen_hundred_utc() {
        assert_eq!(
            day_of(utc("2026-01-01T15:59:59Z")),
            NaiveDate::from_ymd_opt(2026, 1, 1).unwrap()
        );
        assert_eq!(
            day_of(utc("2026-01-01T16:00:00Z")),
            NaiveDate::from_ymd_opt(2026, 1, 2).unwrap()
        );
    }

    #[test]
    fn a_day_spans_sixteen_hundred_utc_to_sixteen_hundred_utc() {
        let (start, end) = bounds(NaiveDate::from_ymd_opt(2026, 1, 2).unwrap());
        assert_eq!(start, utc("2026-01-01T16:00:00Z"));
        assert_eq!(end, utc("2026-01-02T16:00:00Z"));
    }

    #[test]
    fn a_day_is_due_only_when_it_plus_the_delay_is_before_today() {
        let today = NaiveDate::from_ymd_opt(2026, 2, 10).unwrap();
        let cut = cutoff(today, 30);
        // D = 2026-01-10: D + 30 = 2026-02-09 < today -> due.
        let (_, end_of_jan_10) = bounds(NaiveDate::from_ymd_opt(2026, 1, 10).unwrap());
        assert!(end_of_jan_10 <= cut);
        // D = 2026-01-11: D + 30 = 2026-02-10 = today -> not due.
        let (start_of_jan_11, _) = bounds(NaiveDate::from_ymd_opt(2026, 1, 11).unwrap());
        assert_eq!(start_of_jan_11, cut);
    }

    #[test]
    fn days_render_as_yyyymmdd() {
        assert_eq!(
            yyyymmdd(NaiveDate::from_ymd_opt(2026, 3, 7).unwrap()),
            20260307
        );
    }
}
