//! What the pages show, read from the same PostgreSQL and Redis as the workers. Every read is
//! bounded (a page never scans a table or a key space), and a store that does not answer is shown
//! as such instead of failing the page.
//!
//! # Layout
//! - [`bounded`](mod@bounded): the time and row bounds of every read, and reading one part of a
//!   page.
//! - [`fleet`](mod@fleet): the fleet page, part by part.
//! - [`chart`]: the fleet page's chart of polls per hour by outcome.
//! - [`queues`](mod@queues): every queue's counts and live workers, and the dead sets (the queues
//!   page).
//! - [`parked`](mod@parked): the parked chains of a task (the parked page).
//! - [`money`](mod@money): payments and approvals that need attention, failed callbacks (the
//!   money page).
//!
//! Every public name is re-exported here: `console::data::X`.

pub mod bounded;
pub mod chart;
pub mod fleet;
pub mod money;
pub mod parked;
pub mod queues;

pub use bounded::{bounded, LIST_LIMIT, STORE_TIMEOUT};
pub use chart::{poll_chart, PollChart, OUTCOMES};
pub use fleet::{fleet, Fleet, MaintenanceView};
pub use money::{money, FailedCallback, Money, StuckApproval, StuckPayment, UUID_TEXT};
pub use parked::{parked, ParkedView};
pub use queues::{dead_sets, queue_counts, queues, QueueCounts, QueueDead, WorkerView, DEAD_LIMIT};
