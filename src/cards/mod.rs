//! The card domain: applying an observed card change, whoever observed it.
//!
//! A poll (`crate::polling`) and a channel callback (`crate::payments::callback`) both end in the
//! same change: the optimistic card update, its audit event and its outbox event. Keeping that
//! here, below both jobs, means neither job imports the other.
//!
//! # Layout
//! - [`apply`]: [`apply_status`], [`apply_card_data`] and their [`Applied`] answer, inside the
//!   caller's transaction.

pub mod apply;

pub use apply::{apply_card_data, apply_status, Applied, ChangeSource};
