//! The inventory of every Redis key pattern cardworker writes, with its owner and its lifetime
//! (no key grows with time; a key of a card goes with the card's chain, a key of an hour or a day
//! has a TTL).
//!
//! The harness checks every prefix it cleans up against it (`harness::inventory`, so every test
//! binary that uses the harness does); the tests of the inventory itself are in
//! `tests/it/key_inventory.rs`.
//!
//! It is enforced on the whole integration suite: every test's prefix is scanned when its
//! [`crate::harness::TestRedis`] guard drops (before the keys are deleted), and a key that matches
//! no pattern here, or a key of a TTL pattern without an expiry, fails that test. So a new writer
//! anywhere in the product fails `make test` until its keys are listed here, with a lifetime. The
//! table is mirrored for operators in docs/RUNBOOK.md ("Redis keys"), which a test here keeps in
//! step.
//!
//! Pattern syntax: the deployment prefix is `<prefix>`; any other `<name>` stands for a
//! non-empty, `:`-free part of one segment; everything else is literal (`{budget}` is a literal
//! Redis hash tag, and so are the braces of `{poll:<task>:<shard>}`).

use redis::aio::ConnectionManager;
use redis::AsyncCommands as _;

/// How long a key of a pattern lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// One key (or one per task or queue) for the deployment: a fixed number, whatever the fleet
    /// size or uptime.
    Deployment,
    /// Holds one entry per card with a live chain; the entry goes when the chain ends.
    PerChain,
    /// Holds entries of jobs waiting or in flight; each leaves when its job is fed, done
    /// (`queue::backend`'s acknowledgement) or trimmed (`queue::intake::trim`: dead after 7 days,
    /// an older release's done jobs at once).
    Jobs,
    /// One key per job, deleted by its acknowledgement when the job is done (dead: by the trim,
    /// after 7 days).
    PerJob,
    /// One key per worker instance, removed once apalis drops the worker (`trim_workers`), or,
    /// for a set, gone with its last member.
    PerWorker,
    /// Expires: a TTL of at most this many seconds is set when the key is created (checked).
    Ttl(i64),
}

/// One key pattern.
#[derive(Debug, Clone, Copy)]
pub struct KeyPattern {
    /// The key, with `<prefix>` and placeholders.
    pub pattern: &'static str,
    /// Who writes it.
    pub owner: &'static str,
    /// How long it lives.
    pub lifetime: Lifetime,
}

const fn k(pattern: &'static str, owner: &'static str, lifetime: Lifetime) -> KeyPattern {
    KeyPattern {
        pattern,
        owner,
        lifetime,
    }
}

use Lifetime::*;

/// Every key pattern the product writes under `redis.key_prefix`.
pub const INVENTORY: &[KeyPattern] = &[
    // The polling due queue (src/polling/due_queue.rs, jobs/src/due_queue.lua).
    k(
        "<prefix>:{poll:<task>:<shard>}:due",
        "polling due queue: card -> due ms, or 2^50 + a lease's deadline while a poll holds the card",
        PerChain,
    ),
    k(
        "<prefix>:{poll:<task>:<shard>}:state",
        "polling due queue: card -> unchanged-poll tally + next poll's failures and deferrals",
        PerChain,
    ),
    k(
        "<prefix>:{poll:<task>:<shard>}:last_lease",
        "polling due queue: the shard's last lease score",
        Deployment,
    ),
    // The chains of the release before the due queue: read and removed once, as a worker starts
    // (src/polling/takeover.rs).
    k(
        "<prefix>:chain:<task>",
        "the release before's polling chains: card -> chain id + tally + next job's state; moved into the due queue at start",
        PerChain,
    ),
    k(
        "<prefix>:chain:<task>:due",
        "the release before's chain due set: card -> due ms (or 2^50 + the fed job's turn); moved into the due queue at start",
        PerChain,
    ),
    k(
        "<prefix>:chain:<task>:late",
        "the release before's late set of deferred polls; deleted at start",
        PerChain,
    ),
    k(
        "<prefix>:reconcile:cursor:<task>",
        "polling reconcile: the cursor walk's position",
        Deployment,
    ),
    // Unchanged polls (src/polling/unchanged.rs).
    k(
        "<prefix>:unchanged_total:<task>:<hour>",
        "unchanged polls: fleet-wide count per task and UTC hour",
        Ttl(49 * 3600),
    ),
    k(
        "<prefix>:outcome_total:<task>:<outcome>:<hour>",
        "recorded polls (persisted_change, persisted_failure): fleet-wide count per task, outcome and UTC hour (the console's chart)",
        Ttl(49 * 3600),
    ),
    // Intake (src/queue, jobs/src/lib.rs).
    k(
        "<prefix>:intake:<queue>",
        "intake: waiting entries with a payload of their own (not a chain's poll), entry id -> due ms",
        Jobs,
    ),
    k(
        "<prefix>:intake:<queue>:payload",
        "intake: waiting entries' payloads",
        Jobs,
    ),
    k(
        "<prefix>:intakes:due",
        "intake feeder: the earliest waiting entry of each queue (intake or chain due set)",
        Deployment,
    ),
    k(
        "<prefix>:claim:<queue>:tick:<ts>",
        "cron ticks (runner::spawn, Producer::enqueue_once): one job per tick",
        Ttl(24 * 3600),
    ),
    // apalis-redis 1.0 under the queue name (fed by feed.lua, trimmed by trim.lua).
    k(
        "<prefix>:q:<queue>:active",
        "apalis-redis: ids ready to fetch",
        Jobs,
    ),
    k(
        "<prefix>:q:<queue>:scheduled",
        "apalis-redis: ids scheduled for later",
        Jobs,
    ),
    k(
        "<prefix>:q:<queue>:data",
        "apalis-redis: job payloads by id",
        Jobs,
    ),
    k(
        "<prefix>:q:<queue>:signal",
        "apalis-redis: the fetch wake-up list (one element)",
        Deployment,
    ),
    k(
        "<prefix>:q:<queue>:done",
        "apalis-redis: done ids of an older release's acknowledgements, until the trim",
        Jobs,
    ),
    k(
        "<prefix>:q:<queue>:dead",
        "apalis-redis: dead ids, trimmed after 7 days",
        Jobs,
    ),
    k(
        "<prefix>:q:<queue>:failed",
        "apalis-redis: failed ids (retries)",
        Jobs,
    ),
    k(
        "<prefix>:q:<queue>:meta:<id>",
        "feed.lua: one job's status (read by an older release's fetch; deleted by the ack)",
        PerJob,
    ),
    k(
        "<prefix>:q:<queue>:inflight:<worker>",
        "apalis-redis: a worker's jobs in flight",
        PerWorker,
    ),
    k(
        "<prefix>:q:<queue>:workers",
        "apalis-redis: worker heartbeats",
        Deployment,
    ),
    k(
        "<prefix>:q:<queue>:workers:metadata:<worker>",
        "apalis-redis: one worker's metadata",
        PerWorker,
    ),
    // Budget and circuit (src/budget).
    k(
        "<prefix>:{budget}:total",
        "budget: leases of every task",
        Jobs,
    ),
    k(
        "<prefix>:{budget}:task:<task>",
        "budget: one task's leases",
        Jobs,
    ),
    k(
        "<prefix>:{budget}:overrides",
        "budget: runtime limit overrides (`budget set`)",
        Deployment,
    ),
    k(
        "<prefix>:{budget}:paused",
        "budget: paused tasks (`budget pause`)",
        Deployment,
    ),
    k(
        "<prefix>:{budget}:expired",
        "budget: leases ended by expiry instead of a release, per scope (a counter)",
        Deployment,
    ),
    k(
        "<prefix>:{budget}:kept",
        "budget: each process's idle kept slots at its last renewal (show tells them from running polls)",
        Deployment,
    ),
    k(
        "<prefix>:{budget}:fence",
        "budget: the run_id of the server holding the budget and the end of the fence after a data loss",
        Deployment,
    ),
    k(
        "<prefix>:{budget}:waiters",
        "budget: processes refused a token lately (the others stop keeping idle slots)",
        Ttl(2),
    ),
    k(
        "<prefix>:{budget}:circuit:<task>",
        "Gateway circuit: one task's state",
        Deployment,
    ),
    k(
        "<prefix>:{budget}:circuit:<task>:window",
        "Gateway circuit: one task's recent outcomes (bounded list)",
        Deployment,
    ),
    // Maintenance (src/maintenance).
    k(
        "<prefix>:maintenance:paused",
        "maintenance: the runtime brake",
        Deployment,
    ),
    k(
        "<prefix>:maintenance:last_day:<job>",
        "maintenance: the last processed day per job",
        Deployment,
    ),
    // The Redis probe (src/runner/redis_watch.rs).
    k(
        "<prefix>:redis_epoch",
        "Redis probe: the epoch marker whose absence means data loss",
        Deployment,
    ),
];

/// A segment matches a literal segment exactly, and a segment with a placeholder (`<name>`,
/// with literal text before or after it, as in `<shard>}`) when it has that text around a
/// non-empty middle.
fn segment_matches(pattern: &str, segment: &str) -> bool {
    match (pattern.find('<'), pattern.find('>')) {
        (Some(open), Some(close)) if open < close => {
            let (before, after) = (&pattern[..open], &pattern[close + 1..]);
            segment.len() > before.len() + after.len()
                && segment.starts_with(before)
                && segment.ends_with(after)
        }
        _ => pattern == segment,
    }
}

/// Whether `key` (with the prefix already replaced by `<prefix>`) matches `pattern`.
pub fn matches(pattern: &str, key: &str) -> bool {
    let (p, k): (Vec<&str>, Vec<&str>) = (pattern.split(':').collect(), key.split(':').collect());
    p.len() == k.len() && p.iter().zip(&k).all(|(p, k)| segment_matches(p, k))
}

/// The pattern `key` of `prefix` belongs to.
pub fn classify(prefix: &str, key: &str) -> Option<&'static KeyPattern> {
    let rest = key.strip_prefix(prefix)?;
    let name = format!("<prefix>{rest}");
    INVENTORY.iter().find(|p| matches(p.pattern, &name))
}

/// What is wrong with the keys of `prefix`: keys no pattern names, and keys of a TTL pattern
/// without an expiry (or with a longer one than listed).
pub async fn violations(
    conn: &mut ConnectionManager,
    prefix: &str,
    keys: &[String],
) -> Vec<String> {
    let mut out = Vec::new();
    for key in keys {
        match classify(prefix, key) {
            None => out.push(format!("{key}: written under the prefix but not in the key inventory (test-kit/src/inventory.rs)")),
            Some(KeyPattern { pattern, owner, lifetime: Ttl(max) }) => {
                let ttl: i64 = conn.ttl(key).await.unwrap_or(-2);
                // -2: gone meanwhile (expired or deleted), which is fine.
                if ttl == -1 || ttl > *max {
                    out.push(format!("{key} ({pattern}, {owner}): listed as expiring within {max} s, but its TTL is {ttl}"));
                }
            }
            Some(_) => {}
        }
    }
    out
}
