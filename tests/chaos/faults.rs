//! The fault schedule: drawn from the seed before the run starts (so a seed replays it), then
//! played: each fault at its time, several at once. Restarts of one service are serialised by
//! that service's lock; everything else may overlap (a pause during a Gateway outage is one more
//! crossing). Every fault that opens a window closes it before the schedule ends, so the quiet
//! period starts clean.

use std::sync::Arc;
use std::time::Duration;

use cardworker::sim::SimConfigPatch;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use rand::{Rng as _, SeedableRng as _};

use crate::world::Kill;
use crate::World;

/// How long [`Fault::RedisCutOffWhileEmpty`] keeps its worker cut off: longer than any hold a
/// process keeps by a timer of its own, shorter than the budget's fence.
pub const CUT_OFF_MS: u64 = 20_000;

/// One fault of the schedule.
#[derive(Debug, Clone)]
pub enum Fault {
    /// kill -9 or SIGTERM to one worker.
    Worker { slot: usize, kill: Kill },
    /// `CLIENT KILL TYPE normal`: every client connection of Redis dropped.
    RedisClientKill,
    /// `CLIENT PAUSE` for this long (past the client's 10 s response timeout when > 10 s).
    RedisPause { ms: u64 },
    /// Redis stopped for `down_ms`, back with its data (`keep`) or empty.
    RedisRestart { keep: bool, down_ms: u64 },
    /// `FLUSHALL`: every key gone, while Redis keeps answering (no call fails).
    RedisFlushAll,
    /// redis-server killed with SIGKILL and started again from its append-only file after
    /// `down_ms`: the data comes back, under a new server (`run_id`).
    RedisKillAof { down_ms: u64 },
    /// `FLUSHALL`, then one worker stopped (SIGTERM) and started again by its supervisor: a pod
    /// that starts while the budget's fence is on.
    PodStartedInFence { slot: usize },
    /// One worker cut off from Redis by its proxy for [`CUT_OFF_MS`], while Redis is stopped for
    /// `down_ms` and comes back empty: the worker's polls at the Gateway lose their leases, and
    /// it cannot write them back.
    RedisCutOffWhileEmpty { slot: usize, down_ms: u64 },
    /// A failover to a replica that lagged: the replica's link to the primary is cut for
    /// `lag_ms` (the primary takes writes it never sees), then the replica is promoted and every
    /// proxy routed to it. The old primary follows the new one from then on.
    RedisFailover { lag_ms: u64 },
    /// The string of short Redis outages: `(gap before, empty restart or pause, length)`.
    RedisString { outages: Vec<(u64, bool, u64)> },
    /// PostgreSQL restarted (fast shutdown).
    PgRestart,
    /// PostgreSQL stopped this long.
    PgStop { secs: u64 },
    /// Every Gateway call answers 503.
    GwOutage { secs: u64 },
    /// Every Gateway call takes almost the client's timeout.
    GwSlow { secs: u64 },
    /// Payment and approval POSTs are answered after the client's timeout: acted on first (the
    /// answer is lost), or, with `before_act`, held on the wire before the Gateway acts (a query
    /// meanwhile answers 404). An operator who watches repeats `enqueue payment|approval` on
    /// each row as soon as it is unknown.
    GwLostAnswers { secs: u64, before_act: bool },
    /// A share of Gateway answers are 200 with a bad body.
    GwGarbage { secs: u64, rate: f64 },
    /// A slow Gateway keeps polls in flight, then Redis pauses past the response timeout.
    StallUnderLoad { pause_ms: u64 },
    /// A share of the cards (`per_mille` of them) answered past the client's timeout, within the
    /// handler's, for `secs`: the worker stops waiting for those calls while the Gateway still
    /// works on them, and they must still count against the budget.
    GwPastTimeout {
        secs: u64,
        per_mille: u32,
        seed: u64,
    },
    /// An operator runs `enqueue payment` twice on a pending or unknown payment.
    OpRepeatPayment,
    /// An operator runs `enqueue approval` twice on a pending or unknown approval.
    OpRepeatApproval,
    /// An operator runs `enqueue carddata|card-status` twice for one card (an index into the
    /// cards).
    OpEnqueueCard { task: &'static str, card: usize },
    /// `unpark --task T --all`.
    OpUnparkAll { task: &'static str },
    /// `budget set --task T --limit N`, cleared `secs` later.
    OpBudgetSet {
        task: &'static str,
        limit: u32,
        secs: u64,
    },
    /// `budget pause --task T|all`, resumed `secs` later.
    OpBudgetPause { task: &'static str, secs: u64 },
    /// `circuit open --task T`, closed `secs` later.
    OpCircuitOpen { task: &'static str, secs: u64 },
}

impl Fault {
    /// The kind, as counted in the report.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Worker {
                kill: Kill::Kill9, ..
            } => "worker kill -9",
            Fault::Worker {
                kill: Kill::Term, ..
            } => "worker SIGTERM",
            Fault::RedisClientKill => "redis CLIENT KILL",
            Fault::RedisPause { .. } => "redis CLIENT PAUSE",
            Fault::RedisRestart { keep: true, .. } => "redis restart (data kept)",
            Fault::RedisRestart { keep: false, .. } => "redis restart (empty)",
            Fault::RedisString { .. } => "redis string of 6 short outages",
            Fault::RedisFlushAll => "redis FLUSHALL",
            Fault::RedisKillAof { .. } => "redis kill -9 and restart from its AOF",
            Fault::PodStartedInFence { .. } => "redis FLUSHALL, then a worker started",
            Fault::RedisCutOffWhileEmpty { .. } => {
                "a worker cut off from redis while it restarts empty"
            }
            Fault::RedisFailover { .. } => "redis failover to a replica that lagged",
            Fault::PgRestart => "postgres fast restart",
            Fault::PgStop { .. } => "postgres stopped",
            Fault::GwOutage { .. } => "gateway outage (503)",
            Fault::GwSlow { .. } => "gateway slowdown",
            Fault::GwLostAnswers { .. } => "gateway lost answers + operator repeat",
            Fault::GwGarbage { .. } => "gateway garbage bodies",
            Fault::StallUnderLoad { .. } => "redis stall while polls hold the budget",
            Fault::GwPastTimeout { .. } => "gateway answers past the client's timeout",
            Fault::OpRepeatPayment => "operator enqueue payment x2",
            Fault::OpRepeatApproval => "operator enqueue approval x2",
            Fault::OpEnqueueCard { .. } => "operator enqueue card x2",
            Fault::OpUnparkAll { .. } => "operator unpark --all",
            Fault::OpBudgetSet { .. } => "operator budget set/clear",
            Fault::OpBudgetPause { .. } => "operator budget pause/resume",
            Fault::OpCircuitOpen { .. } => "operator circuit open/close",
        }
    }

    /// How long the fault lasts, at most (ms).
    fn duration_ms(&self) -> u64 {
        match self {
            Fault::RedisPause { ms } => *ms,
            Fault::RedisRestart { down_ms, .. } | Fault::RedisKillAof { down_ms } => {
                down_ms + 5_000
            }
            Fault::RedisFlushAll | Fault::PodStartedInFence { .. } => 5_000,
            Fault::RedisCutOffWhileEmpty { down_ms, .. } => CUT_OFF_MS.max(*down_ms) + 5_000,
            Fault::RedisFailover { lag_ms } => lag_ms + 15_000,
            Fault::RedisString { outages } => outages.iter().map(|(g, _, l)| g + l + 3_000).sum(),
            Fault::PgRestart => 10_000,
            Fault::PgStop { secs }
            | Fault::GwOutage { secs }
            | Fault::GwSlow { secs }
            | Fault::GwGarbage { secs, .. }
            | Fault::OpBudgetSet { secs, .. }
            | Fault::OpBudgetPause { secs, .. }
            | Fault::OpCircuitOpen { secs, .. } => secs * 1000 + 5_000,
            Fault::GwLostAnswers { secs, .. } => secs * 1000 + 31_000,
            Fault::StallUnderLoad { pause_ms } => pause_ms + 20_000,
            Fault::GwPastTimeout { secs, .. } => secs * 1000 + 30_000,
            _ => 2_000,
        }
    }
}

/// The schedule: `(ms after the fault phase starts, fault)`, in time order.
pub fn plan(seed: u64, phase_ms: u64, workers: usize) -> Vec<(u64, Fault)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut plan = Vec::new();
    let warm = 10_000.min(phase_ms / 6);
    // The string of six short Redis outages within two minutes (or the phase, when shorter).
    let span = 120_000.min(phase_ms.saturating_sub(warm + 5_000));
    let mut outages = Vec::new();
    let mut used = 0;
    for i in 0..6 {
        let empty = rng.random_bool(0.5);
        let len = if empty {
            rng.random_range(2_000..4_000)
        } else {
            rng.random_range(3_000..11_000)
        };
        let gap = if i == 0 {
            0
        } else {
            rng.random_range(1_000..6_000)
        };
        outages.push((gap, empty, len));
        used += gap + len + 3_000;
    }
    // Squeeze the gaps and lengths into the span when the phase is short.
    if used > span {
        let f = span as f64 / used as f64;
        for o in &mut outages {
            o.0 = (o.0 as f64 * f) as u64;
            o.2 = ((o.2 as f64 * f) as u64).max(2_000);
        }
    }
    let string = Fault::RedisString { outages };
    let latest = phase_ms.saturating_sub(string.duration_ms()).max(warm);
    plan.push((rng.random_range(warm..=latest), string));

    let tasks = ["carddata", "card_status"];
    let n = phase_ms / 5_000;
    for _ in 0..n {
        let roll = rng.random_range(0..100u32);
        let task = *tasks.choose(&mut rng).unwrap_or(&"carddata");
        let fault = draw(roll, task, workers, &mut rng);
        if let Some(at) = start_of(&fault, warm, phase_ms, &mut rng) {
            plan.push((at, fault));
        }
    }
    // In runs of four minutes or more, each kind of the draw above that the seed's draws missed
    // comes once, at a time of its own, from a stream of its own (so that the rest of every
    // seed's schedule stays as it was): a ten-minute run has every kind of fault.
    if phase_ms >= 240_000 {
        let mut missed = StdRng::seed_from_u64(seed ^ 0x6576_6572_795f_6b69);
        for roll in 0..100 {
            let task = *tasks.choose(&mut missed).unwrap_or(&"carddata");
            let fault = draw(roll, task, workers, &mut missed);
            if plan.iter().any(|(_, f)| f.kind() == fault.kind()) {
                continue;
            }
            if let Some(at) = start_of(&fault, warm, phase_ms, &mut missed) {
                plan.push((at, fault));
            }
        }
    }
    // Answers past the client's timeout, drawn from a stream of their own so that the rest of
    // every seed's schedule stays as it was: one per two minutes of the phase, at least one.
    let mut past = StdRng::seed_from_u64(seed ^ 0x7061_7374_5f74_6f75);
    for _ in 0..(phase_ms / 120_000).max(1) {
        let fault = Fault::GwPastTimeout {
            secs: past.random_range(10..30),
            per_mille: past.random_range(100..400),
            seed: past.random(),
        };
        if let Some(at) = start_of(&fault, warm, phase_ms, &mut past) {
            plan.push((at, fault));
        }
    }
    // The losses of Redis data that fail no call (FLUSHALL, a restart from the append-only
    // file, a pod started during the fence that follows), drawn from a stream of their own so
    // that the rest of every seed's schedule stays as it was. (The two-minute run of `make test`
    // keeps its schedule: each such loss holds every poll for two handler timeouts.)
    each_per_five_minutes(
        &mut plan,
        seed ^ 0x6c6f_7374_5f64_6174,
        phase_ms,
        warm,
        |rng| {
            vec![
                Fault::RedisFlushAll,
                Fault::RedisKillAof {
                    down_ms: rng.random_range(500..3_000),
                },
                Fault::PodStartedInFence {
                    slot: rng.random_range(0..workers),
                },
            ]
        },
    );
    // The losses that come through the network (a worker cut off while Redis restarts empty,
    // a failover to a replica that lagged), from a third stream, on the same terms.
    each_per_five_minutes(
        &mut plan,
        seed ^ 0x6e65_7477_6f72_6b73,
        phase_ms,
        warm,
        |rng| {
            vec![
                Fault::RedisCutOffWhileEmpty {
                    slot: rng.random_range(0..workers),
                    down_ms: rng.random_range(500..3_000),
                },
                Fault::RedisFailover {
                    lag_ms: rng.random_range(2_000..8_000),
                },
            ]
        },
    );
    plan.sort_by_key(|(at, _)| *at);
    plan
}

/// When `fault` starts: a time drawn from `rng` between the warm-up's end and the latest start
/// that lets it end within the phase; `None`, and nothing drawn, when it cannot fit.
fn start_of(fault: &Fault, warm: u64, phase_ms: u64, rng: &mut StdRng) -> Option<u64> {
    let latest = phase_ms.saturating_sub(fault.duration_ms());
    (latest > warm).then(|| rng.random_range(warm..=latest))
}

/// The fault of the schedule's main draw that `roll` (0..100) picks, its parameters from `rng`;
/// `task` is the polling task of an operator's fault that names one.
fn draw(roll: u32, task: &'static str, workers: usize, rng: &mut StdRng) -> Fault {
    match roll {
        0..=9 => Fault::Worker {
            slot: rng.random_range(0..workers),
            kill: Kill::Kill9,
        },
        10..=15 => Fault::Worker {
            slot: rng.random_range(0..workers),
            kill: Kill::Term,
        },
        16..=21 => Fault::RedisClientKill,
        22..=26 => Fault::RedisPause {
            ms: rng.random_range(10_500..14_000),
        },
        27..=30 => Fault::RedisRestart {
            keep: true,
            down_ms: rng.random_range(500..4_000),
        },
        31..=33 => Fault::RedisRestart {
            keep: false,
            down_ms: rng.random_range(500..4_000),
        },
        34..=36 => Fault::PgRestart,
        37..=38 => Fault::PgStop { secs: 20 },
        39..=43 => Fault::GwOutage {
            secs: rng.random_range(5..25),
        },
        44..=47 => Fault::GwSlow {
            secs: rng.random_range(15..40),
        },
        48..=53 => Fault::GwLostAnswers {
            secs: rng.random_range(8..30),
            before_act: rng.random_bool(0.3),
        },
        54..=58 => Fault::GwGarbage {
            secs: rng.random_range(5..20),
            rate: rng.random_range(0.1..0.6),
        },
        59..=65 => Fault::StallUnderLoad {
            pause_ms: rng.random_range(11_000..14_000),
        },
        66..=72 => Fault::OpRepeatPayment,
        73..=77 => Fault::OpRepeatApproval,
        78..=82 => Fault::OpEnqueueCard {
            task,
            card: rng.random_range(0..usize::MAX),
        },
        83..=86 => Fault::OpUnparkAll { task },
        87..=90 => Fault::OpBudgetSet {
            task,
            limit: rng.random_range(1..=4),
            secs: rng.random_range(5..30),
        },
        91..=94 => Fault::OpBudgetPause {
            task: ["carddata", "card_status", "all"]
                .choose(rng)
                .copied()
                .unwrap_or("all"),
            secs: rng.random_range(5..25),
        },
        _ => Fault::OpCircuitOpen {
            task,
            secs: rng.random_range(5..25),
        },
    }
}

/// In runs whose fault phase is four minutes or more: each fault `kinds` draws, once per five
/// minutes of the phase, at a time of its own, all from the stream seeded with `stream`.
fn each_per_five_minutes(
    plan: &mut Vec<(u64, Fault)>,
    stream: u64,
    phase_ms: u64,
    warm: u64,
    kinds: impl Fn(&mut StdRng) -> Vec<Fault>,
) {
    if phase_ms < 240_000 {
        return;
    }
    let mut rng = StdRng::seed_from_u64(stream);
    for _ in 0..(phase_ms / 300_000).max(1) {
        for fault in kinds(&mut rng) {
            if let Some(at) = start_of(&fault, warm, phase_ms, &mut rng) {
                plan.push((at, fault));
            }
        }
    }
}

/// Plays the schedule from now; returns when every fault has ended (and been undone).
pub async fn play(world: Arc<World>, plan: Vec<(u64, Fault)>) {
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for (at, fault) in plan {
        let world = world.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + Duration::from_millis(at)).await;
            world.journal.fault(fault.kind(), format!("{fault:?}"));
            inject(&world, &fault).await;
            world.journal.note(format!("end of {}", fault.kind()));
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

async fn redis_command(url: &str, cmd: &mut redis::Cmd) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut conn = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await??;
    let _: redis::Value =
        tokio::time::timeout(Duration::from_secs(5), cmd.query_async(&mut conn)).await??;
    Ok(())
}

async fn redis_pause(world: &World, ms: u64) {
    let _ = redis_command(
        &world.services.redis_url,
        redis::cmd("CLIENT").arg("PAUSE").arg(ms).arg("ALL"),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// Kills redis-server with SIGKILL, and after `down_ms` starts it again on its append-only file.
async fn redis_kill_aof(world: &World, down_ms: u64) {
    let mut redis = world.services.redis.lock().await;
    tokio::task::block_in_place(|| redis.kill());
    tokio::time::sleep(Duration::from_millis(down_ms)).await;
    tokio::task::block_in_place(|| redis.start());
}

/// Cuts the worker of `slot` off from Redis for [`CUT_OFF_MS`], and meanwhile stops Redis for
/// `down_ms` and starts it again empty.
async fn redis_cut_off_while_empty(world: &World, slot: usize, down_ms: u64) {
    let _network = world.services.network.lock().await;
    let proxy = &world.services.slots[slot];
    proxy.cut();
    let back = tokio::time::Instant::now() + Duration::from_millis(CUT_OFF_MS);
    redis_restart(world, false, down_ms).await;
    tokio::time::sleep_until(back).await;
    let port = world.services.redis.lock().await.port;
    proxy.route_to(port);
}

/// Cuts the replica's link for `lag_ms`, promotes the replica, routes every proxy to it and
/// makes the old primary follow it.
async fn redis_failover(world: &World, lag_ms: u64) -> anyhow::Result<()> {
    let services = &world.services;
    let _network = services.network.lock().await;
    let mut primary = services.redis.lock().await;
    let mut replica = services.replica.lock().await;
    let mut conn = cardworker::context::connect_redis(&replica.url()).await?;
    // In step first: after an empty restart of the primary, the replica may still be syncing.
    for _ in 0..100 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut conn)
            .await?;
        if info.contains("master_link_status:up") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    services.link.cut();
    tokio::time::sleep(Duration::from_millis(lag_ms)).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut conn)
        .await?;
    services.route_all(replica.port);
    std::mem::swap(&mut *primary, &mut *replica);
    services.link.route_to(primary.port);
    // The old primary may be under a `CLIENT PAUSE` of another fault: it takes the `REPLICAOF`
    // once the pause is over.
    let mut tries = 0;
    loop {
        match crate::world::follow(&replica, &services.link).await {
            Ok(()) => return Ok(()),
            Err(e) if tries >= 3 => return Err(e),
            Err(_) => tries += 1,
        }
    }
}

/// Stops Redis for `down_ms` and starts it again, with its data or empty.
async fn redis_restart(world: &World, keep: bool, down_ms: u64) {
    let mut redis = world.services.redis.lock().await;
    tokio::task::block_in_place(|| redis.stop());
    tokio::time::sleep(Duration::from_millis(down_ms)).await;
    tokio::task::block_in_place(|| {
        if keep {
            redis.start()
        } else {
            redis.restart_empty()
        }
    });
}

/// The fields `patch` sets, back to the simulator's base config.
fn restore(world: &World, patch: &SimConfigPatch) {
    let base = &world.gw_base;
    let _ = world.gw.sim.update_config(&SimConfigPatch {
        latency_ms: patch.latency_ms.map(|_| base.latency_ms),
        latency_jitter_ms: patch.latency_jitter_ms.map(|_| base.latency_jitter_ms),
        error_rate: patch.error_rate.map(|_| base.error_rate),
        garbage_rate: patch.garbage_rate.map(|_| base.garbage_rate),
        payment_mode: patch.payment_mode.map(|_| base.payment_mode),
        hang_ms: patch.hang_ms.map(|_| base.hang_ms),
        post_act_delay_ms: patch.post_act_delay_ms.map(|_| base.post_act_delay_ms),
        post_answer_delay_ms: patch
            .post_answer_delay_ms
            .map(|_| base.post_answer_delay_ms),
        conflict_concurrent_posts: patch
            .conflict_concurrent_posts
            .map(|_| base.conflict_concurrent_posts),
        ..SimConfigPatch::default()
    });
}

/// Applies `patch` for `secs`, then restores what it set. Windows may overlap: an outage during
/// a slowdown is one more crossing.
async fn gateway_window(world: &World, patch: SimConfigPatch, secs: u64) {
    let _ = world.gw.sim.update_config(&patch);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    restore(world, &patch);
}

/// A latency near the client's timeout (and under it).
fn slow_patch(timeout_ms: u64) -> SimConfigPatch {
    SimConfigPatch {
        latency_ms: Some(timeout_ms * 7 / 10),
        latency_jitter_ms: Some(timeout_ms * 2 / 10),
        ..SimConfigPatch::default()
    }
}

/// One row of `table` an operator would look at: an unknown or pending one if any, else the
/// latest.
async fn pick_row(world: &World, table: &str, key: &str) -> Option<String> {
    let sql = format!(
        "SELECT {key}::text FROM {table} ORDER BY (status IN ('unknown', 'pending')) DESC, \
         updated_at DESC LIMIT 1"
    );
    sqlx::query_scalar(&sql)
        .fetch_optional(&world.pool)
        .await
        .ok()
        .flatten()
}

/// `enqueue payment|approval` twice on every unknown or pending row (at most 5), as an operator
/// who does not trust the first.
async fn repeat_unsettled(world: &World, what: &str) {
    let (table, key, flag) = if what == "payment" {
        ("payments", "payment_id", "--payment-id")
    } else {
        ("approvals", "approval_id", "--approval-id")
    };
    let sql = format!(
        "SELECT {key}::text FROM {table} WHERE status IN ('unknown', 'pending') ORDER BY updated_at DESC LIMIT 5"
    );
    let mut ids: Vec<String> = sqlx::query_scalar(&sql)
        .fetch_all(&world.pool)
        .await
        .unwrap_or_default();
    if ids.is_empty() {
        ids.extend(pick_row(world, table, key).await);
    }
    for id in ids {
        for _ in 0..2 {
            world.cli.run(&["enqueue", what, flag, &id]).await;
        }
    }
}

/// Runs an operator command until it succeeds (Redis or PostgreSQL may be down for a while).
async fn must(world: &World, args: &[&str]) {
    if world.cli.run_until_ok(args, 60).await.is_none() {
        world
            .journal
            .note(format!("operator command kept failing: {args:?}"));
    }
}

async fn inject(world: &World, fault: &Fault) {
    let timeout_ms = world.gateway_timeout_ms;
    match fault {
        Fault::Worker { slot, kill } => {
            world.sup.signal(*slot, *kill);
        }
        Fault::RedisClientKill => {
            let _ = redis_command(
                &world.services.redis_url,
                redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"),
            )
            .await;
        }
        Fault::RedisPause { ms } => redis_pause(world, *ms).await,
        Fault::RedisFlushAll => {
            let _ = redis_command(&world.services.redis_url, &mut redis::cmd("FLUSHALL")).await;
        }
        Fault::RedisKillAof { down_ms } => redis_kill_aof(world, *down_ms).await,
        Fault::PodStartedInFence { slot } => {
            let _ = redis_command(&world.services.redis_url, &mut redis::cmd("FLUSHALL")).await;
            world.sup.signal(*slot, Kill::Term);
        }
        Fault::RedisRestart { keep, down_ms } => redis_restart(world, *keep, *down_ms).await,
        Fault::RedisCutOffWhileEmpty { slot, down_ms } => {
            redis_cut_off_while_empty(world, *slot, *down_ms).await;
        }
        Fault::RedisFailover { lag_ms } => {
            if let Err(e) = redis_failover(world, *lag_ms).await {
                world.journal.note(format!("redis failover: {e:#}"));
            }
        }
        Fault::RedisString { outages } => {
            for (gap, empty, len) in outages {
                tokio::time::sleep(Duration::from_millis(*gap)).await;
                world.journal.note(format!(
                    "redis string: {} for {len} ms",
                    if *empty { "empty restart" } else { "pause" }
                ));
                if *empty {
                    redis_restart(world, false, *len).await;
                } else {
                    redis_pause(world, *len).await;
                }
            }
        }
        Fault::PgRestart => {
            let mut pg = world.services.pg.lock().await;
            tokio::task::block_in_place(|| {
                pg.stop();
                pg.start();
            });
        }
        Fault::PgStop { secs } => {
            let mut pg = world.services.pg.lock().await;
            tokio::task::block_in_place(|| pg.stop());
            tokio::time::sleep(Duration::from_secs(*secs)).await;
            tokio::task::block_in_place(|| pg.start());
        }
        Fault::GwOutage { secs } => {
            let patch = SimConfigPatch {
                error_rate: Some(1.0),
                ..SimConfigPatch::default()
            };
            gateway_window(world, patch, *secs).await;
        }
        Fault::GwSlow { secs } => gateway_window(world, slow_patch(timeout_ms), *secs).await,
        Fault::GwLostAnswers { secs, before_act } => {
            let late = Some(timeout_ms + 5_000);
            let patch = if *before_act {
                SimConfigPatch {
                    post_act_delay_ms: late,
                    ..SimConfigPatch::default()
                }
            } else {
                SimConfigPatch {
                    post_answer_delay_ms: late,
                    ..SimConfigPatch::default()
                }
            };
            let _ = world.gw.sim.update_config(&patch);
            // An operator watches: a payment or approval whose answer was lost (unknown now) is
            // submitted again at once, twice, before recovery's query settles it.
            let watch_until = tokio::time::Instant::now()
                + Duration::from_millis(secs * 1000 + timeout_ms + 10_000);
            let restore_at = tokio::time::Instant::now() + Duration::from_secs(*secs);
            let mut restored = false;
            let mut repeated = std::collections::HashSet::new();
            while tokio::time::Instant::now() < watch_until {
                if !restored && tokio::time::Instant::now() >= restore_at {
                    restore(world, &patch);
                    restored = true;
                }
                let unknown: Vec<String> = sqlx::query_scalar(
                    "SELECT payment_id::text FROM payments WHERE status = 'unknown' \
                     AND updated_at > now() - interval '5 seconds'",
                )
                .fetch_all(&world.pool)
                .await
                .unwrap_or_default();
                for id in unknown {
                    if repeated.insert(id.clone()) {
                        for _ in 0..2 {
                            world
                                .cli
                                .run(&["enqueue", "payment", "--payment-id", &id])
                                .await;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if !restored {
                restore(world, &patch);
            }
        }
        Fault::GwGarbage { secs, rate } => {
            let patch = SimConfigPatch {
                garbage_rate: Some(*rate),
                ..SimConfigPatch::default()
            };
            gateway_window(world, patch, *secs).await;
        }
        Fault::StallUnderLoad { pause_ms } => {
            let slow = slow_patch(timeout_ms);
            let _ = world.gw.sim.update_config(&slow);
            // Long polls take every token first.
            tokio::time::sleep(Duration::from_millis(timeout_ms / 3)).await;
            redis_pause(world, *pause_ms).await;
            tokio::time::sleep(Duration::from_millis(timeout_ms / 2)).await;
            restore(world, &slow);
        }
        Fault::GwPastTimeout {
            secs,
            per_mille,
            seed,
        } => {
            // Past the client's timeout (20 s) and within the handler's (22 s), per card.
            let mut rng = StdRng::seed_from_u64(*seed);
            let slow: Vec<String> = world
                .cards
                .iter()
                .filter(|_| rng.random_range(0..1000) < *per_mille)
                .cloned()
                .collect();
            for card in &slow {
                let late = timeout_ms + rng.random_range(500..1_800);
                world.gw.sim.set_card_latency(card, Some(late));
            }
            tokio::time::sleep(Duration::from_secs(*secs)).await;
            for card in &slow {
                world.gw.sim.set_card_latency(card, None);
            }
        }
        Fault::OpRepeatPayment => repeat_unsettled(world, "payment").await,
        Fault::OpRepeatApproval => repeat_unsettled(world, "approval").await,
        Fault::OpEnqueueCard { task, card } => {
            let card = world.cards[card % world.cards.len()].clone();
            let sub = if *task == "carddata" {
                "carddata"
            } else {
                "card-status"
            };
            for _ in 0..2 {
                world.cli.run(&["enqueue", sub, "--card-ref", &card]).await;
            }
        }
        Fault::OpUnparkAll { task } => {
            world.cli.run(&["unpark", "--task", task, "--all"]).await;
        }
        Fault::OpBudgetSet { task, limit, secs } => {
            world
                .cli
                .run(&[
                    "budget",
                    "set",
                    "--task",
                    task,
                    "--limit",
                    &limit.to_string(),
                ])
                .await;
            tokio::time::sleep(Duration::from_secs(*secs)).await;
            must(world, &["budget", "clear", "--task", task]).await;
        }
        Fault::OpBudgetPause { task, secs } => {
            world.cli.run(&["budget", "pause", "--task", task]).await;
            tokio::time::sleep(Duration::from_secs(*secs)).await;
            must(world, &["budget", "resume", "--task", task]).await;
        }
        Fault::OpCircuitOpen { task, secs } => {
            world.cli.run(&["circuit", "open", "--task", task]).await;
            tokio::time::sleep(Duration::from_secs(*secs)).await;
            must(world, &["circuit", "close", "--task", task]).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::plan;

    fn kinds(seed: u64, phase_ms: u64) -> BTreeSet<&'static str> {
        plan(seed, phase_ms, 3)
            .iter()
            .map(|(_, f)| f.kind())
            .collect()
    }

    #[test]
    fn the_schedule_of_a_ten_minute_run_has_every_kind_of_fault_whatever_the_seed() {
        let every: BTreeSet<&'static str> =
            (0..200).flat_map(|seed| kinds(seed, 600_000)).collect();
        assert_eq!(every.len(), 27, "{every:?}");
        for seed in (0..200).chain(643..653) {
            let drawn = kinds(seed, 600_000);
            let missing: Vec<_> = every.difference(&drawn).collect();
            assert!(missing.is_empty(), "seed {seed} misses {missing:?}");
        }
    }
}
