//! The polls this process runs now ([`RunningPolls`]), by task and card, with the chain state
//! each checked in under: what a process writes back when Redis comes back empty while they are at
//! the Gateway (`runner::redis_watch`), so that reconcile finds their chains live and no second
//! poll of their cards starts beside them. Here, below `context`, because every job's context
//! holds the registry; the polls (`polling::poll`) register in it.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use anyhow::Context as _;
use cardworker_jobs::{keys, ChainState, Job as _, PollCardData, PollCardStatus};
use redis::aio::ConnectionManager;
use redis::Script;

use crate::config::Task;

static CHAIN: LazyLock<Script> = LazyLock::new(|| Script::new(cardworker_jobs::chain::SCRIPT));
/// The polls this process runs now, by task and card, with the chain state they checked in
/// under: what [`RunningPolls::reassert`] writes back after Redis comes back empty while they
/// are at the Gateway, so that reconcile finds their chains live and no second poll of their
/// cards starts beside them.
#[derive(Clone, Default)]
pub struct RunningPolls {
    /// Task and card -> the chain state of the running poll.
    polls: Arc<Mutex<HashMap<(Task, String), ChainState>>>,
}

/// A poll registered in [`RunningPolls`] for as long as it lives.
pub struct Running {
    polls: RunningPolls,
    key: (Task, String),
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(mut polls) = self.polls.polls.lock() {
            polls.remove(&self.key);
        }
    }
}

impl RunningPolls {
    /// Registers the poll of `card_ref` for `task` under `state` until the guard drops.
    pub fn enter(&self, task: Task, card_ref: &str, state: &ChainState) -> Running {
        let key = (task, card_ref.to_owned());
        if let Ok(mut polls) = self.polls.lock() {
            polls.insert(key.clone(), state.clone());
        }
        Running {
            polls: self.clone(),
            key,
        }
    }

    /// How many polls run now.
    pub fn len(&self) -> usize {
        self.polls.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// Whether no poll runs now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes each running poll's chain entry back where the card has none (Redis came back
    /// empty): the entry of its chain, fed at its turn, with its run marker. Returns how many
    /// were written.
    pub async fn reassert(
        &self,
        conn: &mut ConnectionManager,
        prefix: &str,
    ) -> anyhow::Result<u64> {
        let polls: Vec<((Task, String), ChainState)> = match self.polls.lock() {
            Ok(polls) => polls.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => Vec::new(),
        };
        let mut written = 0;
        for ((task, card_ref), state) in polls {
            let queue = match task {
                Task::Carddata => PollCardData::QUEUE,
                Task::CardStatus => PollCardStatus::QUEUE,
            };
            let turn = if state.turn == 0 {
                String::new()
            } else {
                state.turn.to_string()
            };
            // The chain script's keys and its `reassert` op (`jobs/src/chain.lua`).
            let done: i64 = CHAIN
                .key(keys::chain(prefix, queue))
                .key(keys::intake(prefix, queue))
                .key(keys::intake_payload(prefix, queue))
                .key(keys::chain_due(prefix, queue))
                .arg("reassert")
                .arg(&card_ref)
                .arg(&state.chain)
                .arg("")
                .arg(state.failures)
                .arg("")
                .arg("")
                .arg(turn)
                .invoke_async(conn)
                .await
                .with_context(|| format!("writing back the {task} chain of {card_ref}"))?;
            written += u64::try_from(done).unwrap_or(0);
        }
        Ok(written)
    }
}
