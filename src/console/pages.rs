//! The pages, as maud templates: compiled with the crate, and every `(expr)` is HTML-escaped, so a
//! card_ref or a payload holding HTML shows as text. Nothing here is rendered with
//! `PreEscaped` except the fixed style sheet and refresh script below.

use chrono::{DateTime, Utc};
use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::data::{Fleet, Money, ParkedView, QueueDead};
use crate::budget::CircuitState;
use crate::commands::investigate::Investigation;
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

fn when(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

fn opt_when(t: &Option<DateTime<Utc>>) -> String {
    t.as_ref().map(when).unwrap_or_else(|| "-".to_owned())
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
                    (body)
                    p.note { "Refreshes every " (REFRESH_SECS) " s while you are not typing. Rendered " (when(&Utc::now())) "." }
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

fn yes_no(b: bool, yes: &'static str, no: &'static str) -> Markup {
    html! { @if b { span.bad { (yes) } } @else { span.ok { (no) } } }
}

/// `/`: the fleet.
pub fn fleet(f: &Fleet, viewer: &Viewer) -> Markup {
    let body = html! {
        @for e in &f.errors { p.refused { (e) } }
        h2 { "Stores" }
        table {
            tr { th { "PostgreSQL" } td { @if f.postgres_ok { span.ok { "answers" } } @else { span.bad { "does not answer" } } } }
            tr { th { "Redis" } td { @if f.redis_ok { span.ok { "answers" } } @else { span.bad { "does not answer" } } } }
        }
        h2 { "Polling budgets and circuits" }
        @if let Some(b) = &f.budget {
            table #budgets {
                tr { th { "scope" } th { "in use" } th { "limit" } th { "config" } th { "override" } th { "paused" } th { "circuit" } th { "parked" } @if viewer.writable { th { "act" } } }
                tr { td { "total" } td.num { (b.total.in_use) } td.num { (b.total.limit) } td.num { (b.total.limit) } td { "-" } td { "-" } td { "-" } td { "-" } @if viewer.writable { td {} } }
                @for (name, t) in &b.tasks {
                    tr data-task=(name) {
                        td { (name) }
                        td.num { (t.in_use) }
                        td.num { (t.limit) }
                        td.num { (t.config_limit) }
                        td { @if let Some(o) = t.override_limit { (o) } @else if let Some(raw) = &t.invalid_override { span.bad { "invalid " (raw) " (ignored)" } } @else { "-" } }
                        td.paused { (yes_no(t.paused, "paused", "running")) }
                        td.circuit {
                            @match t.circuit.state {
                                CircuitState::Closed => span.ok { "closed" },
                                s => span.bad { (s.label()) @if t.circuit.forced { " (forced)" } },
                            }
                            " · window " (t.circuit.window.calls) " calls, " (t.circuit.window.failures) " failed"
                            @if let Some(since) = &t.circuit.since { " · since " (when(since)) }
                        }
                        td.num { (f.parked.iter().find(|(n, _)| n == name).map(|(_, c)| *c).unwrap_or(0)) }
                        @if viewer.writable {
                            td {
                                form.inline method="post" action="/actions/budget" {
                                    (action_fields(viewer))
                                    input type="hidden" name="task" value=(name);
                                    @if t.paused { button name="op" value="resume" { "Resume" } } @else { button name="op" value="pause" { "Pause" } }
                                    input type="number" name="limit" min="1" max="256" placeholder="limit" style="width:5em";
                                    button name="op" value="set" { "Set limit" }
                                    button name="op" value="clear" { "Clear override" }
                                }
                                form.inline method="post" action="/actions/circuit" {
                                    (action_fields(viewer))
                                    input type="hidden" name="task" value=(name);
                                    button name="op" value="open" { "Force circuit open" }
                                    button name="op" value="close" { "Force circuit closed" }
                                }
                            }
                        }
                    }
                }
            }
        } @else {
            p.bad { "Budgets unavailable (Redis)." }
        }
        h2 { "Maintenance" }
        table #maintenance {
            tr { th { "maintenance.enabled" } td { @if f.maintenance.enabled { "on" } @else { "off" } } }
            tr { th { "brake" } td.brake { @match f.maintenance.paused { Some(true) => span.bad { "paused" }, Some(false) => span.ok { "not paused" }, None => "unknown" } } }
            tr { th { "last archived day" } td { (f.maintenance.last_archived_day.as_deref().unwrap_or("-")) } }
            @for (job, days) in &f.maintenance.days_pending {
                tr { th { (job) " days pending" } td { @match days { Some(d) => (d), None => span.note { "measured only while maintenance is on" } } } }
            }
        }
        @if viewer.writable {
            form method="post" action="/actions/maintenance" {
                (action_fields(viewer))
                button name="op" value="pause" { "Pause maintenance" }
                button name="op" value="resume" { "Resume maintenance" }
            }
        }
        h2 { "Queues" }
        table #queues {
            tr { th { "queue" } th { "intake" } th { "active" } th { "scheduled" } th { "dead" } }
            @for q in &f.queues {
                tr data-queue=(q.queue) {
                    td { (q.queue) } td.num { (q.intake) } td.num { (q.active) } td.num { (q.scheduled) }
                    td.num.dead { @if q.dead > 0 { a href={ "/queues#q-" (q.queue) } { span.bad { (q.dead) } } } @else { "0" } }
                }
            }
        }
        h2 { "Live workers (" (f.workers.len()) ")" }
        table #workers {
            tr { th { "worker (kind-pod-id)" } th { "queue" } th { "heartbeat age" } }
            @for w in &f.workers {
                tr {
                    td { code { (w.name) } } td { (w.queue) }
                    td.num { @if w.heartbeat_age_secs > 60 { span.warn { (w.heartbeat_age_secs) " s" } } @else { (w.heartbeat_age_secs) " s" } }
                }
            }
        }
    };
    layout("Fleet", viewer, true, body)
}

/// `/queues`: every queue's dead set.
pub fn queues(sets: &[QueueDead], viewer: &Viewer) -> Markup {
    let body = html! {
        p.note { "Dead jobs are kept for 7 days. Requeue hands a job back through the intake, due now (a newer waiting job of the same entry is kept instead); card numbers in payloads and reasons are masked." }
        @for q in sets {
            section id={ "q-" (q.queue) } data-queue=(q.queue) {
                h2 { (q.queue) ": " span.dead-count { (q.total) } " dead" }
                @if !q.entries.is_empty() {
                    form method="post" action="/actions/dead" {
                        @if viewer.writable { (action_fields(viewer)) }
                        input type="hidden" name="queue" value=(q.queue);
                        table {
                            tr { th { "died" } th { "job id" } th { "entry" } th { "reason" } th { "payload" } @if viewer.writable { th { "act" } } }
                            @for e in &q.entries {
                                tr.dead-entry {
                                    td { (opt_when(&e.died_at)) }
                                    td { code { (e.id) } }
                                    td { code { (e.intake_entry.as_deref().unwrap_or("-")) } }
                                    td { code.reason { (e.reason.as_deref().unwrap_or("-")) } }
                                    td { code.payload { (e.payload.as_deref().unwrap_or("-")) } }
                                    @if viewer.writable {
                                        td {
                                            button name="requeue" value=(e.id) { "Requeue" }
                                            button name="discard" value=(e.id) { "Discard" }
                                        }
                                    }
                                }
                            }
                        }
                        @if viewer.writable {
                            button name="requeue_all" value="1" { "Requeue all " (q.total) }
                            " "
                            button name="discard_all" value="1" { "Discard all " (q.total) }
                        }
                    }
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
                @if !rows.is_empty() {
                    form method="post" action="/actions/unpark" {
                        @if viewer.writable { (action_fields(viewer)) }
                        input type="hidden" name="task" value=(task.label());
                        table {
                            tr { @if viewer.writable { th { "" } } th { "card" } th { "parked at" } th { "last failure" } @if viewer.writable { th { "act" } } }
                            @for r in rows {
                                tr.parked-row data-card=(r.card_ref) {
                                    @if viewer.writable { td { input type="checkbox" name="card_ref" value=(r.card_ref) aria-label="select"; } }
                                    td { a href=(card_href(&r.card_ref)) { (r.card_ref) } }
                                    td { (when(&r.parked_at)) }
                                    td {
                                        (opt_when(&r.failed_at))
                                        @if let Some(h) = r.http_status { " · HTTP " (h) }
                                        @if let Some(e) = &r.error { br; code { (e) } }
                                    }
                                    @if viewer.writable { td { button.unpark-one name="one" value=(r.card_ref) { "Unpark" } } }
                                }
                            }
                        }
                        @if viewer.writable {
                            button name="selected" value="1" { "Unpark selected" }
                            " "
                            button name="all" value="1" { "Unpark all " (total) }
                        }
                    }
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

/// `/cards/{card_ref}`: everything `investigate` shows.
pub fn card(inv: &Investigation, viewer: &Viewer) -> Markup {
    let c = &inv.card;
    let body = html! {
        table #card {
            tr { th { "card_ref" } td.card-ref { (c.card_ref) } }
            tr { th { "data" } td { (c.data_state) @if let Some(l4) = &c.pan_last4 { " · last4 " (l4) } } }
            tr { th { "status" } td { (c.status) } }
            tr { th { "version" } td { (c.version) " · created " (when(&c.created_at)) " · updated " (when(&c.updated_at)) } }
        }
        h2 { "Chains" }
        table #chains {
            tr { th { "task" } th { "state" } th { "chain" } th { "parked at" } @if viewer.writable { th { "act" } } }
            @for ch in &inv.chains {
                tr data-task=(ch.task) {
                    td { (ch.task) }
                    td.state { @if ch.state == "parked" { span.bad { (ch.state) } } @else { (ch.state) } }
                    td { code { (ch.chain_id.as_deref().unwrap_or("-")) } }
                    td { (opt_when(&ch.parked_at)) }
                    @if viewer.writable {
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
        h2 { "Timeline (changes and failures, newest first)" }
        table #timeline {
            tr { th { "at" } th { "kind" } th { "what" } th { "state" } th { "details" } }
            @for e in &inv.timeline {
                tr {
                    td { (when(&e.at)) @if e.archived { " [archived]" } }
                    td { (e.kind) " #" (e.id) }
                    td { (e.what) }
                    td { (e.state.as_deref().unwrap_or("")) }
                    td {
                        @if let Some(h) = e.http_status { "HTTP " (h) " · " }
                        @if let Some(d) = e.duration_ms { (d) " ms · " }
                        @if let Some(s) = &e.summary { code { (s) } }
                        @if let Some(s) = &e.error { br; code.bad { (s) } }
                        @if let Some(s) = &e.recovery { br; span.note { "next: " (s) } }
                        @if let Some(cid) = &e.correlation_id { br; span.note { "correlation " (cid) } }
                    }
                }
            }
        }
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
        @for (title, facts) in [("Manual facts (operator actions on this card)", &inv.manual_facts), ("Fleet facts (circuit transitions, operator actions on polling)", &inv.fleet_facts)] {
            h2 { (title) }
            table {
                tr { th { "at" } th { "event" } th { "by" } th { "on" } th { "summary" } }
                @for f in facts {
                    tr { td { (when(&f.at)) } td { (f.event_type) } td { (f.actor) } td { (f.resource_type) ":" (f.resource_id) } td { (f.summary) } }
                }
            }
        }
        h2 { "Payments" }
        table {
            tr { th { "payment" } th { "amount" } th { "status" } th { "submissions" } th { "updated" } }
            @for p in &inv.payments {
                tr { td { code { (p.payment_id) } } td.num { (p.amount_minor) " " (p.currency) } td { (p.status) } td.num { (p.submissions) } td { (when(&p.updated_at)) } }
            }
        }
        h2 { "Callbacks" }
        table {
            tr { th { "channel / id" } th { "state" } th { "about" } th { "deliveries" } th { "last" } th { "reason" } }
            @for cb in &inv.callbacks {
                tr { td { code { (cb.channel) " / " (cb.callback_id) } } td { (cb.state) } td { (cb.resource_type.as_deref().unwrap_or("-")) ":" (cb.resource_id.as_deref().unwrap_or("-")) } td.num { (cb.deliveries) } td { (when(&cb.last_received_at)) } td { (cb.reason.as_deref().unwrap_or("-")) } }
            }
        }
    };
    layout(&format!("Card {}", c.card_ref), viewer, true, body)
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
    use super::*;

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
