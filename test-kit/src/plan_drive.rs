//! Drives every statement path of `src/` through the product's own functions and commands, on a
//! running worker ([`TestApp`]): the plan guard runs it on a small private cluster
//! (`plans.rs`), `make bench-plans` at production volumes (`benches/bench_plans.rs`).
//!
//! [`COVERAGE`] names every statement the drive must have run, by the file that issues it and
//! fragments of its text; the guard test fails when one of them never ran, and when a file of
//! `src/` has more `sqlx::query*` call sites than entries here.
//!
//! A new statement gets covered in three steps: (1) add a [`COVERAGE`] entry naming its file and
//! a fragment only it contains; (2) make [`drive`] run it (a step below, or a new one); (3) run
//! `cargo nextest run --test it -E 'test(/plan/)'`: it passes when the statement ran and its plan
//! reads no guarded table whole.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cardworker::commands::{self, investigate, Cli};
use cardworker::config::{Config, Task};
use cardworker::context::AppContext;
use cardworker::gateway::{CardStatus, PaymentResult, PaymentStatus};
use cardworker::maintenance::{self, JobKind};
use cardworker::payments::{callback, recovery, submit};
use cardworker::polling::reconcile;
use cardworker::sim::{PaymentBehaviour, SimConfigPatch};
use cardworker_jobs::{ProcessCallback, SubmitApproval, SubmitPayment};
use clap::Parser as _;
use uuid::Uuid;

use crate::harness::{metric_value, wait_until, TestApp};

/// How a statement is recognised in the log (its text with white space folded).
#[derive(Debug, Clone, Copy)]
pub enum Sql {
    /// Contains every fragment.
    Contains(&'static [&'static str]),
    /// Contains every fragment of the first list and none of the second.
    ContainsNot(&'static [&'static str], &'static [&'static str]),
    /// Is exactly this text.
    Exact(&'static str),
}

/// One product statement the drive must run.
#[derive(Debug, Clone, Copy)]
pub struct Statement {
    /// The file of `src/` that issues it.
    pub source: &'static str,
    /// What it does.
    pub what: &'static str,
    /// How to recognise it.
    pub sql: Sql,
}

impl Statement {
    /// Whether `statement` (white space folded) is this one.
    pub fn matches(&self, statement: &str) -> bool {
        match self.sql {
            Sql::Contains(all) => all.iter().all(|f| statement.contains(f)),
            Sql::ContainsNot(all, none) => {
                all.iter().all(|f| statement.contains(f))
                    && !none.iter().any(|f| statement.contains(f))
            }
            Sql::Exact(text) => statement == text,
        }
    }
}

const fn s(source: &'static str, what: &'static str, sql: Sql) -> Statement {
    Statement { source, what, sql }
}

/// Every statement of `src/`, by file. Keep the files in the order of the layers.
pub const COVERAGE: &[Statement] = &[
    // storage
    s("src/storage/cards.rs", "load a card", Sql::Contains(&["FROM cards WHERE card_ref = $1"])),
    s("src/storage/cards.rs", "load the cards of overdue chains", Sql::Contains(&["FROM cards WHERE card_ref = ANY($1)"])),
    s("src/storage/cards.rs", "a page of cards (gateway-sim --seed-from-db)", Sql::Contains(&["FROM cards WHERE id > $1 ORDER BY id LIMIT $2"])),
    s("src/storage/cards.rs", "unpark a batch of parked chains", Sql::Contains(&["UPDATE cards SET", "WHERE id IN (SELECT id FROM cards", "FOR UPDATE SKIP LOCKED"])),
    s("src/storage/cards.rs", "count the parked chains", Sql::Contains(&["SELECT (SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL)"])),
    s("src/storage/cards.rs", "parked chains whose retry is overdue", Sql::Contains(&["IS NOT NULL AND", "< now() - $1 * interval '1 millisecond'"])),
    s("src/storage/cards.rs", "apply card data", Sql::Contains(&["UPDATE cards SET data_state = 'ready'"])),
    s("src/storage/cards.rs", "apply a status", Sql::Contains(&["UPDATE cards SET status = $3"])),
    s("src/storage/cards.rs", "park a carddata chain", Sql::Contains(&["UPDATE cards SET carddata_parked_at = now() WHERE card_ref = $1"])),
    s("src/storage/cards.rs", "park a card_status chain", Sql::Contains(&["UPDATE cards SET card_status_parked_at = now() WHERE card_ref = $1"])),
    s("src/storage/cards.rs", "unpark a carddata chain", Sql::Contains(&["UPDATE cards SET carddata_parked_at = NULL WHERE card_ref = $1"])),
    s("src/storage/cards.rs", "unpark a card_status chain", Sql::Contains(&["UPDATE cards SET card_status_parked_at = NULL WHERE card_ref = $1"])),
    s("src/storage/records.rs", "terminal integration log", Sql::ContainsNot(&["INSERT INTO integration_logs (correlation_id", "duration_ms)"], &["'pending'"])),
    s("src/storage/records.rs", "audit event", Sql::ContainsNot(&["INSERT INTO audit_events (event_type"], &["(event_type, actor, summary, details)"])),
    s("src/storage/records.rs", "audit resource link", Sql::ContainsNot(&["INSERT INTO audit_resources (audit_event_id"], &["unnest($3::text[])"])),
    s("src/storage/records.rs", "outbox event", Sql::Contains(&["INSERT INTO outbox_events (aggregate_type"])),
    s("src/storage/records.rs", "an operator's audit event", Sql::Contains(&["INSERT INTO audit_events (event_type, actor, summary, details)"])),
    s("src/storage/records.rs", "an operator action's outcome on its event", Sql::Contains(&["UPDATE audit_events SET details = details || jsonb_build_object('outcome', $2::jsonb) WHERE id = $1"])),
    s("src/storage/records.rs", "an operator event's resource links", Sql::Contains(&["INSERT INTO audit_resources (audit_event_id, resource_type, resource_id) SELECT $1, $2, unnest($3::text[])"])),
    s("src/reliable/pending.rs", "pending attempt log", Sql::Contains(&["INSERT INTO integration_logs (correlation_id", "'pending', $5, now())"])),
    s("src/reliable/pending.rs", "finish an attempt log", Sql::Contains(&["UPDATE integration_logs SET state = $2"])),
    s("src/reliable/pending.rs", "reopen an attempt log", Sql::Contains(&["FROM integration_logs WHERE id = $1 AND state = 'pending' FOR UPDATE"])),
    // telemetry
    s("src/telemetry/http.rs", "readiness probe", Sql::Exact("SELECT 1")),
    // budget: the deployment's first start (every worker start, before its first poll)
    s("src/budget/mod.rs", "record the deployment's first start", Sql::Contains(&["INSERT INTO budget_deployment (id) VALUES (TRUE) ON CONFLICT (id) DO UPDATE"])),
    // polling
    s("src/polling/reconcile.rs", "reconcile carddata", Sql::Contains(&["FROM cards WHERE data_state = 'pending' AND carddata_parked_at IS NULL AND id > $1"])),
    s("src/polling/reconcile.rs", "reconcile card_status", Sql::Contains(&["FROM cards WHERE status NOT IN ('cancelled', 'expired') AND card_status_parked_at IS NULL AND id > $1"])),
    // reliable::table: one statement per operation, run for both tables
    s("src/reliable/table.rs", "load a payment", Sql::ContainsNot(&["FROM payments WHERE payment_id = $1"], &["FOR UPDATE"])),
    s("src/reliable/table.rs", "load an approval", Sql::ContainsNot(&["FROM approvals WHERE approval_id = $1"], &["FOR UPDATE"])),
    s("src/reliable/table.rs", "lock a payment", Sql::Contains(&["FROM payments WHERE payment_id = $1 FOR UPDATE"])),
    s("src/reliable/table.rs", "lock an approval", Sql::Contains(&["FROM approvals WHERE approval_id = $1 FOR UPDATE"])),
    s("src/reliable/table.rs", "begin a payment submission", Sql::Contains(&["UPDATE payments SET status = 'pending', submissions = submissions + 1"])),
    s("src/reliable/table.rs", "begin an approval submission", Sql::Contains(&["UPDATE approvals SET status = 'pending', submissions = submissions + 1"])),
    s("src/reliable/table.rs", "decide a payment", Sql::Contains(&["UPDATE payments SET status = $2, channel_ref = COALESCE($3, channel_ref)"])),
    s("src/reliable/table.rs", "decide an approval (or mark it in review)", Sql::Contains(&["UPDATE approvals SET status = $2, channel_ref = COALESCE($3, channel_ref)"])),
    s("src/reliable/table.rs", "mark a payment attempt's outcome", Sql::Contains(&["UPDATE payments SET status = $3, updated_at = now() WHERE payment_id = $1 AND attempt_log_id = $2"])),
    s("src/reliable/table.rs", "mark an approval attempt's outcome", Sql::Contains(&["UPDATE approvals SET status = $3, updated_at = now() WHERE approval_id = $1 AND attempt_log_id = $2"])),
    s("src/reliable/table.rs", "move a payment to the back of recovery's line", Sql::Contains(&["UPDATE payments SET updated_at = now() WHERE payment_id = $1 AND status NOT IN"])),
    s("src/reliable/table.rs", "move an approval to the back of recovery's line", Sql::Contains(&["UPDATE approvals SET updated_at = now() WHERE approval_id = $1 AND status NOT IN"])),
    s("src/reliable/table.rs", "refuse an approval: final with its reason", Sql::Contains(&["UPDATE approvals SET status = $2, failure_reason = $3, updated_at = now() WHERE approval_id = $1 AND status NOT IN"])),
    s("src/reliable/table.rs", "reopen a payment the Gateway never saw", Sql::Contains(&["UPDATE payments SET status = 'requested', updated_at = now()"])),
    s("src/reliable/table.rs", "reopen an approval the Gateway never saw", Sql::Contains(&["UPDATE approvals SET status = 'requested', updated_at = now()"])),
    s("src/reliable/table.rs", "touch a requested payment before it is enqueued", Sql::Contains(&["UPDATE payments SET updated_at = CASE WHEN status = 'requested'"])),
    s("src/reliable/table.rs", "touch a requested approval before it is enqueued", Sql::Contains(&["UPDATE approvals SET updated_at = CASE WHEN status = 'requested'"])),
    s("src/reliable/table.rs", "find unsettled payments", Sql::Contains(&["SELECT payment_id FROM payments WHERE status IN ('requested', 'pending', 'unknown')"])),
    s("src/reliable/table.rs", "find undecided approvals", Sql::Contains(&["SELECT approval_id FROM approvals WHERE status IN ('requested', 'pending', 'unknown')"])),
    s("src/reliable/table.rs", "find approvals in review to ask about again", Sql::Contains(&["SELECT approval_id FROM approvals WHERE status = 'in_review'"])),
    s("src/payments/callback/mod.rs", "record a delivery", Sql::Contains(&["INSERT INTO inbound_callbacks (channel, callback_id, body, state, reason)"])),
    s("src/payments/callback/mod.rs", "record a received callback before it is enqueued", Sql::Contains(&["INSERT INTO inbound_callbacks (channel, callback_id, body, state, queued_at)"])),
    s("src/payments/callback/mod.rs", "find received callbacks nobody processed", Sql::Contains(&["WHERE state = 'received' AND queued_at < now()"])),
    s("src/payments/callback/mod.rs", "touch a received callback before it is enqueued again", Sql::Contains(&["UPDATE inbound_callbacks SET queued_at = now() WHERE id = $1 AND state = 'received' AND queued_at = $2"])),
    s("src/payments/callback/mod.rs", "mark a callback applied", Sql::Contains(&["UPDATE inbound_callbacks SET state = 'applied'"])),
    s("src/payments/callback/mod.rs", "mark a callback failed", Sql::Contains(&["UPDATE inbound_callbacks SET state = 'failed'"])),
    s("src/payments/callback/apply.rs", "link a change's audit event to its log", Sql::Contains(&["UPDATE audit_events SET integration_log_id = $2 WHERE id = $1"])),
    // maintenance
    s("src/maintenance/session.rs", "SET LOCAL statement_timeout", Sql::Contains(&["SELECT set_config('statement_timeout', $1, true)"])),
    s("src/maintenance/session.rs", "oldest due archive day", Sql::Contains(&["SELECT LEAST((SELECT min(created_at) FROM integration_logs WHERE state <> 'pending' AND created_at < $1)"])),
    s("src/maintenance/session.rs", "oldest due retention day", Sql::Contains(&["SELECT LEAST((SELECT min(created_at) FROM audit_resources_archive WHERE created_at < $1)"])),
    s("src/maintenance/session.rs", "archive days pending", Sql::Contains(&["WITH RECURSIVE d(found, n)", "FROM integration_logs WHERE state <> 'pending'"])),
    s("src/maintenance/session.rs", "retention days pending", Sql::Contains(&["WITH RECURSIVE d(found, n)", "FROM integration_logs_archive WHERE"])),
    s("src/maintenance/session.rs", "archive column list", Sql::Contains(&["FROM information_schema.columns"])),
    s("src/maintenance/run.rs", "maintenance lock", Sql::Contains(&["SELECT pg_try_advisory_lock($1)"])),
    s("src/maintenance/run.rs", "maintenance unlock", Sql::Contains(&["SELECT pg_advisory_unlock($1)"])),
    s("src/maintenance/archive.rs", "move a batch of logs", Sql::Contains(&["WITH batch AS ( SELECT id FROM integration_logs WHERE state <> 'pending'"])),
    s("src/maintenance/archive.rs", "lock a batch of audit events", Sql::Contains(&["SELECT id, created_at FROM audit_events WHERE created_at >= $1", "FOR UPDATE"])),
    s("src/maintenance/archive.rs", "move a batch's links", Sql::Contains(&["DELETE FROM audit_resources WHERE audit_event_id = ANY($1)"])),
    s("src/maintenance/archive.rs", "move a batch's events", Sql::Contains(&["DELETE FROM audit_events WHERE id = ANY($1)"])),
    s("src/maintenance/retention.rs", "count expired links", Sql::Contains(&["SELECT count(*) FROM audit_resources_archive WHERE created_at >= $1"])),
    s("src/maintenance/retention.rs", "count expired events", Sql::Contains(&["SELECT count(*) FROM audit_events_archive WHERE created_at >= $1"])),
    s("src/maintenance/retention.rs", "count expired logs", Sql::Contains(&["SELECT count(*) FROM integration_logs_archive WHERE created_at >= $1"])),
    s("src/maintenance/retention.rs", "delete expired links", Sql::Contains(&["WITH batch AS ( SELECT id FROM audit_resources_archive"])),
    s("src/maintenance/retention.rs", "delete expired events", Sql::Contains(&["WITH batch AS ( SELECT id FROM audit_events_archive"])),
    s("src/maintenance/retention.rs", "delete expired logs", Sql::Contains(&["WITH batch AS ( SELECT id FROM integration_logs_archive"])),
    // commands
    s("src/commands/investigate/timeline.rs", "a card's integration logs", Sql::Contains(&["FROM integration_logs WHERE resource_type = 'card' AND resource_id = $1", "FROM integration_logs_archive WHERE"])),
    s("src/commands/investigate/timeline.rs", "a card's audit events", Sql::Contains(&["FROM audit_resources r JOIN audit_events e", "FROM audit_resources_archive r JOIN audit_events_archive e"])),
    s("src/console/data/fleet.rs", "the console's PostgreSQL check", Sql::Exact("SELECT true")),
    s("src/console/data/parked.rs", "the console's parked count", Sql::Exact("SELECT count(*) FROM cards WHERE carddata_parked_at IS NOT NULL")),
    s("src/console/data/parked.rs", "the console's parked list", Sql::Contains(&["FROM cards c LEFT JOIN LATERAL"])),
    s("src/console/data/money.rs", "the console's stuck payments", Sql::Contains(&["FROM payments WHERE status = 'unknown' OR"])),
    s("src/console/data/money.rs", "the console's stuck approvals", Sql::Contains(&["FROM approvals WHERE (status IN ('requested', 'pending', 'unknown') AND updated_at < now() - $1 * interval '1 second')"])),
    s("src/console/data/money.rs", "the console's failed callbacks", Sql::Contains(&["FROM inbound_callbacks cb LEFT JOIN payments p ON p.payment_id = CASE"])),
    s("src/commands/investigate/facts.rs", "a card's manual facts", Sql::Contains(&["WHERE r.resource_type = 'card' AND r.resource_id = $1 AND e.event_type LIKE 'operator.%'"])),
    s("src/commands/investigate/facts.rs", "the fleet's polling facts", Sql::Contains(&["UNION ALL", "WHERE r.resource_type = 'task' AND r.resource_id = 'carddata'"])),
    s("src/commands/investigate/payments.rs", "a card's payments", Sql::Contains(&["FROM payments WHERE card_ref = $1 ORDER BY created_at DESC LIMIT $2"])),
    s("src/commands/investigate/payments.rs", "a card's approvals", Sql::Contains(&["FROM approvals WHERE card_ref = $1 ORDER BY created_at DESC LIMIT $2"])),
    s("src/commands/investigate/payments.rs", "the history of a card's approvals", Sql::Contains(&["WHERE r.resource_type = 'approval' AND r.resource_id = ids.id"])),
    s("src/commands/investigate/callbacks.rs", "a card's callbacks", Sql::Contains(&["FROM inbound_callbacks", "resource_id = ANY (ARRAY(SELECT payment_id::text FROM payments WHERE card_ref = $1))"])),
];

/// The volumes the drive runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// A fresh, nearly empty database (the guard in `make test`).
    Small,
    /// The seeded production volumes of `make bench-plans` (90 days of records).
    Production,
}

/// A cron schedule that does not fire during a drive.
pub const NEVER: &str = "0 0 0 1 1 *";

/// The configuration of the driven worker: every schedule out of the way (the drive runs each
/// path itself), maintenance on with cleanup, and short failure runs.
pub fn configure(c: &mut Config, scale: Scale) {
    let small = scale == Scale::Small;
    for task in [&mut c.polling.carddata, &mut c.polling.card_status] {
        // Small: 1 s, so that a failing chain is parked after 2 failures within seconds. At
        // volume, one poll per chain (the reconcile pass starts thousands).
        task.interval_secs = if small { 1 } else { 3600 };
        task.max_consecutive_failures = if small { 2 } else { 1 };
    }
    c.polling.reconcile_cron = NEVER.to_owned();
    c.payments.recovery_cron = NEVER.to_owned();
    c.maintenance.enabled = true;
    c.maintenance.cleanup_enabled = true;
    c.maintenance.archive_cron = NEVER.to_owned();
    c.maintenance.retention_cron = NEVER.to_owned();
    // Small: the seeded day 3 days back is due for both. At volume (90 days online, 90 more in
    // the archive): 60 due days for each.
    c.maintenance.archive_after_days = if small { 1 } else { 30 };
    c.maintenance.retention_days = if small { 1 } else { 120 };
    c.maintenance.batch_size = if small { 2 } else { 1000 };
}

const LIMIT: Duration = Duration::from_secs(30);

/// The driven worker with its command-line configuration file.
struct Driver<'a> {
    app: &'a TestApp,
    /// Prefix of every card, payment and callback the drive creates (one drive per tag).
    tag: String,
    scale: Scale,
    config_file: PathBuf,
    _dir: tempfile::TempDir,
}

/// Runs every path once. Panics (naming the step) when a path does not do what it should: a
/// drive that silently skipped a path would let its statements go unjudged.
pub async fn drive(app: &TestApp, tag: &str, scale: Scale) {
    let dir = tempfile::tempdir().expect("tempdir");
    let config_file = dir.path().join("cardworker.toml");
    std::fs::write(
        &config_file,
        app.ctx.config.to_toml_string().expect("config as toml"),
    )
    .expect("write config");
    let d = Driver {
        app,
        tag: tag.to_owned(),
        scale,
        config_file,
        _dir: dir,
    };
    let poll_card = d.polls().await;
    d.failures_parking_and_unpark().await;
    let payment = d.payments().await;
    d.approvals().await;
    d.recovery_leftovers().await;
    d.callbacks(&poll_card).await;
    d.maintenance().await;
    d.investigate(&poll_card).await;
    d.console().await;
    d.operator_commands(&poll_card, payment).await;
    d.reconcile().await;
}

impl Driver<'_> {
    fn pool(&self) -> &sqlx::PgPool {
        &self.app.db.pool
    }

    fn ctx(&self) -> &AppContext {
        &self.app.ctx
    }

    /// Runs one command line in-process, exactly as `main` would (`--config` appended).
    async fn cli(&self, args: &[&str]) {
        let mut argv = vec!["cardworker"];
        argv.extend_from_slice(args);
        let config = self.config_file.to_string_lossy().into_owned();
        argv.extend_from_slice(&["--config", &config]);
        let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        commands::execute(cli)
            .await
            .unwrap_or_else(|e| panic!("{argv:?} failed: {e:#}"));
    }

    /// `cardworker enqueue carddata` and `enqueue card-status` for one card: a chain of each task
    /// due now (un-parking a parked one).
    async fn enqueue_both(&self, card_ref: &str) {
        for task in ["carddata", "card-status"] {
            self.cli(&["enqueue", task, "--card-ref", card_ref]).await;
        }
    }

    async fn insert_card(&self, card_ref: &str) {
        sqlx::query("INSERT INTO cards (card_ref) VALUES ($1)")
            .bind(card_ref)
            .execute(self.pool())
            .await
            .expect("insert card");
    }

    async fn card_is(&self, card_ref: &str, sql_condition: &str) -> bool {
        sqlx::query_scalar::<_, bool>(&format!(
            "SELECT EXISTS (SELECT 1 FROM cards WHERE card_ref = $1 AND {sql_condition})"
        ))
        .bind(card_ref)
        .fetch_one(self.pool())
        .await
        .expect("card state")
    }

    async fn wait_card(&self, card_ref: &str, sql_condition: &str, what: &str) {
        wait_until(LIMIT, what, || self.card_is(card_ref, sql_condition)).await;
    }

    fn polled(&self, card_ref: &str, path_end: &str) -> bool {
        let path = format!("/v1/cards/{card_ref}/{path_end}");
        self.app
            .sim
            .recent_requests()
            .iter()
            .any(|r| r.path == path)
    }

    /// Polls without a change (no write), then with one of each task (card update, log, audit,
    /// outbox). Returns the card, now `ready` and `active`.
    async fn polls(&self) -> String {
        let card = format!("{}-poll", self.tag);
        self.insert_card(&card).await;
        // The simulator's new card is what the row says (pending, inactive): unchanged.
        self.enqueue_both(&card).await;
        wait_until(LIMIT, "an unchanged poll of each task", || async {
            self.polled(&card, "data") && self.polled(&card, "status")
        })
        .await;
        self.app
            .sim
            .set_card_ready(&card, "tok_plan", "4242", 12, 2030);
        self.app.sim.set_card_status(&card, CardStatus::Active);
        self.enqueue_both(&card).await;
        self.wait_card(
            &card,
            "data_state = 'ready' AND status = 'active'",
            "a changed poll of each task",
        )
        .await;
        card
    }

    /// Failing polls until both chains are parked, then `enqueue` un-parks them and the next
    /// polls succeed.
    async fn failures_parking_and_unpark(&self) {
        let card = format!("{}-fail", self.tag);
        self.insert_card(&card).await;
        self.app.sim.fail_card(&card);
        self.enqueue_both(&card).await;
        self.wait_card(
            &card,
            "carddata_parked_at IS NOT NULL AND card_status_parked_at IS NOT NULL",
            "both chains parked after repeated failures",
        )
        .await;
        self.app.sim.heal_card(&card);
        self.app
            .sim
            .set_card_ready(&card, "tok_fail", "1234", 1, 2031);
        self.app.sim.set_card_status(&card, CardStatus::Frozen);
        self.enqueue_both(&card).await;
        self.wait_card(
            &card,
            "carddata_parked_at IS NULL AND card_status_parked_at IS NULL
             AND data_state = 'ready' AND status = 'frozen'",
            "un-parked chains that poll again",
        )
        .await;
    }

    async fn insert_payment(&self, card_ref: &str, status: &str) -> Uuid {
        let id = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO payments (payment_id, card_ref, amount_minor, currency, status)
             VALUES ($1, $2, 1234, 'CNY', $3)",
        )
        .bind(id)
        .bind(card_ref)
        .bind(status)
        .execute(self.pool())
        .await
        .expect("insert payment");
        id
    }

    /// A payment whose worker died mid-call: `pending`, with its attempt's log still `pending`.
    async fn insert_dead_attempt(&self, card_ref: &str) -> Uuid {
        let id = self.insert_payment(card_ref, "pending").await;
        sqlx::query(
            "WITH log AS (
                 INSERT INTO integration_logs
                   (correlation_id, resource_type, resource_id, scenario, state, started_at)
                 VALUES ($2, 'payment', $1::text, 'payment_submit', 'pending', now())
                 RETURNING id)
             UPDATE payments SET attempt_log_id = (SELECT id FROM log), submissions = 1
              WHERE payment_id = $1",
        )
        .bind(id)
        .bind(Uuid::new_v4())
        .execute(self.pool())
        .await
        .expect("a dead attempt");
        id
    }

    async fn payment_status(&self, id: Uuid) -> String {
        sqlx::query_scalar("SELECT status FROM payments WHERE payment_id = $1")
            .bind(id)
            .fetch_one(self.pool())
            .await
            .expect("payment status")
    }

    /// Submissions (accepted, unknown, an unknown id), then recovery settling a dead attempt and
    /// an unknown one and resubmitting one the Gateway never saw. Returns an unsettled payment
    /// for `enqueue payment`.
    async fn payments(&self) -> Uuid {
        let card = format!("{}-poll", self.tag);
        let sim = &self.app.sim;
        let accepted = self.insert_payment(&card, "requested").await;
        let got = submit::submit(
            self.ctx(),
            &SubmitPayment {
                payment_id: accepted,
                retries: 0,
            },
        )
        .await
        .expect("submit");
        assert!(
            matches!(&got, submit::Submitted::Answered { status, .. } if status == "accepted"),
            "{got:?}"
        );

        let unknown = self.insert_payment(&card, "requested").await;
        sim.set_payment_behaviour(unknown, PaymentBehaviour::ServerError);
        submit::submit(
            self.ctx(),
            &SubmitPayment {
                payment_id: unknown,
                retries: 0,
            },
        )
        .await
        .expect("submit");
        assert_eq!(self.payment_status(unknown).await, "unknown");
        let nobody = submit::submit(
            self.ctx(),
            &SubmitPayment {
                payment_id: Uuid::new_v4(),
                retries: 0,
            },
        )
        .await
        .expect("submit");
        assert_eq!(nobody, submit::Submitted::UnknownRow);

        // Recovery: the three oldest unsettled payments are ours (older than any seeded one).
        let dead = self.insert_dead_attempt(&card).await;
        let forgotten = self.insert_payment(&card, "unknown").await;
        for id in [unknown, dead] {
            sim.set_payment_behaviour(id, PaymentBehaviour::Accept);
            sim.store_payment(PaymentResult {
                payment_id: id,
                status: PaymentStatus::Accepted,
                channel_ref: format!("ch-{id}"),
            });
        }
        sqlx::query(
            "UPDATE payments SET updated_at = '2000-01-01T00:00:00Z' WHERE payment_id = ANY($1)",
        )
        .bind(vec![unknown, dead, forgotten])
        .execute(self.pool())
        .await
        .expect("age the payments");
        let report = recovery::recover(self.ctx(), Duration::from_secs(300), 3)
            .await
            .expect("recovery");
        assert_eq!((report.settled, report.resubmitted), (2, 1), "{report:?}");
        wait_until(LIMIT, "the resubmitted payment is accepted", || async {
            self.payment_status(forgotten).await == "accepted"
        })
        .await;
        self.insert_payment(&card, "requested").await
    }

    /// What recovery does besides settling: a payment whose query the Gateway cannot answer goes
    /// to the back of the line, and a `received` callback whose job was lost is enqueued again.
    async fn insert_approval(&self, card_ref: &str) -> Uuid {
        let id = Uuid::new_v4();
        sqlx::query("INSERT INTO approvals (approval_id, card_ref, kind) VALUES ($1, $2, 'issue')")
            .bind(id)
            .bind(card_ref)
            .execute(self.pool())
            .await
            .expect("insert approval");
        id
    }

    async fn approval_status(&self, id: Uuid) -> String {
        sqlx::query_scalar("SELECT status FROM approvals WHERE approval_id = $1")
            .bind(id)
            .fetch_one(self.pool())
            .await
            .expect("approval status")
    }

    async fn age_approvals(&self, ids: &[Uuid]) {
        sqlx::query(
            "UPDATE approvals SET updated_at = '2000-01-01T00:00:00Z' WHERE approval_id = ANY($1)",
        )
        .bind(ids.to_vec())
        .execute(self.pool())
        .await
        .expect("age the approvals");
    }

    fn sim_approvals(&self, in_review: f64) {
        self.app
            .sim
            .update_config(&SimConfigPatch {
                approval_in_review_rate: Some(in_review),
                approval_review_ms: Some(0),
                ..SimConfigPatch::default()
            })
            .expect("sim config");
    }

    /// Approvals on the shared path: `enqueue approval` and the worker's submission, an answer in
    /// review, a 5xx (unknown), recovery deciding one in review, resubmitting one the Gateway
    /// never saw and leaving one it could not answer for, and an `approval.result` callback.
    async fn approvals(&self) {
        let card = format!("{}-poll", self.tag);
        let submitted = self.insert_approval(&card).await;
        self.cli(&[
            "enqueue",
            "approval",
            "--approval-id",
            &submitted.to_string(),
        ])
        .await;
        wait_until(LIMIT, "the enqueued approval is approved", || async {
            self.approval_status(submitted).await == "approved"
        })
        .await;

        self.sim_approvals(1.0);
        let in_review = self.insert_approval(&card).await;
        cardworker::approvals::submit::submit(
            self.ctx(),
            &SubmitApproval {
                approval_id: in_review,
                retries: 0,
            },
        )
        .await
        .expect("submit");
        self.sim_approvals(0.0);
        assert_eq!(self.approval_status(in_review).await, "in_review");

        let unknown = self.insert_approval(&card).await;
        self.app.sim.set_error_rate(1.0);
        cardworker::approvals::submit::submit(
            self.ctx(),
            &SubmitApproval {
                approval_id: unknown,
                retries: 0,
            },
        )
        .await
        .expect("submit");
        self.app.sim.set_error_rate(0.0);
        assert_eq!(self.approval_status(unknown).await, "unknown");

        // A kind the contract does not allow: refused, final with its reason, never sent.
        let refused = Uuid::new_v4();
        sqlx::query(
            "INSERT INTO approvals (approval_id, card_ref, kind) VALUES ($1, $2, 'upgrade')",
        )
        .bind(refused)
        .bind(&card)
        .execute(self.pool())
        .await
        .expect("insert approval");
        cardworker::approvals::submit::submit(
            self.ctx(),
            &SubmitApproval {
                approval_id: refused,
                retries: 0,
            },
        )
        .await
        .expect("submit");
        assert_eq!(self.approval_status(refused).await, "failed");

        // Recovery: the unknown one was never stored by the sim (its 503 came first): 404,
        // resubmitted; the one in review is decided by now.
        let thresholds = cardworker::reliable::Thresholds {
            undecided: Duration::from_secs(300),
            waiting: Duration::from_secs(900),
        };
        self.age_approvals(&[in_review, unknown]).await;
        let report = cardworker::approvals::recovery::recover(self.ctx(), thresholds, 10)
            .await
            .expect("approval recovery");
        assert_eq!((report.settled, report.resubmitted), (1, 1), "{report:?}");
        wait_until(LIMIT, "the resubmitted approval is approved", || async {
            self.approval_status(unknown).await == "approved"
        })
        .await;

        let left = self.insert_approval(&card).await;
        self.age_approvals(&[left]).await;
        self.app.sim.set_error_rate(1.0);
        let report = cardworker::approvals::recovery::recover(self.ctx(), thresholds, 10)
            .await
            .expect("approval recovery");
        self.app.sim.set_error_rate(0.0);
        assert_eq!(report.left, 1, "{report:?}");

        let decided = self.callback(
            "approval",
            format!(
                r#"{{"type":"approval.result","approval_id":"{left}","status":"declined","channel_ref":"ch-cb"}}"#
            ),
        );
        assert_eq!(
            self.deliver(&decided).await,
            callback::Delivery::Applied { changed: true }
        );
    }

    async fn recovery_leftovers(&self) {
        let card = format!("{}-poll", self.tag);
        let left = self.insert_payment(&card, "unknown").await;
        sqlx::query(
            "UPDATE payments SET updated_at = '2000-01-01T00:00:00Z' WHERE payment_id = $1",
        )
        .bind(left)
        .execute(self.pool())
        .await
        .expect("age the payment");
        let swept = format!("{}-swept", self.tag);
        sqlx::query(
            "INSERT INTO inbound_callbacks (channel, callback_id, body, state, queued_at)
             VALUES ('visa', $1, $2, 'received', '2000-01-01T00:00:00Z')",
        )
        .bind(&swept)
        // About a card nobody has: processing it records a failure, which is enough here.
        .bind(format!(
            r#"{{"type":"card.status","card_ref":"{}-nobody","status":"frozen"}}"#,
            self.tag
        ))
        .execute(self.pool())
        .await
        .expect("a received callback");
        self.app.sim.set_error_rate(1.0);
        let report = recovery::recover(self.ctx(), Duration::from_secs(300), 1)
            .await
            .expect("recovery");
        self.app.sim.set_error_rate(0.0);
        assert_eq!(report.left, 1, "{report:?}");
        assert_eq!(self.payment_status(left).await, "unknown");
        // The sweep runs with the recovery job.
        let swept_jobs = callback::sweep_received(self.ctx(), Duration::from_secs(300), 10)
            .await
            .expect("sweep");
        assert!(swept_jobs >= 1, "{swept_jobs}");
        wait_until(LIMIT, "the swept callback is processed", || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM inbound_callbacks
                                 WHERE callback_id = $1 AND state <> 'received')",
            )
            .bind(&swept)
            .fetch_one(self.pool())
            .await
            .expect("callback state")
        })
        .await;
    }

    fn callback(&self, id: &str, body: String) -> ProcessCallback {
        ProcessCallback {
            channel: "visa".to_owned(),
            callback_id: format!("{}-{id}", self.tag),
            body,
            retries: 0,
            recorded: false,
        }
    }

    async fn deliver(&self, job: &ProcessCallback) -> callback::Delivery {
        callback::process(self.ctx(), job).await.expect("callback")
    }

    /// Card and payment callbacks: applied, duplicate, unchanged, failed (unknown card, malformed
    /// body, contradicting result).
    async fn callbacks(&self, card: &str) {
        use callback::Delivery;
        let status =
            |s: &str| format!(r#"{{"type":"card.status","card_ref":"{card}","status":"{s}"}}"#);
        let frozen = self.callback("frozen", status("frozen"));
        assert_eq!(
            self.deliver(&frozen).await,
            Delivery::Applied { changed: true }
        );
        assert_eq!(self.deliver(&frozen).await, Delivery::Duplicate);
        let again = self.callback("frozen-again", status("frozen"));
        assert_eq!(
            self.deliver(&again).await,
            Delivery::Applied { changed: false }
        );
        let nobody = self.callback(
            "nobody",
            format!(
                r#"{{"type":"card.status","card_ref":"{}-nobody","status":"active"}}"#,
                self.tag
            ),
        );
        assert!(matches!(self.deliver(&nobody).await, Delivery::Failed(_)));
        let malformed = self.callback("malformed", "not json".to_owned());
        assert!(matches!(
            self.deliver(&malformed).await,
            Delivery::Failed(_)
        ));

        let payment = self.insert_dead_attempt(card).await;
        let result = |s: &str| {
            format!(
                r#"{{"type":"payment.result","payment_id":"{payment}","status":"{s}","channel_ref":"ch-cb"}}"#
            )
        };
        let accepted = self.callback("pay", result("accepted"));
        assert_eq!(
            self.deliver(&accepted).await,
            Delivery::Applied { changed: true }
        );
        let repeated = self.callback("pay-again", result("accepted"));
        assert_eq!(
            self.deliver(&repeated).await,
            Delivery::Applied { changed: false }
        );
        let contradicting = self.callback("pay-contra", result("rejected"));
        assert!(matches!(
            self.deliver(&contradicting).await,
            Delivery::Failed(_)
        ));
    }

    /// Records of one old day, so that archive and retention have a day to handle (at volume the
    /// seeded 90 days already do).
    async fn seed_old_day(&self) {
        sqlx::query(
            "WITH log AS (
                 INSERT INTO integration_logs
                   (correlation_id, resource_type, resource_id, scenario, state, started_at,
                    finished_at, created_at)
                 SELECT gen_random_uuid(), 'card', $1, 'card_status_poll', 'failed',
                        now() - interval '3 days', now() - interval '3 days',
                        now() - interval '3 days' + g * interval '1 second'
                   FROM generate_series(1, 5) g
                 RETURNING id, created_at
             ), ev AS (
                 INSERT INTO audit_events (event_type, integration_log_id, summary, created_at)
                 SELECT 'poll.failed', id, 'old failure', created_at FROM log
                 RETURNING id, created_at
             )
             INSERT INTO audit_resources (audit_event_id, resource_type, resource_id, created_at)
             SELECT id, 'card', $1, created_at FROM ev",
        )
        .bind(format!("{}-old", self.tag))
        .execute(self.pool())
        .await
        .expect("seed an old day");
    }

    /// Archive one day, then retention of it with cleanup off (counted) and on (deleted), and the
    /// backlog probes.
    async fn maintenance(&self) {
        if self.scale == Scale::Small {
            self.seed_old_day().await;
        }
        let archived = maintenance::run_job(self.ctx(), JobKind::Archive)
            .await
            .expect("archive run");
        assert_eq!(archived.result, "processed", "{archived:?}");
        assert!(archived.rows_of("integration_logs") > 0, "{archived:?}");

        let mut off = (*self.ctx().config).clone();
        off.maintenance.cleanup_enabled = false;
        let off = AppContext::connect(off).await.expect("connect");
        let kept = maintenance::run_job(&off, JobKind::Retention)
            .await
            .expect("retention run, cleanup off");
        assert!(kept.rows_of("integration_logs_archive") > 0, "{kept:?}");
        off.pool.close().await;

        let deleted = maintenance::run_job(self.ctx(), JobKind::Retention)
            .await
            .expect("retention run, cleanup on");
        assert!(
            deleted
                .rows
                .iter()
                .any(|r| r.action == "deleted" && r.rows > 0),
            "{deleted:?}"
        );
        self.cli(&["maintenance", "status"]).await;
    }

    /// The console's pages read what they show through `console::data`.
    async fn console(&self) {
        let _ = cardworker::console::data::fleet(self.ctx()).await;
        cardworker::console::data::parked(self.ctx(), Task::Carddata)
            .await
            .expect("parked page");
        cardworker::console::data::money(self.ctx())
            .await
            .expect("money page");
    }

    async fn investigate(&self, card: &str) {
        let inv = investigate::investigate(self.ctx(), card)
            .await
            .expect("investigate");
        assert!(
            inv.callbacks
                .iter()
                .any(|c| c.resource_type.as_deref() == Some("card"))
                && inv
                    .callbacks
                    .iter()
                    .any(|c| c.resource_type.as_deref() == Some("payment")),
            "callbacks about the card and about its payments: {:?}",
            inv.callbacks
        );
        assert!(!inv.payments.is_empty() && !inv.timeline.is_empty());
        assert!(
            inv.approvals.iter().any(|a| !a.history.is_empty()),
            "the card's approvals with their history: {:?}",
            inv.approvals
        );
    }

    async fn maintenance_runs(&self, job: &str) -> f64 {
        let (_, text) = self.app.get("/metrics").await;
        ["processed", "nothing_due", "skipped_busy", "failed"]
            .iter()
            .map(|result| {
                metric_value(
                    &text,
                    "cardworker_maintenance_runs_total",
                    &[("job", job), ("result", result)],
                )
            })
            .sum()
    }

    /// Every operator command (spec section 2) except `run` and `gateway-sim`, in-process, and
    /// the readiness probe.
    async fn operator_commands(&self, card: &str, unsettled: Uuid) {
        let (status, _) = self.app.get("/readyz").await;
        assert_eq!(status, 200);
        for args in [
            &["check-config"][..],
            &["check-config", "--format", "json"],
            &["migrate"],
            &["budget", "show"],
            &["budget", "show", "--format", "json"],
            &["budget", "set", "--task", "carddata", "--limit", "2"],
            &["budget", "clear", "--task", "carddata"],
            &["budget", "pause", "--task", "all"],
            &["budget", "resume", "--task", "all"],
            &["maintenance", "pause"],
            &["maintenance", "resume"],
            &["maintenance", "status", "--format", "json"],
            &["investigate", "--card-ref", card],
            &["investigate", "--card-ref", card, "--format", "json"],
            &[
                "circuit",
                "open",
                "--task",
                "carddata",
                "--reason",
                "plan guard",
            ],
            &["circuit", "close", "--task", "carddata"],
            &[
                "unpark",
                "--task",
                "carddata",
                "--all",
                "--reason",
                "plan guard",
            ],
            &["unpark", "--task", "card_status", "--card-ref", card],
            &[
                "unpark",
                "--task",
                "carddata",
                "--parked-before",
                "2000-01-01T00:00:00Z",
            ],
        ] {
            self.cli(args).await;
        }
        // On the worker's pool: the harness's own sessions are not in the guard's log.
        cardworker::storage::cards::page(&self.ctx().pool, 0, 10)
            .await
            .expect("a page of cards");
        cardworker::storage::cards::count_parked(&self.ctx().pool)
            .await
            .expect("parked counts");

        let id = unsettled.to_string();
        self.cli(&["enqueue", "payment", "--payment-id", &id]).await;
        wait_until(LIMIT, "the enqueued payment is accepted", || async {
            self.payment_status(unsettled).await == "accepted"
        })
        .await;
        // Settled now: reported, not submitted again.
        self.cli(&["enqueue", "payment", "--payment-id", &id]).await;

        let body_file = self._dir.path().join("callback.json");
        std::fs::write(
            &body_file,
            format!(r#"{{"type":"card.status","card_ref":"{card}","status":"active"}}"#),
        )
        .expect("body file");
        let callback_id = format!("{}-cli", self.tag);
        self.cli(&[
            "enqueue",
            "callback",
            "--channel",
            "visa",
            "--callback-id",
            &callback_id,
            "--body-file",
            &body_file.to_string_lossy(),
        ])
        .await;
        wait_until(LIMIT, "the enqueued callback is applied", || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM inbound_callbacks
                                 WHERE callback_id = $1 AND state = 'applied')",
            )
            .bind(&callback_id)
            .fetch_one(self.pool())
            .await
            .expect("callback state")
        })
        .await;

        for job in ["archive", "retention"] {
            let before = self.maintenance_runs(job).await;
            self.cli(&["enqueue", job]).await;
            wait_until(LIMIT, "the enqueued maintenance run", || async {
                self.maintenance_runs(job).await > before
            })
            .await;
        }
    }

    /// Small: `cardworker reconcile` (full sweeps). At volume one pass per task at
    /// `reconcile_batch`, as the scheduled reconcile runs it (the cards it adds poll once each,
    /// in the background: more executions of the poll statements at volume).
    async fn reconcile(&self) {
        // Parked cards whose retry is overdue (their due entry lost with Redis).
        for task in Task::ALL {
            reconcile::restore_parked_retries(self.ctx(), task)
                .await
                .expect("restore parked cards whose retry is overdue");
        }
        match self.scale {
            Scale::Small => self.cli(&["reconcile", "--format", "json"]).await,
            Scale::Production => {
                let batch = self.ctx().config.polling.reconcile_batch;
                for task in Task::ALL {
                    let pass = reconcile::pass(self.ctx(), task, 0, batch)
                        .await
                        .expect("reconcile pass");
                    assert!(pass.examined > 0, "{task}: {pass:?}");
                }
            }
        }
    }
}

/// Counts the `sqlx::query*` call sites of every `.rs` file under `dir` (relative paths from
/// the crate root), for the check that [`COVERAGE`] names at least as many statements per file.
pub fn call_sites(root: &Path, dir: &str) -> Vec<(String, usize)> {
    let mut files = Vec::new();
    collect_rs(&root.join(dir), &mut files);
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read source");
        let n = [
            "sqlx::query(",
            "sqlx::query_as(",
            "sqlx::query_as::<",
            "sqlx::query_scalar(",
            "sqlx::query_scalar::<",
            "sqlx::raw_sql(",
        ]
        .iter()
        .map(|p| text.matches(p).count())
        .sum::<usize>();
        if n > 0 {
            let rel = file
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            out.push((rel, n));
        }
    }
    out
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}
