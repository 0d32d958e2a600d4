//! The grace of one supervised worker: after each failure, whether to start it again (at once,
//! or after a back-off once Redis answers) or to stop the process, and why.

use std::time::{Duration, Instant};

use super::ending::Ending;
use crate::backoff::{Backoff, Jitter};
use crate::telemetry::RedisSnapshot;

/// A worker that ends this soon after an outage ended is still counted as its casualty (its
/// heartbeat finds its registration gone a heartbeat or two after Redis returned). A quiet
/// queue's worker may find it later (its beat is 30 s): a lost registration counts as Redis
/// trouble whenever it comes ([`super::ending::is_redis_trouble`]).
pub const RECOVERY_WINDOW: Duration = Duration::from_secs(30);
/// A restarted worker that has run this long is healthy again: its next failure starts a new
/// clock (fresh back-off, fresh grace) even if the Redis verdict has not changed since.
pub const STABLE_AFTER: Duration = Duration::from_secs(30);

/// The delay before restart number `n` (1-based) of one worker: 0.5 s doubling to 10 s, ±20 %.
pub fn restart_backoff(n: u32) -> Duration {
    Backoff::new(
        Duration::from_millis(500),
        Duration::from_secs(10),
        Jitter::Proportional(0.2),
    )
    .delay(n)
}

/// What the supervisor does after one failure of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Start it again at once.
    RestartNow,
    /// Start it again after this back-off, once Redis answers.
    RestartAfter(Duration),
    /// Stop the process: the failure is not Redis trouble (`false`), or Redis trouble past the
    /// grace (`true`).
    Stop { past_grace: bool },
}

/// The grace clock of one worker: decides, failure by failure, whether to restart it.
///
/// **One outage** is one generation of the probe's verdict ([`RedisSnapshot::generation`]): from
/// the first probe Redis does not answer to the first one it answers again. Its clock starts when
/// Redis stopped answering (the outage's start, not the worker's first failure in it), and it is
/// over as soon as Redis answers: a worker that fails after that starts a new clock with a fresh
/// back-off, however many outages came before. A worker that fails while the probe still gets
/// answers (its connection broke first, or it keeps failing while Redis answers) clocks from that
/// failure, for as long as the verdict does not change; so a worker that never gets going again
/// with Redis answering is still stopped once past the grace.
///
/// State lost with Redis's data (a registration or an in-flight set gone after an empty restart,
/// or dropped by a peer's orphan recovery) is not an outage: with Redis answering, the worker is
/// started again at once under a fresh name, which registers it again, and no clock starts. Once
/// per generation: a registration that vanishes again with nothing changed in between is backed
/// off and clocked like any other failure, so it can never spin.
#[derive(Debug, Default)]
pub struct Grace {
    /// The clock of the failures of the current generation, if this worker failed in it.
    clock: Option<Clock>,
    /// Restarts since the clock started.
    restarts: u32,
    /// The generation in which this worker last registered again at once.
    reregistered_in: Option<u64>,
}

/// When a worker's failures in one generation of the Redis verdict began to count.
#[derive(Debug, Clone, Copy)]
struct Clock {
    since: Instant,
    generation: u64,
}

impl Grace {
    /// One failure at `now` of a run that lasted `ran_for` and ended as `ending`, while Redis
    /// stood as `redis`, under `worker.redis_outage_grace_secs` = `grace`.
    pub fn on_failure(
        &mut self,
        now: Instant,
        ran_for: Duration,
        ending: Ending,
        redis: &RedisSnapshot,
        grace: Duration,
    ) -> Verdict {
        let redis_trouble = redis.troubled_within(now, RECOVERY_WINDOW) || ending != Ending::Other;
        if !redis_trouble || grace.is_zero() {
            return Verdict::Stop { past_grace: false };
        }
        if ending == Ending::LostState
            && redis.is_up()
            && self.reregistered_in != Some(redis.generation)
        {
            self.reregistered_in = Some(redis.generation);
            return Verdict::RestartNow;
        }
        let clock = match self.clock {
            Some(clock) if clock.generation == redis.generation && ran_for < STABLE_AFTER => clock,
            _ => {
                self.restarts = 0;
                let clock = Clock {
                    since: redis.down_since.unwrap_or(now),
                    generation: redis.generation,
                };
                self.clock = Some(clock);
                clock
            }
        };
        if now.saturating_duration_since(clock.since) > grace {
            return Verdict::Stop { past_grace: true };
        }
        self.restarts += 1;
        Verdict::RestartAfter(restart_backoff(self.restarts))
    }

    /// Restarts since the current clock started.
    pub fn restarts(&self) -> u32 {
        self.restarts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(60);

    /// The probe's verdict along a test's own timeline, kept as `RedisStatus` keeps it (its
    /// generation moves on at each outage's start and end and at a data loss; the test
    /// `the_redis_generation_moves_on_when_an_outage_begins_or_ends_and_when_data_is_lost`
    /// checks that on the real thing).
    struct Timeline {
        start: Instant,
        now: Instant,
        redis: RedisSnapshot,
    }

    impl Timeline {
        fn new() -> Self {
            let start = Instant::now();
            Self {
                start,
                now: start,
                redis: RedisSnapshot {
                    down_since: None,
                    recovered_at: None,
                    generation: 0,
                },
            }
        }

        /// Moves the clock to `ms` after the start.
        fn at(&mut self, ms: u64) -> Instant {
            self.now = self.start + Duration::from_millis(ms);
            self.now
        }

        fn down(&mut self) {
            self.redis.down_since = Some(self.now);
            self.redis.generation += 1;
        }

        fn up(&mut self, empty: bool) {
            self.redis.down_since = None;
            self.redis.recovered_at = Some(self.now);
            self.redis.generation += 1;
            if empty {
                self.redis.generation += 1;
            }
        }
    }

    /// A worker under test: its grace and when its current run started.
    struct Subject {
        grace: Grace,
        started_at: Instant,
    }

    impl Subject {
        fn fails(&mut self, t: &Timeline, ending: Ending) -> Verdict {
            self.grace.on_failure(
                t.now,
                t.now.saturating_duration_since(self.started_at),
                ending,
                &t.redis,
                GRACE,
            )
        }

        /// Restarted at the time `t` is at.
        fn restarted(&mut self, t: &Timeline) {
            self.started_at = t.now;
        }
    }
    #[test]
    fn six_short_outages_in_two_minutes_each_get_their_own_grace_and_a_lost_registration_re_registers_at_once(
    ) {
        // The combined-fault run's six outages (start, length in ms as logged; `true`: Redis
        // restarted empty), each shorter than the grace, 119 s from the first to the last.
        let outages = [
            (0, 10_752, false),
            (22_000, 2_858, true),
            (40_000, 2_715, true),
            (58_000, 11_005, false),
            (82_000, 10_073, false),
            (109_000, 2_719, true),
        ];
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        let mut delays = Vec::new();
        for (i, &(start, length, empty)) in outages.iter().enumerate() {
            let last = i == outages.len() - 1;
            t.at(start);
            t.down();
            if !last {
                // The worker's fetch fails in the outage (refused, or timed out in a pause).
                t.at(start + length / 2);
                match worker.fails(&t, Ending::Connection) {
                    Verdict::RestartAfter(delay) => delays.push(delay),
                    other => panic!(
                        "outage {} ({length} ms, within the grace): the worker is restarted, not {other:?}",
                        i + 1
                    ),
                }
            }
            t.at(start + length);
            t.up(empty);
            t.at(start + length + 500);
            worker.restarted(&t);
        }
        // The last outage's worker was rebuilt before it began; 91 ms after Redis answered
        // (empty), its fetch finds its registration gone.
        let (start, length, _) = outages[5];
        worker.started_at = t.start + Duration::from_millis(start - 1_500);
        t.at(start + length + 91);
        assert_eq!(
            worker.fails(&t, Ending::LostState),
            Verdict::RestartNow,
            "a lost registration with Redis answering registers again at once, whatever earlier outages did"
        );
        for (i, delay) in delays.iter().enumerate() {
            assert!(
                *delay <= Duration::from_millis(600),
                "outage {}: a new outage starts its back-off afresh: {delay:?}",
                i + 1
            );
        }
    }

    #[test]
    fn the_grace_clock_of_an_outage_starts_when_redis_stops_answering_not_when_a_worker_fails() {
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        t.at(1_000);
        t.down();
        // The worker's first failure comes late in the outage (a quiet queue's beat), past the
        // grace counted from the outage's start.
        t.at(1_000 + GRACE.as_millis() as u64 + 1);
        assert_eq!(
            worker.fails(&t, Ending::Connection),
            Verdict::Stop { past_grace: true }
        );
    }

    #[test]
    fn a_worker_failing_again_and_again_while_redis_answers_is_stopped_once_past_the_grace() {
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        let mut ms = 5_000;
        t.at(ms);
        assert_eq!(worker.fails(&t, Ending::LostState), Verdict::RestartNow);
        worker.restarted(&t);
        // A second lost registration with no outage or data loss since is not re-registered at
        // once again: it is backed off and clocked like a connection failure.
        ms += 100;
        t.at(ms);
        assert!(matches!(
            worker.fails(&t, Ending::LostState),
            Verdict::RestartAfter(_)
        ));
        loop {
            ms += 5_000;
            t.at(ms);
            worker.restarted(&t);
            ms += 100;
            t.at(ms);
            match worker.fails(&t, Ending::Connection) {
                Verdict::RestartAfter(_) => assert!(ms <= 5_100 + GRACE.as_millis() as u64),
                Verdict::Stop { past_grace: true } => {
                    assert!(ms > 5_100 + GRACE.as_millis() as u64);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_worker_ending_for_another_reason_stops_the_process_at_once() {
        let mut t = Timeline::new();
        let mut worker = Subject {
            grace: Grace::default(),
            started_at: t.now,
        };
        t.at(120_000);
        assert_eq!(
            worker.fails(&t, Ending::Other),
            Verdict::Stop { past_grace: false }
        );
    }

    #[test]
    fn restarts_back_off_from_half_a_second_to_ten_seconds() {
        for _ in 0..100 {
            let first = restart_backoff(1);
            assert!(first >= Duration::from_millis(400) && first <= Duration::from_millis(600));
            assert!(restart_backoff(30) <= Duration::from_secs(10));
        }
    }
}
