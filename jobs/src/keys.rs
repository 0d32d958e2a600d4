//! Redis key names shared by producers and the worker. Every key lives under the deployment's
//! `redis.key_prefix`.

/// The apalis queue name (apalis hangs its own keys under it: `…:active`, `…:data`, …).
pub fn queue(prefix: &str, queue: &str) -> String {
    format!("{prefix}:q:{queue}")
}

/// The intake sorted set of a queue (member: entry id, score: due unix ms on the Redis clock).
pub fn intake(prefix: &str, queue: &str) -> String {
    format!("{prefix}:intake:{queue}")
}

/// The intake payload hash of a queue (entry id -> JSON payload).
pub fn intake_payload(prefix: &str, queue: &str) -> String {
    format!("{prefix}:intake:{queue}:payload")
}

/// A one-off claim, for example one cron tick.
pub fn claim(prefix: &str, claim: &str) -> String {
    format!("{prefix}:claim:{claim}")
}
