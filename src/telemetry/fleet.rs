//! The fleet-wide gauges' refresher: `/metrics` never waits on Redis or PostgreSQL for longer
//! than [`FRESH_WAIT`], and only after a pause.
//!
//! The fleet-wide gauges (polling tokens and limits, Gateway circuits, parked chains, queue
//! depth, how late polling runs) are read from Redis and PostgreSQL by a background loop
//! ([`FleetGauges::run`]), every `telemetry.fleet_gauges_secs`, and a scrape renders the last
//! values read. A scrape during a Redis outage therefore answers at once with values as old as
//! the outage, and says so: `cardworker_fleet_gauges_age_seconds` is the time since the last
//! round in which every read succeeded (since the process started, before the first). The alert
//! `CardworkerFleetGaugesStale` pages on it while the pod answers its scrapes.
//!
//! The gauges are there for the scraper, so the loop reads only while someone scrapes: after one
//! round at start (before the endpoint serves), it goes on while the last scrape is less than
//! `telemetry.fleet_gauges_idle_secs` old ([`SCRAPED_WITHIN`] by default), and a scrape wakes it.
//! An unscraped pod (a test, a bench) sends nothing for them.
//!
//! A scrape shows the present: one that finds the loop paused and the gauges older than one
//! refresh period wakes it and waits for that round to end, up to [`FRESH_WAIT`], then answers
//! with what it has, marked by its age. A paused loop is the only case that waits: while the loop
//! runs, values older than a period mean that reads fail (an outage), and the scrape answers at
//! once. So during an outage only the first scrape after a pause waits, and at most the bound.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

use super::metrics as m;

/// The loop keeps reading while the last scrape is younger than this (longer than any sane
/// scrape interval, so a scraped pod never pauses between two scrapes): the default of
/// `telemetry.fleet_gauges_idle_secs`.
pub const SCRAPED_WITHIN: Duration = Duration::from_secs(300);

/// The longest a scrape waits for the round it woke (spec section 10: about one second).
pub const FRESH_WAIT: Duration = Duration::from_secs(1);

/// The state shared by the refresh loop and the `/metrics` handler. Cheap to clone.
#[derive(Clone)]
pub struct FleetGauges {
    times: Arc<Mutex<Times>>,
    /// How long the loop reads on without a scrape: `telemetry.fleet_gauges_idle_secs`.
    scraped_within: Duration,
    /// Wakes a loop that stopped reading for want of scrapes.
    scraped: Arc<Notify>,
    /// Rounds ended so far (whether their reads succeeded or not): a scrape that woke the loop
    /// waits for the next value.
    rounds: Arc<watch::Sender<u64>>,
}

struct Times {
    /// When the last round in which every read succeeded began (the process's start before the
    /// first: the registered values are then that old).
    fresh_as_of: Instant,
    /// The last scrape (`None` before the first).
    last_scrape: Option<Instant>,
    /// Whether the loop waits for a scrape (it read nothing since the last scrape went stale).
    paused: bool,
    /// The loop's period (`None` until it runs: a scrape then never waits).
    period: Option<Duration>,
}

impl Default for FleetGauges {
    fn default() -> Self {
        Self::new(SCRAPED_WITHIN)
    }
}

impl FleetGauges {
    /// A refresher whose loop pauses after `scraped_within` without a scrape.
    pub fn new(scraped_within: Duration) -> Self {
        let (rounds, _) = watch::channel(0);
        Self {
            times: Arc::new(Mutex::new(Times {
                fresh_as_of: Instant::now(),
                last_scrape: None,
                paused: false,
                period: None,
            })),
            scraped_within,
            scraped: Arc::new(Notify::new()),
            rounds: Arc::new(rounds),
        }
    }

    /// How old the gauges are: the time since the last round of reads that all succeeded began.
    pub fn age(&self) -> Duration {
        self.times
            .lock()
            .map(|t| t.fresh_as_of.elapsed())
            .unwrap_or(Duration::MAX)
    }

    /// Called by `/metrics` before it renders: keeps (or wakes) the refresh loop, waits for a
    /// fresh round when it woke a paused loop over gauges older than one period (up to
    /// [`FRESH_WAIT`]), and publishes `cardworker_fleet_gauges_age_seconds`. Takes no lock the
    /// loop holds across an await.
    pub async fn on_scrape(&self) {
        let mut rounds = self.rounds.subscribe();
        let stale_and_paused = if let Ok(mut t) = self.times.lock() {
            t.last_scrape = Some(Instant::now());
            t.paused
                && t.period
                    .is_some_and(|period| t.fresh_as_of.elapsed() > period)
        } else {
            false
        };
        rounds.borrow_and_update();
        self.scraped.notify_one();
        if stale_and_paused {
            let _ = tokio::time::timeout(FRESH_WAIT, rounds.changed()).await;
        }
        ::metrics::gauge!(m::FLEET_GAUGES_AGE).set(self.age().as_secs_f64());
    }

    /// Whether the last scrape is recent enough to read; records the answer as the loop's pause.
    fn keep_reading(&self) -> bool {
        self.times.lock().is_ok_and(|mut t| {
            let lately = t
                .last_scrape
                .is_some_and(|at| at.elapsed() < self.scraped_within);
            t.paused = !lately;
            lately
        })
    }

    /// Whether the loop waits for a scrape.
    #[cfg(test)]
    fn paused(&self) -> bool {
        self.times.lock().is_ok_and(|t| t.paused)
    }

    /// Runs one round of reads: `round` reads every source and publishes what it read, and
    /// answers whether every read succeeded (it bounds each read's time itself, so that one hung
    /// source does not hold the others back). The process runs one before it serves `/metrics`.
    pub async fn refresh(&self, round: impl Future<Output = bool>) {
        let began = Instant::now();
        if round.await {
            if let Ok(mut t) = self.times.lock() {
                t.fresh_as_of = began;
            }
        }
        self.rounds.send_modify(|n| *n += 1);
    }

    /// Runs a round ([`FleetGauges::refresh`]) every `period` while the endpoint is scraped,
    /// until the future is dropped with the process's stop.
    pub async fn run<F, Fut>(self, period: Duration, mut round: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        if let Ok(mut t) = self.times.lock() {
            t.period = Some(period);
        }
        let mut last = Instant::now();
        loop {
            tokio::time::sleep(period.saturating_sub(last.elapsed())).await;
            while !self.keep_reading() {
                self.scraped.notified().await;
            }
            last = Instant::now();
            self.refresh(round()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    use super::*;

    const PERIOD: Duration = Duration::from_millis(20);

    async fn until(what: &str, check: impl Fn() -> bool) {
        let start = Instant::now();
        while !check() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "timed out: {what}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn counting(
        rounds: &Arc<AtomicU32>,
        ok: &Arc<AtomicBool>,
    ) -> impl FnMut() -> std::future::Ready<bool> {
        let (rounds, ok) = (rounds.clone(), ok.clone());
        move || {
            rounds.fetch_add(1, Ordering::SeqCst);
            std::future::ready(ok.load(Ordering::SeqCst))
        }
    }

    #[tokio::test]
    async fn the_age_counts_from_the_last_round_in_which_every_read_succeeded() {
        let fleet = FleetGauges::default();
        let (rounds, ok) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicBool::new(true)));
        fleet.on_scrape().await;
        tokio::spawn(fleet.clone().run(PERIOD, counting(&rounds, &ok)));
        until("three rounds", || rounds.load(Ordering::SeqCst) >= 3).await;
        assert!(fleet.age() < PERIOD * 10, "{:?}", fleet.age());

        ok.store(false, Ordering::SeqCst);
        let failing_from = rounds.load(Ordering::SeqCst) + 1;
        let at = Instant::now();
        until("ten failed rounds", || {
            rounds.load(Ordering::SeqCst) >= failing_from + 10
        })
        .await;
        assert!(
            fleet.age() >= at.elapsed().saturating_sub(PERIOD * 2),
            "failed rounds leave the age growing: {:?} after {:?}",
            fleet.age(),
            at.elapsed()
        );
        ok.store(true, Ordering::SeqCst);
        until("fresh again", || fleet.age() < PERIOD * 3).await;
    }

    #[tokio::test]
    async fn an_unscraped_pod_reads_nothing_and_a_scrape_wakes_the_loop_until_scrapes_stop() {
        let fleet = FleetGauges::new(PERIOD * 10);
        let (rounds, ok) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicBool::new(true)));
        tokio::spawn(fleet.clone().run(PERIOD, counting(&rounds, &ok)));
        tokio::time::sleep(PERIOD * 10).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 0, "no round while unscraped");

        fleet.on_scrape().await;
        until("rounds while scraped", || {
            rounds.load(Ordering::SeqCst) >= 4
        })
        .await;
        // Without scrapes for longer than `scraped_within`, it stops reading again.
        until("the loop to go quiet", || fleet.paused()).await;
        tokio::time::sleep(PERIOD * 2).await;
        let quiet = rounds.load(Ordering::SeqCst);
        tokio::time::sleep(PERIOD * 10).await;
        assert_eq!(rounds.load(Ordering::SeqCst), quiet);
        fleet.on_scrape().await;
        until("a scrape wakes it", || {
            rounds.load(Ordering::SeqCst) > quiet
        })
        .await;
    }

    #[tokio::test]
    async fn a_scrape_that_wakes_a_paused_loop_waits_for_the_fresh_round_and_a_failing_one_answers_at_once(
    ) {
        let fleet = FleetGauges::new(PERIOD * 5);
        let rounds = Arc::new(AtomicU32::new(0));
        let ok = Arc::new(AtomicBool::new(true));
        let slow = Duration::from_millis(200);
        let round = {
            let (rounds, ok) = (rounds.clone(), ok.clone());
            move || {
                let (rounds, ok) = (rounds.clone(), ok.clone());
                async move {
                    tokio::time::sleep(slow).await;
                    rounds.fetch_add(1, Ordering::SeqCst);
                    ok.load(Ordering::SeqCst)
                }
            }
        };
        tokio::spawn(fleet.clone().run(PERIOD, round));
        until("the loop to pause", || fleet.paused()).await;
        tokio::time::sleep(PERIOD * 2).await;
        assert!(fleet.age() > PERIOD);

        let before = rounds.load(Ordering::SeqCst);
        let at = Instant::now();
        fleet.on_scrape().await;
        assert!(
            rounds.load(Ordering::SeqCst) > before,
            "the scrape answered after the round it woke"
        );
        assert!(
            at.elapsed() >= slow && at.elapsed() < FRESH_WAIT,
            "{:?}",
            at.elapsed()
        );
        assert!(fleet.age() < slow * 2, "fresh: {:?}", fleet.age());

        // While the loop runs and its reads fail, a scrape does not wait for them.
        ok.store(false, Ordering::SeqCst);
        let failing_from = rounds.load(Ordering::SeqCst) + 1;
        let start = Instant::now();
        while rounds.load(Ordering::SeqCst) <= failing_from + 2 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "timed out: failed rounds"
            );
            fleet.on_scrape().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(fleet.age() > PERIOD);
        let at = Instant::now();
        fleet.on_scrape().await;
        assert!(at.elapsed() < slow, "{:?}", at.elapsed());

        // After a pause during the failure, the one scrape that wakes the loop waits at most the
        // bound, and the next one answers at once.
        let fleet2 = FleetGauges::new(PERIOD * 5);
        let hung = || std::future::pending::<bool>();
        tokio::spawn(fleet2.clone().run(PERIOD, hung));
        until("the second loop to pause", || fleet2.paused()).await;
        tokio::time::sleep(PERIOD * 2).await;
        let at = Instant::now();
        fleet2.on_scrape().await;
        let waited = at.elapsed();
        assert!(
            waited >= FRESH_WAIT && waited < FRESH_WAIT * 2,
            "{waited:?}"
        );
        let at = Instant::now();
        fleet2.on_scrape().await;
        assert!(at.elapsed() < PERIOD * 5, "{:?}", at.elapsed());
    }
}
