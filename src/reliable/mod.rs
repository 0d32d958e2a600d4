//! The reliable money path: every call that makes the Gateway act (a payment, an approval), from
//! its row to the one decision on record.
//!
//! A payment and an approval are the same problem: a row in PostgreSQL that must reach the
//! Gateway exactly once in effect (pending before the call, one `Idempotency-Key` per row ever),
//! whose answer may be lost with the process that asked, and whose decision can arrive three ways
//! (the POST's answer, a recovery query, a channel callback), in any order and from any pod. So
//! the path is written once, here, over a [`Kind`]: the *description* of one kind of reliable
//! call (its table, its body, its statuses, which of them are final, how a refused request reads,
//! its records' names). Its users are `crate::payments` and `crate::approvals`, the jobs that run
//! it for their kind, and the channel callback (`crate::payments::callback`), which applies a
//! decision through [`decide`].
//!
//! # Layout
//! The path, in the order a row takes it:
//! - [`pending`]: **the pending record before the call.** A `pending` integration-log row, its
//!   audit event and link are committed before anything is sent; the same row is finalised later
//!   (`succeeded`, `failed`, `unknown`) with the domain change, its audit event and the outbox
//!   event, in one transaction. A crash mid-call leaves the row as evidence, and recovery
//!   reopens it ([`pending::Pending::reopen`]).
//! - [`submit`]: **the submit**, steps 1 and 2: only a `requested` row goes on; the pending
//!   commit sets it `pending` with its attempt's deadline; then the POST, always with
//!   `Idempotency-Key` = the row's id. [`finish`] is step 3: what the answer means (a decision, a
//!   waiting status, `unknown`, not received and retried with the same key) and the one
//!   transaction that records it. [`attempt`] holds what a run reports ([`Submitted`]), its retry
//!   rules and the attempt's deadline.
//! - [`recover`]: **recovery**: the pass over rows left undecided (`pending` past its deadline,
//!   `unknown`, a `requested` row whose job was lost, a waiting row): one query of the Gateway's
//!   record each, a decision settled from it, and a resubmission only after a 404 (the Gateway
//!   never saw it). [`recover::query_now`] is the same step for one row, for `enqueue`.
//! - [`decide`]: the decision **once**, whoever brings it: each path locks the row and calls it
//!   in its own transaction; the first final decision wins and is written with its outbox event;
//!   the same one again is a no-op; a different one after a final one becomes one
//!   `<kind>.conflict` audit event naming both.
//! - [`table`]: the SQL on a kind's table (`payments`, `approvals`): one statement per operation
//!   for every kind, the table's name and columns taken from the [`Kind`]. It is also **the one
//!   DB clock**: an attempt's deadline, a row's `updated_at` and an attempt log's `started_at`
//!   are written with PostgreSQL's `now()` and compared with it, in SQL
//!   ([`table::ON_DB_CLOCK`]: `in_flight` and `idle_ms` computed with the row), never with this
//!   host's clock, so a worker or CLI host whose clock runs ahead or behind decides as one whose
//!   clock is right. `crate::clock` is this process's clock, for timestamps compared with
//!   nothing stored.
//! - [`kind`]: the [`Kind`] trait, the [`Row`] it reads, the reliable-path columns every kind's
//!   table has ([`Tracking`]), how a decision arrives ([`Arrival`]) and recovery's
//!   [`Thresholds`].
//! - [`payment`], [`approval`]: the two descriptions.
//!
//! Within the path, imports point one way: `kind` uses `pending`; `table` uses `kind`; `decide`
//! uses both; `attempt` uses none of them; `finish` uses `decide`; `submit` uses `finish`;
//! `recover` uses `submit` (a refusal is written the one way). This file only declares and
//! re-exports.
//!
//! # Layering
//! Layer 6, beside `crate::runner`: it needs the `AppContext` (Gateway client, pool, producer)
//! and is used by the jobs of layer 7, which may not import each other. The channel callback
//! (`crate::payments::callback`) applies approval results through [`decide`] and
//! [`approval::Approval`] for that reason.

pub mod approval;
pub mod attempt;
pub mod decide;
pub mod finish;
pub mod kind;
pub mod payment;
pub mod pending;
pub mod recover;
pub mod submit;
pub mod table;

pub use attempt::Submitted;
pub use decide::Decided;
pub use kind::{Answer, Arrival, Kind, Names, Row, Thresholds, Tracking};
pub use recover::RecoveryReport;
