//! The text rendering of an [`Investigation`] for people: one block per section, newest first.

use std::fmt::Write as _;

use super::facts::outcome_note;
use super::investigation::{Investigation, LIMIT};
use crate::config::Task;
use crate::polling::unchanged::HOURS_KEPT;

/// The text rendering for people.
pub fn render_text(inv: &Investigation) -> String {
    let mut s = String::new();
    card(&mut s, inv);
    chains(&mut s, inv);
    timeline(&mut s, inv);
    unchanged(&mut s, inv);
    facts(&mut s, inv);
    payments(&mut s, inv);
    approvals(&mut s, inv);
    callbacks(&mut s, inv);
    s
}

/// The card as stored: its data, status and version.
fn card(s: &mut String, inv: &Investigation) {
    let c = &inv.card;
    let _ = writeln!(s, "card {}", c.card_ref);
    let _ = writeln!(
        s,
        "  data: {}{}",
        c.data_state,
        match (&c.pan_last4, c.expiry_month, c.expiry_year) {
            (Some(l4), Some(m), Some(y)) => format!(
                " (token {}, last4 {l4}, expiry {m:02}/{y})",
                c.card_token.as_deref().unwrap_or("-")
            ),
            _ => String::new(),
        }
    );
    let _ = writeln!(s, "  status: {}", c.status);
    let _ = writeln!(
        s,
        "  version {}, created {}, updated {}",
        c.version, c.created_at, c.updated_at
    );
}

/// Each task's chain, and how to restart a parked one.
fn chains(s: &mut String, inv: &Investigation) {
    let _ = writeln!(s, "\nchains");
    for ch in &inv.chains {
        let _ = writeln!(
            s,
            "  {:<12} {}{}{}{}",
            ch.task,
            ch.state,
            if ch.failures > 0 {
                format!(" ({} consecutive failures)", ch.failures)
            } else {
                String::new()
            },
            ch.next_poll_due_at
                .map(|at| if ch.polling_now {
                    format!(", a poll holds the card now (its lease ends {at})")
                } else {
                    format!(", next poll due {at}")
                })
                .unwrap_or_default(),
            ch.parked_at
                .map(|p| format!(
                    " since {p}; retried automatically, or restart now with `cardworker unpark --task {} --card-ref {}`",
                    ch.task.parse().map(Task::cli_name).unwrap_or(ch.task),
                    inv.card.card_ref
                ))
                .unwrap_or_default()
        );
    }
}

/// Changes and failures, newest first.
fn timeline(s: &mut String, inv: &Investigation) {
    let _ = writeln!(
        s,
        "\ntimeline (changes and failures, newest first, at most {LIMIT})"
    );
    if inv.timeline.is_empty() {
        let _ = writeln!(s, "  (nothing recorded)");
    }
    for e in &inv.timeline {
        let cid = e
            .correlation_id
            .map(|c| c.to_string())
            .unwrap_or_else(|| "-".to_owned());
        let arch = if e.archived { " [archived]" } else { "" };
        match e.kind {
            "integration_log" => {
                let _ = writeln!(
                    s,
                    "  {} log #{}{arch} {} {} correlation_id={cid} http={} {}ms",
                    e.at,
                    e.id,
                    e.what,
                    e.state.as_deref().unwrap_or("-"),
                    e.http_status
                        .map(|h| h.to_string())
                        .unwrap_or_else(|| "-".to_owned()),
                    e.duration_ms.unwrap_or(0)
                );
                if let Some(r) = &e.summary {
                    let _ = writeln!(s, "      response: {r}");
                }
                if let Some(r) = &e.error {
                    let _ = writeln!(s, "      error: {r}");
                }
                if let Some(r) = &e.recovery {
                    let _ = writeln!(s, "      next: {r}");
                }
            }
            _ => {
                let _ = writeln!(
                    s,
                    "  {} audit #{}{arch} {} correlation_id={cid}: {}",
                    e.at,
                    e.id,
                    e.what,
                    e.summary.as_deref().unwrap_or("")
                );
            }
        }
    }
}

/// Unchanged polls: how they are kept, this card's tally and the fleet's hours.
fn unchanged(s: &mut String, inv: &Investigation) {
    let _ = writeln!(s, "\nunchanged polls");
    let _ = writeln!(s, "  {}", inv.note);
    if let Some(at) = inv.counts_since {
        let _ = writeln!(
            s,
            "  Redis has counted since {at} (when it was last found empty: data lost, or first start)"
        );
    }
    for u in &inv.unchanged_polls {
        let _ = writeln!(s, "  {:<12} this card: {}", u.task, u.explanation);
        let _ = writeln!(
            s,
            "  {:<12} all cards, last {HOURS_KEPT} h: {}",
            "", u.all_cards_total
        );
        for (hour, n) in u.all_cards_by_hour.iter().take(6) {
            let _ = writeln!(s, "      hour {hour} UTC: {n}");
        }
    }
}

/// The card's manual facts and the fleet's latest polling facts.
fn facts(s: &mut String, inv: &Investigation) {
    for (title, facts) in [
        (
            "manual facts (operator actions on this card)",
            &inv.manual_facts,
        ),
        (
            "fleet facts (latest circuit transitions and operator actions on polling)",
            &inv.fleet_facts,
        ),
    ] {
        let _ = writeln!(s, "\n{title}");
        if facts.is_empty() {
            let _ = writeln!(s, "  (none)");
        }
        for f in facts {
            let note = outcome_note(f.outcome.as_deref());
            let _ = writeln!(
                s,
                "  {} audit #{} {} by {} on {}:{}: {}{}",
                f.at,
                f.id,
                f.event_type,
                f.actor,
                f.resource_type,
                f.resource_id,
                f.summary,
                if note.is_empty() {
                    String::new()
                } else {
                    format!(" [{note}]")
                }
            );
        }
    }
}

/// The card's payments.
fn payments(s: &mut String, inv: &Investigation) {
    let _ = writeln!(s, "\npayments");
    if inv.payments.is_empty() {
        let _ = writeln!(s, "  (none)");
    }
    for p in &inv.payments {
        let _ = writeln!(
            s,
            "  {} {} {} {} channel_ref={} submissions={} created {} updated {}",
            p.payment_id,
            p.amount_minor,
            p.currency,
            p.status,
            p.channel_ref.as_deref().unwrap_or("-"),
            p.submissions,
            p.created_at,
            p.updated_at
        );
    }
}

/// The card's approvals, each with its history.
fn approvals(s: &mut String, inv: &Investigation) {
    let _ = writeln!(s, "\napprovals");
    if inv.approvals.is_empty() {
        let _ = writeln!(s, "  (none)");
    }
    for a in &inv.approvals {
        let _ = writeln!(
            s,
            "  {} {}{} {} channel_ref={} submissions={} created {} updated {}",
            a.approval_id,
            a.kind,
            a.amount_minor
                .map_or_else(String::new, |m| format!(" amount_minor={m}")),
            a.status,
            a.channel_ref.as_deref().unwrap_or("-"),
            a.submissions,
            a.created_at,
            a.updated_at
        );
        for e in &a.history {
            let note = outcome_note(e.outcome.as_deref());
            let _ = writeln!(
                s,
                "    {} {}: {}{}",
                e.at,
                e.event_type,
                e.summary,
                if note.is_empty() {
                    String::new()
                } else {
                    format!(" [{note}]")
                }
            );
        }
    }
}

/// The callbacks about the card, its payments and its approvals.
fn callbacks(s: &mut String, inv: &Investigation) {
    let _ = writeln!(s, "\ncallbacks");
    if inv.callbacks.is_empty() {
        let _ = writeln!(s, "  (none)");
    }
    for cb in &inv.callbacks {
        let _ = writeln!(
            s,
            "  {}/{} {} on {}:{} deliveries={} last {}{}",
            cb.channel,
            cb.callback_id,
            cb.state,
            cb.resource_type.as_deref().unwrap_or("-"),
            cb.resource_id.as_deref().unwrap_or("-"),
            cb.deliveries,
            cb.last_received_at,
            cb.reason
                .as_deref()
                .map(|r| format!(" reason: {r}"))
                .unwrap_or_default()
        );
    }
}
