//! What a failed poll leaves behind: its failure record (and the parked mark), a parked card's
//! un-parking, and the successor of a poll that ended abnormally. Split from the poll's flow
//! (`super`) because this is the part that decides parking, the most delicate rule of polling.

use super::*;

/// Records one failed or unknown poll (`record` with its error and what happens next) and
/// counts it: the next attempt after back-off, or the chain parked at the maximum.
///
/// Only a connection-level database error keeps the failure uncounted (a retry, as for any
/// infrastructure trouble). A deterministic one (PostgreSQL refuses this record) is recorded
/// again in a minimal form, with the refusal as its error; if even that is refused, the failure
/// still counts: a poll is never retried forever without being counted.
pub(super) async fn record_failure<J: PollTask>(
    run: &mut Run<'_, J>,
    mut record: LogRecord,
    reason: String,
    parked_retry: bool,
) -> anyhow::Result<PollOutcome> {
    let ctx = run.ctx;
    let task = J::TASK;
    let max = run.max_failures();
    // A parked chain's retry that fails leaves it parked (one poll per retry).
    let failures = if parked_retry {
        run.state.failures.max(max)
    } else {
        run.state.failures + 1
    };
    let mut park = match (failures >= max, parked_retry) {
        (false, _) => Park::No,
        (true, false) => Park::Now,
        (true, true) => Park::Again,
    };
    let delay = if park == Park::No {
        backoff(run.interval(), failures)
    } else {
        run.parked_retry()
    };
    let recovery = if park == Park::No {
        format!(
            "retry in {} s (failure {failures} of {max})",
            delay.as_secs_f64().round().max(1.0) as u64
        )
    } else {
        format!(
            "{}; retried automatically in {} s (polling.{}.parked_retry_secs); restart now with `cardworker unpark --task {} --card-ref {}`",
            if parked_retry {
                "the parked chain's retry failed, it stays parked".to_owned()
            } else {
                format!("chain parked after {max} consecutive failures")
            },
            delay.as_secs(),
            task.label(),
            task.cli_name(),
            run.card_ref
        )
    };
    // Fenced: a poll whose card an operator restarted while it was at the Gateway (`enqueue`,
    // `unpark`: a fresh state) records nothing and parks nothing, since the card may have just
    // been un-parked; its successor keeps the restart's fresh state.
    if run.is_replaced().await {
        tracing::info!(%task, card_ref = %run.card_ref, reason = %reason, "failed poll of a card restarted meanwhile: not recorded, nothing parked");
        let fresh = PollState::default().after(Step::Keep, 0, Utc::now());
        run.acknowledge(backoff(run.interval(), 1), fresh, super::Count::Keep)
            .await?;
        return Ok(PollOutcome::StaleFailure);
    }
    record.error = Some(reason.clone());
    record.recovery_summary = Some(recovery.clone());
    if let Err(e) = persist_failure::<J>(ctx, &record, failures, park).await {
        if fault::classify_chain(&e) == DbFault::Transient {
            return run.retry_after_infra_error(e).await;
        }
        tracing::error!(%task, card_ref = %run.card_ref, error = %format!("{e:#}"), "failure record refused by PostgreSQL; recording a minimal one");
        let mut minimal = record.clone();
        minimal.response_summary = "(not stored: PostgreSQL refused the full record)".to_owned();
        minimal.error = Some(shorten(&format!("{reason} (record refused: {e:#})"), 2000));
        if let Err(e) = persist_failure::<J>(ctx, &minimal, failures, park).await {
            if fault::classify_chain(&e) == DbFault::Transient {
                return run.retry_after_infra_error(e).await;
            }
            tracing::error!(%task, card_ref = %run.card_ref, error = %format!("{e:#}"), "no failure record could be written; the failure still counts");
            if park != Park::No {
                let mut conn = ctx.pool.acquire().await.context("parking the chain")?;
                if let Err(e) = cards::park(&mut conn, &run.card_ref, task).await {
                    tracing::error!(%task, card_ref = %run.card_ref, error = %e, "the chain could not be parked either; it retries");
                    park = Park::No;
                }
            }
        }
    }
    count(task, PERSISTED_FAILURE);
    crate::polling::unchanged::count_fleet_outcome(
        ctx.prefix(),
        task,
        PERSISTED_FAILURE,
        chrono::Utc::now(),
    );
    tracing::warn!(%task, card_ref = %run.card_ref, correlation_id = %record.correlation_id, outcome = record.state.as_str(), reason = %reason, recovery = %recovery, "poll failed; recorded");
    // A parked chain stays scheduled: its next job is the retry.
    let delay = if park == Park::No {
        backoff(run.interval(), failures)
    } else {
        delay
    };
    if !run
        .schedule_counted(failures, delay, super::Count::Reset)
        .await?
    {
        tracing::debug!(card_ref = %run.card_ref, "lease ended meanwhile; the retry is another poll's");
    }
    Ok(PollOutcome::Failed {
        parked: park != Park::No,
    })
}

/// `text` cut to at most `max` characters.
fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// How long an abnormal end's failure record may take: PostgreSQL is often why the poll got stuck.
const ABNORMAL_RECORD_TIMEOUT: Duration = Duration::from_secs(2);

/// After a poll ended abnormally (`runner`'s hook: an error, a panic or the handler timeout), the
/// chain must not vanish with it:
/// - a **panic** is a fault of the poll itself: it is recorded as a failure and counted (the
///   chain parks at the maximum, so a poll that always panics does not spin forever);
/// - an **error** or a **timeout** is infrastructure (Redis or PostgreSQL stalled; the Gateway
///   call has its own, shorter timeout): the successor comes after back-off with the failure
///   count unchanged, and nothing is recorded.
///
/// A job whose lease ended leaves nothing: its successor's write names the lease.
pub async fn after_abnormal_end<J: PollTask>(job: J, ctx: Arc<AppContext>, error: JobError) {
    let task = J::TASK;
    let mut run = Run::<J>::new(&ctx, &job, super::lease_ends(&ctx));
    // Its call may still be at the Gateway (sent before the poll was cut off): the card's next
    // poll comes no sooner than the handler's limit from now, by when that call is over.
    run.not_before = Some(std::time::Instant::now() + ctx.config.polling.handler_timeout());
    if let JobError::Panicked(_) = &error {
        let now = Utc::now();
        let record = LogRecord {
            correlation_id: Uuid::now_v7(),
            resource_type: "card",
            resource_id: run.card_ref.clone(),
            scenario: J::SCENARIO,
            state: LogState::Failed,
            request_summary: format!("{task} poll of card {}", run.card_ref),
            response_summary: "(the poll ended abnormally; no answer recorded)".to_owned(),
            http_status: None,
            error: None,
            recovery_summary: None,
            started_at: now,
            finished_at: now,
        };
        let reason = format!("the poll ended abnormally: {error}");
        match tokio::time::timeout(
            ABNORMAL_RECORD_TIMEOUT,
            // Not a parked chain's retry as far as this end knows: a panic counts as one more
            // failure (a parked card's panicking retry is parked again).
            record_failure(&mut run, record, reason, false),
        )
        .await
        {
            Ok(Ok(outcome)) => {
                tracing::warn!(%task, card_ref = %run.card_ref, ?outcome, "abnormal end recorded; polling goes on");
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(%task, card_ref = %run.card_ref, error = %format!("{e:#}"), "abnormal end not recorded");
            }
            Err(_) => {
                tracing::warn!(%task, card_ref = %run.card_ref, "recording the abnormal end timed out");
            }
        }
    }
    let failures = run.state.failures;
    let delay = backoff(run.interval(), failures + 1);
    tracing::warn!(%task, card_ref = %run.card_ref, error = %error, retry_in_ms = delay.as_millis() as u64, "poll ended abnormally; successor scheduled");
    if let Err(e) = run.schedule(failures, delay).await {
        tracing::error!(%task, card_ref = %run.card_ref, error = %format!("{e:#}"), "no successor after an abnormal end; the card is due again when its lease ends");
    }
}

/// What a recorded failure does to the chain's parked mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Park {
    /// Not parked.
    No,
    /// This failure parks the chain (`poll.parked`).
    Now,
    /// A parked chain's retry failed: the mark is renewed (the next retry counts from now).
    Again,
}

/// The un-parking transaction of a parked chain's successful retry: the parked mark cleared and
/// one `poll.unparked` audit event.
pub(super) async fn persist_unpark<J: PollTask>(
    ctx: &AppContext,
    card_ref: &str,
    correlation_id: Uuid,
) -> anyhow::Result<()> {
    let task = J::TASK;
    let mut tx = ctx
        .pool
        .begin()
        .await
        .context("starting the un-parking transaction")?;
    cards::unpark(&mut *tx, card_ref, task)
        .await
        .context("clearing the parked mark")?;
    records::insert_audit(
        &mut tx,
        &AuditRecord {
            event_type: "poll.unparked",
            correlation_id: Some(correlation_id),
            summary: format!(
                "{task} chain of card {card_ref} un-parked: its retry got a valid answer"
            ),
            details: serde_json::json!({ "task": task.label(), "by": "parked_retry" }),
            resource_type: "card",
            resource_id: card_ref.to_owned(),
        },
        None,
    )
    .await
    .context("writing the un-parking audit event")?;
    tx.commit().await.context("committing the un-parking")?;
    Ok(())
}

/// The failure transaction: terminal `failed`/`unknown` log with its audit event and link, and,
/// when this failure parks the chain, the parked mark and a `poll.parked` audit event (a failed
/// retry of a parked chain renews the mark only).
async fn persist_failure<J: PollTask>(
    ctx: &AppContext,
    record: &LogRecord,
    failures: u32,
    park: Park,
) -> anyhow::Result<()> {
    let task = J::TASK;
    let mut tx = ctx
        .pool
        .begin()
        .await
        .context("starting the failure transaction")?;
    let log_id = records::insert_terminal_log(&mut tx, record)
        .await
        .context("writing the poll's integration log")?;
    let state = record.state.as_str();
    let details = serde_json::json!({
        "task": task.label(),
        "failures": failures,
        "error": record.error,
        "http_status": record.http_status,
        "recovery": record.recovery_summary,
    });
    records::insert_audit(
        &mut tx,
        &AuditRecord {
            event_type: if record.state == LogState::Unknown {
                "poll.unknown"
            } else {
                "poll.failed"
            },
            correlation_id: Some(record.correlation_id),
            summary: format!(
                "{} poll of card {} {state}: {}",
                task,
                record.resource_id,
                record.error.as_deref().unwrap_or("-")
            ),
            details: details.clone(),
            resource_type: "card",
            resource_id: record.resource_id.clone(),
        },
        Some(log_id),
    )
    .await
    .context("writing the failure's audit event")?;
    if park != Park::No {
        cards::park(&mut tx, &record.resource_id, task)
            .await
            .context("parking the chain")?;
    }
    if park == Park::Now {
        records::insert_audit(
            &mut tx,
            &AuditRecord {
                event_type: "poll.parked",
                correlation_id: Some(record.correlation_id),
                summary: format!(
                    "{task} chain of card {} parked after {failures} consecutive failures; \
                     retried automatically after polling.{}.parked_retry_secs, or restart with \
                     `cardworker unpark --task {} --card-ref {}`",
                    record.resource_id,
                    task.label(),
                    task.cli_name(),
                    record.resource_id
                ),
                details,
                resource_type: "card",
                resource_id: record.resource_id.clone(),
            },
            Some(log_id),
        )
        .await
        .context("writing the parking audit event")?;
    }
    tx.commit().await.context("committing the failure record")?;
    Ok(())
}
