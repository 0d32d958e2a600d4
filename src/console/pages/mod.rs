//! The pages, as maud templates: compiled with the crate, and every `(expr)` is HTML-escaped, so a
//! card_ref or a payload holding HTML shows as text. Nothing here is rendered with
//! `PreEscaped` except the fixed style sheet and refresh script below.
//!
//! # Layout
//! - this file: the layout every page shares, the small helpers, and the queues, parked, money,
//!   login and message pages.
//! - `fleet`: the fleet page and its chart of poll outcomes.
//! - `card`: a card's page and its timeline.

mod card;
mod fleet;

pub use card::{card, timeline_rows, TimelineRow};
pub use fleet::{fleet, poll_chart};

use chrono::{DateTime, Utc};
use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::data::{Money, ParkedView, QueueCounts, QueueDead};
use crate::commands::investigate::FactView;
use crate::config::Task;

/// Seconds between refreshes.
pub const REFRESH_SECS: u32 = 5;

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222}\
header{background:#1f3a5f;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}\
header a{color:#fff;text-decoration:none;font-weight:600}header form{margin:0}\
main{padding:8px 16px}table{border-collapse:collapse;margin:6px 0 14px}\
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}\
th{background:#eef2f7}.ok{color:#17692b;font-weight:600}.bad{color:#b00020;font-weight:600}\
.warn{color:#a05a00;font-weight:600}.num{text-align:right;font-variant-numeric:tabular-nums}\
code,pre{font:12px ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;margin:0}\
.note{color:#555}.flash{background:#e8f5e9;border:1px solid #8bc34a;padding:6px 10px}\
.refused{background:#fdecea;border:1px solid #e57373;padding:6px 10px}\
form.inline{display:inline}input[name=reason]{width:16em}button{margin:1px}";

/// Reloads every few seconds, unless the operator is typing, has ticked a box or focused a field.
const REFRESH_SCRIPT: &str = "(function(){var busy=false;\
document.addEventListener('input',function(){busy=true});\
setInterval(function(){if(busy||document.querySelector('input:focus,input[type=checkbox]:checked'))return;\
location.reload()},REFRESH_MS)})();";

/// What every page knows about the viewer.
#[derive(Debug, Clone)]
pub struct Viewer {
    /// The CSRF token to put in forms.
    pub csrf: String,
    /// Actions are possible (a token is configured).
    pub writable: bool,
    /// The viewer is logged in (or sent the token).
    pub admin: bool,
}

impl Viewer {
    /// Whether the pages show action controls: only to a viewer who may use them, so that a page
    /// looks read-only exactly when it is.
    pub fn can_act(&self) -> bool {
        self.writable && self.admin
    }
}

fn when(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn opt_when(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref().map(when).unwrap_or_else(|| "-".to_owned())
}

/// Audit events as facts: when, what, who, on what, and for an operator action whose outcome is
/// not a plain `applied`, that outcome.
fn facts_table(id: &str, facts: &[FactView], none: &str) -> Markup {
    html! {
        table id=(id) {
            tr { th { "at" } th { "event" } th { "by" } th { "on" } th { "summary" } }
            @if facts.is_empty() { (empty_row(5, none)) }
            @for f in facts {
                tr.fact data-outcome=(f.outcome.as_deref().unwrap_or("")) { td { (when(&f.at)) } td { (f.event_type) } td { (f.actor) } td { (f.resource_type) ":" (f.resource_id) } td { (f.summary) (outcome_mark(f.outcome.as_deref())) } }
            }
        }
    }
}

/// An operator action's outcome when it is not a plain `applied`: unknown (requested, no outcome
/// on record) or failed, said in words after its summary.
fn outcome_mark(outcome: Option<&str>) -> Markup {
    let note = crate::commands::investigate::outcome_note(outcome);
    html! {
        @if !note.is_empty() {
            " " span.bad.outcome { "[" (note) "]" }
        }
    }
}

/// The link to a card's page (its card_ref percent-encoded).
pub fn card_href(card_ref: &str) -> String {
    format!(
        "/cards/{}",
        percent_encoding::utf8_percent_encode(card_ref, percent_encoding::NON_ALPHANUMERIC)
    )
}

/// The page frame: header, navigation, card search, login state, refresh.
pub fn layout(title: &str, viewer: &Viewer, refresh: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · cardworker console" }
                style { (PreEscaped(STYLE)) }
                @if refresh {
                    script { (PreEscaped(REFRESH_SCRIPT.replace("REFRESH_MS", &(REFRESH_SECS * 1000).to_string()))) }
                    noscript { meta http-equiv="refresh" content=(REFRESH_SECS * 2); }
                }
            }
            body {
                header {
                    span { "cardworker" }
                    a href="/" { "Fleet" }
                    a href="/queues" { "Queues" }
                    a href="/parked" { "Parked" }
                    a href="/money" { "Money" }
                    form method="get" action="/cards" {
                        input type="search" name="card_ref" placeholder="card_ref" aria-label="card_ref";
                        " " button type="submit" { "Card" }
                    }
                    span style="margin-left:auto" {
                        @if !viewer.writable {
                            "read-only (no admin token configured)"
                        } @else if viewer.admin {
                            form.inline method="post" action="/logout" {
                                input type="hidden" name="csrf" value=(viewer.csrf);
                                button type="submit" { "Log out" }
                            }
                        } @else {
                            a href="/login" { "Log in to act" }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    @if !viewer.can_act() {
                        p.note #read-only {
                            @if viewer.writable { "Read-only view: " a href="/login" { "log in" } " with the admin token to act." }
                            @else { "Read-only console: no admin token is configured, so nothing can be changed from here." }
                        }
                    }
                    (body)
                    p.note {
                        @if refresh { "Refreshes every " (REFRESH_SECS) " s while you are not typing. " }
                        "Rendered " (when(&Utc::now())) "."
                    }
                }
            }
        }
    }
}

/// The common hidden field and reason box of an action form.
fn action_fields(viewer: &Viewer) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(viewer.csrf);
        input type="text" name="reason" placeholder="reason (for the audit event)";
    }
}

/// `inner` inside an action form posting to `action` (with the CSRF field and the reason box)
/// for a viewer who may act; for anyone else `inner` alone, with no form around it.
fn action_form(viewer: &Viewer, action: &str, inner: Markup) -> Markup {
    html! {
        @if viewer.can_act() {
            form method="post" action=(action) {
                (action_fields(viewer))
                (inner)
            }
        } @else {
            (inner)
        }
    }
}

/// A table's only row when it has nothing to show, saying so.
fn empty_row(columns: usize, text: &str) -> Markup {
    html! { tr.empty { td colspan=(columns) { span.note { (text) } } } }
}

fn yes_no(b: bool, yes: &'static str, no: &'static str) -> Markup {
    html! { @if b { span.bad { (yes) } } @else { span.ok { (no) } } }
}

/// The queues' counts: waiting, scheduled, running, dead.
fn queue_table(queues: &[QueueCounts]) -> Markup {
    html! {
        table #queues {
            tr {
                th { "queue" }
                th title="due now, not yet running (in the intake, or handed to a worker and not yet fetched)" { "waiting" }
                th title="due later: a chain's next poll, a delayed job, a retry" { "scheduled" }
                th title="fetched by a worker and running" { "running" }
                th { "dead" }
            }
            @if queues.is_empty() { (empty_row(5, "No queues could be read.")) }
            @for q in queues {
                tr data-queue=(q.queue) {
                    td { (q.queue) }
                    td.num.waiting { (q.waiting) }
                    td.num.scheduled { (q.scheduled) }
                    td.num.running { (q.running) }
                    td.num.dead { @if q.dead > 0 { a href={ "/queues#q-" (q.queue) } { span.bad { (q.dead) } } } @else { "0" } }
                }
            }
        }
        p.note { "waiting: due now, not yet running · scheduled: due later (a chain's next poll, a retry) · running: fetched by a worker." }
    }
}

/// `/queues`: every queue's counts and dead set.
pub fn queues(counts: &[QueueCounts], sets: &[QueueDead], viewer: &Viewer) -> Markup {
    let body = html! {
        (queue_table(counts))
        p.note { "Dead jobs are kept for 7 days. Requeue hands a job back through the intake, due now (a newer waiting job of the same entry is kept instead); card numbers in payloads and reasons are masked." }
        @for q in sets {
            section id={ "q-" (q.queue) } data-queue=(q.queue) {
                h2 { (q.queue) ": " span.dead-count { (q.total) } " dead" }
                @if q.entries.is_empty() {
                    p.note.empty { "No dead jobs." }
                } @else {
                    (action_form(viewer, "/actions/dead", html! {
                        @if viewer.can_act() { input type="hidden" name="queue" value=(q.queue); }
                        table {
                            tr { th { "died" } th { "job id" } th { "entry" } th { "reason" } th { "payload" } @if viewer.can_act() { th { "act" } } }
                            @for e in &q.entries {
                                tr.dead-entry {
                                    td { (opt_when(&e.died_at)) }
                                    td { code { (e.id) } }
                                    td { code { (e.intake_entry.as_deref().unwrap_or("-")) } }
                                    td { code.reason { (e.reason.as_deref().unwrap_or("-")) } }
                                    td { code.payload { (e.payload.as_deref().unwrap_or("-")) } }
                                    @if viewer.can_act() {
                                        td {
                                            button name="requeue" value=(e.id) { "Requeue" }
                                            button name="discard" value=(e.id) { "Discard" }
                                        }
                                    }
                                }
                            }
                        }
                        @if viewer.can_act() {
                            button name="requeue_all" value="1" { "Requeue all " (q.total) }
                            " "
                            button name="discard_all" value="1" { "Discard all " (q.total) }
                        }
                    }))
                }
            }
        }
    };
    layout("Queues", viewer, true, body)
}

/// `/parked`: parked chains per task.
pub fn parked(lists: &[(Task, i64, Vec<ParkedView>)], viewer: &Viewer) -> Markup {
    let body = html! {
        p.note { "A chain parks after polling.<task>.max_consecutive_failures failures in a row and retries itself after parked_retry_secs. Unpark restarts it now." }
        @for (task, total, rows) in lists {
            section id={ "parked-" (task.label()) } data-task=(task.label()) {
                h2 { (task.label()) ": " span.parked-count { (total) } " parked" }
                @if rows.is_empty() {
                    p.note.empty { "No parked chains." }
                } @else {
                    (action_form(viewer, "/actions/unpark", html! {
                        @if viewer.can_act() { input type="hidden" name="task" value=(task.label()); }
                        table {
                            tr { @if viewer.can_act() { th { "" } } th { "card" } th { "parked at" } th { "last failure" } @if viewer.can_act() { th { "act" } } }
                            @for r in rows {
                                tr.parked-row data-card=(r.card_ref) {
                                    @if viewer.can_act() { td { input type="checkbox" name="card_ref" value=(r.card_ref) aria-label="select"; } }
                                    td { a href=(card_href(&r.card_ref)) { (r.card_ref) } }
                                    td { (when(&r.parked_at)) }
                                    td {
                                        (opt_when(&r.failed_at))
                                        @if let Some(h) = r.http_status { " · HTTP " (h) }
                                        @if let Some(e) = &r.error { br; code { (e) } }
                                    }
                                    @if viewer.can_act() { td { button.unpark-one name="one" value=(r.card_ref) { "Unpark" } } }
                                }
                            }
                        }
                        @if viewer.can_act() {
                            button name="selected" value="1" { "Unpark selected" }
                            " "
                            button name="all" value="1" { "Unpark all " (total) }
                        }
                    }))
                }
            }
        }
    };
    layout("Parked chains", viewer, true, body)
}

/// `/money`: payments and callbacks that need attention.
pub fn money(m: &Money, viewer: &Viewer) -> Markup {
    let body = html! {
        h2 { "Payments that need attention (" (m.payments.len()) ")" }
        p.note { "unknown, or requested/pending for longer than payments.recovery_after_secs = " (m.threshold_secs) " s (recovery reconciles these with the Gateway)." }
        table #payments {
            tr { th { "payment" } th { "card" } th { "amount" } th { "status" } th { "submissions" } th { "updated" } }
            @if m.payments.is_empty() { (empty_row(6, "No payment needs attention.")) }
            @for p in &m.payments {
                tr {
                    td { code { (p.payment_id) } }
                    td { a href=(card_href(&p.card_ref)) { (p.card_ref) } }
                    td.num { (p.amount_minor) " " (p.currency) }
                    td { @if p.status == "unknown" { span.bad { (p.status) } } @else { span.warn { (p.status) } } }
                    td.num { (p.submissions) }
                    td { (when(&p.updated_at)) }
                }
            }
        }
        h2 { "Approvals that need attention (" (m.approvals.len()) ")" }
        p.note { "requested/pending/unknown past approvals.recovery_after_secs, or in_review past approvals.review_query_secs (approval recovery asks the Gateway about these; RUNBOOK: an approval is stuck)." }
        table #approvals {
            tr { th { "approval" } th { "card" } th { "kind" } th { "status" } th { "submissions" } th { "updated" } }
            @if m.approvals.is_empty() { (empty_row(6, "No approval needs attention.")) }
            @for a in &m.approvals {
                tr {
                    td { code { (a.approval_id) } }
                    td { a href=(card_href(&a.card_ref)) { (a.card_ref) } }
                    td { (a.kind) }
                    td { @if a.status == "unknown" { span.bad { (a.status) } } @else { span.warn { (a.status) } } }
                    td.num { (a.submissions) }
                    td { (when(&a.updated_at)) }
                }
            }
        }
        h2 { "Failed callbacks (" (m.callbacks.len()) ")" }
        table #callbacks {
            tr { th { "channel / id" } th { "about" } th { "card" } th { "deliveries" } th { "last" } th { "reason" } }
            @if m.callbacks.is_empty() { (empty_row(6, "No failed callbacks.")) }
            @for c in &m.callbacks {
                tr {
                    td { code { (c.channel) " / " (c.callback_id) } }
                    td { (c.resource_type.as_deref().unwrap_or("-")) ":" (c.resource_id.as_deref().unwrap_or("-")) }
                    td { @if let Some(r) = &c.card_ref { a href=(card_href(r)) { (r) } } @else { "-" } }
                    td.num { (c.deliveries) }
                    td { (when(&c.last_received_at)) }
                    td { code { (c.reason.as_deref().unwrap_or("-")) } }
                }
            }
        }
    };
    layout("Money", viewer, true, body)
}

/// A card that is not on record.
pub fn unknown_card(card_ref: &str, viewer: &Viewer) -> Markup {
    layout(
        "Unknown card",
        viewer,
        false,
        html! { p.refused { "There is no card " code.card-ref { (card_ref) } " in cards." } },
    )
}

/// The login form.
pub fn login(viewer: &Viewer, problem: Option<&str>) -> Markup {
    let body = html! {
        @if let Some(problem) = problem { p.refused { (problem) } }
        @if !viewer.writable {
            p { "This console is read-only: no admin token is configured (env CARDWORKER__CONSOLE__ADMIN_TOKEN)." }
        } @else {
            form method="post" action="/login" {
                input type="hidden" name="csrf" value=(viewer.csrf);
                label { "Your name " input type="text" name="operator" required maxlength="64" autocomplete="name"; }
                " " label { "Admin token " input type="password" name="token" autocomplete="off"; }
                " " button type="submit" { "Log in" }
            }
        }
    };
    layout("Log in", viewer, false, body)
}

/// What an action did (200) or why it was refused (403).
pub fn outcome(viewer: &Viewer, ok: bool, message: &str, back: &str) -> Markup {
    let body = html! {
        @if ok { p.flash #outcome { (message) } } @else { p.refused #outcome { (message) } }
        p { a href=(back) { "Back" } }
    };
    layout(if ok { "Done" } else { "Refused" }, viewer, false, body)
}

/// An error page (a store did not answer).
pub fn error(viewer: &Viewer, title: &str, message: &str) -> Markup {
    layout(title, viewer, true, html! { p.refused { (message) } })
}

#[cfg(test)]
mod tests {
    use super::super::data::{PollChart, OUTCOMES};
    use super::*;
    use crate::commands::investigate::TimelineEntry;

    fn viewer() -> Viewer {
        Viewer {
            csrf: "c".repeat(64),
            writable: true,
            admin: false,
        }
    }

    #[test]
    fn a_card_ref_holding_html_is_rendered_as_text_and_linked_percent_encoded() {
        let evil = "<script>alert(1)</script>";
        let page = unknown_card(evil, &viewer()).into_string();
        assert!(
            page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{page}"
        );
        assert!(!page.contains(evil), "{page}");
        assert_eq!(
            card_href("a/b <c>"),
            "/cards/a%2Fb%20%3Cc%3E",
            "a card_ref cannot leave its path segment"
        );
        let outcome =
            outcome(&viewer(), false, "\"><img src=x onerror=alert(1)>", "/").into_string();
        assert!(!outcome.contains("<img"), "{outcome}");
    }

    fn entry(kind: &'static str, id: i64, correlation: Option<u128>) -> TimelineEntry {
        TimelineEntry {
            at: Utc::now(),
            kind,
            archived: false,
            id,
            correlation_id: correlation.map(uuid::Uuid::from_u128),
            what: format!("{kind}-{id}"),
            state: None,
            summary: None,
            error: None,
            recovery: None,
            http_status: None,
            duration_ms: None,
        }
    }

    #[test]
    fn a_log_and_the_audit_event_of_its_correlation_id_are_one_timeline_row() {
        let entries = [
            entry("audit_event", 10, Some(2)),
            entry("integration_log", 20, Some(2)),
            entry("audit_event", 11, None),
            entry("integration_log", 21, Some(3)),
            entry("audit_event", 12, Some(1)),
            entry("integration_log", 22, Some(1)),
            entry("audit_event", 13, Some(2)),
        ];
        let rows = timeline_rows(&entries);
        let ids: Vec<(Option<i64>, Vec<i64>)> = rows
            .iter()
            .map(|r| (r.log.map(|e| e.id), r.audits.iter().map(|e| e.id).collect()))
            .collect();
        assert_eq!(
            ids,
            [
                (Some(20), vec![10, 13]),
                (None, vec![11]),
                (Some(21), vec![]),
                (Some(22), vec![12]),
            ]
        );
        // Two logs of one correlation id (never written, but possible) stay two rows.
        let twice = [
            entry("integration_log", 1, Some(9)),
            entry("integration_log", 2, Some(9)),
        ];
        assert_eq!(timeline_rows(&twice).len(), 2);
    }

    fn parked_page(admin: bool) -> String {
        let rows = vec![ParkedView {
            card_ref: "c-1".to_owned(),
            parked_at: Utc::now(),
            failed_at: None,
            error: None,
            http_status: None,
        }];
        let v = Viewer { admin, ..viewer() };
        parked(
            &[(Task::Carddata, 1, rows), (Task::CardStatus, 0, vec![])],
            &v,
        )
        .into_string()
    }

    #[test]
    fn a_viewer_who_is_not_logged_in_sees_no_action_control_and_is_told_why() {
        let page = parked_page(false);
        assert!(!page.contains("action=\"/actions/"), "{page}");
        assert!(!page.contains("Unpark all"), "{page}");
        assert!(!page.contains("name=\"reason\""), "{page}");
        assert!(page.contains("id=\"read-only\""), "{page}");
        let page = parked_page(true);
        assert!(page.contains("Unpark all 1"), "{page}");
        assert!(!page.contains("id=\"read-only\""), "{page}");
        assert!(
            page.contains("No parked chains."),
            "an empty list says so: {page}"
        );
    }

    #[test]
    fn only_a_page_that_refreshes_says_so() {
        let done = outcome(&viewer(), true, "ok", "/").into_string();
        assert!(!done.contains("Refreshes every"), "{done}");
        assert!(!done.contains("<script"), "{done}");
        let page = parked_page(true);
        assert!(page.contains("Refreshes every 5 s"), "{page}");
        assert!(page.contains("location.reload()"), "{page}");
    }

    #[test]
    fn the_chart_draws_every_hours_polls_by_outcome_and_nothing_else() {
        let hours: Vec<(String, [u64; 3])> = (0..48)
            .map(|h| (format!("20261202{:02}", h % 24), [h, 2 * h, h % 3]))
            .collect();
        let chart = PollChart { hours };
        let svg = poll_chart(&chart).into_string();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(!svg.contains("<script"), "{svg}");
        assert_eq!(svg.matches("<g class=\"hour\"").count(), 48);
        for (k, outcome) in OUTCOMES.iter().enumerate() {
            let sum: u64 = svg
                .split(&format!("data-outcome=\"{outcome}\" data-count=\""))
                .skip(1)
                .map(|rest| {
                    rest[..rest.find('"').expect("quote")]
                        .parse::<u64>()
                        .expect("n")
                })
                .sum();
            assert_eq!(sum, chart.total(k), "{outcome}");
        }
        assert_eq!(chart.total(0), (0..48).sum::<u64>());
    }

    #[test]
    fn every_action_form_carries_the_csrf_token_and_a_read_only_console_shows_none() {
        let page = login(&viewer(), None).into_string();
        assert!(
            page.contains(&format!("name=\"csrf\" value=\"{}\"", "c".repeat(64))),
            "{page}"
        );
        let read_only = Viewer {
            writable: false,
            ..viewer()
        };
        let page = login(&read_only, None).into_string();
        assert!(
            page.contains("read-only") && !page.contains("type=\"password\""),
            "{page}"
        );
    }
}
