//! The cross-worker polling budget.

pub mod cli;
