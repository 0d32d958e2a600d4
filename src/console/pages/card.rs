//! A card's page: everything `investigate` shows, with its timeline of changes and failures.

use maud::{html, Markup};

use super::*;
use crate::commands::investigate::{Investigation, TimelineEntry};

/// One event of a card's timeline: the integration log of a Gateway call and the audit events
/// written with it (same correlation id: a change, or a failure and the parking it caused) are
/// one row, not several.
#[derive(Debug, Clone)]
pub struct TimelineRow<'a> {
    /// The integration log of the call, if the event has one.
    pub log: Option<&'a TimelineEntry>,
    /// The audit events of the event, newest first.
    pub audits: Vec<&'a TimelineEntry>,
}

impl<'a> TimelineRow<'a> {
    /// The row's first entry (the newest: `investigate` lists newest first).
    fn first(&self) -> Option<&'a TimelineEntry> {
        self.audits.first().copied().or(self.log)
    }
}

/// Groups `entries` (newest first) by correlation id, keeping their order: each row holds at
/// most one integration log and every audit event of its correlation id; an entry without a
/// correlation id is a row of its own.
pub fn timeline_rows(entries: &[TimelineEntry]) -> Vec<TimelineRow<'_>> {
    let mut rows: Vec<TimelineRow<'_>> = Vec::new();
    let mut by_correlation: std::collections::HashMap<uuid::Uuid, usize> = Default::default();
    for e in entries {
        let is_log = e.kind == "integration_log";
        if let Some(&i) = e
            .correlation_id
            .as_ref()
            .and_then(|c| by_correlation.get(c))
        {
            if !is_log {
                rows[i].audits.push(e);
                continue;
            }
            if rows[i].log.is_none() {
                rows[i].log = Some(e);
                continue;
            }
        }
        if let Some(c) = e.correlation_id {
            by_correlation.entry(c).or_insert(rows.len());
        }
        rows.push(TimelineRow {
            log: is_log.then_some(e),
            audits: if is_log { Vec::new() } else { vec![e] },
        });
    }
    rows
}

/// `/cards/{card_ref}`: everything `investigate` shows.
pub fn card(inv: &Investigation, viewer: &Viewer) -> Markup {
    let body = html! {
        (summary(inv))
        (chains_table(inv, viewer))
        (timeline_table(inv))
        (unchanged_table(inv))
        (facts_tables(inv))
        (payments_table(inv))
        (approvals_table(inv))
        (callbacks_table(inv))
    };
    layout(&format!("Card {}", inv.card.card_ref), viewer, true, body)
}

/// The card as stored.
fn summary(inv: &Investigation) -> Markup {
    let c = &inv.card;
    html! {
        table #card {
            tr { th { "card_ref" } td.card-ref { (c.card_ref) } }
            tr { th { "data" } td { (c.data_state) @if let Some(l4) = &c.pan_last4 { " · last4 " (l4) } } }
            tr { th { "status" } td { (c.status) } }
            tr { th { "version" } td { (c.version) " · created " (when(&c.created_at)) " · updated " (when(&c.updated_at)) } }
        }
    }
}

/// Each task's chain, with its unpark button when parked.
fn chains_table(inv: &Investigation, viewer: &Viewer) -> Markup {
    let c = &inv.card;
    html! {
        h2 { "Chains" }
        table #chains {
            tr { th { "task" } th { "state" } th { "failures" } th { "next poll due" } th { "parked at" } @if viewer.can_act() { th { "act" } } }
            @for ch in &inv.chains {
                tr data-task=(ch.task) {
                    td { (ch.task) }
                    td.state { @if ch.state == "parked" { span.bad { (ch.state) } } @else { (ch.state) } }
                    td.failures { (ch.failures) }
                    td.next-due {
                        @match &ch.next_poll_due_at {
                            Some(at) => { @if ch.polling_now { "being polled (lease ends " (when(at)) ")" } @else { (when(at)) } }
                            None => span.note { "none (not in the due queue)" },
                        }
                    }
                    td { (opt_when(&ch.parked_at)) }
                    @if viewer.can_act() {
                        td { @if ch.state == "parked" {
                            form.inline method="post" action="/actions/unpark" {
                                (action_fields(viewer))
                                input type="hidden" name="task" value=(ch.task);
                                button name="one" value=(c.card_ref) { "Unpark" }
                            }
                        } }
                    }
                }
            }
        }
    }
}

/// The timeline, one row per event ([`timeline_rows`]).
fn timeline_table(inv: &Investigation) -> Markup {
    let rows = timeline_rows(&inv.timeline);
    html! {
        h2 { "Timeline (changes and failures, newest first)" }
        p.note { "One row per event: a change or failure's audit event and the integration log of its Gateway call share a correlation id." }
        table #timeline {
            tr { th { "at" } th { "event" } th { "state" } th { "details" } th { "records" } }
            @if rows.is_empty() { (empty_row(5, "No changes or failures on record.")) }
            @for r in &rows {
                @if let Some(first) = r.first() {
                    tr.event data-correlation=(first.correlation_id.map(|c| c.to_string()).unwrap_or_default()) {
                        td { (when(&first.at)) @if first.archived { " [archived]" } }
                        td {
                            @for (i, a) in r.audits.iter().enumerate() { @if i > 0 { br; } (a.what) }
                            @if let Some(l) = r.log { @if !r.audits.is_empty() { br; } span.note { (l.what) } }
                        }
                        td { (r.log.and_then(|l| l.state.as_deref()).unwrap_or("")) }
                        td {
                            @if let Some(l) = r.log {
                                @if let Some(h) = l.http_status { "HTTP " (h) " · " }
                                @if let Some(d) = l.duration_ms { (d) " ms · " }
                                @if let Some(s) = &l.summary { code { (s) } }
                                @if let Some(s) = &l.error { br; code.bad { (s) } }
                                @if let Some(s) = &l.recovery { br; span.note { "next: " (s) } }
                            }
                            @for (i, a) in r.audits.iter().enumerate() { @if let Some(s) = &a.summary { @if r.log.is_some() || i > 0 { br; } (s) } }
                            @if let Some(cid) = &first.correlation_id { br; span.note { "correlation " (cid) } }
                        }
                        td.note {
                            @if let Some(l) = r.log { "log #" (l.id) }
                            @for (i, a) in r.audits.iter().enumerate() { @if i > 0 || r.log.is_some() { br; } "audit #" (a.id) }
                        }
                    }
                }
            }
        }
    }
}

/// Unchanged polls: how they are kept, this card's tally and the fleet's last 48 h.
fn unchanged_table(inv: &Investigation) -> Markup {
    html! {
        h2 { "Unchanged polls" }
        p.note { (inv.note) }
        @if let Some(at) = &inv.counts_since { p.note { "Redis has counted since " (when(at)) " (when it was last found empty: its data lost, or the first start)." } }
        table {
            tr { th { "task" } th { "this card" } th { "since" } th { "last unchanged poll" } th { "all cards, last 48 h" } }
            @for u in &inv.unchanged_polls {
                tr {
                    td { (u.task) }
                    td.num { @if let Some(n) = u.card_count { (n) } @else { "–" } }
                    td { @if let Some(at) = &u.since { (when(at)) br; } span.note { (u.explanation) } }
                    td { @if let Some(at) = &u.last_unchanged_at { (when(at)) } @else { "–" } }
                    td.num { (u.all_cards_total) }
                }
            }
        }
    }
}

/// The card's manual facts and the fleet's latest polling facts.
fn facts_tables(inv: &Investigation) -> Markup {
    html! {
        @for (title, id, facts, none) in [("Manual facts (operator actions on this card)", "manual-facts", &inv.manual_facts, "No operator action on this card."), ("Fleet facts (circuit transitions, operator actions on polling)", "fleet-facts", &inv.fleet_facts, "No circuit transition or operator action on polling.")] {
            h2 { (title) }
            (facts_table(id, facts, none))
        }
    }
}

/// The card's payments.
fn payments_table(inv: &Investigation) -> Markup {
    html! {
        h2 { "Payments" }
        table #card-payments {
            tr { th { "payment" } th { "amount" } th { "status" } th { "submissions" } th { "updated" } }
            @if inv.payments.is_empty() { (empty_row(5, "No payments.")) }
            @for p in &inv.payments {
                tr { td { code { (p.payment_id) } } td.num { (p.amount_minor) " " (p.currency) } td { (p.status) } td.num { (p.submissions) } td { (when(&p.updated_at)) } }
            }
        }
    }
}

/// The card's approvals, each with its history.
fn approvals_table(inv: &Investigation) -> Markup {
    html! {
        h2 { "Approvals" }
        table #card-approvals {
            tr { th { "approval" } th { "kind" } th { "amount" } th { "status" } th { "channel ref" } th { "submissions" } th { "created" } th { "updated" } }
            @if inv.approvals.is_empty() { (empty_row(8, "No approvals.")) }
            @for a in &inv.approvals {
                tr.approval data-approval=(a.approval_id) {
                    td { code { (a.approval_id) } }
                    td { (a.kind) }
                    td.num { @if let Some(n) = a.amount_minor { (n) } @else { "-" } }
                    td.status { (a.status) }
                    td { (a.channel_ref.as_deref().unwrap_or("-")) }
                    td.num { (a.submissions) }
                    td { (when(&a.created_at)) }
                    td { (when(&a.updated_at)) }
                }
                tr.approval-history data-approval=(a.approval_id) {
                    td colspan="8" {
                        @if a.history.is_empty() {
                            span.note { "No events yet." }
                        } @else {
                            ol {
                                @for h in &a.history {
                                    li.approval-event { (when(&h.at)) " · " code { (h.event_type) } " · " (h.summary) (outcome_mark(h.outcome.as_deref())) }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The callbacks about the card, its payments and its approvals.
fn callbacks_table(inv: &Investigation) -> Markup {
    html! {
        h2 { "Callbacks" }
        table #card-callbacks {
            tr { th { "channel / id" } th { "state" } th { "about" } th { "deliveries" } th { "last" } th { "reason" } }
            @if inv.callbacks.is_empty() { (empty_row(6, "No callbacks.")) }
            @for cb in &inv.callbacks {
                tr { td { code { (cb.channel) " / " (cb.callback_id) } } td { (cb.state) } td { (cb.resource_type.as_deref().unwrap_or("-")) ":" (cb.resource_id.as_deref().unwrap_or("-")) } td.num { (cb.deliveries) } td { (when(&cb.last_received_at)) } td { (cb.reason.as_deref().unwrap_or("-")) } }
            }
        }
    }
}
