//! Payments and channel callbacks: the reliable paths.

pub mod cli;
