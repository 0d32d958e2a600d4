//! One submission attempt's terms, shared by its steps (`super::submit`, `super::finish`) and by
//! recovery: what a run reports ([`Submitted`]), how often and how late a submission is retried
//! ([`MAX_RETRIES`], [`backoff`]), and the attempt's deadline ([`attempt_limit`]).

use std::time::Duration;

use crate::backoff::{Backoff, Jitter};

/// Retries through the intake for a request that was not received or a database error before
/// the pending commit, after which the job gives up (the row stays `requested`, visible and
/// resubmittable by `cardworker enqueue payment|approval`).
pub const MAX_RETRIES: u32 = 8;

/// First back-off delay; doubles per retry up to [`MAX_BACKOFF`].
const BASE_BACKOFF: Duration = Duration::from_secs(2);
/// Longest back-off delay.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// What one run of [`submit`](super::submit::submit) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Submitted {
    /// No such row: recorded (audit), nothing sent.
    UnknownRow,
    /// The row cannot be submitted (bad input, unknown card): made final with the reason (where
    /// the kind has a refused status), on record (audit), nothing sent.
    Refused(String),
    /// Already decided (final): nothing sent.
    AlreadySettled(String),
    /// Submitted before and waiting for its decision (`in_review`): nothing sent.
    Waiting(String),
    /// `pending`: an earlier attempt is open (in flight, or its worker died mid-call). Nothing
    /// sent: whether the Gateway has it is for recovery to ask, never to assume.
    AttemptOpen {
        /// The open attempt's `pending` log.
        log_id: Option<i64>,
        /// Until when the attempt may still be in flight (recovery leaves it alone until then).
        deadline: Option<chrono::DateTime<chrono::Utc>>,
    },
    /// `unknown`: the Gateway may have acted. Nothing sent: a row is POSTed again only after a
    /// query answered 404 (recovery's, or the one `enqueue` asks for).
    AwaitsQuery(String),
    /// A database error before the pending commit: nothing sent, retry scheduled after this.
    Deferred(Duration),
    /// The Gateway answered (or refused the request, which for some kinds is a decision).
    Answered {
        /// The attempt's log row.
        log_id: i64,
        /// What it answered (`accepted`, `in_review`, `failed`, …).
        status: String,
    },
    /// The Gateway may have acted; the row is `unknown` until recovery settles it.
    Unknown {
        /// The attempt's log row.
        log_id: i64,
    },
    /// The request certainly had no effect.
    Failed {
        /// The attempt's log row.
        log_id: i64,
        /// The row's status afterwards (`requested` or `unknown`).
        status: String,
        /// When the retry is due, if one was scheduled.
        retry_in: Option<Duration>,
    },
}

/// The back-off before retry number `retries + 1`: from `BASE_BACKOFF` doubling up to
/// `MAX_BACKOFF`, jittered by ±20 % and still at most `MAX_BACKOFF`.
pub fn backoff(retries: u32) -> Duration {
    Backoff::new(BASE_BACKOFF, MAX_BACKOFF, Jitter::Proportional(0.2)).delay(retries + 1)
}

/// The time limit of a submission job (the Gateway timeout bounds the call; the rest is two
/// short transactions). An attempt whose pending commit is older than this has certainly ended:
/// it is the attempt's deadline, before which recovery leaves a `pending` row alone.
pub fn attempt_limit(config: &crate::config::Config) -> Duration {
    config.gateway.timeout() + Duration::from_secs(30)
}
