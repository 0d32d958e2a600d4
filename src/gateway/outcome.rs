//! What one Gateway call came to (spec section 1): its [`Outcome`] (`Valid`, `Failed` or
//! `Unknown`, with a [`Failure`] reason) and the [`CallResult`] a caller gets, with what an
//! integration log row needs (timing, status, request and response summaries).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Why a call was not a valid observation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: String,
}

impl Failure {
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// The classification of one call (spec section 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// A valid observation.
    Valid(T),
    /// The call certainly did not happen or did not answer usefully; safe to repeat.
    Failed(Failure),
    /// The Gateway may have acted, or answered something we cannot read.
    Unknown(Failure),
}

impl<T> Outcome<T> {
    /// `"valid"`, `"failed"` or `"unknown"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Valid(_) => "valid",
            Outcome::Failed(_) => "failed",
            Outcome::Unknown(_) => "unknown",
        }
    }

    pub fn is_valid(&self) -> bool {
        matches!(self, Outcome::Valid(_))
    }

    pub fn is_failed(&self) -> bool {
        matches!(self, Outcome::Failed(_))
    }

    pub fn is_unknown(&self) -> bool {
        matches!(self, Outcome::Unknown(_))
    }

    /// The observation, when valid.
    pub fn valid(&self) -> Option<&T> {
        match self {
            Outcome::Valid(v) => Some(v),
            _ => None,
        }
    }

    /// The failure, when failed or unknown.
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            Outcome::Valid(_) => None,
            Outcome::Failed(f) | Outcome::Unknown(f) => Some(f),
        }
    }
}

/// One classified call with what is needed for an integration log row.
#[derive(Debug, Clone, PartialEq)]
pub struct CallResult<T> {
    pub outcome: Outcome<T>,
    /// Wall time from sending the request to having read (or given up on) the answer.
    pub elapsed: Duration,
    /// The HTTP status, when one was received.
    pub http_status: Option<u16>,
    /// `METHOD path` plus the non-sensitive request fields.
    pub request_summary: String,
    /// Whitelisted response fields or, for a body that is not JSON, a truncated, redacted excerpt.
    pub response_summary: String,
}

impl<T> CallResult<T> {
    /// The same call with its valid answer mapped (e.g. a query's `Found`/`NotFound` to an
    /// `Option`).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> CallResult<U> {
        CallResult {
            outcome: match self.outcome {
                Outcome::Valid(v) => Outcome::Valid(f(v)),
                Outcome::Failed(e) => Outcome::Failed(e),
                Outcome::Unknown(e) => Outcome::Unknown(e),
            },
            elapsed: self.elapsed,
            http_status: self.http_status,
            request_summary: self.request_summary,
            response_summary: self.response_summary,
        }
    }
}
