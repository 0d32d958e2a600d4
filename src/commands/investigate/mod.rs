//! What is on record for one card (`cardworker investigate`): its state, its timeline of changes
//! and failures (integration logs and audit events, online and archived, newest first), its
//! chains (with when each one's next poll is due), its payments and callbacks, the unchanged-poll
//! counts kept in Redis, its manual facts
//! (the operator actions on the card: `operator.*` events with who and why) and the latest
//! fleet-wide polling facts (circuit openings and closings, budget and maintenance actions).
//!
//! Unchanged polls are counted, not recorded; what Redis keeps of them, and what the view says
//! after Redis lost its data, is in `unchanged` ([`UnchangedView`]).
//!
//! # Layout
//! The read model is one view type and one query per section of the output; every query is
//! covered by the plan guard. JSON (`--format json`) is the view types' serde.
//! - `investigation`: [`Investigation`], the whole view, and [`investigate`], which gathers it
//!   section by section.
//! - `timeline`: [`TimelineEntry`], the card's integration logs and audit events, online and
//!   archived.
//! - `chains`: [`ChainView`], the card's chain of each task (Redis).
//! - `unchanged`: [`UnchangedView`], the unchanged-poll counts (Redis) and what they mean.
//! - `payments`: [`PaymentView`], [`ApprovalView`] with its history.
//! - `callbacks`: [`CallbackView`], the callbacks about the card, its payments and approvals.
//! - `facts`: [`FactView`], the card's manual facts and the fleet's latest polling facts.
//! - `render`: the text rendering for people (`--format text`).
//!
//! Every public name is re-exported here: `commands::investigate::X`.

mod callbacks;
mod chains;
mod facts;
mod investigation;
mod payments;
mod render;
mod timeline;
mod unchanged;

pub use callbacks::{CallbackView, CALLBACKS_SQL};
pub use chains::ChainView;
pub use facts::{fleet_facts, outcome_note, FactView, FLEET_FACTS};
pub use investigation::{investigate, InvestigateError, Investigation, LIMIT};
pub use payments::{ApprovalEvent, ApprovalView, PaymentView, APPROVAL_HISTORY};
pub use render::render_text;
pub use timeline::TimelineEntry;
pub use unchanged::{unchanged_counts, UnchangedView, NOTE};
