//! A scripted Gateway for approvals (spec section 7): `POST /v1/approvals` and
//! `GET /v1/approvals/{id}`, answering each approval as the test scripted it, and counting every
//! POST with its `Idempotency-Key`. The only thing the approval tests fake is the Gateway.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::Notify;
use uuid::Uuid;

/// How the Gateway answers one approval's POST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Script {
    /// Acts (stores the status) and answers it.
    Answer(&'static str),
    /// Acts (stores the status), then never answers until released: the caller cannot know.
    ActThenHang(&'static str),
    /// Acts (stores the status), then waits until released and answers it.
    ActThenWait(&'static str),
    /// Never acts on it (the request was lost before the Gateway took it): stores nothing and
    /// never answers until released. A later GET answers 404.
    LoseThenHang,
    /// Acts (stores the status), then answers 503.
    ActThen503(&'static str),
    /// Answers a 200 that is not the contract's body, storing nothing.
    Garbled,
    /// Refuses the request: 422, storing nothing.
    Refuse,
}

/// What the Gateway saw of one approval.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Every POST received, with its `Idempotency-Key` (`None` when absent).
    pub keys: Vec<Option<String>>,
    /// What the Gateway has on record: (status, channel_ref); `None` means 404.
    pub stored: Option<(String, String)>,
    /// POSTs the Gateway acted on.
    pub acted: u32,
}

#[derive(Default)]
struct Inner {
    scripts: HashMap<Uuid, Script>,
    seen: HashMap<Uuid, Seen>,
    default: Option<Script>,
}

/// A handle on the running scripted Gateway.
#[derive(Clone)]
pub struct ScriptedGateway {
    inner: Arc<Mutex<Inner>>,
    release: Arc<Notify>,
    /// Its base URL.
    pub url: String,
}

impl ScriptedGateway {
    /// Starts it on a free port; every approval is answered `approved` unless scripted.
    pub async fn start() -> Self {
        let gw = Self {
            inner: Arc::new(Mutex::new(Inner::default())),
            release: Arc::new(Notify::new()),
            url: String::new(),
        };
        let app = Router::new()
            .route("/v1/approvals", post(h_post))
            .route("/v1/approvals/{id}", get(h_get))
            .with_state(gw.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the scripted gateway");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, ..gw }
    }

    /// Scripts the POST of `id`.
    pub fn script(&self, id: Uuid, script: Script) {
        self.lock().scripts.insert(id, script);
    }

    /// Scripts every approval not scripted on its own.
    pub fn script_all(&self, script: Script) {
        self.lock().default = Some(script);
    }

    /// The channel decides: what the Gateway has on record for `id` becomes `status`.
    pub fn decide(&self, id: Uuid, status: &str) {
        self.lock().seen.entry(id).or_default().stored =
            Some((status.to_owned(), format!("ch_{}", id.simple())));
    }

    /// What it saw of `id`.
    pub fn seen(&self, id: Uuid) -> Seen {
        self.lock().seen.get(&id).cloned().unwrap_or_default()
    }

    /// POSTs received for `id`.
    pub fn posts(&self, id: Uuid) -> usize {
        self.seen(id).keys.len()
    }

    /// Releases every hanging POST (they then answer 503: the caller is long gone).
    pub fn release(&self) {
        self.release.notify_waiters();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn body(id: Uuid, status: &str, channel_ref: &str) -> Value {
    json!({ "approval_id": id, "status": status, "channel_ref": channel_ref })
}

async fn h_post(
    State(gw): State<ScriptedGateway>,
    headers: HeaderMap,
    Json(req): Json<Value>,
) -> Response {
    let Some(id) = req
        .get("approval_id")
        .and_then(Value::as_str)
        .and_then(|s| Uuid::parse_str(s).ok())
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let key = headers
        .get("Idempotency-Key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let (script, already) = {
        let mut inner = gw.lock();
        let script = inner
            .scripts
            .get(&id)
            .copied()
            .or(inner.default)
            .unwrap_or(Script::Answer("approved"));
        let seen = inner.seen.entry(id).or_default();
        seen.keys.push(key);
        (script, seen.stored.clone())
    };
    // Idempotent like the real Gateway: an approval it already has is answered as recorded.
    if let Some((status, channel_ref)) = already {
        return Json(body(id, &status, &channel_ref)).into_response();
    }
    let act = |status: &str| {
        let mut inner = gw.lock();
        let seen = inner.seen.entry(id).or_default();
        seen.acted += 1;
        let channel_ref = format!("ch_{}", id.simple());
        seen.stored = Some((status.to_owned(), channel_ref.clone()));
        channel_ref
    };
    match script {
        Script::Answer(status) => {
            let channel_ref = act(status);
            Json(body(id, status, &channel_ref)).into_response()
        }
        Script::ActThenHang(status) => {
            act(status);
            gw.release.notified().await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        Script::ActThenWait(status) => {
            let channel_ref = act(status);
            gw.release.notified().await;
            Json(body(id, status, &channel_ref)).into_response()
        }
        Script::LoseThenHang => {
            gw.release.notified().await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        Script::ActThen503(status) => {
            act(status);
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        Script::Garbled => (StatusCode::OK, "<html>approved</html>").into_response(),
        Script::Refuse => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "refused"})),
        )
            .into_response(),
    }
}

async fn h_get(State(gw): State<ScriptedGateway>, Path(id): Path<Uuid>) -> Response {
    match gw.seen(id).stored {
        Some((status, channel_ref)) => Json(body(id, &status, &channel_ref)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "unknown approval"})),
        )
            .into_response(),
    }
}
