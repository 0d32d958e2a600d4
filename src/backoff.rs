//! The one back-off rule: exponential from a base, capped, jittered, and still capped after the
//! jitter.
//!
//! Three paths wait before they try again, each with its own base and cap:
//! - a failed poll (`polling::poll`): base `min(interval, 10 s)`, cap `max(interval, 10 min)`,
//!   ±20 %, so a fleet of failing cards does not retry in lock-step;
//! - a payment whose database write failed (`payments::submit`) and a callback whose card is
//!   missing: base and cap of their own, ±20 %;
//! - a polling job deferred for lack of tokens (`polling::budget_layer`): uniform between the
//!   base and the exponential value ([`Jitter::FromBase`]), so deferred jobs spread over the
//!   whole window instead of clustering at its end.
//!
//! The cap is a promise to operators ("never more than 10 minutes"), so it holds after jitter.

use std::time::Duration;

use rand::Rng as _;

/// How a delay is spread around its exponential value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Jitter {
    /// Uniform within ±`fraction` of the exponential value (then capped).
    Proportional(f64),
    /// Uniform between the base and the exponential value.
    FromBase,
}

/// An exponential back-off: attempt `n` (1-based) waits about `base * 2^(n-1)`, never more than
/// `cap`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    jitter: Jitter,
}

impl Backoff {
    /// A back-off from `base` up to `cap` (raised to `base` if smaller), with `jitter`.
    pub fn new(base: Duration, cap: Duration, jitter: Jitter) -> Self {
        Self {
            base,
            cap: cap.max(base),
            jitter,
        }
    }

    /// The delay before attempt `n` (1-based; 0 is read as 1), with fresh randomness.
    pub fn delay(&self, n: u32) -> Duration {
        self.delay_at(n, rand::rng().random_range(0.0..=1.0))
    }

    /// The delay before attempt `n` for the random draw `u` in `0.0..=1.0`: the deterministic core
    /// of [`Backoff::delay`].
    pub fn delay_at(&self, n: u32, u: f64) -> Duration {
        let u = if u.is_finite() {
            u.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let doublings = n.saturating_sub(1).min(30);
        let exp = self.base.saturating_mul(1u32 << doublings).min(self.cap);
        let jittered = match self.jitter {
            Jitter::Proportional(fraction) => {
                let f = fraction.clamp(0.0, 1.0);
                exp.mul_f64(1.0 - f + 2.0 * f * u)
            }
            Jitter::FromBase => self.base + (exp - self.base).mul_f64(u),
        };
        jittered.min(self.cap)
    }
}

/// `d` jittered uniformly by ±`fraction`: the spread of the regular poll interval.
pub fn spread(d: Duration, fraction: f64) -> Duration {
    let f = fraction.clamp(0.0, 1.0);
    d.mul_f64(rand::rng().random_range((1.0 - f)..=(1.0 + f)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn the_delay_doubles_with_each_attempt_until_the_cap() {
        let b = Backoff::new(S(10), S(600), Jitter::Proportional(0.0));
        let delays: Vec<u64> = (1..=8).map(|n| b.delay_at(n, 0.5).as_secs()).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 600, 600]);
        assert_eq!(b.delay_at(0, 0.5), S(10), "attempt 0 reads as the first");
        assert_eq!(b.delay_at(u32::MAX, 0.5), S(600));
    }

    #[test]
    fn the_cap_holds_after_proportional_jitter() {
        let b = Backoff::new(S(10), S(600), Jitter::Proportional(0.2));
        assert_eq!(
            b.delay_at(20, 1.0),
            S(600),
            "+20 % of the cap is cut back to the cap"
        );
        assert_eq!(b.delay_at(1, 1.0), S(12));
        assert_eq!(b.delay_at(1, 0.0), S(8));
        for _ in 0..500 {
            let d = b.delay(30);
            assert!(d <= S(600) && d >= S(480), "{d:?}");
        }
    }

    #[test]
    fn jitter_from_the_base_spreads_between_the_base_and_the_exponential_value() {
        let b = Backoff::new(S(2), S(30), Jitter::FromBase);
        assert_eq!(b.delay_at(1, 1.0), S(2), "the first delay is the base");
        assert_eq!(b.delay_at(3, 0.0), S(2));
        assert_eq!(b.delay_at(3, 1.0), S(8));
        assert_eq!(b.delay_at(40, 1.0), S(30));
        for _ in 0..500 {
            let d = b.delay(3);
            assert!(d >= S(2) && d <= S(8), "{d:?}");
        }
    }

    #[test]
    fn a_cap_below_the_base_is_raised_to_the_base() {
        let b = Backoff::new(S(5), S(1), Jitter::Proportional(0.2));
        assert_eq!(b.delay_at(3, 1.0), S(5));
    }

    #[test]
    fn a_bad_random_draw_does_not_escape_the_bounds() {
        let b = Backoff::new(S(10), S(100), Jitter::Proportional(0.2));
        assert_eq!(b.delay_at(1, f64::NAN), S(10));
        assert_eq!(b.delay_at(1, 7.0), S(12));
    }

    #[test]
    fn the_poll_spread_stays_within_its_fraction() {
        for _ in 0..500 {
            let d = spread(S(100), 0.1);
            assert!(d >= S(90) && d <= S(110), "{d:?}");
        }
    }
}
