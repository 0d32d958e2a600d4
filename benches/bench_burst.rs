//! `make bench-burst`: a due burst, every card's chains of both tasks due at the same moment, and
//! how long one worker process takes to poll them all against how long it would take at its own
//! steady rate.
//!
//! The setup: a private `redis-server` (nothing else on it), a fresh database on the benches'
//! PostgreSQL, `BENCH_CARDS` cards (default 20,000), one release `cardworker run` process,
//! `total_limit = 128` with 64 per task (the worker's concurrency per task is its limit, so all
//! 128 slots can run at once), both tasks every 3,600 s (no card comes due twice within the
//! burst), and the in-process Gateway simulator at 0 ms with no changes. In one run:
//! 1. raw apalis-redis: no-op jobs/s through plain apalis-redis (concurrency 32) on the same Redis
//!    before anything else, the yardstick the polls/s are set beside;
//! 2. a first round: every card's chains due at once and polled once, so that each card's state
//!    is stored and every poll of the burst is an unchanged poll (the poll of a fleet already
//!    running, not a card's first poll, which writes its state); the worker stops, Redis is
//!    emptied;
//! 3. the burst: both tasks' chains of every card started with one due moment, far enough ahead
//!    (`BENCH_LEAD_SECS`, default 15 s + 1 s per 1,000 cards) that all are written, a fresh
//!    worker is up, and the budget's fence after the FLUSHALL of step 2 is over before it (the
//!    run stops with an error otherwise, and prints how long before the due moment it ended);
//!    then the simulator's record of card reads ([`Simulator::record_card_reads`]: each card's
//!    first read per task, when its Gateway call arrived) until every card was read by both tasks
//!    (at most `BENCH_LIMIT_SECS`, default 300).
//!
//! What it prints, from that record:
//! - the tail: the due moment to the last card's first poll, per task and the later of the two;
//! - polls needed: 2 × cards;
//! - the steady polls/s: the polls of the middle 80 % of the burst (from its 10th to its 90th
//!   percentile first read) over the time between them. The start (the worker's first fetch
//!   after the due moment, its connections warming up) and the end (slots draining as the last
//!   cards are fetched) are left out because they are what the ratio judges: the polls needed
//!   over the time from first to last poll would count them in the rate too, and so cancel them
//!   half out of the ratio;
//! - the ideal: polls needed ÷ steady polls/s; the ratio tail ÷ ideal (goal ≤ 1.25); whether
//!   every card was polled within 120 s of the due moment;
//! - raw apalis-redis jobs/s beside the steady polls/s, and their quotient;
//! - what bounds the tail: when the burst had done half, 90 % and 99 % of its polls, and the CPU
//!   of the worker, of Redis, of this process (the simulator) and of the whole machine over the
//!   burst, against the machine's cores.
//!
//! `BENCH_CARDS=2000` makes a quick run. `CARDWORKER_BIN` runs another build. Prints markdown
//! (docs/BENCHMARKS.md).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cardworker::config::Task;
use cardworker::sim::{CardReads, Simulator};
use cardworker_test_kit::bench::{env_or, private_redis};
use cardworker_test_kit::harness::wait_until;
use cardworker_test_kit::process::Worker;
use cardworker_test_kit::redis_stats::{raw_apalis_median, redis_sample};
use cardworker_test_kit::worker_stage::{
    gateway_calls, process_cpu, start_chains, stop, wait_for_calls, Stage,
};
use cardworker_wire::CallKind;

/// Long enough that no card is polled twice within the burst.
const INTERVAL_SECS: u64 = 3600;

/// The goal's bound on every card's first poll after the due moment.
const WITHIN: Duration = Duration::from_secs(120);

/// The goal's bound on tail ÷ ideal.
const GOAL_RATIO: f64 = 1.25;

fn binary() -> String {
    std::env::var("CARDWORKER_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_cardworker").to_owned())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cards: usize = env_or("BENCH_CARDS", "20000").parse()?;
    let lead =
        Duration::from_secs(env_or("BENCH_LEAD_SECS", &(15 + cards / 1000).to_string()).parse()?);
    let limit = Duration::from_secs(env_or("BENCH_LIMIT_SECS", "300").parse()?);
    let (redis, mut conn) = private_redis().await?;

    // 1. Raw apalis-redis on the same Redis (a warm-up run first).
    let raw = raw_apalis_median(&conn).await?;
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await?;

    let (_, sim, sim_handle) = Simulator::spawn_on("127.0.0.1:0").await?;
    sim.set_latency(0, 0);
    sim.set_change_rate(0.0);
    let stage = Stage::new(binary(), redis.url(), sim_handle.base_url()).await?;
    let result = run(&stage, &sim, &mut conn, cards, lead, limit).await;
    stage.remove().await;
    drop(redis);
    let burst = result?;
    burst.print(cards, raw.rate);
    Ok(())
}

/// What the burst measured.
struct Burst {
    /// Each task's first reads, seconds after the due moment, in order.
    carddata: Vec<f64>,
    card_status: Vec<f64>,
    /// Cards read more than once by one task.
    twice: usize,
    /// Peak polls in flight: all, carddata, card_status.
    peaks: (u64, u64, u64),
    /// CPU seconds over the burst: the worker, Redis, this process (the simulator).
    cpu: (f64, f64, f64),
    /// The machine's busy CPU seconds over the burst, every process on it.
    machine: f64,
    /// The due moment to the end of the burst, seconds.
    span: f64,
    /// Worker warnings and errors logged.
    problems: usize,
}

async fn run(
    stage: &Stage,
    sim: &Simulator,
    conn: &mut redis::aio::ConnectionManager,
    cards: usize,
    lead: Duration,
    limit: Duration,
) -> anyhow::Result<Burst> {
    let needed = 2 * cards as u64;

    // 2. The first round: each card's state stored, so that the burst's polls are unchanged.
    let (path, refs) = stage
        .seed_chains(conn, cards, INTERVAL_SECS, Instant::now(), Duration::ZERO)
        .await?;
    let worker = Worker::spawn(&stage.binary, &path)?;
    wait_for_calls(|| gateway_calls(sim), needed, limit, "the first round").await?;
    stop(worker);
    let _: () = redis::cmd("FLUSHALL").query_async(conn).await?;

    // 3. The burst: every chain due at `due`, a fresh worker up before it.
    let due = Instant::now() + lead;
    start_chains(conn, &stage.prefix, &refs, &Task::ALL, due, Duration::ZERO).await?;
    let worker = Worker::spawn(&stage.binary, &path)?;
    anyhow::ensure!(
        Instant::now() + Duration::from_secs(2) < due,
        "the chains and the worker were not ready 2 s before the due moment: raise BENCH_LEAD_SECS (now {} s)",
        lead.as_secs()
    );
    // The FLUSHALL above is a loss of the budget's data: the worker's first contact fences
    // polling for `Budget::fence_length` (docs/BUDGET.md). The burst measures polling, not that
    // fence, so the fence must be over by the due moment.
    let fence_end = budget_fence_end(conn, &stage.prefix).await?;
    anyhow::ensure!(
        fence_end + Duration::from_secs(1) < due,
        "the budget's fence after the bench's FLUSHALL ends {:.1} s after the due moment: raise BENCH_LEAD_SECS (now {} s)",
        fence_end.saturating_duration_since(due).as_secs_f64(),
        lead.as_secs()
    );
    eprintln!(
        "the budget's fence after the FLUSHALL ends {:.1} s before the due moment",
        due.saturating_duration_since(fence_end).as_secs_f64()
    );
    sim.record_card_reads();
    tokio::time::sleep(due.saturating_duration_since(Instant::now())).await;
    sim.reset_peaks();
    let calls_before = gateway_calls(sim);
    let (r0, w0, b0, m0) = (
        redis_sample(conn).await?,
        process_cpu(worker.pid()),
        process_cpu(std::process::id()),
        machine_busy(),
    );
    // The total count is cheap to read; the per-card record is read once, at the end.
    let waited = wait_for_calls(
        || gateway_calls(sim) - calls_before,
        needed,
        limit,
        "the burst",
    )
    .await;
    let span = due.elapsed().as_secs_f64();
    let (r1, w1, b1, m1) = (
        redis_sample(conn).await?,
        process_cpu(worker.pid()),
        process_cpu(std::process::id()),
        machine_busy(),
    );
    let problems = worker.problems.lock().map(|p| p.len()).unwrap_or(0);
    stop(worker);
    if let Err(e) = waited {
        // The figures below still say how far the burst got.
        eprintln!("{e:#} within {} s", limit.as_secs());
    }
    let stats = sim.stats();
    let peak = |kind: CallKind| stats.peak_per_call.get(kind.as_str()).copied().unwrap_or(0);
    let (carddata, carddata_twice) = since(&sim.card_reads(CallKind::Carddata), due);
    let (card_status, status_twice) = since(&sim.card_reads(CallKind::CardStatus), due);
    Ok(Burst {
        carddata,
        card_status,
        twice: carddata_twice + status_twice,
        peaks: (
            stats.peak_in_flight_polls,
            peak(CallKind::Carddata),
            peak(CallKind::CardStatus),
        ),
        cpu: (w1 - w0, r1.cpu_secs - r0.cpu_secs, b1 - b0),
        machine: m1 - m0,
        span,
        problems,
    })
}

/// When the budget's fence ends, on this process's clock: waits (up to 20 s) for the worker to
/// check the fence (its hash appears at its first contact with the budget), then reads its end
/// (unix ms on Redis's clock).
async fn budget_fence_end(
    conn: &mut redis::aio::ConnectionManager,
    prefix: &str,
) -> anyhow::Result<Instant> {
    let key = cardworker::keys::fence_key(prefix);
    wait_until(
        Duration::from_secs(20),
        "the worker to check the budget's fence",
        || {
            let (mut conn, key) = (conn.clone(), key.clone());
            async move {
                redis::cmd("HEXISTS")
                    .arg(&key)
                    .arg("until")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or(false)
            }
        },
    )
    .await;
    let until: u64 = redis::cmd("HGET")
        .arg(&key)
        .arg("until")
        .query_async(conn)
        .await?;
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await?;
    let now_ms = secs * 1000 + micros / 1000;
    Ok(Instant::now() + Duration::from_millis(until.saturating_sub(now_ms)))
}

/// CPU seconds the machine has spent busy so far, all cores and processes (`/proc/stat`: every
/// field of the `cpu` line but idle and iowait), 0 when unreadable.
fn machine_busy() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0.0;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0.0;
    };
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal: guest time is within user already.
    let busy: f64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, t)| t)
        .sum();
    busy / 100.0
}

/// The first reads of `reads` in seconds after `due` (negative: before it), in order, and how
/// many cards were read more than once.
fn since(reads: &HashMap<String, CardReads>, due: Instant) -> (Vec<f64>, usize) {
    let mut times: Vec<f64> = reads
        .values()
        .map(|r| match r.first.checked_duration_since(due) {
            Some(after) => after.as_secs_f64(),
            None => -due.duration_since(r.first).as_secs_f64(),
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let twice = reads.values().filter(|r| r.count > 1).count();
    (times, twice)
}

impl Burst {
    fn print(&self, cards: usize, raw_rate: f64) {
        let needed = 2 * cards;
        let last = |t: &[f64]| t.last().copied().unwrap_or(f64::NAN);
        let (tail_data, tail_status) = (last(&self.carddata), last(&self.card_status));
        let tail = tail_data.max(tail_status);
        let mut all: Vec<f64> = self
            .carddata
            .iter()
            .chain(&self.card_status)
            .copied()
            .collect();
        all.sort_by(f64::total_cmp);
        let polled = all.len();
        // The middle 80 % of the burst's polls, 10th to 90th percentile.
        let (lo, hi) = (polled / 10, polled * 9 / 10);
        let rate = match (all.get(lo), all.get(hi)) {
            (Some(a), Some(b)) if b > a => (hi - lo) as f64 / (b - a),
            _ => f64::NAN,
        };
        let ideal = needed as f64 / rate;
        let ratio = tail / ideal;
        let within = |t: &[f64]| t.iter().filter(|s| **s <= WITHIN.as_secs_f64()).count();
        let in_time = within(&self.carddata) + within(&self.card_status);
        let met = |ok: bool| if ok { "yes" } else { "no" };
        let (worker, redis, bench) = self.cpu;
        let cores = |secs: f64| secs / self.span;
        println!(
            "| measure ({cards} cards × 2 tasks due at once, one worker process, total limit 128 (64 per task), 0 ms Gateway, no changes) | value | goal | met? |"
        );
        println!("| --- | --- | --- | --- |");
        println!(
            "| every card polled within {} s of the due moment | {in_time} of {needed} polls | all | {} |",
            WITHIN.as_secs(),
            met(in_time == needed)
        );
        println!(
            "| last card's first poll ÷ ideal (tail ÷ (polls needed ÷ steady polls/s)) | {ratio:.2} | ≤ {GOAL_RATIO} | {} |",
            met(ratio <= GOAL_RATIO)
        );
        println!(
            "| tail: due moment to the last card's first poll (carddata / card_status) | {tail:.1} s ({tail_data:.1} / {tail_status:.1}) | | |"
        );
        println!("| polls needed (2 × cards) / polled | {needed} / {polled} | | |");
        println!(
            "| steady polls/s (middle 80 % of the burst: {:.1} s to {:.1} s) | {rate:.0} | | |",
            all.get(lo).copied().unwrap_or(f64::NAN),
            all.get(hi).copied().unwrap_or(f64::NAN)
        );
        println!("| ideal: polls needed ÷ steady polls/s | {ideal:.1} s | | |");
        println!(
            "| polls needed ÷ tail (the burst's mean rate) | {:.0} | | |",
            needed as f64 / tail
        );
        println!(
            "| first poll after the due moment | {:.2} s | | |",
            all.first().copied().unwrap_or(f64::NAN)
        );
        println!(
            "| raw apalis-redis no-op jobs/s, same Redis, same run (concurrency 32, median of 3) | {raw_rate:.0} | | |"
        );
        println!(
            "| steady polls/s ÷ raw apalis-redis jobs/s | {:.2} | | |",
            rate / raw_rate
        );
        let at = |share: f64| {
            let i = ((polled as f64 * share).ceil() as usize).clamp(1, polled.max(1)) - 1;
            all.get(i).copied().unwrap_or(f64::NAN)
        };
        println!(
            "| time from the due moment to 50 % / 90 % / 99 % / 100 % of the polls needed | {:.1} / {:.1} / {:.1} / {:.1} s | | |",
            at(0.5),
            at(0.9),
            at(0.99),
            at(1.0)
        );
        println!(
            "| CPU over the burst ({:.1} s), in cores: worker / Redis / simulator and bench / the whole machine (of {}) | {:.2} / {:.2} / {:.2} / {:.2} | | |",
            self.span,
            std::thread::available_parallelism().map_or(0, usize::from),
            cores(worker),
            cores(redis),
            cores(bench),
            cores(self.machine)
        );
        println!(
            "| peak Gateway calls in flight: all / carddata / card_status (at 0 ms a call is in flight only while the simulator serves it) | {} / {} / {} | | |",
            self.peaks.0, self.peaks.1, self.peaks.2
        );
        println!(
            "| cards polled twice by one task during the burst | {} | | |",
            self.twice
        );
        println!("| worker warnings/errors logged | {} | | |", self.problems);
    }
}
