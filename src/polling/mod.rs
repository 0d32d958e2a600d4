//! Polling jobs: card data and card status.

pub mod cli;
