//! The polling intake without payloads: a chain's waiting poll is its entry in the
//! chain due set, its job's payload is built from the chain entry when the feeder moves it into
//! apalis, and the entry stays, re-scored to the fed range, for reconcile.

use std::time::Duration;

use cardworker::commands::investigate;
use cardworker::config::Task;
use cardworker::polling::chain::{self, Count, FED};
use cardworker::polling::reconcile;
use cardworker::queue::intake::{self, feed_once};
use cardworker::queue::QueueName;
use cardworker_jobs::{keys, ChainState, Job as _, PollCardData, PollCardStatus};
use redis::AsyncCommands as _;

use crate::harness::{spawn_app_with, wait_until, TestRedis};
use crate::unchanged::chain_a_minute_out;

/// The payloads apalis holds for `queue`, decoded (the feeder stores each as a JSON string).
async fn apalis_payloads(redis: &TestRedis, queue: &str) -> Vec<PollCardData> {
    let data: Vec<String> = redis
        .conn
        .clone()
        .hvals(format!("{}:data", keys::queue(&redis.prefix, queue)))
        .await
        .expect("hvals");
    data.iter()
        .map(|raw| {
            let inner: String = serde_json::from_str(raw).expect("a JSON string");
            serde_json::from_str(&inner).expect("a poll payload")
        })
        .collect()
}

async fn score(redis: &TestRedis, task: Task, card: &str) -> Option<u64> {
    let s: Option<f64> = redis
        .conn
        .clone()
        .zscore(chain::due_key(&redis.prefix, task), card)
        .await
        .expect("zscore");
    s.map(|s| s as u64)
}

/// Writes a chain entry of `card` by hand, as `entry`, due at `due` ms (Redis clock).
async fn write_entry(
    conn: &mut redis::aio::ConnectionManager,
    (prefix, task): (&str, Task),
    card: &str,
    entry: &str,
    due: u64,
) {
    let _: () = redis::pipe()
        .hset(chain::chain_key(prefix, task), card, entry)
        .ignore()
        .zadd(chain::due_key(prefix, task), card, due)
        .ignore()
        .query_async(conn)
        .await
        .expect("a chain entry written by hand");
}

/// The poll of `state` writes its successor, due now, into the chain entry alone: the task's
/// intake payload hash stays empty.
async fn schedule_without_payload(
    conn: &mut redis::aio::ConnectionManager,
    (prefix, task): (&str, Task),
    card: &str,
    state: &ChainState,
) {
    assert!(
        chain::schedule(&mut *conn, prefix, task, card, state, Duration::ZERO)
            .await
            .expect("schedule")
    );
    let payloads: i64 = conn
        .hlen(keys::intake_payload(prefix, chain::queue_of(task)))
        .await
        .expect("hlen");
    assert_eq!(payloads, 0, "no payload hash entry for a chain's poll");
}

/// How a delivery of `card`'s job of `state` checks in (a 60 s run marker).
async fn liveness(
    conn: &mut redis::aio::ConnectionManager,
    (prefix, task): (&str, Task),
    card: &str,
    state: &ChainState,
) -> chain::Liveness {
    chain::check(conn, prefix, task, card, state, Duration::from_secs(60))
        .await
        .expect("check")
}

#[tokio::test]
async fn a_polling_entry_fed_without_a_payload_hash_carries_the_chains_state() {
    let (redis, mut conn, id) = chain_a_minute_out(Task::Carddata, "c-1").await;
    let (prefix, task) = (redis.prefix.as_str(), Task::Carddata);
    assert_eq!(id.len(), 8, "a short chain id: {id}");
    // A deferred retry after two failures: its state goes into the chain entry, no payload.
    let next = ChainState {
        chain: id.clone(),
        failures: 2,
        deferrals: 1,
        turn: 0,
    };
    schedule_without_payload(&mut conn, (prefix, task), "c-1", &next).await;
    let waiting = score(&redis, task, "c-1").await.expect("waiting");
    assert!(waiting < FED);

    let q = QueueName::new(prefix, PollCardData::QUEUE);
    // The queue depth counts the waiting chain, then the job in apalis: one either way.
    assert_eq!(intake::waiting(&mut conn, &q).await.expect("waiting"), 1);
    assert_eq!(intake::depth(&mut conn, &q).await.expect("depth"), 1);
    let fed = feed_once(&mut conn, &q).await.expect("feed");
    assert_eq!((fed.moved, fed.waiting), (1, 0));
    assert_eq!(intake::waiting(&mut conn, &q).await.expect("waiting"), 0);
    assert_eq!(intake::depth(&mut conn, &q).await.expect("depth"), 1);
    let jobs = apalis_payloads(&redis, PollCardData::QUEUE).await;
    assert_eq!(
        jobs,
        vec![PollCardData {
            card_ref: "c-1".into(),
            // Its turn: the due time it was fed for.
            state: ChainState {
                turn: waiting,
                ..next.clone()
            },
        }]
    );
    // The entry stays, in the fed range at the due time it was fed for.
    assert_eq!(score(&redis, task, "c-1").await, Some(FED + waiting));
    // Nothing waits: the due hint names no carddata entry.
    let hinted: Option<f64> = conn.zscore(&q.due_hint, &q.intake).await.expect("hint");
    assert_eq!(hinted, None);
    let (due, next) = intake::due_queues(&mut conn, std::slice::from_ref(&q), i64::MAX / 2)
        .await
        .expect("due");
    assert!(due.is_empty());
    assert_eq!(next, None, "and no later time either");
}

#[tokio::test]
async fn an_old_format_entry_with_a_payload_is_still_fed_once() {
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let (prefix, task) = (redis.prefix.as_str(), Task::CardStatus);
    let now = chain::redis_now_ms(&mut conn).await.expect("now");
    let due = now - 1_000;
    // What an older release writes for a waiting poll: a four-field chain entry, the due index,
    // and the intake entry with its payload.
    let old_id = "01JDOLDRELEASECHAIN0000000";
    let payload = format!(r#"{{"card_ref":"c-old","chain":"{old_id}","failures":3}}"#);
    let entry = format!("{old_id}|0|0|s0");
    write_entry(&mut conn, (prefix, task), "c-old", &entry, due).await;
    let _: () = redis::pipe()
        .zadd(keys::intake(prefix, PollCardStatus::QUEUE), "c-old", due)
        .ignore()
        .hset(
            keys::intake_payload(prefix, PollCardStatus::QUEUE),
            "c-old",
            &payload,
        )
        .ignore()
        .query_async(&mut conn)
        .await
        .expect("an old release's entry");
    let q = QueueName::new(prefix, PollCardStatus::QUEUE);
    let fed = feed_once(&mut conn, &q).await.expect("feed");
    assert_eq!(fed.moved, 1, "fed once, from its own payload");
    let jobs = apalis_payloads(&redis, PollCardStatus::QUEUE).await;
    assert_eq!(jobs.len(), 1);
    assert_eq!(
        (
            jobs[0].card_ref.as_str(),
            jobs[0].state.chain.as_str(),
            jobs[0].state.failures
        ),
        ("c-old", old_id, 3)
    );
    // Its chain's entry is only moved to the fed range: its job is the one just fed.
    assert_eq!(score(&redis, task, "c-old").await, Some(FED + due));
    assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 0);
    // The job runs through the new release: still live, and its successor has no payload.
    let seen = ChainState {
        chain: old_id.into(),
        failures: 3,
        deferrals: 0,
        turn: 0,
    };
    assert_eq!(
        liveness(&mut conn, (prefix, task), "c-old", &seen).await,
        chain::Liveness::Live
    );
    let successor = ChainState {
        failures: 4,
        ..seen.clone()
    };
    schedule_without_payload(&mut conn, (prefix, task), "c-old", &successor).await;
    assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 1);
    let jobs = apalis_payloads(&redis, PollCardStatus::QUEUE).await;
    assert!(
        jobs.iter().any(|j| ChainState {
            turn: 0,
            ..j.state.clone()
        } == successor),
        "{jobs:?}"
    );
}

#[tokio::test]
async fn a_card_ref_that_json_must_escape_is_fed_as_exactly_that_ref() {
    // The feeder writes the payload of a card ref and chain id made only of letters, digits and
    // `-_.:` as text, without cjson (three cjson calls are a fifth of the feeder's time); every
    // other ref goes through cjson. Both paths must decode to the entry's card,
    // chain, failures and deferrals.
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let (prefix, task) = (redis.prefix.as_str(), Task::Carddata);
    let refs = [
        "plain-1_a.B:c",
        "with/slash",
        "quo\"te",
        "back\\slash",
        "tab\there",
        "ünïcode",
        "sp ace",
    ];
    let mut want = Vec::new();
    for card in refs {
        let id = chain::start(&mut conn, prefix, task, card, Duration::ZERO)
            .await
            .expect("start");
        want.push((card.to_owned(), id, 0, 0));
    }
    // A deferred chain's state field is `failures.deferrals`.
    let now = chain::redis_now_ms(&mut conn).await.expect("now");
    let entry = "01DEFERRED|0|0|s0|2.3";
    write_entry(&mut conn, (prefix, task), "c-deferred", entry, now - 1_000).await;
    want.push(("c-deferred".to_owned(), "01DEFERRED".to_owned(), 2, 3));
    let q = QueueName::new(prefix, PollCardData::QUEUE);
    assert_eq!(
        feed_once(&mut conn, &q).await.expect("feed").moved,
        want.len()
    );
    let mut fed: Vec<(String, String, u32, u32)> = apalis_payloads(&redis, PollCardData::QUEUE)
        .await
        .into_iter()
        .map(|j| {
            (
                j.card_ref,
                j.state.chain,
                j.state.failures,
                j.state.deferrals,
            )
        })
        .collect();
    fed.sort();
    want.sort();
    assert_eq!(fed, want);
}

#[tokio::test]
async fn a_chain_entry_with_an_empty_field_is_still_read_as_the_chain_it_names() {
    // The scripts read the entries they write with one pattern of non-empty fields; anything
    // else falls back to the old split, which skips empty fields. An entry edited by
    // hand with an empty field must still be fed with its state and checked as its own chain.
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let (prefix, task) = (redis.prefix.as_str(), Task::Carddata);
    let now = chain::redis_now_ms(&mut conn).await.expect("now");
    let entry = "01GAPCHAIN|3||0|s0|2";
    write_entry(&mut conn, (prefix, task), "c-gap", entry, now - 1_000).await;
    let q = QueueName::new(prefix, PollCardData::QUEUE);
    assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 1);
    let jobs = apalis_payloads(&redis, PollCardData::QUEUE).await;
    assert_eq!(jobs.len(), 1);
    assert_eq!(
        (jobs[0].state.chain.as_str(), jobs[0].state.failures),
        ("01GAPCHAIN", 2)
    );
    assert_eq!(
        liveness(&mut conn, (prefix, task), "c-gap", &jobs[0].state).await,
        chain::Liveness::Live
    );
}

#[tokio::test]
async fn a_fed_entry_is_never_fed_twice_while_its_job_lives_even_behind_a_backlog_longer_than_the_grace(
) {
    let redis = TestRedis::new().await;
    let mut conn = redis.conn.clone();
    let (prefix, task) = (redis.prefix.as_str(), Task::CardStatus);
    let id = chain::start(&mut conn, prefix, task, "c-1", Duration::ZERO)
        .await
        .expect("start");
    let q = QueueName::new(prefix, PollCardStatus::QUEUE);
    assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 1);
    // The job waits in a long apalis backlog: as if it had been fed a day ago.
    let now = chain::redis_now_ms(&mut conn).await.expect("now");
    let _: () = conn
        .zadd(chain::due_key(prefix, task), "c-1", FED + now - 86_400_000)
        .await
        .expect("zadd");
    for _ in 0..3 {
        assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 0);
    }
    let swept = intake::sweep_queues(&mut conn, std::slice::from_ref(&q), i64::MAX / 2)
        .await
        .expect("sweep");
    assert!(swept.is_empty(), "the sweep sees nothing waiting");
    assert_eq!(
        apalis_payloads(&redis, PollCardStatus::QUEUE).await.len(),
        1,
        "one job of the card"
    );
    // The job finally runs: still the card's live chain.
    let seen = ChainState {
        chain: id.clone(),
        ..ChainState::default()
    };
    assert_eq!(
        liveness(&mut conn, (prefix, task), "c-1", &seen).await,
        chain::Liveness::Live
    );
    // Past the grace the chain counts as dead (its job may have vanished): a producer's poll (or
    // reconcile) starts a new chain, fed at once, and the old job, should it still run, is stale
    // and calls nothing: the card is never polled twice at once.
    let merged = redis_producer(&redis)
        .enqueue(&PollCardStatus {
            card_ref: "c-1".into(),
            state: ChainState::default(),
        })
        .await
        .expect("enqueue");
    assert_ne!(merged, id);
    assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 1);
    assert_eq!(
        liveness(&mut conn, (prefix, task), "c-1", &seen).await,
        chain::Liveness::Stale
    );
}

fn redis_producer(redis: &TestRedis) -> cardworker_jobs::Producer<redis::aio::ConnectionManager> {
    cardworker_jobs::Producer::new(redis.conn.clone(), redis.prefix.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_still_restarts_a_chain_whose_job_vanished_after_it_was_fed() {
    let app = spawn_app_with(|cfg| {
        cfg.polling.card_status.interval_secs = 1;
        cfg.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    })
    .await;
    app.insert_card("c-1").await;
    let mut conn = app.redis.conn.clone();
    let prefix = app.redis.prefix.clone();
    let old = chain::start(
        &mut conn,
        &prefix,
        Task::CardStatus,
        "c-1",
        Duration::from_secs(3600),
    )
    .await
    .expect("start");
    // Fed an hour ago, and its job never wrote a successor (a pod killed under it, say).
    let hour_ago = chain::redis_now_ms(&mut conn).await.expect("now") - 3_600_000;
    let _: () = conn
        .zadd(
            chain::due_key(&prefix, Task::CardStatus),
            "c-1",
            FED + hour_ago,
        )
        .await
        .expect("zadd");
    let done = reconcile::restart_overdue(&app.ctx, Task::CardStatus)
        .await
        .expect("reconcile");
    assert_eq!((done.found, done.restarted), (1, 1));
    let live = chain::live_chains(&mut conn, &prefix, Task::CardStatus, &["c-1".to_owned()])
        .await
        .expect("live");
    assert!(live[0].as_deref().is_some_and(|id| id != old), "{live:?}");
    wait_until(
        Duration::from_secs(20),
        "the restarted chain polls",
        || async {
            app.sim
                .stats()
                .calls_total
                .get("card_status")
                .copied()
                .unwrap_or(0)
                >= 1
        },
    )
    .await;
    let again = reconcile::restart_overdue(&app.ctx, Task::CardStatus)
        .await
        .expect("reconcile");
    assert_eq!(again.found, 0, "nothing overdue any more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn investigate_still_shows_the_due_time_and_the_unchanged_facts() {
    let app = spawn_app_with(|cfg| {
        cfg.polling.reconcile_cron = "0 0 0 1 1 *".to_owned();
    })
    .await;
    app.insert_card("c-1").await;
    let mut conn = app.redis.conn.clone();
    let prefix = app.redis.prefix.clone();
    let task = Task::CardStatus;
    let id = chain::start(&mut conn, &prefix, task, "c-1", Duration::from_secs(3600))
        .await
        .expect("start");
    let next = ChainState {
        chain: id,
        ..ChainState::default()
    };
    for _ in 0..2 {
        assert!(chain::schedule_counted(
            &mut conn,
            &prefix,
            task,
            "c-1",
            &next,
            Duration::from_secs(3600),
            &Count::Unchanged(chrono::Utc::now()),
        )
        .await
        .expect("schedule"));
    }
    cardworker::polling::unchanged::flush(&mut conn, &prefix)
        .await
        .expect("flush");
    let inv = investigate::investigate(&app.ctx, "c-1")
        .await
        .expect("investigate");
    let ch = inv
        .chains
        .iter()
        .find(|c| c.task == "card_status")
        .expect("card_status chain");
    let due = ch.next_poll_due_at.expect("a due time");
    let in_secs = (due - chrono::Utc::now()).num_seconds();
    assert!((3500..=3601).contains(&in_secs), "due in {in_secs} s");
    assert!(!ch.next_poll_fed);
    let u = inv
        .unchanged_polls
        .iter()
        .find(|u| u.task == "card_status")
        .expect("card_status view");
    assert_eq!(u.card_count, Some(2));
    assert!(u.last_unchanged_at.is_some());
    assert!(u.all_cards_total >= 2, "{u:?}");
    let text = investigate::render_text(&inv);
    assert!(text.contains("next poll due"), "{text}");
}

/// The one job the feeder hands apalis for `card` in `queue`, fed now.
async fn fed_job(redis: &TestRedis, card: &str) -> PollCardData {
    let mut conn = redis.conn.clone();
    let q = QueueName::new(&redis.prefix, PollCardData::QUEUE);
    // The job this feed moves in is the one not there before it: a job fed earlier (a running
    // poll's, say) may carry the same turn of another chain.
    let before = apalis_payloads(redis, PollCardData::QUEUE).await;
    assert_eq!(feed_once(&mut conn, &q).await.expect("feed").moved, 1);
    let jobs = apalis_payloads(redis, PollCardData::QUEUE).await;
    let job = jobs
        .into_iter()
        .filter(|j| j.card_ref == card && !before.contains(j))
        .max_by_key(|j| j.state.turn)
        .expect("the fed job");
    assert!(job.state.turn > 0, "a fed job carries its turn: {job:?}");
    job
}

/// Card `c-1`'s carddata chain on a prefix of its own, through the calls a worker's poll makes.
struct OneChain {
    redis: TestRedis,
    conn: redis::aio::ConnectionManager,
}

impl OneChain {
    const TASK: Task = Task::Carddata;
    const CARD: &str = "c-1";

    /// The chain started, its first poll due now.
    async fn start() -> Self {
        let redis = TestRedis::new().await;
        let conn = redis.conn.clone();
        let mut chain = Self { redis, conn };
        chain.restart().await;
        chain
    }

    /// The chain started, its first job fed and checked in (run marker `ttl`): it polls.
    async fn running(ttl: Duration) -> (Self, PollCardData) {
        let one = Self::start().await;
        let job = one.fed_job().await;
        assert_eq!(one.check(&job.state, ttl).await, chain::Liveness::Live);
        (one, job)
    }

    /// Starts the chain again, as an operator's `enqueue` does.
    async fn restart(&mut self) {
        let prefix = self.redis.prefix.clone();
        chain::start(
            &mut self.conn,
            &prefix,
            Self::TASK,
            Self::CARD,
            Duration::ZERO,
        )
        .await
        .expect("start");
    }

    /// Feeds the due poll into apalis: its job.
    async fn fed_job(&self) -> PollCardData {
        fed_job(&self.redis, Self::CARD).await
    }

    /// The chain's score in the due set.
    async fn score(&self) -> Option<u64> {
        score(&self.redis, Self::TASK, Self::CARD).await
    }

    /// A delivery of the job of `state` checks in (run marker `ttl`).
    async fn check(&self, state: &ChainState, ttl: Duration) -> chain::Liveness {
        let (mut conn, prefix) = (self.conn.clone(), &self.redis.prefix);
        chain::check(&mut conn, prefix, Self::TASK, Self::CARD, state, ttl)
            .await
            .expect("check")
    }

    /// The poll of `state` writes its successor, due after `delay`: whether it was written.
    async fn schedule(&self, state: &ChainState, delay: Duration) -> bool {
        let (mut conn, prefix) = (self.conn.clone(), &self.redis.prefix);
        chain::schedule(&mut conn, prefix, Self::TASK, Self::CARD, state, delay)
            .await
            .expect("schedule")
    }

    /// The budget defers the delivery of `state` (run marker `ttl`).
    async fn defer(&self, state: &ChainState, ttl: Duration) -> chain::Deferred {
        let (mut conn, prefix) = (self.conn.clone(), &self.redis.prefix);
        chain::defer(
            &mut conn,
            prefix,
            Self::TASK,
            Self::CARD,
            state,
            Duration::ZERO,
            ttl,
        )
        .await
        .expect("defer")
    }
}

#[tokio::test]
async fn a_second_delivery_of_a_job_whose_turn_is_over_is_stale_and_writes_nothing() {
    // apalis re-queues the jobs of a worker whose stream ended, although each ran on in a task of
    // its own and wrote its successor: that second delivery carries a live chain id.
    let ttl = Duration::from_secs(60);
    let (one, job) = OneChain::running(ttl).await;
    assert!(one.schedule(&job.state, Duration::from_secs(60)).await);
    let successor = one.score().await;
    assert_eq!(
        one.check(&job.state, ttl).await,
        chain::Liveness::Stale,
        "the second delivery must not poll"
    );
    assert!(
        !one.schedule(&job.state, Duration::ZERO).await,
        "the second delivery must not move the chain's next poll"
    );
    assert_eq!(one.score().await, successor);
}

#[tokio::test]
async fn a_second_delivery_of_a_running_job_does_not_poll_and_a_restarted_chain_waits_for_the_poll()
{
    let ttl = Duration::from_secs(60);
    let (mut one, running) = OneChain::running(ttl).await;
    // The same job delivered again while its poll is at the Gateway.
    assert!(
        matches!(
            one.check(&running.state, ttl).await,
            chain::Liveness::Running(left) if left <= ttl
        ),
        "the second delivery must not poll"
    );
    // An operator restarts the chain meanwhile: its first job waits for the running poll.
    one.restart().await;
    let first = one.fed_job().await;
    assert_ne!(first.state.chain, running.state.chain);
    assert!(
        matches!(one.check(&first.state, ttl).await, chain::Liveness::Busy(_)),
        "the restarted chain's first poll waits"
    );
    // The running poll ends: its successor is not written (its chain was replaced), and the
    // way is clear.
    assert!(!one.schedule(&running.state, Duration::ZERO).await);
    assert_eq!(one.check(&first.state, ttl).await, chain::Liveness::Live);
}

#[tokio::test]
async fn a_second_delivery_whose_first_died_after_its_check_takes_the_turn_over_once_the_marker_is_over(
) {
    // The first delivery checked in (its run marker stands) and its process died before it
    // wrote a successor; apalis hands the job out again within the marker's time.
    let ttl = Duration::from_secs(2);
    let (one, job) = OneChain::running(ttl).await;
    let fed = one.score().await;
    let left = match one.check(&job.state, ttl).await {
        chain::Liveness::Running(left) => left,
        other => panic!("the second delivery must not poll while the marker stands: {other:?}"),
    };
    assert!(left <= ttl, "{left:?}");
    chain::defer_when_free(
        one.conn.clone(),
        None,
        &one.redis.prefix,
        OneChain::TASK,
        OneChain::CARD,
        &job.state,
        Duration::ZERO,
        ttl,
        left,
    );
    assert_eq!(
        one.score().await,
        fed,
        "while the marker stands, the chain waits on its first delivery"
    );
    wait_until(
        ttl + Duration::from_secs(5),
        "the chain's next poll waits to be fed once the marker is over",
        || async { one.score().await.is_some_and(|s| s < FED) },
    )
    .await;
    let next = one.fed_job().await;
    assert!(next.state.turn > job.state.turn, "{next:?} after {job:?}");
    assert_eq!(
        one.check(&next.state, ttl).await,
        chain::Liveness::Live,
        "the new turn polls"
    );
}

#[tokio::test]
async fn a_deferred_second_delivery_writes_nothing_while_the_first_runs_and_is_stale_once_it_wrote_its_successor(
) {
    let ttl = Duration::from_secs(60);
    let (one, job) = OneChain::running(ttl).await;
    let fed = one.score().await;
    let mut deferred = job.state.clone();
    deferred.deferrals += 1;
    let answer = one.defer(&deferred, ttl).await;
    assert!(
        matches!(answer, chain::Deferred::Running(left) if left <= ttl),
        "{answer:?}"
    );
    assert_eq!(one.score().await, fed, "nothing written");
    // The running poll's own successor is written, and the deferral is stale from then on.
    assert!(one.schedule(&job.state, Duration::from_secs(600)).await);
    let successor = one.score().await;
    assert_eq!(one.defer(&deferred, ttl).await, chain::Deferred::Stale);
    assert_eq!(one.score().await, successor);
}
