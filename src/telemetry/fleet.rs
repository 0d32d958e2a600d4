//! The fleet-wide gauges' refresher: `/metrics` never waits on Redis or PostgreSQL.
//!
//! The fleet-wide gauges (polling tokens and limits, Gateway circuits, parked chains, queue
//! depth) are read from Redis and PostgreSQL by a background loop ([`FleetGauges::run`]), every
//! `telemetry.fleet_gauges_secs`, and a scrape renders the last values read. A scrape during a
//! Redis outage therefore answers at once with values as old as the outage, and says so:
//! `cardworker_fleet_gauges_age_seconds` is the time since the last round in which every read
//! succeeded (since the process started, before the first). The alert
//! `CardworkerFleetGaugesStale` pages on it while the pod answers its scrapes.
//!
//! The gauges are there for the scraper, so the loop reads only while someone scrapes: after one
//! round at start (before the endpoint serves), it goes on while the last scrape is less than
//! [`SCRAPED_WITHIN`] old, and a scrape wakes it. An unscraped pod (a test, a bench) sends nothing
//! for them.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::metrics as m;

/// The loop keeps reading while the last scrape is younger than this (longer than any sane
/// scrape interval, so a scraped pod never pauses between two scrapes).
pub const SCRAPED_WITHIN: Duration = Duration::from_secs(300);

/// The state shared by the refresh loop and the `/metrics` handler. Cheap to clone.
#[derive(Clone)]
pub struct FleetGauges {
    times: Arc<Mutex<Times>>,
    /// [`SCRAPED_WITHIN`] (shorter in this module's tests).
    scraped_within: Duration,
    /// Wakes a loop that stopped reading for want of scrapes.
    scraped: Arc<Notify>,
}

struct Times {
    /// When the last round in which every read succeeded began (the process's start before the
    /// first: the registered values are then that old).
    fresh_as_of: Instant,
    /// The last scrape (`None` before the first).
    last_scrape: Option<Instant>,
}

impl Default for FleetGauges {
    fn default() -> Self {
        Self {
            times: Arc::new(Mutex::new(Times {
                fresh_as_of: Instant::now(),
                last_scrape: None,
            })),
            scraped_within: SCRAPED_WITHIN,
            scraped: Arc::new(Notify::new()),
        }
    }
}

impl FleetGauges {
    /// How old the gauges are: the time since the last round of reads that all succeeded began.
    pub fn age(&self) -> Duration {
        self.times
            .lock()
            .map(|t| t.fresh_as_of.elapsed())
            .unwrap_or(Duration::MAX)
    }

    /// Called by `/metrics` before it renders: publishes `cardworker_fleet_gauges_age_seconds`
    /// and keeps (or wakes) the refresh loop. Takes no lock the loop holds across an await.
    pub fn on_scrape(&self) {
        let age = if let Ok(mut t) = self.times.lock() {
            t.last_scrape = Some(Instant::now());
            t.fresh_as_of.elapsed()
        } else {
            Duration::MAX
        };
        ::metrics::gauge!(m::FLEET_GAUGES_AGE).set(age.as_secs_f64());
        self.scraped.notify_one();
    }

    fn scraped_lately(&self) -> bool {
        self.times.lock().is_ok_and(|t| {
            t.last_scrape
                .is_some_and(|at| at.elapsed() < self.scraped_within)
        })
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
    }

    /// Runs a round ([`FleetGauges::refresh`]) every `period` while the endpoint is scraped,
    /// until the future is dropped with the process's stop.
    pub async fn run<F, Fut>(self, period: Duration, mut round: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let mut last = Instant::now();
        loop {
            tokio::time::sleep(period.saturating_sub(last.elapsed())).await;
            while !self.scraped_lately() {
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
        fleet.on_scrape();
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
        let fleet = FleetGauges {
            scraped_within: PERIOD * 10,
            ..FleetGauges::default()
        };
        let (rounds, ok) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicBool::new(true)));
        tokio::spawn(fleet.clone().run(PERIOD, counting(&rounds, &ok)));
        tokio::time::sleep(PERIOD * 10).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 0, "no round while unscraped");

        fleet.on_scrape();
        until("rounds while scraped", || {
            rounds.load(Ordering::SeqCst) >= 4
        })
        .await;
        // Without scrapes for longer than `scraped_within`, it stops reading again.
        until("the loop to go quiet", || !fleet.scraped_lately()).await;
        tokio::time::sleep(PERIOD * 2).await;
        let quiet = rounds.load(Ordering::SeqCst);
        tokio::time::sleep(PERIOD * 10).await;
        assert_eq!(rounds.load(Ordering::SeqCst), quiet);
        fleet.on_scrape();
        until("a scrape wakes it", || {
            rounds.load(Ordering::SeqCst) > quiet
        })
        .await;
    }
}
