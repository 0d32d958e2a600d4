//! The fleet page: budget, circuits, queues, maintenance and the latest operator actions, with the
//! chart of poll outcomes per hour.

use maud::{html, Markup};

use super::super::data::{Fleet, PollChart, OUTCOMES};
use super::*;
use crate::budget::CircuitState;
use crate::limit::LIMIT_CEILING;
use crate::maintenance::session::DAYS_PENDING_CAP;
use crate::polling::unchanged::HOURS_KEPT;

/// `/`: the fleet.
pub fn fleet(f: &Fleet, viewer: &Viewer) -> Markup {
    let body = html! {
        @for e in &f.errors { p.refused { (e) } }
        h2 { "Polls per hour, last " (HOURS_KEPT) " h" }
        @match &f.chart {
            Some(c) => (poll_chart(c)),
            None => p.bad { "Polls per hour unavailable (Redis)." },
        }
        (stores_table(f))
        (latest_facts(f))
        (budgets_table(f, viewer))
        (maintenance_table(f, viewer))
        h2 { "Queues" }
        (queue_table(&f.queues))
        (workers_table(f))
    };
    layout("Fleet", viewer, true, body)
}

/// Whether each store answers.
fn stores_table(f: &Fleet) -> Markup {
    html! {
        h2 { "Stores" }
        table {
            tr { th { "PostgreSQL" } td { @if f.postgres_ok { span.ok { "answers" } } @else { span.bad { "does not answer" } } } }
            tr { th { "Redis" } td { @if f.redis_ok { span.ok { "answers" } } @else { span.bad { "does not answer" } } } }
        }
    }
}

/// The latest operator actions and circuit transitions.
fn latest_facts(f: &Fleet) -> Markup {
    html! {
        h2 { "Latest operator actions and circuit transitions" }
        @match &f.facts {
            Some(facts) => (facts_table("fleet-facts", facts, "No circuit transition or operator action on polling.")),
            None => p.bad { "Unavailable (PostgreSQL)." },
        }
    }
}

/// Each task's budget and circuit, with the operator's forms.
fn budgets_table(f: &Fleet, viewer: &Viewer) -> Markup {
    html! {
        h2 { "Polling budgets and circuits" }
        @if let Some(b) = &f.budget {
            table #budgets {
                tr { th { "scope" } th title="tokens held by running polls" { "in use" } th title="tokens kept idle between polls (reserved for the next polls, given back under contention)" { "kept" } th { "limit" } th { "config" } th { "override" } th { "paused" } th { "circuit" } th { "parked" } @if viewer.can_act() { th { "act" } } }
                tr { td { "total" } td.num { (b.total.in_use) } td.num { (b.total.kept) } td.num { (b.total.limit) } td.num { (b.total.limit) } td { "-" } td { "-" } td { "-" } td { "-" } @if viewer.can_act() { td {} } }
                @for (name, t) in &b.tasks {
                    tr data-task=(name) {
                        td { (name) }
                        td.num.in-use { (t.in_use) }
                        td.num.kept { (t.kept) }
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
                        td.num.parked { (f.parked.iter().find(|(n, _)| n == name).map(|(_, c)| *c).unwrap_or(0)) }
                        @if viewer.can_act() {
                            td {
                                form.inline method="post" action="/actions/budget" {
                                    (action_fields(viewer))
                                    input type="hidden" name="task" value=(name);
                                    @if t.paused { button name="op" value="resume" { "Resume" } } @else { button name="op" value="pause" { "Pause" } }
                                    input type="number" name="limit" min="1" max=(LIMIT_CEILING) placeholder="limit" style="width:5em";
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
    }
}

/// The maintenance switch, brake and backlog, with the operator's forms.
fn maintenance_table(f: &Fleet, viewer: &Viewer) -> Markup {
    html! {
        h2 { "Maintenance" }
        table #maintenance {
            tr { th { "maintenance.enabled" } td { @if f.maintenance.enabled { "on" } @else { "off" } } }
            tr { th { "brake" } td.brake { @match f.maintenance.paused { Some(true) => span.bad { "paused" }, Some(false) => span.ok { "not paused" }, None => "unknown" } } }
            tr { th { "last archived day" } td { (f.maintenance.last_archived_day.as_deref().unwrap_or("-")) } }
            @for (job, backlog) in &f.maintenance.backlog {
                tr data-job=(job) {
                    th { (job) " days pending" }
                    td.days-pending {
                        @match backlog {
                            Some(b) => {
                                span.days { (b.days_pending) }
                                @if b.days_pending >= DAYS_PENDING_CAP { " or more" }
                                @if let Some(next) = &b.next_day { " · next day " (next.format("%Y-%m-%d")) }
                                " · days before " (b.due_before.format("%Y-%m-%d")) " (Asia/Shanghai) are due"
                            }
                            None => span.bad { "could not be measured" },
                        }
                    }
                }
            }
        }
        @if !f.maintenance.enabled {
            p.note { "Maintenance is off (maintenance.enabled = false): nothing is archived or deleted. The days pending are what the first runs would process once it is turned on (as `cardworker maintenance status` measures them)." }
        }
        @if viewer.can_act() {
            form method="post" action="/actions/maintenance" {
                (action_fields(viewer))
                button name="op" value="pause" { "Pause maintenance" }
                button name="op" value="resume" { "Resume maintenance" }
            }
        }
    }
}

/// The live workers and their heartbeats.
fn workers_table(f: &Fleet) -> Markup {
    html! {
        h2 { "Live workers (" (f.workers.len()) ")" }
        table #workers {
            tr { th { "worker (kind-pod-id)" } th { "queue" } th { "heartbeat age" } }
            @if f.workers.is_empty() { (empty_row(3, "No live workers: no `cardworker run` process heartbeats on this deployment.")) }
            @for w in &f.workers {
                tr {
                    td { code { (w.name) } } td { (w.queue) }
                    td.num { @if w.heartbeat_age_secs > 60 { span.warn { (w.heartbeat_age_secs) " s" } } @else { (w.heartbeat_age_secs) " s" } }
                }
            }
        }
    }
}

/// The colour of each outcome in the chart, in the order of [`OUTCOMES`].
const OUTCOME_COLOURS: [&str; 3] = ["#9db4cf", "#2e7d32", "#c62828"];
/// What the chart calls each outcome.
const OUTCOME_NAMES: [&str; 3] = ["unchanged", "changed", "failed"];

/// The polls per hour as an inline SVG of stacked bars, one per hour, drawn on the server from
/// numbers only (maud escapes every text, as on the rest of the page). Each bar segment carries
/// its count (`data-count`) and a tooltip.
pub fn poll_chart(chart: &PollChart) -> Markup {
    const W: f64 = 960.0;
    const H: f64 = 200.0;
    const LEFT: f64 = 56.0;
    const TOP: f64 = 10.0;
    const BOTTOM: f64 = 28.0;
    let plot_w = W - LEFT - 8.0;
    let plot_h = H - TOP - BOTTOM;
    let peak = chart
        .hours
        .iter()
        .map(|(_, n)| n.iter().sum::<u64>())
        .max()
        .unwrap_or(0)
        .max(1);
    let slot = plot_w / chart.hours.len().max(1) as f64;
    let bar = (slot - 2.0).max(1.0);
    let scale = plot_h / peak as f64;
    let label = |hour: &str| -> String {
        // `YYYYMMDDHH` -> `DD HH:00`.
        match (hour.get(6..8), hour.get(8..10)) {
            (Some(d), Some(h)) => format!("{d} {h}:00"),
            _ => hour.to_owned(),
        }
    };
    html! {
        figure #poll-chart style="margin:0 0 10px" {
            svg width=(W) height=(H) viewBox={ "0 0 " (W) " " (H) } role="img"
                aria-label={ "Polls per UTC hour by outcome, last " (chart.hours.len()) " hours" }
                style="background:#fafbfc;border:1px solid #ddd" {
                line x1=(LEFT) y1=(TOP + plot_h) x2=(W - 8.0) y2=(TOP + plot_h) stroke="#888" {}
                line x1=(LEFT) y1=(TOP) x2=(LEFT) y2=(TOP + plot_h) stroke="#888" {}
                text x=(LEFT - 4.0) y=(TOP + 8.0) text-anchor="end" font-size="11" { (peak) }
                text x=(LEFT - 4.0) y=(TOP + plot_h) text-anchor="end" font-size="11" { "0" }
                @for (i, (hour, counts)) in chart.hours.iter().enumerate() {
                    @let x = LEFT + 1.0 + i as f64 * slot;
                    g.hour data-hour=(hour) {
                        title { (label(hour)) " UTC: " (counts[0]) " unchanged, " (counts[1]) " changed, " (counts[2]) " failed" }
                        @for (k, n) in counts.iter().enumerate() {
                            @let below: u64 = counts[..k].iter().sum();
                            @let y = TOP + plot_h - (below + n) as f64 * scale;
                            rect x=(format!("{x:.1}")) y=(format!("{y:.1}")) width=(format!("{bar:.1}"))
                                height=(format!("{:.1}", *n as f64 * scale)) fill=(OUTCOME_COLOURS[k])
                                data-outcome=(OUTCOMES[k]) data-count=(n) {}
                        }
                    }
                    @if i % 6 == 0 {
                        text x=(format!("{x:.1}")) y=(H - 10.0) font-size="11" { (label(hour)) }
                    }
                }
            }
            figcaption.note {
                "Polls per UTC hour, fleet-wide, both tasks. "
                @for (k, name) in OUTCOME_NAMES.iter().enumerate() {
                    span.legend data-outcome=(OUTCOMES[k]) {
                        span style={ "display:inline-block;width:10px;height:10px;background:" (OUTCOME_COLOURS[k]) } {}
                        " " (name) " (" code { (OUTCOMES[k]) } "): " span.total { (chart.total(k)) }
                    }
                    @if k + 1 < OUTCOME_NAMES.len() { " · " } @else { ". " }
                }
                "Unchanged polls are counted, not recorded; each worker writes its counts every 5 s."
            }
        }
    }
}
