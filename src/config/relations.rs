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
use super::types::Config;

/// One relation: its key, the key it is checked against, both values (in that order), whether
/// they break it, and what is allowed given the other value.
struct Relation {
    key: &'static str,
    other: &'static str,
    values: fn(&Config) -> (u64, u64),
    broken: fn(u64, u64) -> bool,
    allowed: fn(u64) -> String,
}

fn task_limit_allowed(total: u64) -> String {
    format!(
        "{}, and at most polling.total_limit ({total})",
        limit_allowed()
    )
}

/// Every relation, in the order its problems are reported.
const RELATIONS: &[Relation] = &[
    Relation {
        key: "polling.carddata.limit",
        other: "polling.total_limit",
        values: |c| {
            (
                c.polling.carddata.limit.into(),
                c.polling.total_limit.into(),
            )
        },
        broken: |limit, total| limit > total,
        allowed: task_limit_allowed,
    },
    Relation {
        key: "polling.card_status.limit",
        other: "polling.total_limit",
        values: |c| {
            (
                c.polling.card_status.limit.into(),
                c.polling.total_limit.into(),
            )
        },
        broken: |limit, total| limit > total,
        allowed: task_limit_allowed,
    },
    Relation {
        key: "polling.handler_timeout_secs",
        other: "gateway.timeout_ms",
        values: |c| (c.polling.handler_timeout_secs, c.gateway.timeout_ms),
        broken: |secs, ms| secs.saturating_mul(1000) <= ms.saturating_add(1000),
        allowed: |ms| {
            format!(
                "must be greater than gateway.timeout_ms + 1 s ({ms} ms + 1000 ms), i.e. at \
                 least {}",
                ms.saturating_add(1000) / 1000 + 1
            )
        },
    },
    Relation {
        key: "polling.lease_ttl_secs",
        other: "polling.handler_timeout_secs",
        values: |c| (c.polling.lease_ttl_secs, c.polling.handler_timeout_secs),
        broken: |lease, handler| lease < handler.saturating_add(5),
        allowed: |handler| {
            format!(
                "must be at least polling.handler_timeout_secs + 5 ({handler} + 5 = {}) \
                 and at most 3600",
                handler.saturating_add(5)
            )
        },
    },
    Relation {
        key: "polling.defer_max_delay_secs",
        other: "polling.defer_delay_secs",
        values: |c| (c.polling.defer_max_delay_secs, c.polling.defer_delay_secs),
        broken: |max, first| max < first,
        allowed: |first| {
            format!("must be at least polling.defer_delay_secs ({first}) and at most 600")
        },
    },
    Relation {
        key: "polling.circuit.max_cooldown_secs",
        other: "polling.circuit.cooldown_secs",
        values: |c| {
            let circuit = &c.polling.circuit;
            (circuit.max_cooldown_secs, circuit.cooldown_secs)
        },
        broken: |max, first| max < first,
        allowed: |first| {
            format!("must be at least polling.circuit.cooldown_secs ({first}) and at most 3600")
        },
    },
    Relation {
        key: "polling.circuit.min_calls",
        other: "polling.circuit.window_calls",
        values: |c| {
            let circuit = &c.polling.circuit;
            (circuit.min_calls.into(), circuit.window_calls.into())
        },
        broken: |min, window| min > window,
        allowed: |window| {
            format!(
                "must be at most polling.circuit.window_calls ({window}): the window could never \
                 hold enough calls to open the circuit"
            )
        },
    },
    Relation {
        key: "polling.circuit.min_failing_cards",
        other: "polling.circuit.min_calls",
        values: |c| {
            let circuit = &c.polling.circuit;
            (circuit.min_failing_cards.into(), circuit.min_calls.into())
        },
        broken: |cards, min| cards > min,
        allowed: |min| format!("must be at most polling.circuit.min_calls ({min})"),
    },
];

/// Checks the relations between keys; a key already refused is not checked again. Each problem
/// names the source of its key and of the key it was checked against, since either may be the
/// one to change (a file's `total_limit = 3` against a default task limit of 4, say).
pub(super) fn check_relations(
    c: &Config,
    bad: &BTreeSet<&'static str>,
    sources: &Sources,
) -> Vec<Problem> {
    RELATIONS
        .iter()
        .filter(|r| !bad.contains(r.key) && !bad.contains(r.other))
        .filter_map(|r| {
            let (value, other) = (r.values)(c);
            (r.broken)(value, other).then(|| {
                Problem::new(
                    r.key,
                    value.to_string(),
                    sources.of(r.key),
                    (r.allowed)(other),
                )
                .checked_against(r.other, other, sources.of(r.other))
            })
        })
        .collect()
}
