//! The checker: after the quiet period, every invariant verified from the outside, from the
//! simulator's request log (the journal), PostgreSQL, Redis (through the operator's CLI) and the
//! workers' `/metrics`. One line per invariant with its counts; every violation is listed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use sqlx::Row as _;

use crate::journal::Call;
use crate::world::metric_sum;
use crate::World;

/// What the checker found.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per invariant.
    pub lines: Vec<String>,
    /// Every violation, with its invariant's number.
    pub violations: Vec<String>,
}

impl Report {
    fn line(&mut self, n: u8, name: &str, ok: bool, counts: String) {
        let verdict = if ok { "ok  " } else { "FAIL" };
        self.lines.push(format!("{verdict} {n}. {name}: {counts}"));
    }

    fn violation(&mut self, n: u8, what: String) {
        self.violations.push(format!("[{n}] {what}"));
    }
}

/// The limits and intervals the workers run with.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub total: u64,
    pub per_task: u64,
    pub interval_secs: u64,
    /// Rows unsettled for longer than this (s) are stale.
    pub recovery_window_secs: u64,
}

/// Invariants 1–5: what the journal and PostgreSQL say about the whole run.
pub async fn check_history(world: &World, limits: Limits, report: &mut Report) {
    let calls = world.journal.calls();
    let now = world.journal.now_ms();
    budget_in_flight(&calls, now, limits, report);
    simulator_peaks(world, limits, report);
    one_poll_per_card(&calls, now, report);
    money(world, &calls, report).await;
    card_changes(world, report).await;
    callbacks(world, report).await;
}

/// Invariant 1: In-flight card calls never above the total and each task's limit, at any instant.
fn budget_in_flight(calls: &[Call], now: u64, limits: Limits, report: &mut Report) {
    // (time, +1/-1, task); ends sort before starts at the same instant.
    let mut edges: Vec<(u64, i8, &'static str)> = Vec::new();
    for c in calls {
        if let Some((task, _)) = c.card_call() {
            edges.push((c.start_ms, 1, task));
            edges.push((c.end_ms.unwrap_or(now), -1, task));
        }
    }
    edges.sort_by_key(|(t, d, _)| (*t, *d));
    let (mut total, mut per): (i64, HashMap<&str, i64>) = (0, HashMap::new());
    let (mut peak, mut peaks): (i64, BTreeMap<&str, i64>) = (0, BTreeMap::new());
    let mut over = 0u64;
    let mut first_over = None;
    for (t, d, task) in &edges {
        total += i64::from(*d);
        let n = per.entry(task).or_insert(0);
        *n += i64::from(*d);
        peak = peak.max(total);
        let p = peaks.entry(task).or_insert(0);
        *p = (*p).max(*n);
        if *d > 0 && (total > limits.total as i64 || *n > limits.per_task as i64) {
            over += 1;
            first_over.get_or_insert((*t, total, *task, *n));
        }
    }
    let ok = over == 0;
    report.line(
        1,
        "in-flight Gateway calls within the budget",
        ok,
        format!(
            "{} card calls; peak total {peak} (limit {}), peak per task {peaks:?} (limit {}); {over} admissions over a limit",
            edges.len() / 2,
            limits.total,
            limits.per_task
        ),
    );
    if let Some((t, total, task, n)) = first_over {
        report.violation(
            1,
            format!(
                "{over} calls started over a limit; the first at {:.1}s: {total} in flight, {n} of {task}",
                t as f64 / 1000.0
            ),
        );
    }
}

/// Invariants 1 and 2 again, from the simulator's own in-flight counters and peaks.
fn simulator_peaks(world: &World, limits: Limits, report: &mut Report) {
    let stats = world.gw.sim.stats();
    let mut bad = Vec::new();
    if stats.peak_in_flight_polls > limits.total {
        bad.push(format!(
            "{} polls in flight at once",
            stats.peak_in_flight_polls
        ));
    }
    for task in ["carddata", "card_status"] {
        let peak = stats.peak_per_call.get(task).copied().unwrap_or(0);
        if peak > limits.per_task {
            bad.push(format!("{peak} {task} calls in flight at once"));
        }
        let same = stats
            .peak_same_card_per_call
            .get(task)
            .copied()
            .unwrap_or(0);
        if same > 1 {
            bad.push(format!("{same} {task} calls about one card at once"));
        }
    }
    report.line(
        1,
        "the simulator's own peaks within the budget, one call per card",
        bad.is_empty(),
        format!(
            "peak polls {}, per call {:?}, same card per call {:?}",
            stats.peak_in_flight_polls, stats.peak_per_call, stats.peak_same_card_per_call
        ),
    );
    for b in bad {
        report.violation(1, format!("the simulator's peaks: {b}"));
    }
}

/// Invariant 2: No card and task polled twice at once.
fn one_poll_per_card(calls: &[Call], now: u64, report: &mut Report) {
    let mut by: HashMap<(&str, &str), Vec<(u64, u64)>> = HashMap::new();
    for c in calls {
        if let Some((task, card)) = c.card_call() {
            by.entry((task, card))
                .or_default()
                .push((c.start_ms, c.end_ms.unwrap_or(now)));
        }
    }
    let mut twice = Vec::new();
    for ((task, card), mut spans) in by.iter().map(|(k, v)| (*k, v.clone())) {
        spans.sort_unstable();
        let mut end = 0;
        for (s, e) in spans {
            if s < end {
                twice.push(format!("{card} {task} at {:.1}s", s as f64 / 1000.0));
            }
            end = end.max(e);
        }
    }
    twice.sort();
    report.line(
        2,
        "no card and task polled twice at once",
        twice.is_empty(),
        format!(
            "{} cards x tasks polled; {} overlapping polls",
            by.len(),
            twice.len()
        ),
    );
    for t in twice.iter().take(20) {
        report.violation(2, format!("polled twice at once: {t}"));
    }
}

/// Invariant 3: Each payment and approval: at most one POST before any query that answered 404, never two
/// POSTs at once; its final status is the Gateway's decision; exactly one decided outbox event;
/// one conflict audit event per contradicting callback.
async fn money(world: &World, calls: &[Call], report: &mut Report) {
    let mut by: HashMap<(String, &'static str), Vec<&Call>> = HashMap::new();
    for c in calls {
        if let Some((kind, id, _)) = c.money_call() {
            by.entry((id, kind)).or_default().push(c);
        }
    }
    let created = world.created_rows();
    let (mut posts_total, mut double, mut concurrent) = (0u64, 0u64, 0u64);
    let (mut agree, mut differ, mut unsettled, mut without_gw) = (0u64, 0u64, 0u64, 0u64);
    let (mut one_event, mut bad_events) = (0u64, 0u64);
    for (kind, id) in &created {
        let id_s = id.to_string();
        let mut seq = by.get(&(id_s.clone(), *kind)).cloned().unwrap_or_default();
        seq.sort_by_key(|c| c.start_ms);
        let mut posts_since_404 = 0;
        let mut last_post_end: Option<u64> = None;
        for c in &seq {
            let is_post = c.method == "POST";
            if is_post {
                posts_total += 1;
                posts_since_404 += 1;
                if posts_since_404 == 2 {
                    double += 1;
                    report.violation(
                        3,
                        format!(
                            "{kind} {id}: POSTed again at {:.1}s with no query answered 404 since the first POST",
                            c.start_ms as f64 / 1000.0
                        ),
                    );
                }
                if last_post_end.is_some_and(|e| c.start_ms < e) {
                    concurrent += 1;
                    report.violation(3, format!("{kind} {id}: two POSTs in flight at once"));
                }
                last_post_end = Some(last_post_end.unwrap_or(0).max(c.end_ms.unwrap_or(u64::MAX)));
            } else if c.status == Some(404) {
                posts_since_404 = 0;
            }
        }
        let recorded = world.money_status(kind, *id).await;
        let Some(recorded) = recorded else {
            continue;
        };
        let gateway = crate::workload::gateway_decision(world, kind, *id).await;
        let decided = ["accepted", "rejected", "approved", "declined"].contains(&recorded.as_str());
        match &gateway {
            Some((d, _)) if *d == recorded => agree += 1,
            Some((d, _)) if decided || recorded == "failed" => {
                differ += 1;
                report.violation(
                    3,
                    format!("{kind} {id}: recorded {recorded}, the Gateway decided {d}"),
                );
            }
            Some(_) => unsettled += 1,
            None if decided => {
                without_gw += 1;
                report.violation(
                    3,
                    format!("{kind} {id}: recorded {recorded}, but the Gateway has no decision"),
                );
            }
            None => unsettled += 1,
        }
        if decided {
            let events: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1 AND event_type IN \
                 ('payment.accepted', 'payment.rejected', 'approval.decided')",
            )
            .bind(&id_s)
            .fetch_one(&world.pool)
            .await
            .unwrap_or(-1);
            if events == 1 {
                one_event += 1;
            } else {
                bad_events += 1;
                report.violation(3, format!("{kind} {id}: {events} decided outbox events"));
            }
        }
    }
    // Conflict audit events: one per contradicting callback, none elsewhere.
    let contradicted: BTreeSet<(String, String)> = world
        .journal
        .deliveries()
        .into_iter()
        .filter(|d| d.conflicting)
        .map(|d| (d.kind.to_owned(), d.resource_id))
        .collect();
    let rows = sqlx::query(
        "SELECT split_part(e.event_type, '.', 1) AS kind, r.resource_id, count(DISTINCT e.id) AS n \
         FROM audit_events e JOIN audit_resources r ON r.audit_event_id = e.id \
         WHERE e.event_type IN ('payment.conflict', 'approval.conflict') \
           AND r.resource_type IN ('payment', 'approval') GROUP BY 1, 2",
    )
    .fetch_all(&world.pool)
    .await
    .unwrap_or_default();
    let mut conflicts: BTreeMap<(String, String), i64> = BTreeMap::new();
    for r in rows {
        conflicts.insert((r.get("kind"), r.get("resource_id")), r.get("n"));
    }
    let mut bad_conflicts = 0;
    for key in contradicted
        .iter()
        .chain(conflicts.keys())
        .collect::<BTreeSet<_>>()
    {
        let n = conflicts.get(key).copied().unwrap_or(0);
        let want = i64::from(contradicted.contains(key));
        if n != want {
            bad_conflicts += 1;
            report.violation(
                3,
                format!(
                    "{} {}: {n} conflict audit events, {want} contradicting callbacks",
                    key.0, key.1
                ),
            );
        }
    }
    let ok = double + concurrent + differ + without_gw + bad_events + bad_conflicts == 0;
    report.line(
        3,
        "money: one POST before a 404, the Gateway's decision, one decided event",
        ok,
        format!(
            "{} rows, {posts_total} POSTs; {double} second POSTs before a 404, {concurrent} concurrent POSTs; \
             final = Gateway {agree}, differs {differ}, decided without the Gateway {without_gw}, \
             not settled yet {unsettled}; one decided event {one_event}, other counts {bad_events}; \
             contradicting callbacks {}, conflict events wrong {bad_conflicts}",
            created.len(),
            contradicted.len()
        ),
    );
}

/// Invariant 4: Every card change the simulator made is recorded once, in order, and nothing else is.
async fn card_changes(world: &World, report: &mut Report) {
    let mut made: HashMap<(String, &'static str), Vec<String>> = HashMap::new();
    for c in world.journal.changes() {
        made.entry((c.card_ref, c.task)).or_default().push(c.value);
    }
    let rows = sqlx::query(
        "SELECT aggregate_id, event_type, coalesce(payload->>'status', payload->>'card_token') AS v \
         FROM outbox_events WHERE event_type IN ('card.status_changed', 'card.data_ready') ORDER BY id",
    )
    .fetch_all(&world.pool)
    .await
    .unwrap_or_default();
    let mut recorded: HashMap<(String, &'static str), Vec<String>> = HashMap::new();
    for r in rows {
        let task = if r.get::<String, _>("event_type") == "card.data_ready" {
            "carddata"
        } else {
            "card_status"
        };
        recorded
            .entry((r.get("aggregate_id"), task))
            .or_default()
            .push(r.get::<Option<String>, _>("v").unwrap_or_default());
    }
    let finals = sqlx::query("SELECT card_ref, status, card_token FROM cards")
        .fetch_all(&world.pool)
        .await
        .unwrap_or_default();
    let (mut made_n, mut recorded_n, mut superseded, mut invented, mut stale) = (0, 0, 0, 0, 0);
    for v in made.values() {
        made_n += v.len();
    }
    for ((card, task), rec) in &recorded {
        recorded_n += rec.len();
        let sim = made
            .get(&(card.clone(), *task))
            .cloned()
            .unwrap_or_default();
        // The recorded values must be a subsequence of the simulator's.
        let mut it = sim.iter();
        let mut matched = 0;
        for v in rec {
            if it.by_ref().any(|s| s == v) {
                matched += 1;
            } else {
                invented += 1;
                report.violation(
                    4,
                    format!("{card} {task}: recorded {v}, not a change the simulator made next (made {sim:?}, recorded {rec:?})"),
                );
                break;
            }
        }
        let _ = matched;
    }
    for r in finals {
        let card: String = r.get("card_ref");
        for task in ["carddata", "card_status"] {
            let Some(sim) = made.get(&(card.clone(), task)) else {
                continue;
            };
            let rec = recorded.get(&(card.clone(), task)).map_or(0, Vec::len);
            superseded += sim.len().saturating_sub(rec);
            let stored: Option<String> = if task == "carddata" {
                r.get("card_token")
            } else {
                r.get("status")
            };
            if stored.as_deref() != sim.last().map(String::as_str) {
                stale += 1;
                report.violation(
                    4,
                    format!(
                        "{card} {task}: stored {stored:?}, the simulator's last change was {:?}",
                        sim.last()
                    ),
                );
            }
        }
    }
    report.line(
        4,
        "card changes recorded once, none invented",
        invented + stale == 0,
        format!(
            "{made_n} changes made, {recorded_n} recorded; {invented} recorded that the simulator did not make; \
             {stale} cards whose last change is not on record; {superseded} superseded before a poll saw them"
        ),
    );
}

/// Invariant 5: Every callback delivered is applied once (or, contradicting a payment's recorded
/// decision, failed with its reason), and none is left unprocessed.
async fn callbacks(world: &World, report: &mut Report) {
    let mut delivered: BTreeMap<(String, String), (u64, bool, &'static str)> = BTreeMap::new();
    for d in world.journal.deliveries() {
        let e = delivered
            .entry((d.channel, d.callback_id))
            .or_insert((0, d.conflicting, d.kind));
        e.0 += 1;
    }
    let (mut applied, mut failed_ok, mut bad, mut dup_effects) = (0, 0, 0, 0);
    for ((channel, id), (n, conflicting, kind)) in &delivered {
        let row = sqlx::query(
            "SELECT state, deliveries, coalesce(reason, '') AS reason FROM inbound_callbacks WHERE channel = $1 AND callback_id = $2",
        )
        .bind(channel)
        .bind(id)
        .fetch_optional(&world.pool)
        .await
        .ok()
        .flatten();
        let Some(row) = row else {
            bad += 1;
            report.violation(
                5,
                format!("callback {channel}/{id}: delivered {n}x, no row"),
            );
            continue;
        };
        let state: String = row.get("state");
        let deliveries: i32 = row.get("deliveries");
        match state.as_str() {
            "applied" => applied += 1,
            "failed" if *conflicting && *kind == "payment" => failed_ok += 1,
            other => {
                bad += 1;
                report.violation(
                    5,
                    format!(
                        "callback {channel}/{id}: {other} ({}) after {deliveries} deliveries",
                        row.get::<String, _>("reason")
                    ),
                );
            }
        }
        if i64::from(deliveries) < *n as i64 {
            bad += 1;
            report.violation(
                5,
                format!("callback {channel}/{id}: delivered {n}x, {deliveries} on record"),
            );
        }
        let effects: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM integration_logs WHERE scenario = 'callback' AND state = 'succeeded' \
             AND request_summary LIKE $1",
        )
        .bind(format!("callback {channel}/{id} %"))
        .fetch_one(&world.pool)
        .await
        .unwrap_or(0);
        if effects > 1 {
            dup_effects += 1;
            report.violation(
                5,
                format!("callback {channel}/{id}: applied {effects} times"),
            );
        }
    }
    report.line(
        5,
        "every callback applied once",
        bad + dup_effects == 0,
        format!(
            "{} distinct callbacks, {} deliveries; applied {applied}, contradictions refused {failed_ok}; \
             wrong state {bad}; applied more than once {dup_effects}",
            delivered.len(),
            delivered.values().map(|v| v.0).sum::<u64>()
        ),
    );
}

/// What Redis holds of `card`'s `task` polling: its due-queue score (at or above 2^50: a lease,
/// 2^50 + its deadline) and its state, for a violation's line.
async fn chain_state(world: &World, task: &str, card: &str) -> String {
    let Some(task) = cardworker::config::Task::ALL
        .into_iter()
        .find(|t| t.label() == task)
    else {
        return format!("unknown task {task}");
    };
    let prefix = crate::world::PREFIX;
    let read = async {
        let mut conn = cardworker::context::connect_redis(&world.services.redis_url).await?;
        let queue = cardworker::polling::lease::due_queue(prefix, task);
        let entry: Option<String> = redis::cmd("HGET")
            .arg(&queue.keys().state)
            .arg(card)
            .query_async(&mut conn)
            .await?;
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(&queue.keys().due)
            .arg(card)
            .query_async(&mut conn)
            .await?;
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        anyhow::Ok(format!(
            "state {entry:?}, due score {score:?} (Redis now {} ms)",
            secs * 1000 + micros / 1000
        ))
    };
    read.await.unwrap_or_else(|e| format!("unreadable ({e:#})"))
}

/// Invariant 6: After the quiet period: every live chain polled within two intervals, no chain parked but
/// the cards failed alone, no token in use once idle, no unsettled money row older than the
/// recovery window, no panic in any log.
pub async fn check_quiet(world: &World, limits: Limits, report: &mut Report) {
    let calls = world.journal.calls();
    let now = world.journal.now_ms();
    let window = 2 * limits.interval_secs * 1000;
    let mut last: HashMap<(&str, &str), u64> = HashMap::new();
    // Polls per card and task in the last two intervals: one chain makes at most 3.
    let mut recent: HashMap<(&str, &str), u64> = HashMap::new();
    for c in &calls {
        if let Some((task, card)) = c.card_call() {
            let e = last.entry((task, card)).or_insert(0);
            *e = (*e).max(c.start_ms);
            if c.start_ms + window >= now {
                *recent.entry((task, card)).or_insert(0) += 1;
            }
        }
    }
    let failing: BTreeSet<&str> = world.failing.iter().map(String::as_str).collect();
    // (A failing card's chain retries sooner than its interval.)
    let mut forked: Vec<String> = recent
        .iter()
        .filter(|((_, card), n)| **n > 3 && !failing.contains(card))
        .map(|((task, card), n)| format!("{card} {task}: {n} polls in the last {}s", window / 1000))
        .collect();
    forked.sort();
    for f in forked.iter().take(20) {
        report.violation(
            6,
            format!("polled more often than one chain polls (a forked chain): {f}"),
        );
    }
    let cards = sqlx::query(
        "SELECT card_ref, data_state, status, carddata_parked_at IS NOT NULL AS dp, \
         card_status_parked_at IS NOT NULL AS sp FROM cards",
    )
    .fetch_all(&world.pool)
    .await
    .unwrap_or_default();
    let (mut live, mut late, mut parked_ok, mut parked_bad) = (0, 0, 0, 0);
    for r in &cards {
        let card: String = r.get("card_ref");
        for (task, is_live, parked) in [
            (
                "carddata",
                r.get::<String, _>("data_state") == "pending",
                r.get::<bool, _>("dp"),
            ),
            (
                "card_status",
                !["cancelled", "expired"].contains(&r.get::<String, _>("status").as_str()),
                r.get::<bool, _>("sp"),
            ),
        ] {
            if parked {
                if failing.contains(card.as_str()) {
                    parked_ok += 1;
                } else {
                    parked_bad += 1;
                    report.violation(6, format!("{card} {task}: parked"));
                }
                continue;
            }
            if !is_live || failing.contains(card.as_str()) {
                continue;
            }
            live += 1;
            let at = last.get(&(task, card.as_str())).copied().unwrap_or(0);
            if now.saturating_sub(at) > window {
                late += 1;
                if late <= 20 {
                    let state = chain_state(world, task, &card).await;
                    report.violation(
                        6,
                        format!(
                            "{card} {task}: last polled {:.0}s ago (two intervals: {}s); in Redis: {state}",
                            now.saturating_sub(at) as f64 / 1000.0,
                            window / 1000
                        ),
                    );
                }
            }
        }
    }
    let mut stale = 0i64;
    for table in ["payments", "approvals"] {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {table} WHERE status IN ('requested', 'pending', 'unknown') \
             AND updated_at < now() - make_interval(secs => $1)"
        ))
        .bind(limits.recovery_window_secs as f64)
        .fetch_one(&world.pool)
        .await
        .unwrap_or(-1);
        if n != 0 {
            report.violation(
                6,
                format!(
                    "{n} {table} unsettled for longer than {}s",
                    limits.recovery_window_secs
                ),
            );
        }
        stale += n;
    }
    let tokens = idle_tokens(world).await;
    if tokens != Some(0) {
        report.violation(6, format!("tokens in use once idle: {tokens:?}"));
    }
    let mut panics = 0;
    for log in &world.sup.logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines().filter(|l| l.contains("panicked at")) {
            panics += 1;
            if panics <= 5 {
                report.violation(6, format!("panic in {}: {line}", log.display()));
            }
        }
    }
    report.line(
        6,
        "after the quiet period",
        late + parked_bad + panics + forked.len() == 0 && stale == 0 && tokens == Some(0),
        format!(
            "{live} live chains, {late} not polled within two intervals, {} polled faster than their interval; parked: {parked_ok} failed alone, \
             {parked_bad} others; tokens in use once idle {tokens:?}; unsettled money rows older than {}s: {stale}; \
             panics {panics}",
            forked.len(),
            limits.recovery_window_secs
        ),
    );
}

/// Pauses every task's budget, waits for the polls in flight to end, and reads the tokens in use
/// fleet-wide (`budget show`, and the workers' gauge); resumes afterwards.
async fn idle_tokens(world: &World) -> Option<i64> {
    world
        .cli
        .run_until_ok(&["budget", "pause", "--task", "all"], 10)
        .await?;
    let mut in_use = None;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let shown = world.cli.run(&["budget", "show", "--format", "json"]).await;
        let v: Option<i64> = serde_json::from_str::<serde_json::Value>(&shown.stdout)
            .ok()
            .and_then(|v| v["total"]["in_use"].as_i64());
        let gauges: Vec<f64> = world
            .sup
            .metrics()
            .await
            .values()
            .filter_map(|t| metric_sum(t, "cardworker_poll_tokens_in_use", &[("scope", "total")]))
            .collect();
        let gauge_max = gauges.iter().copied().fold(0.0, f64::max);
        in_use = v.map(|v| v.max(gauge_max as i64));
        if in_use == Some(0) {
            break;
        }
    }
    world
        .cli
        .run_until_ok(&["budget", "resume", "--task", "all"], 10)
        .await;
    in_use
}

/// Invariant 7: Exits: only the kills the schedule made.
pub fn check_exits(world: &World, report: &mut Report) {
    let exits = world.sup.exits();
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    let mut other = 0;
    for e in &exits {
        let kind = match (e.as_scheduled(), e.expected) {
            _ if e.startup_error.is_some() => "refused to start (a service down)".to_owned(),
            (true, Some(k)) => format!("scheduled {k:?}"),
            _ => {
                other += 1;
                report.violation(7, format!("unscheduled exit: {}", e.describe()));
                "unscheduled".to_owned()
            }
        };
        *by_kind.entry(kind).or_insert(0) += 1;
    }
    report.line(
        7,
        "exits: only the kills the schedule made",
        other == 0,
        format!(
            "{} exits {by_kind:?}; starts per worker {:?}",
            exits.len(),
            world.sup.starts()
        ),
    );
}

/// Counters of interest from the workers' `/metrics` (each process's own since its start).
pub async fn metrics_summary(world: &World) -> String {
    let texts = world.sup.metrics().await;
    let sum = |name: &str, labels: &[(&str, &str)]| -> f64 {
        texts
            .values()
            .filter_map(|t| metric_sum(t, name, labels))
            .sum()
    };
    format!(
        "workers answering /metrics {}; since their last start: polls persisted_change {:.0}, persisted_failure {:.0}, \
         skipped_unchanged {:.0}; deferred {:.0}; leases expired {:.0}",
        texts.len(),
        sum("cardworker_poll_outcomes_total", &[("outcome", "persisted_change")]),
        sum("cardworker_poll_outcomes_total", &[("outcome", "persisted_failure")]),
        sum("cardworker_poll_outcomes_total", &[("outcome", "skipped_unchanged")]),
        sum("cardworker_poll_deferred_total", &[]),
        sum("cardworker_budget_leases_expired_total", &[]),
    )
}
