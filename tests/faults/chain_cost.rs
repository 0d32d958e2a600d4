//! What a process's polls send to Redis for their chains (issue 16): their checks and successors
//! go through `queue::batch`, several to a script call, and each is answered exactly as it would
//! be alone. Counted by a private redis-server's `INFO commandstats`, never timed.

use std::time::Duration;

use cardworker::config::Task;
use cardworker::context;
use cardworker::polling::chain::{self, Count, Liveness};
use cardworker_jobs::ChainState;
use futures::future::join_all;

use crate::private::PrivateRedis;
use crate::redis_cost::{counted, reset};

const CARDS: usize = 32;

fn state(chain: &str) -> ChainState {
    ChainState {
        chain: chain.to_owned(),
        failures: 0,
        deferrals: 0,
        turn: 0,
    }
}

// A current-thread runtime: every call below is queued before the sending task first runs, so
// what is counted is the batching itself, not a race with it.
#[tokio::test(flavor = "current_thread")]
async fn the_concurrent_checks_and_successors_of_many_polls_cost_one_script_call_each_way() {
    let redis = PrivateRedis::start_new(false);
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let calls = context::chain_calls(&conn);
    let (prefix, task) = ("cost", Task::Carddata);
    let mut direct = conn.clone();
    let mut ids = Vec::new();
    for i in 0..CARDS {
        let id = chain::start(&mut direct, prefix, task, &format!("c-{i}"), Duration::ZERO)
            .await
            .expect("start");
        ids.push(id);
    }
    let mut stats = conn.clone();
    reset(&mut stats).await;

    let checks = join_all(ids.iter().enumerate().map(|(i, id)| {
        let (calls, card) = (&calls, format!("c-{i}"));
        async move {
            chain::check(
                calls,
                prefix,
                task,
                &card,
                &state(id),
                std::time::Duration::from_secs(60),
            )
            .await
        }
    }))
    .await;
    for (i, c) in checks.into_iter().enumerate() {
        assert_eq!(c.expect("check"), Liveness::Live, "card c-{i}");
    }
    let (after_checks, _) = counted(&mut stats).await;
    assert_eq!(
        after_checks.get("evalsha").copied(),
        Some(1),
        "{CARDS} checks in one script call: {after_checks:?}"
    );
    assert_eq!(after_checks.get("hget").copied(), Some(CARDS as u64));

    reset(&mut stats).await;
    let written = join_all(ids.iter().enumerate().map(|(i, id)| {
        let (calls, card) = (&calls, format!("c-{i}"));
        let at = chrono::Utc::now();
        async move {
            chain::schedule_counted(
                calls,
                prefix,
                task,
                &card,
                &state(id),
                Duration::from_secs(60),
                &Count::Unchanged(at),
            )
            .await
        }
    }))
    .await;
    assert!(written.into_iter().all(|w| w.expect("schedule")));
    let (after_schedules, _) = counted(&mut stats).await;
    assert_eq!(
        after_schedules.get("evalsha").copied(),
        Some(1),
        "{CARDS} successors in one script call: {after_schedules:?}"
    );
    // One ZADD per successor into the due set, and one for the whole batch into the due hint.
    assert_eq!(
        after_schedules.get("zadd").copied(),
        Some(CARDS as u64 + 1),
        "{after_schedules:?}"
    );
    assert_eq!(
        after_schedules.get("time").copied(),
        Some(1),
        "one clock read per script call"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_batched_chain_call_answers_what_the_same_call_answers_alone() {
    let redis = PrivateRedis::start_new(false);
    let conn = context::connect_redis(&redis.url()).await.expect("redis");
    let calls = context::chain_calls(&conn);
    let task = Task::CardStatus;
    // The same story twice, once call by call on a connection, once batched: a live chain, a
    // stale job (its chain was replaced), a card without a chain (adopted), and successors of
    // the live and of the stale job.
    async fn story(
        via_batch: Option<&cardworker::queue::batch::ScriptCalls>,
        conn: &redis::aio::ConnectionManager,
        prefix: &str,
        task: Task,
    ) -> Vec<String> {
        let mut direct = conn.clone();
        let live = chain::start(&mut direct, prefix, task, "live", Duration::ZERO)
            .await
            .expect("start");
        let old = chain::start(&mut direct, prefix, task, "replaced", Duration::ZERO)
            .await
            .expect("start");
        let _new = chain::start(&mut direct, prefix, task, "replaced", Duration::ZERO)
            .await
            .expect("restart");
        let jobs = [
            ("live", live.clone()),
            ("replaced", old.clone()),
            ("none", "".to_owned()),
        ];
        let mut out = Vec::new();
        let checks = match via_batch {
            Some(calls) => {
                join_all(jobs.iter().map(|(card, id)| async move {
                    chain::check(
                        calls,
                        prefix,
                        task,
                        card,
                        &state(id),
                        std::time::Duration::from_secs(60),
                    )
                    .await
                }))
                .await
            }
            None => {
                let mut v = Vec::new();
                for (card, id) in &jobs {
                    v.push(
                        chain::check(
                            &mut direct,
                            prefix,
                            task,
                            card,
                            &state(id),
                            std::time::Duration::from_secs(60),
                        )
                        .await,
                    );
                }
                v
            }
        };
        for c in checks {
            out.push(match c.expect("check") {
                Liveness::Adopted(_) => "adopted".to_owned(),
                other => format!("{other:?}"),
            });
        }
        for (card, id) in [("live", &live), ("replaced", &old)] {
            let via: chain::Via<'_> = match via_batch {
                Some(calls) => calls.into(),
                None => (&mut direct).into(),
            };
            let w =
                chain::schedule(via, prefix, task, card, &state(id), Duration::from_secs(5)).await;
            out.push(format!("{card} written: {}", w.expect("schedule")));
        }
        out
    }
    let alone = story(None, &conn, "alone", task).await;
    let batched = story(Some(&calls), &conn, "batched", task).await;
    assert_eq!(
        alone,
        [
            "Live",
            "Stale",
            "adopted",
            "live written: true",
            "replaced written: false"
        ]
    );
    assert_eq!(batched, alone);
}
