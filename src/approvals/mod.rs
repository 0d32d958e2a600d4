//! Approvals (spec section 7): requests a card channel must decide (issuing a card, raising its
//! limit, lifting a freeze), on the same reliable path as payments.
//!
//! The machinery is `crate::reliable`'s, written once for both: this module only runs it for
//! [`Approval`](crate::reliable::approval::Approval), whose description says what differs
//! (`POST /v1/approvals`; `approved`/`declined`/`failed` final; `in_review` waits; a 4xx is the
//! final `failed`; an unknown `kind` or a `limit_change` without an amount is never sent).
//!
//! # Layout
//! - [`submit`]: the job `SubmitApproval`.
//! - [`recovery`]: the job `RecoverApprovals`, on the cron `approvals.recovery_cron` (always on).
//!
//! `approval.result` callbacks go through the one callback path (`crate::payments::callback`),
//! which applies them through `crate::reliable::decide`. `cardworker enqueue approval` is in
//! `crate::commands::approvals`; `investigate` lists a card's approvals with their history.

pub mod recovery;
pub mod submit;
