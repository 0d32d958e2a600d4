//! Who this process is, in the fleet: one place for the pod identity that worker names, lease
//! owners and logs carry.
//!
//! The pod name comes from env `CARDWORKER_POD_NAME` (the Deployment sets it from the downward
//! API), else `HOSTNAME` (a container's host name is its pod name), else `local`. It is read once
//! per process: the identity of a running process never changes.

use std::sync::OnceLock;

/// The pod name of this process.
pub fn name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        std::env::var("CARDWORKER_POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .ok()
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| "local".to_owned())
    })
}

/// `{pod}-{pid}`: this process, as the owner of the polling leases it holds.
pub fn process_id() -> String {
    format!("{}-{}", name(), std::process::id())
}

/// A unique apalis worker name of kind `kind`: apalis refuses a name it saw within a heartbeat,
/// and pods restart with the same host name, so a fresh ULID is part of it.
pub fn worker_name(kind: &str) -> String {
    format!("{kind}-{}-{}", name(), ulid::Ulid::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_names_of_one_kind_are_unique_and_name_the_kind_and_pod() {
        let a = worker_name("carddata");
        let b = worker_name("carddata");
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("carddata-{}-", name())), "{a}");
    }
}
