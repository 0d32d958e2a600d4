//! The cross-worker polling budget.
//!
//! Every polling job holds two tokens while it runs: one from the budget shared by all polling
//! tasks (`polling.total_limit`) and one from its own task's budget (`polling.<task>.limit`, or
//! a runtime override). Both budgets are shared by every worker process through Redis.
//!
//! A token is a **lease**, not a counter: a lease id in a sorted set scored by its expiry (unix
//! ms on the Redis clock, from `TIME`, never the worker's clock). One Lua call removes expired
//! leases when a set looks full (the TTL repair), reads the task's override and the pause set,
//! checks both limits and adds the same lease to both sets or to neither. A crashed worker's leases therefore stop
//! counting after `polling.lease_ttl_secs`, and nothing leaks for longer. When a finished poll's
//! slot turns over to the next poll of the same process ([`Budget::acquire_slot`], `carry`), the
//! new poll takes over the finished one's lease id and the script re-scores that member in place
//! (the id is then a per-process slot id): the limits are checked counting it as the new poll's,
//! and each take-over refreshes its expiry from Redis `TIME`, so the TTL bound is the same. The handler runs under
//! `polling.handler_timeout_secs`, which config validation keeps at least 5 s below the lease, so
//! a lease never expires under a running job.
//!
//! Keys (all under one hash tag, so the script is valid on Redis Cluster):
//! - `{prefix}:{budget}:total`: ZSET of lease ids -> expiry ms;
//! - `{prefix}:{budget}:task:carddata`, `{prefix}:{budget}:task:card_status`: the same, per task;
//! - `{prefix}:{budget}:overrides`: HASH task label -> limit (`budget set` / `budget clear`);
//! - `{prefix}:{budget}:paused`: SET of paused task labels (`budget pause` / `budget resume`).
//! - `{prefix}:{budget}:waiters`: ZSET of processes refused a token lately -> until ms ([`pool`]).
//! - `{prefix}:{budget}:kept`: HASH process id -> the idle slots it kept at its last renewal
//!   ([`pool`]), so that `show` tells kept slots from running polls.
//! - `{prefix}:{budget}:expired`: HASH scope -> leases removed because they had expired instead
//!   of being released (`cardworker_budget_leases_expired_total`).
//!
//! - `{prefix}:{budget}:circuit:{task}` and `…:circuit:{task}:window`: the task's Gateway circuit
//!   breaker ([`circuit`]).
//!
//! Redis holds the overrides, pauses and circuits only: if Redis is lost, limits revert to config
//! (see docs/BUDGET.md), so the config values are the conservative ones, and circuits close.
//!
//! # Layout
//! - `budget.lua`: the one script (`acquire`, `release`, `finish`, `finish_batch`, `renew`,
//!   `show`, `circuit_force`, `reassert`, `extend`, `fence`), with `circuit.lua` prepended to it.
//! - [`pool`]: the slots a process keeps between its polls, so that most polls start without a
//!   Redis call ([`Budget::admit`], [`Budget::finish_poll`]), and their renewal.
//! - [`carry`]: a finished poll's release rides on the process's next acquire (one round trip
//!   per admitted poll that asks Redis).
//! - [`abandoned`]: the lease of a poll whose Gateway call it stopped waiting for stays held until
//!   the call is answered or `polling.handler_timeout_secs` after it was sent.
//! - [`circuit`]: the fleet-wide Gateway circuit breaker of each task, admitted by the same call
//!   as the tokens (an open circuit is one more reason not to admit a poll).
//! - this module: [`Budget`], the Rust API over it (leases, overrides, pauses, circuits), and the
//!   leases this process holds.
//!
//! This module knows admission only: leases and circuits. The tower layer that takes them around
//! every polling job, and gives a card it does not admit back to the due queue, lives with
//! polling (`polling::budget_layer`); the operator commands live in `commands::budget`.
//!
//! One file on purpose, though it is over 1,000 lines with its tests: it is the Rust side of one
//! Lua script (`budget.lua` with `circuit.lua`), whose key layout, argument order and return
//! shapes every method shares (the fence's arguments ride at the end of `acquire` and `renew`);
//! splitting it by operation would spread that contract over several files. What can stand
//! alone already does: [`pool`], [`carry`], [`abandoned`], [`circuit`].

pub mod abandoned;
pub mod carry;
pub mod circuit;
pub mod pool;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use redis::aio::ConnectionManager;
use redis::Script;
use serde::Serialize;

pub use carry::TransitionHook;
pub use circuit::{CallReport, CircuitState, CircuitView, Forced, Transition};
pub use pool::Slot;

use crate::config::{Config, Task};

use crate::limit::{Limit, LIMIT_CEILING};
use crate::shutdown::Shutdown;
use crate::telemetry::metrics as m;

/// How long a process admits no poll after one of its budget calls failed, or its probe found
/// Redis down ([`Budget::hold_for`]): two probe rounds, so that every process has found out whether
/// Redis came back empty and written its running polls' leases back.
pub const OUTAGE_HOLD: Duration = Duration::from_secs(2);

/// The one script: the circuit's functions, then the budget's operations.
static SCRIPT: LazyLock<Script> =
    LazyLock::new(|| Script::new(&format!("{}\n{}", circuit::LUA, include_str!("budget.lua"))));

/// The budget's key names, which [`crate::keys`] owns.
pub use crate::keys::{
    expired_key, fence_key, kept_key, overrides_key, paused_key, task_key, total_key, waiters_key,
};

/// What a fence adds to the longest a poll admitted before a Redis data loss may still be at the
/// Gateway (`2 × handler_timeout_secs` + [`pool::VERDICT_FOR`]): the scheduling slack of the
/// handler's and the call's timers, and a small step of the Redis host's clock.
pub const FENCE_MARGIN: Duration = Duration::from_secs(3);

/// How long shutdown waits for the acquires under way before it releases what the process holds
/// (the polling layer gives up on an acquire after 2 s).
pub const ACQUIRES_DRAIN_FOR: Duration = Duration::from_secs(3);

/// One acquire call under way, counted for as long as it lives (also when its future is dropped).
struct AcquireUnderWay(Arc<(AtomicU64, tokio::sync::Notify)>);

impl AcquireUnderWay {
    fn start(counter: &Arc<(AtomicU64, tokio::sync::Notify)>) -> Self {
        counter.0.fetch_add(1, Ordering::AcqRel);
        Self(counter.clone())
    }
}

impl Drop for AcquireUnderWay {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
        self.0 .1.notify_waiters();
    }
}

/// Why a job did not get its tokens. Also the `reason` label of `cardworker_poll_deferred_total`
/// (together with `budget_unavailable`, which is not an answer of the script).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShortReason {
    /// The total budget was full (also reported when both were).
    Total,
    /// The task's budget was full.
    Task,
    /// The task is paused (`budget pause`).
    Paused,
}

impl ShortReason {
    /// Every reason.
    pub const ALL: [ShortReason; 3] = [ShortReason::Total, ShortReason::Task, ShortReason::Paused];

    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            ShortReason::Total => "total",
            ShortReason::Task => "task",
            ShortReason::Paused => "paused",
        }
    }
}

/// The answer of one acquire call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquired {
    /// Both tokens are held under the lease id.
    Acquired,
    /// Both tokens are held, and the poll is a probe of a half-open circuit (round `round`): its
    /// outcome decides whether the circuit closes ([`Budget::finish`]).
    Probe {
        /// The half-open round it probes for.
        round: u64,
    },
    /// Nothing was taken.
    Short {
        /// Which budget was short.
        reason: ShortReason,
    },
    /// Nothing was taken: Redis may have lost the leases of polls still at the Gateway, and no
    /// poll is admitted until they are over (the fence, in `budget.lua`).
    Fenced {
        /// Until the fence ends, on Redis's clock.
        retry_in: Duration,
    },
    /// Nothing was taken: the task's Gateway circuit is open.
    CircuitOpen {
        /// Until the cool-down ends (zero when unknown: forced open, or every probe slot taken).
        retry_in: Duration,
    },
}

impl Acquired {
    /// The half-open round when the poll is a probe, else 0.
    pub fn probe_round(self) -> u64 {
        match self {
            Acquired::Probe { round } => round,
            _ => 0,
        }
    }
}

/// What releasing a lease with its poll's outcome ([`Budget::finish`]) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    /// Whether the lease still existed.
    pub existed: bool,
    /// The circuit transition this outcome made, if any (already counted in
    /// `cardworker_gateway_circuit_transitions_total`).
    pub transition: Option<Transition>,
}

/// The budget of one task as `budget show` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TaskView {
    /// The effective limit: the valid override, else the config value, at most the total.
    pub limit: Limit,
    /// `polling.<task>.limit`.
    pub config_limit: Limit,
    /// The valid runtime override, if any.
    #[serde(rename = "override")]
    pub override_limit: Option<Limit>,
    /// An override in Redis that is not a valid limit (ignored; the config value applies).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid_override: Option<String>,
    /// Paused by `budget pause`.
    pub paused: bool,
    /// Tokens held by running polls, fleet-wide.
    pub in_use: u64,
    /// Tokens processes keep idle between their polls (reserved for their next polls of the
    /// task, given back under contention; [`pool`]), fleet-wide.
    pub kept: u64,
    /// Leases that ended by expiry instead of a release, fleet-wide, since Redis last lost its
    /// data.
    pub leases_expired: u64,
    /// The task's Gateway circuit breaker.
    pub circuit: CircuitView,
}

/// The total budget as `budget show` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TotalView {
    /// `polling.total_limit`.
    pub limit: Limit,
    /// Tokens held by running polls, fleet-wide.
    pub in_use: u64,
    /// Tokens processes keep idle between their polls, fleet-wide.
    pub kept: u64,
    /// Leases that ended by expiry instead of a release, fleet-wide, since Redis last lost its
    /// data.
    pub leases_expired: u64,
}

/// Everything `budget show` prints (spec section 2 fixes the JSON shape).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BudgetView {
    /// The total budget.
    pub total: TotalView,
    /// Per task label.
    pub tasks: BTreeMap<String, TaskView>,
}

/// The fleet-wide polling budget, seen from one process.
///
/// Cheap to clone; clones share the set of leases this process holds, so that shutdown can
/// release them all in one call.
#[derive(Clone)]
pub struct Budget {
    conn: ConnectionManager,
    prefix: String,
    total_limit: Limit,
    carddata_limit: Limit,
    card_status_limit: Limit,
    lease_ttl: Duration,
    /// `[polling.circuit]`, packed as the script reads it.
    circuit: Arc<str>,
    /// `polling.circuit.window_secs` in ms, for [`Budget::show`]'s window counts.
    circuit_window_ms: i64,
    /// Lease ids this process holds or may hold right now: acquired and not yet released, kept
    /// idle, carried, or asked for by an acquire whose answer is not in (a granted acquire whose
    /// future was dropped still holds its lease in Redis). Shutdown releases them all.
    held: Arc<Mutex<HashSet<String>>>,
    /// The leases of this process's polls that are running now, with their task and when each
    /// began: what [`Budget::reassert_running`] writes back after Redis comes back empty, and
    /// what shutdown leaves to count while a poll's Gateway call may still run
    /// ([`Budget::release_held`]).
    running: Arc<Mutex<HashMap<String, (Task, std::time::Instant)>>>,
    /// No poll is admitted before this moment ([`Budget::hold_for`]): Redis failed lately, or came
    /// back without its data, and may not count every running poll's lease yet.
    hold_until: Arc<Mutex<Option<std::time::Instant>>>,
    /// Set when shutdown releases what the process holds: no acquire is sent after it, and one
    /// answered after it gives its lease back at once.
    closing: Arc<std::sync::atomic::AtomicBool>,
    /// Acquire calls under way, and the signal that one ended (shutdown waits for them).
    acquiring: Arc<(AtomicU64, tokio::sync::Notify)>,
    /// Wakes local waiters when this process releases a token (cross-process waiters poll).
    released: Arc<tokio::sync::Notify>,
    /// Unix seconds of the last warning about an invalid override, so that a garbage override
    /// is reported about once a minute instead of on every acquire.
    last_invalid_warning: Arc<AtomicU64>,
    /// `{pod}-{pid}`: the prefix of this process's lease ids.
    owner: Arc<str>,
    /// Tracks the background releases (a timed-out acquire, a dropped lease guard).
    shutdown: Shutdown,
    /// Redis round trips this budget made (for the benchmark's cost per job).
    round_trips: Arc<AtomicU64>,
    /// Finished polls whose release rides on this process's next acquire ([`carry`]).
    carried: Arc<Mutex<Vec<carry::Carried>>>,
    /// Whether a flush of `carried` is scheduled.
    flush_armed: Arc<std::sync::atomic::AtomicBool>,
    /// Where the circuit transitions of carried finishes go.
    on_transition: Arc<Mutex<Option<TransitionHook>>>,
    /// Idle slots this process keeps between polls, per task ([`pool`]).
    pool: Arc<Mutex<pool::Pool>>,
    /// Whether the renewal loop of the kept slots runs.
    renew_armed: Arc<std::sync::atomic::AtomicBool>,
    /// Polls started on a kept slot, without a Redis call (for tests and the benchmarks).
    reused: Arc<AtomicU64>,
    /// `polling.handler_timeout_secs`: a kept slot is reused only while its lease outlasts a poll,
    /// and a call the poll stopped waiting for counts this long after it was sent ([`abandoned`]).
    handler_timeout: Duration,
    /// Leases held for calls the polls stopped waiting for, per task ([`abandoned`]).
    abandoned: Arc<abandoned::AbandonedCounts>,
    /// Signalled when one of those ends.
    abandoned_ended: Arc<tokio::sync::Notify>,
    /// The first-start mark this process's acquires carry until one is answered (`None`: none):
    /// see [`Budget::record_start`].
    first_start: Arc<Mutex<Option<String>>>,
}

/// The deployment's first worker start, recorded once in PostgreSQL (by this call if it is the
/// first): its moment, PostgreSQL's clock, unix ms.
async fn record_deployment_start(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    // One statement that always returns the row: a pod that starts while another inserts it
    // waits for that insert and then reads its row (ON CONFLICT DO UPDATE locks and returns the
    // existing row; DO NOTHING would return nothing, and a read in the same statement would not
    // see the other pod's row). The update rewrites no field.
    let first: i64 = sqlx::query_scalar(
        "INSERT INTO budget_deployment (id) VALUES (TRUE) \
         ON CONFLICT (id) DO UPDATE SET id = budget_deployment.id \
         RETURNING (extract(epoch FROM started_at) * 1000)::bigint",
    )
    .fetch_one(pool)
    .await
    .context("recording the deployment's first worker start")?;
    Ok(first)
}

impl Budget {
    /// The budget of the deployment `config` describes, on `conn`. Its background releases are
    /// tracked by a shutdown of its own until [`Budget::tracked_by`] names the process's.
    pub fn new(conn: ConnectionManager, config: &Config) -> Self {
        let p = &config.polling;
        Self {
            conn,
            prefix: config.redis.key_prefix.clone(),
            total_limit: p.total_limit,
            carddata_limit: p.carddata.limit,
            card_status_limit: p.card_status.limit,
            lease_ttl: p.lease_ttl(),
            circuit: Arc::from(circuit::packed(&p.circuit)),
            circuit_window_ms: i64::try_from(p.circuit.window_secs.saturating_mul(1000))
                .unwrap_or(i64::MAX),
            held: Arc::default(),
            running: Arc::default(),
            hold_until: Arc::default(),
            closing: Arc::default(),
            acquiring: Arc::default(),
            released: Arc::default(),
            last_invalid_warning: Arc::default(),
            round_trips: Arc::default(),
            owner: Arc::from(crate::pod::process_id()),
            shutdown: Shutdown::new(),
            carried: Arc::default(),
            flush_armed: Arc::default(),
            on_transition: Arc::default(),
            pool: Arc::default(),
            renew_armed: Arc::default(),
            reused: Arc::default(),
            handler_timeout: p.handler_timeout(),
            abandoned: Arc::default(),
            abandoned_ended: Arc::default(),
            first_start: Arc::new(Mutex::new(Some("0".to_owned()))),
        }
    }

    /// Tells the budget when its deployment first started, from the durable record in
    /// PostgreSQL: the first worker start ever writes it (once), before any poll of the
    /// deployment can be admitted. A missing fence hash in Redis is then a data loss (fenced),
    /// except in the first acquire of a process while the deployment is less than half a fence
    /// length old (`budget.lua`, "The fence"): pods that start together with a new deployment
    /// find no hash and are not fenced, whichever acquires first. A budget that is never told
    /// (a test, a benchmark) counts as its deployment's first start, until its first answered
    /// acquire.
    ///
    /// The mark goes to Redis at once (the script's `fence` op), so that a new deployment's
    /// fence hash exists from its first start on, however long its first poll takes to come; if
    /// Redis does not answer, the acquires carry it instead.
    pub async fn record_start(&self, pool: &sqlx::PgPool) -> anyhow::Result<()> {
        let first = record_deployment_start(pool).await?.max(1).to_string();
        let checked: redis::RedisResult<u64> = self
            .invocation("fence")
            .arg(self.fence_ms())
            .arg(&first)
            .invoke_async(&mut self.conn.clone())
            .await;
        if let Ok(mut mark) = self.first_start.lock() {
            *mark = match checked {
                Ok(_) => None,
                Err(e) => {
                    tracing::debug!(error = %e, "the fence is not checked at start; the first acquire checks it");
                    Some(first)
                }
            };
        }
        Ok(())
    }

    /// This budget as one of a deployment that ran before: a missing fence hash is always a
    /// data loss (for tests that play a pod started after one).
    pub fn ran_before(self) -> Self {
        if let Ok(mut mark) = self.first_start.lock() {
            *mark = None;
        }
        self
    }

    /// How long no poll is admitted after Redis may have lost leases (the fence, decided by the
    /// script on Redis's clock): a poll admitted before the loss sends its call within
    /// `handler_timeout_secs` of its admission and the call counts at most `handler_timeout_secs`
    /// after it was sent; a poll may start on a kept slot up to [`pool::VERDICT_FOR`] after the
    /// renewal that allowed it; plus [`FENCE_MARGIN`].
    pub fn fence_length(&self) -> Duration {
        self.handler_timeout * 2 + pool::VERDICT_FOR + FENCE_MARGIN
    }

    fn fence_ms(&self) -> u64 {
        u64::try_from(self.fence_length().as_millis()).unwrap_or(u64::MAX)
    }

    /// This budget with its background releases tracked by the process's `shutdown`, so the
    /// process waits for them before it exits.
    pub fn tracked_by(mut self, shutdown: Shutdown) -> Self {
        self.shutdown = shutdown;
        self
    }

    /// This budget as process `id` sees it (its lease ids' prefix and its entry in the waiters
    /// set): for tests and benchmarks that play several processes in one.
    pub fn with_process_id(mut self, id: &str) -> Self {
        self.owner = Arc::from(id);
        self
    }

    /// The Redis connection the budget uses (shared with the rest of the process).
    pub fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// The deployment's key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Releases `lease` in the background (tracked, so shutdown waits for it): for a lease whose
    /// owner can no longer await the release, such as a dropped guard or a timed-out acquire that
    /// may still have been granted. Release is idempotent.
    pub fn release_in_background(&self, lease: String) {
        let budget = self.clone();
        self.shutdown.spawn_detached(async move {
            if let Err(e) = budget.release(&[lease]).await {
                tracing::debug!(error = %format!("{e:#}"), "background lease release failed; the lease expires");
            }
        });
    }

    /// A fresh lease id: `{host}-{pid}-{ulid}`, so that an operator (or a test) can tell from
    /// the lease sets which process holds which tokens.
    pub fn new_lease_id(&self) -> String {
        format!("{}-{}", self.owner, ulid::Ulid::new())
    }

    /// The config limit of one task.
    pub fn config_limit(&self, task: Task) -> Limit {
        match task {
            Task::Carddata => self.carddata_limit,
            Task::CardStatus => self.card_status_limit,
        }
    }

    /// `polling.lease_ttl_secs`.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// `polling.total_limit`.
    pub fn total_limit(&self) -> Limit {
        self.total_limit
    }

    /// Redis round trips made through this budget (and its clones) so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn invocation(&self, op: &str) -> redis::ScriptInvocation<'static> {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let mut inv = SCRIPT.prepare_invoke();
        inv.key(total_key(&self.prefix))
            .key(task_key(&self.prefix, Task::Carddata))
            .key(task_key(&self.prefix, Task::CardStatus))
            .key(overrides_key(&self.prefix))
            .key(paused_key(&self.prefix))
            .key(circuit::circuit_key(&self.prefix, Task::Carddata))
            .key(circuit::circuit_key(&self.prefix, Task::CardStatus))
            .key(circuit::window_key(&self.prefix, Task::Carddata))
            .key(circuit::window_key(&self.prefix, Task::CardStatus))
            .key(waiters_key(&self.prefix))
            .key(expired_key(&self.prefix))
            .key(kept_key(&self.prefix))
            .key(fence_key(&self.prefix))
            .arg(op);
        inv
    }

    fn task_index(task: Task) -> u8 {
        match task {
            Task::Carddata => 2,
            Task::CardStatus => 3,
        }
    }

    /// Takes a total token and a `task` token under `lease_id`, both or neither, in one script
    /// call, if the task's circuit admits the poll (closed, or half-open with a probe slot free).
    /// The expiry is computed by the script from Redis `TIME`: no timestamp of this process's
    /// clock is passed. The finishes this process carries are released by the same call
    /// (`carry`); none of their leases is taken over, so a granted poll holds `lease_id`.
    pub async fn acquire(&self, task: Task, lease_id: &str) -> anyhow::Result<Acquired> {
        Ok(self.acquire_call(task, lease_id, false).await?.0)
    }

    /// [`Budget::acquire`], but a granted poll may take over the lease of a finish this call
    /// carries (one of its own task when there is one): that member is re-scored in place, in
    /// both sets, instead of being removed and added again, so a slot that turns over costs two
    /// commands fewer. Returns the answer and the lease id the poll holds when
    /// granted: `lease_id`, or the taken-over one. A lease id is then a per-process slot id
    /// (still `{pod}-{pid}-{ulid}`) that passes from poll to poll while the slot stays busy; its
    /// expiry is refreshed by each acquire that takes it, so a crashed process's slots still
    /// expire within `polling.lease_ttl_secs`.
    pub async fn acquire_slot(
        &self,
        task: Task,
        lease_id: &str,
    ) -> anyhow::Result<(Acquired, String)> {
        self.acquire_call(task, lease_id, true).await
    }

    async fn acquire_call(
        &self,
        task: Task,
        lease_id: &str,
        take_over: bool,
    ) -> anyhow::Result<(Acquired, String)> {
        let ttl_ms = u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX);
        type Raw = (
            i64,
            String,
            i64,
            String,
            u64,
            String,
            u64,
            Vec<carry::CarriedAnswer>,
            String,
        );
        if self.closing.load(Ordering::Acquire) {
            anyhow::bail!("the process is stopping: no more {task} polling tokens");
        }
        let _under_way = AcquireUnderWay::start(&self.acquiring);
        // Tracked before the call: if this future is dropped after Redis granted the lease,
        // shutdown still finds it (release is idempotent: a lease never granted costs nothing).
        if let Ok(mut held) = self.held.lock() {
            held.insert(lease_id.to_owned());
        }
        let carried = self.take_carried(take_over.then_some(task));
        let mut inv = self.invocation("acquire");
        inv.arg(Self::task_index(task))
            .arg(task.label())
            .arg(lease_id)
            .arg(self.total_limit.get())
            .arg(self.config_limit(task).get())
            .arg(LIMIT_CEILING)
            .arg(ttl_ms)
            .arg(&*self.circuit)
            .arg(if take_over { "1" } else { "0" })
            .arg(&*self.owner);
        carried.push_args(&mut inv);
        // The first-start mark goes with every call until one is answered: a call that timed out
        // (its future dropped by the caller's timeout) may never have reached Redis.
        let first = self.first_start.lock().ok().and_then(|m| m.clone());
        inv.arg(self.fence_ms())
            .arg(first.as_deref().unwrap_or_default());
        let answer: redis::RedisResult<Raw> = inv.invoke_async(&mut self.conn.clone()).await;
        let (granted, reason, _limit, invalid, round, transition, wait_ms, answers, slot) =
            match answer {
                Ok(raw) => {
                    if first.is_some() {
                        if let Ok(mut mark) = self.first_start.lock() {
                            *mark = None;
                        }
                    }
                    raw
                }
                Err(e) => {
                    // Redis may have run it (a lost reply): give the lease back, in the background.
                    self.release_in_background(lease_id.to_owned());
                    self.hold_for(OUTAGE_HOLD);
                    return Err(
                        anyhow::Error::new(e).context(format!("acquiring {task} polling tokens"))
                    );
                }
            };
        // Settled before the granted lease is recorded as held: a taken-over lease is both one
        // of the carried (no longer held by its finished poll) and the new poll's.
        carried.settle(answers);
        let slot = if slot.is_empty() && granted == 1 {
            lease_id.to_owned()
        } else {
            slot
        };
        if let Ok(mut held) = self.held.lock() {
            if slot != lease_id {
                held.remove(lease_id);
            }
            if granted == 1 {
                held.insert(slot.clone());
            }
        }
        if granted == 1 && self.closing.load(Ordering::Acquire) {
            // Shutdown began while the call was under way: the lease goes straight back.
            self.release(std::slice::from_ref(&slot)).await?;
            anyhow::bail!("the process is stopping: {task} polling tokens given back");
        }
        if !invalid.is_empty() {
            self.warn_invalid_override(task, &invalid);
        }
        if let Some(t) = Transition::parse(&transition, &[]) {
            t.count(task);
            tracing::info!(%task, "Gateway circuit half-open: the cool-down is over, probe polls go through");
        }
        if granted == 1 {
            let answer = if round > 0 {
                Acquired::Probe { round }
            } else {
                Acquired::Acquired
            };
            return Ok((answer, slot));
        }
        let reason = match reason.as_str() {
            "total" => ShortReason::Total,
            "task" => ShortReason::Task,
            "paused" => ShortReason::Paused,
            "fenced" => {
                tracing::debug!(%task, fence_ms = wait_ms, "the budget is fenced after a Redis data loss");
                return Ok((
                    Acquired::Fenced {
                        retry_in: Duration::from_millis(wait_ms),
                    },
                    String::new(),
                ));
            }
            "circuit_open" => {
                return Ok((
                    Acquired::CircuitOpen {
                        retry_in: Duration::from_millis(wait_ms),
                    },
                    String::new(),
                ))
            }
            other => anyhow::bail!("the budget script answered an unknown reason {other:?}"),
        };
        Ok((Acquired::Short { reason }, String::new()))
    }

    /// Records that a poll of `task` runs under `lease` from now on (the poll's lease guard).
    pub fn run_started(&self, task: Task, lease: &str) {
        if let Ok(mut running) = self.running.lock() {
            running.insert(lease.to_owned(), (task, std::time::Instant::now()));
        }
    }

    /// The leases of running polls that began less than `polling.handler_timeout_secs` ago: each
    /// may have a call at the Gateway, which counts until the handler's limit passes.
    fn still_counting(&self) -> HashSet<String> {
        let now = std::time::Instant::now();
        self.running
            .lock()
            .map(|running| {
                running
                    .iter()
                    .filter(|(_, (_, began))| *began + self.handler_timeout > now)
                    .map(|(lease, _)| lease.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Ends the hold of a poll whose task was cancelled before the poll finished (the process
    /// stopped past its shutdown grace): its Gateway call may still be at the Gateway, so its
    /// lease counts until `polling.handler_timeout_secs` after the poll began. It is released
    /// then while this process runs; once shutdown has begun it is left to lapse in Redis, where
    /// it expires no earlier (every poll's lease does, see `admit`). A poll past its handler's
    /// limit gives its lease back at once.
    pub fn leave_unfinished(&self, lease: String) {
        let began = self
            .running
            .lock()
            .ok()
            .and_then(|mut running| running.remove(&lease))
            .map(|(_, began)| began);
        let until = began.map(|b| tokio::time::Instant::from_std(b + self.handler_timeout));
        match until {
            Some(until) if until > tokio::time::Instant::now() => {
                if let Ok(mut held) = self.held.lock() {
                    held.remove(&lease);
                }
                if self.is_closing() {
                    return;
                }
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return;
                };
                let budget = self.clone();
                runtime.spawn(async move {
                    tokio::time::sleep_until(until).await;
                    if let Err(e) = budget.release(&[lease]).await {
                        tracing::debug!(error = %format!("{e:#}"), "releasing a cancelled poll's lease failed; the lease expires");
                    }
                });
            }
            _ => self.release_in_background(lease),
        }
    }

    /// Admits no poll for `d` from now (or until a later hold ends): after a Redis failure, Redis
    /// may come back empty, without the leases of the polls still running, and every process
    /// needs a probe's round to write its own back ([`Budget::reassert_running`]) before a new
    /// poll can be counted against the limits.
    pub fn hold_for(&self, d: Duration) {
        let until = std::time::Instant::now() + d;
        if let Ok(mut hold) = self.hold_until.lock() {
            if hold.is_none_or(|h| h < until) {
                *hold = Some(until);
            }
        }
    }

    /// Whether a hold ([`Budget::hold_for`]) is on now.
    pub fn is_held(&self) -> bool {
        self.hold_until
            .lock()
            .map(|h| h.is_some_and(|until| std::time::Instant::now() < until))
            .unwrap_or(false)
    }

    /// How many of this process's polls run now (under a lease guard).
    pub fn running_polls(&self) -> usize {
        self.running.lock().map(|r| r.len()).unwrap_or(0)
    }

    /// Records that the poll under `lease` is over (its lease guard ended or was dropped).
    pub fn run_ended(&self, lease: &str) {
        if let Ok(mut running) = self.running.lock() {
            running.remove(lease);
        }
    }

    /// Writes the leases of this process's running polls back into Redis where they are missing,
    /// each with a full lease TTL: Redis came back empty while those polls were at the Gateway,
    /// and their tokens must count against the limits until they end. Returns how many were
    /// missing.
    pub async fn reassert_running(&self) -> anyhow::Result<u64> {
        let running: Vec<(String, Task)> = match self.running.lock() {
            Ok(running) => running.iter().map(|(l, (t, _))| (l.clone(), *t)).collect(),
            Err(_) => Vec::new(),
        };
        if running.is_empty() {
            return Ok(0);
        }
        let mut inv = self.invocation("reassert");
        inv.arg(u64::try_from(self.lease_ttl.as_millis()).unwrap_or(u64::MAX));
        for (lease, task) in &running {
            inv.arg(Self::task_index(*task)).arg(lease);
        }
        inv.invoke_async(&mut self.conn.clone())
            .await
            .context("writing the running polls' leases back")
    }

    /// Releases one lease and counts its poll's outcome (about `card_ref`) in the task's circuit,
    /// in one call: the breaker's bookkeeping rides on the release. `probe_round` is
    /// [`Acquired::probe_round`] of the acquire. Idempotent for the lease; a transition is
    /// reported (and counted) by exactly the call that made it.
    pub async fn finish(
        &self,
        task: Task,
        lease_id: &str,
        report: CallReport,
        probe_round: u64,
        card_ref: &str,
    ) -> anyhow::Result<Finished> {
        let (existed, name, numbers): (i64, String, Vec<u64>) = self
            .invocation("finish")
            .arg(Self::task_index(task))
            .arg(lease_id)
            .arg(report.lua())
            .arg(probe_round)
            .arg(&*self.circuit)
            .arg(card_ref)
            .invoke_async(&mut self.conn.clone())
            .await
            .with_context(|| format!("releasing {task} polling tokens"))?;
        if let Ok(mut held) = self.held.lock() {
            held.remove(lease_id);
        }
        self.released.notify_waiters();
        let transition = Transition::parse(&name, &numbers);
        if let Some(t) = transition {
            t.count(task);
        }
        Ok(Finished {
            existed: existed == 1,
            transition,
        })
    }

    /// Forces the task's circuit open (it stays open, without probes, until forced closed) or
    /// closed (window cleared). Returns what it found.
    pub async fn force_circuit(&self, task: Task, open: bool) -> anyhow::Result<Forced> {
        let (before, outage_ms, was_forced): (String, u64, String) = self
            .invocation("circuit_force")
            .arg(Self::task_index(task))
            .arg(if open { "open" } else { "close" })
            .invoke_async(&mut self.conn.clone())
            .await
            .with_context(|| format!("forcing the {task} circuit"))?;
        let before = CircuitState::parse(&before);
        let after = if open { "open" } else { "closed" };
        if before.label() != after {
            metrics::counter!(m::GATEWAY_CIRCUIT_TRANSITIONS, "task" => task.label(), "to" => after)
                .increment(1);
        }
        Ok(Forced {
            before,
            was_forced: was_forced == "1",
            outage_ms,
        })
    }

    fn warn_invalid_override(&self, task: Task, raw: &str) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let last = self.last_invalid_warning.load(Ordering::Relaxed);
        if now >= last.saturating_add(60)
            && self
                .last_invalid_warning
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                task = task.label(),
                stored = %raw,
                config_limit = self.config_limit(task).get(),
                key = %overrides_key(&self.prefix),
                "invalid budget override in Redis ignored; the config limit applies \
                 (fix it with `cardworker budget set` or `budget clear`)"
            );
        }
    }

    /// Releases leases (from every set), in one call. Idempotent: releasing a lease that was
    /// already released or has expired does nothing. Returns how many still existed.
    pub async fn release(&self, lease_ids: &[String]) -> anyhow::Result<u64> {
        if lease_ids.is_empty() {
            return Ok(0);
        }
        let existed: u64 = self
            .invocation("release")
            .arg(lease_ids)
            .invoke_async(&mut self.conn.clone())
            .await
            .context("releasing polling tokens")?;
        if let Ok(mut held) = self.held.lock() {
            for id in lease_ids {
                held.remove(id);
            }
        }
        self.released.notify_waiters();
        Ok(existed)
    }

    /// Releases every lease this process still holds, in one call (shutdown), after sending the
    /// finishes still carried (so that their outcomes count in the circuits) and after the calls
    /// its polls stopped waiting for are over ([`abandoned`], at most `handler_timeout_secs`). From now on no
    /// acquire is sent, and one answered later gives its lease back itself; the acquires under
    /// way are awaited first (at most [`ACQUIRES_DRAIN_FOR`]), and the lease of one still not
    /// answered then (or dropped unanswered) is released too: it was tracked before its call, and
    /// this release reaches Redis after it on the same connection. Returns how many went back:
    /// the carried finishes sent plus the held leases Redis still had.
    pub async fn release_held(&self) -> anyhow::Result<u64> {
        self.closing.store(true, Ordering::Release);
        // No poll starts on a kept slot any more; each finish goes back through `carry`.
        self.drain_pool();
        let deadline = tokio::time::Instant::now() + ACQUIRES_DRAIN_FOR;
        loop {
            let (count, ended) = &*self.acquiring;
            let notified = ended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if count.load(Ordering::Acquire) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                tracing::warn!(
                    "acquires still under way at shutdown; their leases are released unanswered"
                );
                break;
            }
        }
        // A call a poll stopped waiting for keeps its tokens until it is answered or
        // `handler_timeout_secs` after it was sent: the release waits for those (within that).
        self.abandoned_drained(self.handler_timeout).await;
        self.drain_pool();
        let carried = match self.flush_carried().await {
            Ok(sent) => sent as u64,
            Err(e) => {
                tracing::debug!(error = %format!("{e:#}"), "flushing finished polls before the release failed");
                0
            }
        };
        // A poll still running past the grace may have its call at the Gateway: its lease is
        // left to lapse in Redis (no earlier than the handler's limit), not given back now.
        let counting = self.still_counting();
        if !counting.is_empty() {
            tracing::info!(
                polls = counting.len(),
                "polls still running at shutdown: their leases count until the handler's limit and lapse in Redis"
            );
        }
        let ids: Vec<String> = self
            .held
            .lock()
            .map(|h| h.difference(&counting).cloned().collect())
            .unwrap_or_default();
        Ok(carried + self.release(&ids).await?)
    }

    /// Whether shutdown has begun releasing this process's leases ([`Budget::release_held`]).
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// How many leases this process holds right now.
    pub fn held_count(&self) -> usize {
        self.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    /// Resolves when this process next releases a token.
    pub(crate) fn released(&self) -> tokio::sync::futures::Notified<'_> {
        self.released.notified()
    }

    /// Unexpired leases per scope (`total`, `carddata`, `card_status`), fleet-wide.
    pub async fn in_use(&self) -> anyhow::Result<BTreeMap<&'static str, u64>> {
        let view = self.show().await?;
        let mut out = BTreeMap::new();
        out.insert("total", view.total.in_use);
        for task in Task::ALL {
            out.insert(
                task.label(),
                view.tasks.get(task.label()).map_or(0, |t| t.in_use),
            );
        }
        Ok(out)
    }

    /// Limits, overrides, pauses, tokens in use (running polls) and kept (idle slots), and
    /// circuits, in one script call.
    pub async fn show(&self) -> anyhow::Result<BudgetView> {
        type Raw = (
            u64,
            u64,
            u64,
            Vec<String>,
            Vec<String>,
            Vec<String>,
            Vec<String>,
            Vec<String>,
            Vec<String>,
            i64,
            Vec<Option<u64>>,
            Vec<u64>,
        );
        let (
            total,
            carddata,
            card_status,
            overrides,
            paused,
            data_circuit,
            status_circuit,
            data_window,
            status_window,
            now_ms,
            expired,
            kept,
        ): Raw = self
            .invocation("show")
            .invoke_async(&mut self.conn.clone())
            .await
            .context("reading the polling budget")?;
        let overrides: BTreeMap<String, String> = overrides
            .chunks_exact(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect();
        let expired_of = |i: usize| expired.get(i).copied().flatten().unwrap_or(0);
        // A task's leases are its running polls and its kept idle slots (the script counts only
        // kept slots that are still leases, so `kept` never exceeds the leases).
        let kept_of = |i: usize, leases: u64| kept.get(i).copied().unwrap_or(0).min(leases);
        let (data_kept, status_kept) = (kept_of(0, carddata), kept_of(1, card_status));
        let total_kept = (data_kept + status_kept).min(total);
        let mut tasks = BTreeMap::new();
        for (task, (leases, kept), circuit, window, leases_expired) in [
            (
                Task::Carddata,
                (carddata, data_kept),
                data_circuit,
                data_window,
                expired_of(1),
            ),
            (
                Task::CardStatus,
                (card_status, status_kept),
                status_circuit,
                status_window,
                expired_of(2),
            ),
        ] {
            let config_limit = self.config_limit(task);
            let raw = overrides.get(task.label());
            let valid = raw.and_then(|r| r.parse::<Limit>().ok());
            let invalid = match (raw, valid) {
                (Some(r), None) => Some(r.clone()),
                _ => None,
            };
            tasks.insert(
                task.label().to_owned(),
                TaskView {
                    limit: valid.unwrap_or(config_limit).min(self.total_limit),
                    config_limit,
                    override_limit: valid,
                    invalid_override: invalid,
                    paused: paused.iter().any(|p| p == task.label()),
                    in_use: leases - kept,
                    kept,
                    leases_expired,
                    circuit: CircuitView::from_raw(
                        &circuit,
                        &window,
                        now_ms,
                        self.circuit_window_ms,
                    ),
                },
            );
        }
        Ok(BudgetView {
            total: TotalView {
                limit: self.total_limit,
                in_use: total - total_kept,
                kept: total_kept,
                leases_expired: expired_of(0),
            },
            tasks,
        })
    }

    /// Sets a runtime override of `task`'s limit (checked against the total by
    /// [`crate::commands::budget::validate_override`]).
    pub async fn set_override(&self, task: Task, limit: Limit) -> anyhow::Result<()> {
        let _: i64 = redis::cmd("HSET")
            .arg(overrides_key(&self.prefix))
            .arg(task.label())
            .arg(limit.get())
            .query_async(&mut self.conn.clone())
            .await
            .with_context(|| format!("setting the {task} budget override"))?;
        Ok(())
    }

    /// Clears the runtime override of `task`'s limit (the config value applies again). Returns
    /// whether there was one.
    pub async fn clear_override(&self, task: Task) -> anyhow::Result<bool> {
        let removed: i64 = redis::cmd("HDEL")
            .arg(overrides_key(&self.prefix))
            .arg(task.label())
            .query_async(&mut self.conn.clone())
            .await
            .with_context(|| format!("clearing the {task} budget override"))?;
        Ok(removed > 0)
    }

    /// Pauses tasks: their jobs are deferred instead of run. Running jobs finish.
    pub async fn pause(&self, tasks: &[Task]) -> anyhow::Result<()> {
        let labels: Vec<&str> = tasks.iter().map(|t| t.label()).collect();
        let _: i64 = redis::cmd("SADD")
            .arg(paused_key(&self.prefix))
            .arg(&labels)
            .query_async(&mut self.conn.clone())
            .await
            .context("pausing polling tasks")?;
        Ok(())
    }

    /// Lifts the pause of tasks.
    pub async fn resume(&self, tasks: &[Task]) -> anyhow::Result<()> {
        let labels: Vec<&str> = tasks.iter().map(|t| t.label()).collect();
        let _: i64 = redis::cmd("SREM")
            .arg(paused_key(&self.prefix))
            .arg(&labels)
            .query_async(&mut self.conn.clone())
            .await
            .context("resuming polling tasks")?;
        Ok(())
    }

    /// Reads the budget ([`Budget::show`]) and publishes `cardworker_poll_tokens_in_use{scope}`,
    /// `cardworker_poll_tokens_kept{scope}`, `cardworker_poll_limit{scope}`, `cardworker_budget_leases_expired_total{scope}` (the fleet's
    /// count, read from Redis) and `cardworker_gateway_circuit_open{task}` (the fleet-wide gauges'
    /// background refresh, `telemetry::fleet`).
    pub async fn publish_gauges(&self) -> anyhow::Result<()> {
        let view = self.show().await?;
        metrics::gauge!(m::POLL_TOKENS_IN_USE, "scope" => "total").set(view.total.in_use as f64);
        metrics::gauge!(m::POLL_TOKENS_KEPT, "scope" => "total").set(view.total.kept as f64);
        metrics::gauge!(m::POLL_LIMIT, "scope" => "total").set(f64::from(view.total.limit));
        metrics::counter!(m::BUDGET_LEASES_EXPIRED, "scope" => "total")
            .absolute(view.total.leases_expired);
        for task in Task::ALL {
            if let Some(t) = view.tasks.get(task.label()) {
                metrics::gauge!(m::POLL_TOKENS_IN_USE, "scope" => task.label())
                    .set(t.in_use as f64);
                metrics::gauge!(m::POLL_TOKENS_KEPT, "scope" => task.label()).set(t.kept as f64);
                metrics::gauge!(m::POLL_LIMIT, "scope" => task.label()).set(f64::from(t.limit));
                metrics::counter!(m::BUDGET_LEASES_EXPIRED, "scope" => task.label())
                    .absolute(t.leases_expired);
                metrics::gauge!(m::GATEWAY_CIRCUIT_OPEN, "task" => task.label())
                    .set(t.circuit.gauge());
            }
        }
        Ok(())
    }
}
