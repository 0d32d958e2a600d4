//! The relations between keys, checked on the deserialized [`Config`] once every value has
//! passed its own rule: a task's limit against `polling.total_limit`, the handler timeout against
//! the gateway timeout, the lease against the handler timeout, the defer cap against the first
//! delay, the circuit's minimum against its window and its cool-down cap against the first
//! cool-down. Each is what keeps a token lease from expiring under a running poll, a budget from
//! promising more than the total, or a circuit from being unable to open.

use std::collections::BTreeSet;

use toml::Table;

use super::error::{ConfigError, Problem};
use super::rules::{check_values, limit_allowed};
use super::source::{Source, Sources};
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
impl Config {
    /// Validates a configuration built in code (loading already does this); reports every
    /// problem at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let table = Table::try_from(self)?;
        // A config built in code has no layers to point at.
        let sources = Sources::all_from(Source::Code);
        let (mut problems, bad) = check_values(&table, &sources);
        problems.extend(check_relations(self, &bad, &sources));
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::{
        env_source, file_source, from_str, from_str_env, problem_for, problems,
    };
    use crate::config::Source;

    #[test]
    fn task_limit_above_the_total_is_refused() {
        let p = problem_for(
            from_str("[polling]\ntotal_limit = 3\n[polling.carddata]\nlimit = 4"),
            "polling.carddata.limit",
        );
        assert_eq!(p.value, "4");
        assert!(p.allowed.contains("at most polling.total_limit (3)"), "{p}");
        // card_status keeps its default 4, also above 3.
        let all = problems(from_str("polling.total_limit = 3"));
        assert_eq!(all.len(), 2, "{all:?}");
    }

    #[test]
    fn handler_timeout_must_exceed_gateway_timeout_plus_one_second() {
        // 5000 ms + 1 s = 6 s: 6 is refused, 7 accepted.
        let p = problem_for(
            from_str("polling.handler_timeout_secs = 6\npolling.lease_ttl_secs = 60"),
            "polling.handler_timeout_secs",
        );
        assert!(p.allowed.contains("at least 7"), "{p}");
        from_str("polling.handler_timeout_secs = 7").expect("valid");
        // Raising the gateway timeout above the handler timeout is refused too.
        let p = problem_for(
            from_str("gateway.timeout_ms = 15000"),
            "polling.handler_timeout_secs",
        );
        assert!(p.allowed.contains("15000 ms"), "{p}");
    }

    #[test]
    fn lease_ttl_must_cover_handler_timeout_plus_five_seconds() {
        let p = problem_for(
            from_str("polling.handler_timeout_secs = 15\npolling.lease_ttl_secs = 19"),
            "polling.lease_ttl_secs",
        );
        assert!(p.allowed.contains("15 + 5 = 20"), "{p}");
        from_str("polling.handler_timeout_secs = 15\npolling.lease_ttl_secs = 20").expect("valid");
        problem_for(
            from_str("polling.lease_ttl_secs = 3601"),
            "polling.lease_ttl_secs",
        );
    }

    #[test]
    fn circuit_min_calls_above_the_window_is_refused_naming_both_keys() {
        let p = problem_for(
            from_str("[polling.circuit]\nwindow_calls = 10\nmin_calls = 11"),
            "polling.circuit.min_calls",
        );
        assert_eq!(p.value, "11");
        assert!(
            p.allowed
                .contains("at most polling.circuit.window_calls (10)"),
            "{p}"
        );
        assert_eq!(p.related[0].key, "polling.circuit.window_calls");
        from_str("[polling.circuit]\nwindow_calls = 10\nmin_calls = 10").expect("valid");
        let p = problem_for(
            from_str("[polling.circuit]\nmin_calls = 4\nmin_failing_cards = 5"),
            "polling.circuit.min_failing_cards",
        );
        assert!(
            p.allowed.contains("at most polling.circuit.min_calls (4)"),
            "{p}"
        );
    }

    #[test]
    fn circuit_max_cooldown_below_the_cooldown_is_refused() {
        let p = problem_for(
            from_str("polling.circuit.cooldown_secs = 30\npolling.circuit.max_cooldown_secs = 20"),
            "polling.circuit.max_cooldown_secs",
        );
        assert!(
            p.allowed
                .contains("at least polling.circuit.cooldown_secs (30)"),
            "{p}"
        );
        from_str("polling.circuit.cooldown_secs = 30\npolling.circuit.max_cooldown_secs = 30")
            .expect("valid");
    }

    #[test]
    fn circuit_and_parked_retry_keys_are_range_checked_naming_the_key() {
        for (text, key) in [
            (
                "polling.circuit.window_calls = 1",
                "polling.circuit.window_calls",
            ),
            (
                "polling.circuit.window_secs = 0",
                "polling.circuit.window_secs",
            ),
            ("polling.circuit.min_calls = 0", "polling.circuit.min_calls"),
            (
                "polling.circuit.min_failing_cards = 0",
                "polling.circuit.min_failing_cards",
            ),
            (
                "polling.circuit.failure_percent = 101",
                "polling.circuit.failure_percent",
            ),
            (
                "polling.circuit.failure_percent = 0",
                "polling.circuit.failure_percent",
            ),
            (
                "polling.circuit.cooldown_secs = 0",
                "polling.circuit.cooldown_secs",
            ),
            (
                "polling.circuit.max_cooldown_secs = 3601",
                "polling.circuit.max_cooldown_secs",
            ),
            (
                "polling.circuit.half_open_probes = 0",
                "polling.circuit.half_open_probes",
            ),
            (
                "polling.circuit.enabled = \"yes\"",
                "polling.circuit.enabled",
            ),
            (
                "polling.carddata.parked_retry_secs = 0",
                "polling.carddata.parked_retry_secs",
            ),
            (
                "polling.card_status.parked_retry_secs = 2592001",
                "polling.card_status.parked_retry_secs",
            ),
            ("polling.circuit.nope = 1", "polling.circuit.nope"),
        ] {
            let p = problem_for(from_str(text), key);
            assert!(p.to_string().starts_with(key), "{text}: {p}");
        }
        let c = from_str(
            "polling.carddata.parked_retry_secs = 1\n[polling.circuit]\nenabled = false\n\
             failure_percent = 100\nhalf_open_probes = 100",
        )
        .expect("valid");
        assert_eq!(c.polling.carddata.parked_retry_secs, 1);
        assert!(!c.polling.circuit.enabled);
    }

    #[test]
    fn defer_max_delay_below_defer_delay_is_refused() {
        problem_for(
            from_str("polling.defer_delay_secs = 10\npolling.defer_max_delay_secs = 5"),
            "polling.defer_max_delay_secs",
        );
    }

    #[test]
    fn a_relation_names_the_source_of_both_keys() {
        // The handler timeout comes from the file, the gateway timeout from the env.
        let p = problem_for(
            from_str_env(
                "polling.handler_timeout_secs = 10",
                &[("CARDWORKER__GATEWAY__TIMEOUT_MS", "20000")],
            ),
            "polling.handler_timeout_secs",
        );
        assert_eq!(p.source, file_source());
        assert_eq!(p.related.len(), 1, "{p}");
        assert_eq!(p.related[0].key, "gateway.timeout_ms");
        assert_eq!(p.related[0].value, "20000");
        assert_eq!(
            p.related[0].source,
            env_source("CARDWORKER__GATEWAY__TIMEOUT_MS")
        );
        let text = p.to_string();
        assert!(
            text.starts_with("polling.handler_timeout_secs = 10 (from test.toml): "),
            "{text}"
        );
        assert!(
            text.ends_with(
                "; checked against gateway.timeout_ms = 20000 \
                 (from env CARDWORKER__GATEWAY__TIMEOUT_MS)"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_default_that_conflicts_with_a_file_value_names_both_sources() {
        // card_status keeps its default limit 4, above the file's total_limit 3.
        let p = problem_for(
            from_str(
                "polling.total_limit = 3
polling.carddata.limit = 2",
            ),
            "polling.card_status.limit",
        );
        assert_eq!(p.source, Source::Default);
        assert_eq!(p.related[0].key, "polling.total_limit");
        assert_eq!(p.related[0].source, file_source());
        assert!(
            p.to_string()
                .starts_with("polling.card_status.limit = 4 (from default): "),
            "{p}"
        );
        for (key, other) in [
            ("polling.lease_ttl_secs", "polling.handler_timeout_secs"),
            ("polling.defer_max_delay_secs", "polling.defer_delay_secs"),
        ] {
            let p = problem_for(
                from_str("polling.handler_timeout_secs = 60\npolling.defer_delay_secs = 40"),
                key,
            );
            assert_eq!(p.source, Source::Default, "{p}");
            assert_eq!(p.related[0].key, other, "{p}");
            assert_eq!(p.related[0].source, file_source(), "{p}");
        }
    }
}
