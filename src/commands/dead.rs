//! `cardworker dead-set list|requeue|discard`: the operator's hand on a queue's dead set. The
//! console's queue actions call [`act`] too, so both write the same `operator.dead_requeue` /
//! `operator.dead_discard` audit event (linked to the queue).

use anyhow::Context as _;
use serde_json::json;

use super::args::{DeadSetCommand, DeadSetTarget, Format};
use super::operator::{self, Action, Operator};
use super::CommandError;
use crate::config::Config;
use crate::context::connect_redis;
use crate::gateway::redact_digits;
use crate::queue::dead::{self, DeadAction, DeadOutcome, DeadSelector};
use crate::queue::QueueName;

/// The queue named `short`, if it is one of the deployment's queues.
pub fn queue(config: &Config, short: &str) -> Result<QueueName, CommandError> {
    let known = crate::workers::QUEUES;
    if !known.contains(&short) {
        return Err(CommandError::Usage(format!(
            "--queue {short:?}: not a queue of cardworker; one of {}",
            known.join(", ")
        )));
    }
    Ok(QueueName::new(&config.redis.key_prefix, short))
}

/// Runs one `dead-set` subcommand.
pub async fn execute(config: &Config, cmd: DeadSetCommand) -> Result<(), CommandError> {
    match cmd {
        DeadSetCommand::List {
            queue: short,
            limit,
            format,
        } => {
            let q = queue(config, &short)?;
            let mut conn = connect_redis(config.redis.url.expose()).await?;
            let (total, mut entries) = dead::list(&mut conn, &q, limit).await?;
            for e in &mut entries {
                e.payload = e.payload.as_deref().map(redact_digits);
                e.reason = e.reason.as_deref().map(redact_digits);
            }
            match format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string(
                        &json!({"queue": short, "total": total, "entries": entries})
                    )
                    .context("rendering the dead set")?
                ),
                Format::Text => {
                    println!("{short}: {total} dead jobs");
                    for e in entries {
                        println!(
                            "  {} died {} entry {}\n      reason: {}\n      payload: {}",
                            e.id,
                            e.died_at
                                .map(|t| t.to_rfc3339())
                                .unwrap_or_else(|| "-".into()),
                            e.intake_entry.as_deref().unwrap_or("-"),
                            e.reason.as_deref().unwrap_or("-"),
                            e.payload.as_deref().unwrap_or("-"),
                        );
                    }
                }
            }
            Ok(())
        }
        DeadSetCommand::Requeue(target) => run(config, target, DeadAction::Requeue).await,
        DeadSetCommand::Discard(target) => run(config, target, DeadAction::Discard).await,
    }
}

async fn run(
    config: &Config,
    target: DeadSetTarget,
    action: DeadAction,
) -> Result<(), CommandError> {
    let q = queue(config, &target.queue)?;
    let which = if target.all {
        DeadSelector::All
    } else {
        DeadSelector::Ids(target.id)
    };
    let done = act(config, &q, action, which, target.reason, &Operator::cli()).await?;
    println!("{}", describe(&q.short, action, &done));
    Ok(())
}

/// What an action did, for people.
pub fn describe(queue: &str, action: DeadAction, done: &DeadOutcome) -> String {
    let verb = match action {
        DeadAction::Requeue => "requeued through the intake",
        DeadAction::Discard => "discarded",
    };
    let mut s = format!("{queue}: {} dead jobs {verb}", done.acted);
    if done.not_dead > 0 {
        s.push_str(&format!("; {} were no longer dead", done.not_dead));
    }
    if done.kept > 0 {
        s.push_str(&format!(
            "; {} kept dead because a newer job of the same entry is already waiting",
            done.kept
        ));
    }
    s
}

/// Requeues or discards dead jobs of `q` with its audit event (`operator.dead_requeue` /
/// `operator.dead_discard`, with what was acted on as its outcome; nothing is done when the
/// event cannot be written). Shared by the CLI and the console.
pub async fn act(
    config: &Config,
    q: &QueueName,
    action: DeadAction,
    which: DeadSelector,
    reason: Option<String>,
    by: &Operator,
) -> anyhow::Result<DeadOutcome> {
    let (name, verb) = match action {
        DeadAction::Requeue => ("dead_requeue", "requeued"),
        DeadAction::Discard => ("dead_discard", "discarded"),
    };
    let selector = match &which {
        DeadSelector::All => json!("all"),
        DeadSelector::Ids(ids) => json!(ids),
    };
    let recorded = Action::new(
        name,
        "queue",
        vec![q.short.clone()],
        format!("dead jobs of queue {} {verb} by an operator", q.short),
        reason,
    )
    .with_details(json!({"queue": q.short, "selector": selector}));
    let done = operator::carry_out_to(&config.database, &recorded, by, async {
        let mut conn = connect_redis(config.redis.url.expose()).await?;
        let done = dead::act(&mut conn, q, action, &which).await?;
        let outcome = json!(done);
        Ok((done, outcome))
    })
    .await?;
    Ok(done)
}
