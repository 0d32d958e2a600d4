//! The key inventory's own tests (the table is the test kit's `inventory`, which the harness's
//! every `TestRedis` guard checks its prefix against when it drops), and its agreement with
//! `cardworker::keys`, the module that builds every key name.

use std::time::Duration;

use cardworker::config::Task;
use cardworker::maintenance::JobKind;
use redis::AsyncCommands as _;

use crate::harness::inventory::{classify, matches, violations, INVENTORY};
use crate::harness::{spawn_app_with, wait_until};

#[test]
fn patterns_match_whole_segments_and_a_placeholder_only_within_one_segment() {
    assert!(matches("<prefix>:chain:<task>", "<prefix>:chain:carddata"));
    assert!(!matches(
        "<prefix>:chain:<task>",
        "<prefix>:chain:carddata:due"
    ));
    assert!(matches(
        "<prefix>:{budget}:task:<task>",
        "<prefix>:{budget}:task:card_status"
    ));
    assert!(!matches(
        "<prefix>:{budget}:task:<task>",
        "<prefix>:budget:task:card_status"
    ));
    assert_eq!(
        classify("cw", "cw:q:card_status:meta:01JD").map(|p| p.pattern),
        Some("<prefix>:q:<queue>:meta:<id>")
    );
    assert!(
        classify("cw", "cw:unchanged:card_status:2026120200").is_none(),
        "the old per-card hourly hash is not written any more"
    );
    assert!(classify("cw", "other:chain:carddata").is_none());
    assert!(matches(
        "<prefix>:{poll:<task>:<shard>}:due",
        "<prefix>:{poll:carddata:0}:due"
    ));
    assert!(!matches(
        "<prefix>:{poll:<task>:<shard>}:due",
        "<prefix>:{poll:carddata:}:due"
    ));
    assert!(!matches(
        "<prefix>:{poll:<task>:<shard>}:due",
        "<prefix>:poll:carddata:0:due"
    ));
}

#[test]
fn every_pattern_is_listed_for_operators_in_the_runbook() {
    let runbook = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/RUNBOOK.md"))
        .expect("docs/RUNBOOK.md");
    let section = runbook
        .split("### Redis keys")
        .nth(1)
        .expect("a \"### Redis keys\" section in docs/RUNBOOK.md");
    for p in INVENTORY {
        let shown = p.pattern.replace("<prefix>", "{prefix}");
        assert!(
            section.contains(&format!("`{shown}`")),
            "docs/RUNBOOK.md \"Redis keys\" does not list `{shown}`"
        );
    }
}

/// One key of every name `cardworker::keys` builds, for each task, queue and maintenance job,
/// under the prefix `cw` (the feeder's wake-up channel aside: a channel, not a key).
fn every_named_key() -> Vec<String> {
    use cardworker::keys::*;
    let p = "cw";
    let mut out = vec![
        total_key(p),
        overrides_key(p),
        paused_key(p),
        waiters_key(p),
        expired_key(p),
        kept_key(p),
        fence_key(p),
        maintenance_paused_key(p),
        epoch_key(p),
        intake_due_hint(p),
    ];
    for task in Task::ALL {
        out.extend([
            chain_key(p, task),
            due_key(p, task),
            late_key(p, task),
            cursor_key(p, task),
            hour_key(p, task, "2026120200"),
            outcome_hour_key(p, task, "persisted_change", "2026120200"),
            task_key(p, task),
            circuit_key(p, task),
            window_key(p, task),
            poll_due_key(p, task, 0),
            poll_last_lease_key(p, task, 0),
            poll_state_key(p, task, 0),
        ]);
    }
    for queue in cardworker::workers::QUEUES {
        let tick = format!("{queue}:tick:1764892800");
        out.extend([intake(p, queue), intake_payload(p, queue), claim(p, &tick)]);
    }
    for job in [JobKind::Archive, JobKind::Retention] {
        out.push(last_day_key(p, job.label()));
    }
    out
}

#[test]
fn every_key_the_keys_module_names_has_its_pattern_in_the_inventory() {
    let unlisted: Vec<String> = every_named_key()
        .into_iter()
        .filter(|k| classify("cw", k).is_none())
        .collect();
    assert!(
        unlisted.is_empty(),
        "built by src/keys.rs but not in the key inventory: {unlisted:?}"
    );
}

#[test]
fn every_pattern_of_the_inventory_but_apalis_s_own_is_a_name_of_the_keys_module() {
    let named: Vec<String> = every_named_key()
        .iter()
        .map(|k| k.replacen("cw", "<prefix>", 1))
        .collect();
    for p in INVENTORY
        .iter()
        .filter(|p| !p.pattern.starts_with("<prefix>:q:"))
    {
        assert!(
            named.iter().any(|k| matches(p.pattern, k)),
            "{} ({}) is written but src/keys.rs does not name it",
            p.pattern,
            p.owner
        );
    }
}

#[tokio::test]
async fn a_key_the_inventory_does_not_name_and_an_hourly_key_without_expiry_are_both_reported() {
    use crate::harness::TestRedis;
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let mystery = format!("{}:mystery:c-1", redis.prefix);
    let no_ttl = format!("{}:unchanged_total:carddata:2026120200", redis.prefix);
    let listed = format!("{}:chain:carddata", redis.prefix);
    let _: () = conn.set(&mystery, 1).await.expect("set");
    let _: () = conn.set(&no_ttl, 1).await.expect("set");
    let _: () = conn
        .hset(&listed, "c-1", "01CHAIN|0|0|s0")
        .await
        .expect("hset");
    let found = violations(
        &mut conn,
        &redis.prefix,
        &[mystery.clone(), no_ttl.clone(), listed.clone()],
    )
    .await;
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].starts_with(&mystery) && found[0].contains("not in the key inventory"));
    assert!(found[1].starts_with(&no_ttl) && found[1].contains("TTL is -1"));
    // Leave only listed keys for the guard's own scan.
    let _: () = conn.del(&[&mystery, &no_ttl]).await.expect("del");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_polls_and_changes_leaves_only_listed_keys_each_within_its_lifetime() {
    let app = spawn_app_with(|c| {
        c.polling.carddata.interval_secs = 1;
        c.polling.card_status.interval_secs = 1;
    })
    .await;
    for card in ["c-1", "c-2", "c-3"] {
        app.insert_card(card).await;
    }
    for task in cardworker::config::Task::ALL {
        cardworker::polling::reconcile::sweep(&app.ctx, task)
            .await
            .expect("reconcile");
    }
    app.sim
        .set_card_status("c-2", cardworker::gateway::CardStatus::Frozen);
    wait_until(
        Duration::from_secs(30),
        "unchanged polls and a change",
        || async {
            let keys = app.redis.keys().await;
            keys.iter()
                .any(|k| k.contains(":unchanged_total:card_status:"))
                && keys
                    .iter()
                    .any(|k| k.contains(":{poll:card_status:0}:state"))
                && keys
                    .iter()
                    .any(|k| k.contains(":outcome_total:card_status:"))
        },
    )
    .await;
    let keys = app.redis.keys().await;
    let found = violations(&mut app.redis.conn.clone(), &app.redis.prefix, &keys).await;
    assert!(found.is_empty(), "{found:#?}");
    // Nothing keyed per card: the card refs appear only inside hashes and sets.
    assert!(
        keys.iter()
            .all(|k| !k.contains("c-1") && !k.contains("c-2")),
        "{keys:#?}"
    );
}
