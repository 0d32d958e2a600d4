//! The operator's console (`cardworker console`, spec section 8): one web page where an operator
//! sees the fleet and acts on it. A process of its own, never part of `cardworker run`, so worker
//! pods never expose it; bound to loopback by default.
//!
//! It reads the same PostgreSQL and Redis as the workers and acts only through the code of the
//! CLI (`crate::commands`: unpark, circuit, budget, maintenance, dead set), so an action from the
//! page writes the same `operator.<action>` audit event as the command. Without an admin token it
//! is read-only; every action is a POST that needs the token and a CSRF token bound to the login
//! session (see [`auth`]), and is recorded under the operator's name given at login, `via`
//! `console`. An action whose audit event cannot be written is not carried out, and the page
//! says so (`commands::operator::carry_out`).
//!
//! # Layout
//! - this module: [`execute`] (the subcommand), [`router`], the handlers.
//! - [`auth`]: the admin token, login sessions, CSRF.
//! - [`data`]: what the pages show (bounded reads).
//! - [`pages`]: the maud templates (escaped by construction).

pub mod auth;
pub mod data;
pub mod pages;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::Markup;

use auth::{Auth, Refusal, CSRF_COOKIE, SESSION_COOKIE};
use pages::Viewer;

use crate::commands::args::ConsoleArgs;
use crate::commands::budget::{change_budget, force_circuit, validate_override, BudgetChange};
use crate::commands::investigate::{self, InvestigateError};
use crate::commands::operator::Operator;
use crate::commands::{dead as dead_cmd, maintenance_switch, polling, CommandError};
use crate::config::{Config, Task};
use crate::context::AppContext;
use crate::queue::dead::{DeadAction, DeadSelector};
use crate::storage::cards::ParkedSelector;

/// What every handler shares.
pub struct Console {
    /// The same context a worker has (pool, Redis, budget).
    pub ctx: Arc<AppContext>,
    /// The admin token and sessions.
    pub auth: Auth,
}

type Shared = State<Arc<Console>>;

/// `cardworker console [--listen ADDR]`: loads the configuration, connects, serves until SIGTERM.
pub async fn execute(config_path: Option<&Path>, args: ConsoleArgs) -> Result<(), CommandError> {
    let config = Config::load(config_path)?;
    crate::telemetry::init_logging(
        config.telemetry.log_format,
        crate::telemetry::Process::Console,
    );
    let listen = args.listen.unwrap_or_else(|| config.console.listen.clone());
    let addr: SocketAddr = listen.parse().map_err(|_| {
        CommandError::Usage(format!(
            "--listen {listen:?}: must be a socket address such as \"127.0.0.1:9465\""
        ))
    })?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the console to {addr}"))?;
    let bound = listener.local_addr().context("reading the bound address")?;
    let token = config.console.admin_token.expose().map(str::to_owned);
    let writable = token.is_some();
    let ctx = AppContext::connect(config).await?;
    println!(
        "console listening on http://{bound}/ ({})",
        if writable {
            "actions need the admin token"
        } else {
            "read-only: set env CARDWORKER__CONSOLE__ADMIN_TOKEN to act"
        }
    );
    let console = Arc::new(Console {
        ctx,
        auth: Auth::new(token),
    });
    axum::serve(listener, router(console))
        .with_graceful_shutdown(crate::commands::shutdown_signal())
        .await
        .context("serving the console")?;
    Ok(())
}

/// Every page and action.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(fleet_page))
        .route("/queues", get(queues_page))
        .route("/parked", get(parked_page))
        .route("/money", get(money_page))
        .route("/cards", get(card_search))
        .route("/cards/", get(blank_card_page))
        .route("/cards/{card_ref}", get(card_page))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/healthz", get(|| async { "ok" }))
        .route("/actions/unpark", post(unpark))
        .route("/actions/circuit", post(circuit))
        .route("/actions/budget", post(budget))
        .route("/actions/maintenance", post(maintenance))
        .route("/actions/dead", post(dead))
        .with_state(console)
}

/// The viewer of a request, and the browser cookie to set when it had none. Its forms carry
/// the CSRF token the console issues for its session (or, before login, for that cookie).
fn viewer(console: &Console, headers: &HeaderMap) -> (Viewer, Option<String>) {
    let (browser, new) = match auth::cookie(headers, CSRF_COOKIE) {
        Some(c) if c.len() == 64 && c.bytes().all(|b| b.is_ascii_hexdigit()) => {
            (c.to_owned(), None)
        }
        _ => {
            let c = auth::random_token();
            (c.clone(), Some(c))
        }
    };
    let v = Viewer {
        csrf: console.auth.form_token(headers, &browser),
        writable: console.auth.writable(),
        admin: console.auth.is_admin(headers),
    };
    (v, new)
}

/// A page response with the console's headers (no caching, no framing) and the CSRF cookie.
fn page(status: StatusCode, markup: Markup, new_csrf: Option<String>) -> Response {
    let mut resp = (status, markup).into_response();
    let h = resp.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("frame-ancestors 'none'; form-action 'self'; base-uri 'none'"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if let Some(c) = new_csrf {
        if let Ok(v) = HeaderValue::from_str(&format!("{CSRF_COOKIE}={c}; Path=/; SameSite=Strict"))
        {
            h.append(header::SET_COOKIE, v);
        }
    }
    resp
}

async fn fleet_page(State(c): Shared, headers: HeaderMap) -> Response {
    let (v, new) = viewer(&c, &headers);
    let f = data::fleet(&c.ctx).await;
    page(StatusCode::OK, pages::fleet(&f, &v), new)
}

async fn queues_page(State(c): Shared, headers: HeaderMap) -> Response {
    let (v, new) = viewer(&c, &headers);
    let read = async {
        let (counts, _) = data::bounded("queues", data::queue_counts(&c.ctx)).await?;
        let sets = data::dead_sets(&c.ctx).await?;
        anyhow::Ok((counts, sets))
    };
    match read.await {
        Ok((counts, sets)) => page(StatusCode::OK, pages::queues(&counts, &sets, &v), new),
        Err(e) => unavailable(&v, new, "Queues", &e),
    }
}

async fn parked_page(State(c): Shared, headers: HeaderMap) -> Response {
    let (v, new) = viewer(&c, &headers);
    let mut lists = Vec::new();
    for task in Task::ALL {
        match data::parked(&c.ctx, task).await {
            Ok((total, rows)) => lists.push((task, total, rows)),
            Err(e) => return unavailable(&v, new, "Parked chains", &e),
        }
    }
    page(StatusCode::OK, pages::parked(&lists, &v), new)
}

async fn money_page(State(c): Shared, headers: HeaderMap) -> Response {
    let (v, new) = viewer(&c, &headers);
    match data::money(&c.ctx).await {
        Ok(m) => page(StatusCode::OK, pages::money(&m, &v), new),
        Err(e) => unavailable(&v, new, "Money", &e),
    }
}

fn unavailable(v: &Viewer, new: Option<String>, title: &str, e: &anyhow::Error) -> Response {
    tracing::warn!(page = title, error = %format!("{e:#}"), "console page unavailable");
    page(
        StatusCode::SERVICE_UNAVAILABLE,
        pages::error(v, title, &format!("{e:#}")),
        new,
    )
}

#[derive(serde::Deserialize)]
struct Search {
    card_ref: Option<String>,
}

async fn card_search(Query(q): Query<Search>) -> Response {
    match q
        .card_ref
        .as_deref()
        .map(str::trim)
        .filter(|r| !r.is_empty())
    {
        Some(r) => Redirect::to(&pages::card_href(r)).into_response(),
        None => Redirect::to("/").into_response(),
    }
}

async fn card_page(
    State(c): Shared,
    headers: HeaderMap,
    UrlPath(card_ref): UrlPath<String>,
) -> Response {
    let (v, new) = viewer(&c, &headers);
    match investigate::investigate(&c.ctx, &card_ref).await {
        Ok(inv) => page(StatusCode::OK, pages::card(&inv, &v), new),
        Err(InvestigateError::UnknownCard(r)) => {
            page(StatusCode::NOT_FOUND, pages::unknown_card(&r, &v), new)
        }
        Err(InvestigateError::Other(e)) => unavailable(&v, new, "Card", &e),
    }
}

/// The page of the card whose card_ref is empty (`card_href("")`): a row may hold one, and the
/// lists link to it like any other.
async fn blank_card_page(state: Shared, headers: HeaderMap) -> Response {
    card_page(state, headers, UrlPath(String::new())).await
}

async fn login_page(State(c): Shared, headers: HeaderMap) -> Response {
    let (v, new) = viewer(&c, &headers);
    page(StatusCode::OK, pages::login(&v, None), new)
}

/// A parsed `application/x-www-form-urlencoded` body (repeated names kept, for checkboxes).
struct Form(Vec<(String, String)>);

impl Form {
    fn parse(body: &[u8]) -> Self {
        Self(
            url::form_urlencoded::parse(body)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.trim().is_empty())
    }

    fn all(&self, name: &str) -> Vec<String> {
        self.0
            .iter()
            .filter(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.clone())
            .collect()
    }

    fn reason(&self) -> Option<String> {
        self.get("reason").map(|r| r.trim().to_owned())
    }
}

async fn login(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let (v, new) = viewer(&c, &headers);
    let form = Form::parse(&body);
    if let Err(r) = c.auth.check_browser_csrf(&headers, form.get("csrf")) {
        return refused(&v, new, r);
    }
    if !c.auth.writable() {
        return refused(&v, new, Refusal::ReadOnly);
    }
    if !form.get("token").is_some_and(|t| c.auth.is_token(t)) {
        tracing::warn!("console login refused: wrong admin token");
        return page(
            StatusCode::FORBIDDEN,
            pages::login(&v, Some("That is not the admin token.")),
            new,
        );
    }
    let Some(operator) = form.get("operator").and_then(auth::operator_name) else {
        return page(
            StatusCode::BAD_REQUEST,
            pages::login(
                &v,
                Some("Give your name (1 to 64 characters): every action you take is recorded under it."),
            ),
            new,
        );
    };
    tracing::info!(%operator, "console login");
    let session = c.auth.login(&operator);
    let mut resp = Redirect::to("/").into_response();
    if let Ok(cookie) = HeaderValue::from_str(&format!(
        "{SESSION_COOKIE}={session}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
        auth::SESSION_TTL.as_secs()
    )) {
        resp.headers_mut().append(header::SET_COOKIE, cookie);
    }
    resp
}

async fn logout(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    let (v, new) = viewer(&c, &headers);
    let form = Form::parse(&body);
    if let Err(r) = c.auth.check_any_csrf(&headers, form.get("csrf")) {
        return refused(&v, new, r);
    }
    c.auth.logout(&headers);
    let mut resp = Redirect::to("/").into_response();
    resp.headers_mut().append(
        header::SET_COOKIE,
        HeaderValue::from_static("cw_session=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    resp
}

fn refused(v: &Viewer, new: Option<String>, r: Refusal) -> Response {
    page(
        StatusCode::FORBIDDEN,
        pages::outcome(v, false, r.message(), "/"),
        new,
    )
}

/// Checks an action's token and CSRF token; on success the parsed form and who is acting.
fn authorize(
    c: &Console,
    headers: &HeaderMap,
    body: &[u8],
    action: &str,
) -> Result<(Viewer, Option<String>, Form, Operator), Box<Response>> {
    let (v, new) = viewer(c, headers);
    let form = Form::parse(body);
    match c.auth.check(headers, form.get("csrf")) {
        Ok(by) => Ok((v, new, form, by)),
        Err(r) => {
            tracing::warn!(action, refusal = ?r, "console action refused");
            Err(Box::new(refused(&v, new, r)))
        }
    }
}

/// The page after an action: what it did, or why it failed (nothing half-done is hidden).
fn done(
    v: &Viewer,
    new: Option<String>,
    action: &str,
    back: &str,
    result: anyhow::Result<String>,
) -> Response {
    match result {
        Ok(said) => {
            tracing::info!(action, outcome = %said, "console action applied");
            page(StatusCode::OK, pages::outcome(v, true, &said, back), new)
        }
        Err(e) => {
            tracing::warn!(action, error = %format!("{e:#}"), "console action failed");
            page(
                StatusCode::BAD_REQUEST,
                pages::outcome(v, false, &format!("{e:#}"), back),
                new,
            )
        }
    }
}

/// Runs one action: checks the admin token and the CSRF token (403, nothing changed, when either
/// is missing), applies `apply` to the form, and shows what it did.
async fn action<F, Fut>(
    c: Arc<Console>,
    headers: HeaderMap,
    body: Bytes,
    name: &'static str,
    back: &'static str,
    apply: F,
) -> Response
where
    F: FnOnce(Arc<Console>, Form, Operator) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    let (v, new, form, by) = match authorize(&c, &headers, &body, name) {
        Ok(x) => x,
        Err(resp) => return *resp,
    };
    tracing::info!(action = name, operator = %by.name, "console action");
    let result = apply(c.clone(), form, by).await;
    done(&v, new, name, back, result)
}

fn task_of(form: &Form) -> anyhow::Result<Task> {
    let raw = form.get("task").unwrap_or("");
    raw.parse::<Task>()
        .map_err(|_| anyhow::anyhow!("task {raw:?}: must be carddata or card_status"))
}

async fn unpark(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    action(
        c,
        headers,
        body,
        "unpark",
        "/parked",
        |c, form, by| async move {
            let task = task_of(&form)?;
            let selectors: Vec<ParkedSelector> = if form.get("all").is_some() {
                vec![ParkedSelector::All]
            } else if let Some(one) = form.get("one") {
                vec![ParkedSelector::CardRef(one.to_owned())]
            } else {
                form.all("card_ref")
                    .into_iter()
                    .map(ParkedSelector::CardRef)
                    .collect()
            };
            anyhow::ensure!(!selectors.is_empty(), "no parked chain selected");
            let mut restarted = 0;
            for which in selectors {
                restarted += polling::unpark(&c.ctx, task, which, form.reason(), &by)
                    .await?
                    .restarted;
            }
            Ok(format!("{task}: {restarted} parked chains restarted"))
        },
    )
    .await
}

async fn circuit(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    action(c, headers, body, "circuit", "/", |c, form, by| async move {
        let task = task_of(&form)?;
        let open = match form.get("op") {
            Some("open") => true,
            Some("close") => false,
            other => anyhow::bail!("op {other:?}: must be open or close"),
        };
        force_circuit(&c.ctx.config, &c.ctx.budget, task, open, form.reason(), &by).await
    })
    .await
}

async fn budget(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    action(c, headers, body, "budget", "/", |c, form, by| async move {
        let tasks = match form.get("task") {
            Some("all") => Task::ALL.to_vec(),
            _ => vec![task_of(&form)?],
        };
        let change = match form.get("op") {
            Some("pause") => BudgetChange::Pause(tasks),
            Some("resume") => BudgetChange::Resume(tasks),
            Some("set") => {
                let task = tasks[0];
                let raw = form.get("limit").unwrap_or("");
                let limit = validate_override(&c.ctx.config, task, raw)
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                BudgetChange::Set(task, limit)
            }
            Some("clear") => BudgetChange::Clear(tasks[0]),
            other => anyhow::bail!("op {other:?}: must be pause, resume, set or clear"),
        };
        change_budget(&c.ctx.config, &c.ctx.budget, change, form.reason(), &by).await
    })
    .await
}

async fn maintenance(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    action(
        c,
        headers,
        body,
        "maintenance",
        "/",
        |c, form, by| async move {
            let paused = match form.get("op") {
                Some("pause") => true,
                Some("resume") => false,
                other => anyhow::bail!("op {other:?}: must be pause or resume"),
            };
            maintenance_switch(&c.ctx.config, paused, form.reason(), &by).await
        },
    )
    .await
}

async fn dead(State(c): Shared, headers: HeaderMap, body: Bytes) -> Response {
    action(
        c,
        headers,
        body,
        "dead",
        "/queues",
        |c, form, by| async move {
            let short = form.get("queue").unwrap_or("");
            let q = dead_cmd::queue(&c.ctx.config, short).map_err(|e| anyhow::anyhow!("{e}"))?;
            let (action, which) = if form.get("requeue_all").is_some() {
                (DeadAction::Requeue, DeadSelector::All)
            } else if form.get("discard_all").is_some() {
                (DeadAction::Discard, DeadSelector::All)
            } else if let Some(id) = form.get("requeue") {
                (DeadAction::Requeue, DeadSelector::Ids(vec![id.to_owned()]))
            } else if let Some(id) = form.get("discard") {
                (DeadAction::Discard, DeadSelector::Ids(vec![id.to_owned()]))
            } else {
                anyhow::bail!("no dead job selected");
            };
            let outcome =
                dead_cmd::act(&c.ctx.config, &q, action, which, form.reason(), &by).await?;
            Ok(dead_cmd::describe(&q.short, action, &outcome))
        },
    )
    .await
}
