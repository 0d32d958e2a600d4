//! The relations between keys, checked on the deserialized [`Config`] once every value has
//! passed its own rule: a task's limit against `polling.total_limit`, the handler timeout against
//! the gateway timeout, the lease against the handler timeout, the defer cap against the first
//! delay, the circuit's minimum against its window and its cool-down cap against the first
//! cool-down. Each is what keeps a token lease from expiring under a running poll, a budget from
//! promising more than the total, or a circuit from being unable to open.

use std::collections::BTreeSet;

use super::error::Problem;
use super::rules::limit_allowed;
use super::source::Sources;
use super::types::{Config, Task};

/// Checks the relations between keys; a key already refused is not checked again. Each problem
/// names the source of its key and of the key it was checked against, since either may be the
/// one to change (a file's `total_limit = 3` against a default task limit of 4, say).
pub(super) fn check_relations(
    c: &Config,
    bad: &BTreeSet<&'static str>,
    sources: &Sources,
) -> Vec<Problem> {
    let ok = |keys: &[&str]| keys.iter().all(|k| !bad.contains(k));
    let mut problems = Vec::new();
    let p = &c.polling;

    for task in Task::ALL {
        let key = format!("polling.{}.limit", task.label());
        let limit = p.task(task).limit;
        if ok(&[key.as_str(), "polling.total_limit"]) && limit > p.total_limit {
            let allowed = format!(
                "{}, and at most polling.total_limit ({})",
                limit_allowed(),
                p.total_limit
            );
            let source = sources.of(&key);
            problems.push(
                Problem::new(key, limit.to_string(), source, allowed).checked_against(
                    "polling.total_limit",
                    p.total_limit,
                    sources.of("polling.total_limit"),
                ),
            );
        }
    }

    let gateway_plus_one = c.gateway.timeout_ms.saturating_add(1000);
    if ok(&["polling.handler_timeout_secs", "gateway.timeout_ms"])
        && p.handler_timeout_secs.saturating_mul(1000) <= gateway_plus_one
    {
        let key = "polling.handler_timeout_secs";
        let allowed = format!(
            "must be greater than gateway.timeout_ms + 1 s ({} ms + 1000 ms), i.e. at least {}",
            c.gateway.timeout_ms,
            gateway_plus_one / 1000 + 1
        );
        problems.push(
            Problem::new(
                key,
                p.handler_timeout_secs.to_string(),
                sources.of(key),
                allowed,
            )
            .checked_against(
                "gateway.timeout_ms",
                c.gateway.timeout_ms,
                sources.of("gateway.timeout_ms"),
            ),
        );
    }

    let lease_min = p.handler_timeout_secs.saturating_add(5);
    if ok(&["polling.lease_ttl_secs", "polling.handler_timeout_secs"])
        && p.lease_ttl_secs < lease_min
    {
        let key = "polling.lease_ttl_secs";
        let allowed = format!(
            "must be at least polling.handler_timeout_secs + 5 ({} + 5 = {lease_min}) \
             and at most 3600",
            p.handler_timeout_secs
        );
        problems.push(
            Problem::new(key, p.lease_ttl_secs.to_string(), sources.of(key), allowed)
                .checked_against(
                    "polling.handler_timeout_secs",
                    p.handler_timeout_secs,
                    sources.of("polling.handler_timeout_secs"),
                ),
        );
    }

    for (key, value, other, other_value, hi) in [
        (
            "polling.defer_max_delay_secs",
            p.defer_max_delay_secs,
            "polling.defer_delay_secs",
            p.defer_delay_secs,
            600,
        ),
        (
            "polling.circuit.max_cooldown_secs",
            p.circuit.max_cooldown_secs,
            "polling.circuit.cooldown_secs",
            p.circuit.cooldown_secs,
            3600,
        ),
    ] {
        if ok(&[key, other]) && value < other_value {
            let allowed = format!("must be at least {other} ({other_value}) and at most {hi}");
            problems.push(
                Problem::new(key, value.to_string(), sources.of(key), allowed).checked_against(
                    other,
                    other_value,
                    sources.of(other),
                ),
            );
        }
    }

    let c = &p.circuit;
    if ok(&["polling.circuit.min_calls", "polling.circuit.window_calls"])
        && c.min_calls > c.window_calls
    {
        let key = "polling.circuit.min_calls";
        let allowed = format!(
            "must be at most polling.circuit.window_calls ({}): the window could never hold \
             enough calls to open the circuit",
            c.window_calls
        );
        problems.push(
            Problem::new(key, c.min_calls.to_string(), sources.of(key), allowed).checked_against(
                "polling.circuit.window_calls",
                c.window_calls,
                sources.of("polling.circuit.window_calls"),
            ),
        );
    }
    if ok(&[
        "polling.circuit.min_failing_cards",
        "polling.circuit.min_calls",
    ]) && c.min_failing_cards > c.min_calls
    {
        let key = "polling.circuit.min_failing_cards";
        let allowed = format!(
            "must be at most polling.circuit.min_calls ({})",
            c.min_calls
        );
        problems.push(
            Problem::new(
                key,
                c.min_failing_cards.to_string(),
                sources.of(key),
                allowed,
            )
            .checked_against(
                "polling.circuit.min_calls",
                c.min_calls,
                sources.of("polling.circuit.min_calls"),
            ),
        );
    }
    problems
}
