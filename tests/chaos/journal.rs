//! What the world did, as the checker reads it: every Gateway request the simulator served (a
//! middleware in front of the simulator's router records when it came, when it was answered and
//! with which status), every card change the simulator made, every callback handed to the
//! ingress and every fault injected.
//!
//! Times are milliseconds since the run started ([`Journal::now_ms`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};

/// A request the harness itself sends to the simulator carries this header and is not journaled:
/// only the workers' calls are evidence.
pub const HARNESS_HEADER: &str = "x-chaos-harness";

/// One Gateway request as the simulator served it.
#[derive(Debug, Clone)]
pub struct Call {
    /// `GET` or `POST`.
    pub method: String,
    /// The path, e.g. `/v1/cards/c-001/status`.
    pub path: String,
    /// Its `Idempotency-Key` header.
    pub idempotency_key: Option<String>,
    /// When it arrived.
    pub start_ms: u64,
    /// When it was answered, or dropped (the client went away first); `None` while in flight.
    pub end_ms: Option<u64>,
    /// The status answered; `None` when the caller went away before the answer.
    pub status: Option<u16>,
}

impl Call {
    /// `(task, card_ref)` for a card call.
    pub fn card_call(&self) -> Option<(&'static str, &str)> {
        let rest = self.path.strip_prefix("/v1/cards/")?;
        let (card, what) = rest.rsplit_once('/')?;
        match what {
            "data" => Some(("carddata", card)),
            "status" => Some(("card_status", card)),
            _ => None,
        }
    }

    /// `(kind, id, is_post)` for a payment or approval call.
    pub fn money_call(&self) -> Option<(&'static str, String, bool)> {
        for (kind, prefix) in [("payment", "/v1/payments"), ("approval", "/v1/approvals")] {
            if self.path == prefix && self.method == "POST" {
                return Some((kind, self.idempotency_key.clone()?, true));
            }
            if let Some(id) = self.path.strip_prefix(&format!("{prefix}/")) {
                return Some((kind, id.to_owned(), false));
            }
        }
        None
    }
}

/// One card change the simulator made.
#[derive(Debug, Clone)]
pub struct Change {
    pub at_ms: u64,
    pub card_ref: String,
    /// `carddata` (to ready, with `value` the token) or `card_status` (`value` the new status).
    pub task: &'static str,
    pub value: String,
}

/// One callback handed to the ingress (`cardworker enqueue callback` exited 0).
#[derive(Debug, Clone)]
pub struct Delivery {
    pub at_ms: u64,
    pub channel: String,
    pub callback_id: String,
    /// `card`, `payment` or `approval`.
    pub kind: &'static str,
    pub resource_id: String,
    /// Contradicts a decision already on record (sent on purpose).
    pub conflicting: bool,
}

#[derive(Debug, Default)]
struct Inner {
    calls: Vec<Call>,
    changes: Vec<Change>,
    deliveries: Vec<Delivery>,
    /// Faults injected, by kind.
    faults: BTreeMap<String, u64>,
    /// The schedule as it ran: `(ms, what)`.
    events: Vec<(u64, String)>,
}

/// The shared journal. Clones share it.
#[derive(Debug, Clone)]
pub struct Journal {
    t0: Instant,
    inner: Arc<Mutex<Inner>>,
}

impl Journal {
    pub fn new() -> Self {
        Self {
            t0: Instant::now(),
            inner: Arc::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Milliseconds since the run started.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub fn change(&self, card_ref: &str, task: &'static str, value: String) {
        let at_ms = self.now_ms();
        self.lock().changes.push(Change {
            at_ms,
            card_ref: card_ref.to_owned(),
            task,
            value,
        });
    }

    pub fn delivered(&self, d: Delivery) {
        self.lock().deliveries.push(d);
    }

    /// Counts one injected fault of `kind` and notes it in the event list.
    pub fn fault(&self, kind: &str, detail: String) {
        let at = self.now_ms();
        let mut inner = self.lock();
        *inner.faults.entry(kind.to_owned()).or_insert(0) += 1;
        inner.events.push((at, format!("{kind} {detail}")));
    }

    /// Notes an event that is not a fault (a phase, a restore).
    pub fn note(&self, what: String) {
        let at = self.now_ms();
        self.lock().events.push((at, what));
    }

    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    pub fn changes(&self) -> Vec<Change> {
        self.lock().changes.clone()
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.lock().deliveries.clone()
    }

    pub fn faults(&self) -> BTreeMap<String, u64> {
        self.lock().faults.clone()
    }

    pub fn events(&self) -> Vec<(u64, String)> {
        self.lock().events.clone()
    }

    fn begin(&self, call: Call) -> usize {
        let mut inner = self.lock();
        inner.calls.push(call);
        inner.calls.len() - 1
    }

    fn end(&self, idx: usize, status: Option<u16>) {
        let at = self.now_ms();
        if let Some(c) = self.lock().calls.get_mut(idx) {
            c.end_ms = Some(at);
            c.status = status;
        }
    }
}

/// Records the end of a call when the handler's future finishes or is dropped.
struct EndGuard {
    journal: Journal,
    idx: usize,
    status: Option<u16>,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.journal.end(self.idx, self.status);
    }
}

/// The middleware in front of the simulator's router.
pub async fn record(State(journal): State<Journal>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    if !path.starts_with("/v1/") || req.headers().contains_key(HARNESS_HEADER) {
        return next.run(req).await;
    }
    let call = Call {
        method: req.method().as_str().to_owned(),
        path,
        idempotency_key: req
            .headers()
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        start_ms: journal.now_ms(),
        end_ms: None,
        status: None,
    };
    let card_read = call.path.starts_with("/v1/cards/");
    let idx = journal.begin(call);
    let mut guard = EndGuard {
        journal,
        idx,
        status: None,
    };
    if card_read {
        // A card read is at the Gateway from its arrival to its answer, whether or not its
        // client still waits (invariant 1 counts what the Gateway carries): it runs to its end
        // on a task of its own, and its end is recorded there.
        let run = tokio::spawn(async move {
            let mut guard = guard;
            let resp = next.run(req).await;
            guard.status = Some(resp.status().as_u16());
            resp
        });
        return match run.await {
            Ok(resp) => resp,
            Err(_) => axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        };
    }
    let resp = next.run(req).await;
    guard.status = Some(resp.status().as_u16());
    resp
}
