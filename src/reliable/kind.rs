//! What the reliable path knows of a kind of call: the [`Kind`] trait (its table, body,
//! statuses, records' names and Gateway calls), the [`Row`] it reads, the reliable-path columns
//! every kind's table has ([`Tracking`]), how a decision arrives ([`Arrival`]) and recovery's
//! [`Thresholds`]. The two kinds are `super::payment` and `super::approval`.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::PgConnection;
use uuid::Uuid;

use super::pending::OutboxEvent;
use crate::context::AppContext;
use crate::gateway::CallResult;

/// The names a kind's records carry (integration-log scenarios, audit event types).
#[derive(Debug, Clone, Copy)]
pub struct Names {
    /// Scenario of a submission's log row (`payment_submit`).
    pub submit_scenario: &'static str,
    /// Scenario of a recovery query's log row (`payment_recovery_query`).
    pub query_scenario: &'static str,
    /// Audit: a submission begins.
    pub submit_started: &'static str,
    /// Audit: no such row, or a row that cannot be submitted; nothing sent.
    pub submit_refused: &'static str,
    /// Audit: the answer is unknown.
    pub unknown: &'static str,
    /// Audit: the request was not received (nothing acted).
    pub submit_failed: &'static str,
    /// Audit: the Gateway answered, not yet a decision (`in_review`).
    pub waiting: &'static str,
    /// Audit: a dead attempt's log closed by whoever settled the row.
    pub attempt_closed: &'static str,
    /// Audit: recovery settled it from the Gateway's record.
    pub recovered: &'static str,
    /// Audit: recovery resubmits it (the Gateway never saw it).
    pub resubmitted: &'static str,
    /// Audit: recovery's query could not be answered.
    pub recovery_query_failed: &'static str,
    /// Audit: recovery found it changed meanwhile, or still waiting.
    pub recovery_skipped: &'static str,
    /// Audit: a different decision after a final one (never applied).
    pub conflict: &'static str,
}

/// The columns every kind's table has for the reliable path: where the row stands, what the
/// Gateway said, and the bookkeeping of its submissions.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
pub struct Tracking {
    /// The row's status (one of its kind's).
    pub status: String,
    /// The channel's reference once answered.
    pub channel_ref: Option<String>,
    /// Submissions sent to the Gateway, always with `Idempotency-Key` = the row's id.
    pub submissions: i32,
    /// The `pending` log of the latest submission attempt (closed once the attempt ends).
    pub attempt_log_id: Option<i64>,
    /// When the latest attempt's job is certain to have ended (its own time limit, from its
    /// pending commit). Before it, a `pending` row may still have its POST on the wire.
    pub attempt_deadline: Option<DateTime<Utc>>,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed, or last queried while waiting (recovery's order and thresholds).
    pub updated_at: DateTime<Utc>,
    /// Whether the latest attempt may still be in flight (`pending` and before its deadline),
    /// decided by PostgreSQL on its own clock when the row was read ([`super::table::ON_DB_CLOCK`]):
    /// the deadline was written with the database's `now()`, so it is compared with that clock,
    /// never with this host's.
    #[serde(skip)]
    pub in_flight: bool,
    /// Milliseconds from `updated_at` to when the row was read, on the database's clock (never
    /// negative).
    #[serde(skip)]
    pub idle_ms: i64,
}

/// A row of a kind's table, as the shared machinery reads it (`impl_row!` writes the impl).
pub trait Row: for<'r> sqlx::FromRow<'r, PgRow> + Send + Sync + Unpin + Clone + Debug {
    /// The row's id: also the Gateway's `Idempotency-Key`, always.
    fn id(&self) -> Uuid;
    /// The card it is about.
    fn card_ref(&self) -> &str;
    /// Its reliable-path columns.
    fn tracking(&self) -> &Tracking;
    /// Its status column.
    fn status(&self) -> &str {
        &self.tracking().status
    }
    /// Submissions sent so far.
    fn submissions(&self) -> i32 {
        self.tracking().submissions
    }
    /// The latest submission attempt's `pending` log.
    fn attempt_log_id(&self) -> Option<i64> {
        self.tracking().attempt_log_id
    }
    /// Last changed (recovery's order and threshold).
    fn updated_at(&self) -> DateTime<Utc> {
        self.tracking().updated_at
    }
    /// Whether the row's latest attempt may still be in flight: `pending` and before its
    /// deadline on the database's clock, as read with the row (a row without a deadline counts
    /// as in flight never).
    fn attempt_in_flight(&self) -> bool {
        self.tracking().in_flight
    }
}

/// `impl Row for $row` whose id is the field `$id` (and `card_ref`, `tracking`).
macro_rules! impl_row {
    ($row:ty, $id:ident) => {
        impl $crate::reliable::kind::Row for $row {
            fn id(&self) -> uuid::Uuid {
                self.$id
            }
            fn card_ref(&self) -> &str {
                &self.card_ref
            }
            fn tracking(&self) -> &$crate::reliable::kind::Tracking {
                &self.tracking
            }
        }
    };
}
pub(crate) use impl_row;

/// A valid Gateway answer about a row: its status and the channel's reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// A status of the kind (`accepted`, `in_review`, …).
    pub status: &'static str,
    /// The channel's reference.
    pub channel_ref: String,
}

/// How a decision arrived: by the POST's answer, a recovery query or a callback (the `via` label
/// of `cardworker_approval_decisions_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The POST's own answer.
    Response,
    /// Recovery's `GET` of the Gateway's record.
    Query,
    /// A channel callback.
    Callback,
    /// The worker refused to submit the row (bad input, unknown card): never counted in
    /// `cardworker_approval_decisions_total`, whose `via` values are the three above.
    Refused,
}

impl Arrival {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Arrival::Response => "response",
            Arrival::Query => "query",
            Arrival::Callback => "callback",
            Arrival::Refused => "refused",
        }
    }
}

/// The description of one kind of reliable call. Everything else is shared.
pub trait Kind: Send + Sync + Sized + 'static {
    /// `payment`, `approval`: resource type of its records and outbox aggregate type.
    const RESOURCE: &'static str;
    /// Its table.
    const TABLE: &'static str;
    /// Its id column.
    const ID: &'static str;
    /// The columns [`Row`] is read from.
    const COLUMNS: &'static str;
    /// Its final statuses, as an SQL list (`'accepted', 'rejected'`).
    const FINAL_SQL: &'static str;
    /// Its final statuses.
    const FINAL: &'static [&'static str];
    /// The status of a valid answer that is not a decision yet (`in_review`), if the kind has one.
    const WAITING: Option<&'static str>;
    /// Whether a channel callback contradicting a final decision is recorded as a failed
    /// callback (payments) rather than as a processed one whose conflict is on record.
    const CONFLICTING_CALLBACK_FAILS: bool;
    /// Its records' names.
    const NAMES: Names;
    /// The final status of a row the worker refuses to submit (approvals: `failed`), and the
    /// column its reason is kept in. `None`: the kind's rows are never refused (a payment's
    /// columns are CHECKed by its table).
    const REFUSED: Option<(&'static str, &'static str)> = None;
    /// Its row.
    type Row: Row;
    /// Its Gateway answer type.
    type Response: Send + Sync + Clone + Debug;
    /// Its submission job.
    type Job: cardworker_jobs::Job + Send + Sync;

    /// The submission job of row `id` after `retries` retries.
    fn job(id: Uuid, retries: u32) -> Self::Job;

    /// Why the row cannot be submitted (bad input, a card that does not exist), if it cannot.
    /// Asked on the caller's connection (inside its transaction); the submission job, recovery
    /// and the CLI ask this same question, so they refuse the same rows with the same reason.
    fn refuse(
        _conn: &mut PgConnection,
        _row: &Self::Row,
    ) -> impl Future<Output = sqlx::Result<Option<String>>> + Send {
        async { Ok(None) }
    }

    /// The request summary, audit summary and audit details of a submission.
    fn describe(row: &Self::Row) -> (String, String, serde_json::Value);

    /// The POST, always with `Idempotency-Key = id`.
    fn submit(
        ctx: &AppContext,
        row: &Self::Row,
        correlation_id: Uuid,
    ) -> impl Future<Output = CallResult<Self::Response>> + Send;

    /// The GET of the Gateway's record; `None` inside a valid outcome is a 404.
    fn query(
        ctx: &AppContext,
        id: Uuid,
        correlation_id: Uuid,
    ) -> impl Future<Output = CallResult<Option<Self::Response>>> + Send;

    /// What a valid answer says.
    fn answer(response: &Self::Response) -> Answer;

    /// The final status a `Failed` submission is, when the Gateway refused the request itself
    /// (approvals: a 4xx is `failed`). `None`: the request was not received (payments: retried
    /// with the same key).
    fn refusal(_http_status: Option<u16>) -> Option<&'static str> {
        None
    }

    /// The audit event type of a decision to `status`.
    fn decision_event(status: &str) -> &'static str;

    /// The outbox event announcing a decision.
    fn decided_event(
        row: &Self::Row,
        status: &str,
        channel_ref: Option<&str>,
        via: Arrival,
    ) -> OutboxEvent;

    /// Counts an applied final decision (metrics). Called by whoever applied it, after its
    /// transaction committed (a rolled-back attempt is applied again and must not count twice).
    fn count_decision(_status: &str, _via: Arrival) {}

    /// Whether `status` is final.
    fn is_final(status: &str) -> bool {
        Self::FINAL.contains(&status)
    }
}

/// How long rows stay untouched before recovery asks about them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// `requested`, `pending`, `unknown`.
    pub undecided: Duration,
    /// The waiting status (`in_review`).
    pub waiting: Duration,
}

impl Thresholds {
    /// The threshold of a row in `status`.
    pub fn of<K: Kind>(&self, status: &str) -> Duration {
        if K::WAITING == Some(status) {
            self.waiting
        } else {
            self.undecided
        }
    }
}
