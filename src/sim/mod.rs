//! The Gateway simulator behind `cardworker gateway-sim`: a real axum server that speaks the
//! Gateway contract (spec section 1) from an in-memory card set, for local runs, demos, load
//! tests and the integration tests.
//!
//! Behaviour is steered at run time through Rust methods on [`Simulator`] or through the HTTP
//! control API under `/sim/…`:
//!
//! | route | what |
//! | --- | --- |
//! | `GET /healthz` | 200 |
//! | `GET /sim/stats` | [`SimStats`]: in flight now, peaks, totals per call kind |
//! | `POST /sim/stats/reset-peaks` | peaks := current in-flight |
//! | `GET /sim/config`, `POST /sim/config` | read / patch ([`SimConfigPatch`]) the global knobs |
//! | `GET /sim/cards/{card_ref}`, `POST /sim/cards/{card_ref}` | read / patch ([`SimCardPatch`]) one card |
//! | `GET /sim/payments/{payment_id}` | [`PaymentRecord`]: submissions, idempotency keys, stored result |
//! | `POST /sim/payments/{payment_id}` | `{"behaviour": …}` ([`PaymentBehaviour`]) for that payment |
//! | `GET /sim/requests` | the last requests seen ([`RequestRecord`]), oldest first |

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::distr::Alphanumeric;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::gateway::{
    CallKind, CardData, CardStatus, PaymentRequest, PaymentResult, PaymentStatus,
    CORRELATION_HEADER, IDEMPOTENCY_HEADER,
};

/// How many requests [`Simulator::recent_requests`] keeps.
pub const REQUEST_LOG_CAPACITY: usize = 1000;

/// What the simulator answers to `POST /v1/payments` when no per-payment behaviour is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentBehaviour {
    /// Store and answer `accepted`.
    #[default]
    Accept,
    /// Store and answer `rejected`.
    Reject,
    /// Answer 503 without storing.
    ServerError,
    /// Store as `accepted`, then hold the answer for `hang_ms` (longer than a client timeout):
    /// the Gateway acted but the caller does not know.
    Hang,
    /// Answer `accepted` but do not store: a later `GET` answers 404.
    Forget,
}

/// What a card endpoint answers for one card, overriding the global rates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "garbage")]
pub enum CardBehaviour {
    /// Use the global rates.
    #[default]
    Normal,
    /// Always 503.
    Fail,
    /// Always a 200 with a bad body of this kind.
    Garbage(GarbageKind),
}

/// The kinds of bad 2xx body the simulator can produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GarbageKind {
    /// Not JSON at all.
    #[default]
    NotJson,
    /// JSON lacking the `state` / `status` field.
    MissingField,
    /// JSON naming another card or payment.
    OtherRef,
    /// A `state` / `status` outside the list.
    BadValue,
}

impl GarbageKind {
    const ALL: [GarbageKind; 4] = [
        GarbageKind::NotJson,
        GarbageKind::MissingField,
        GarbageKind::OtherRef,
        GarbageKind::BadValue,
    ];
}

/// Global knobs of the simulator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    /// Base latency of every Gateway call.
    pub latency_ms: u64,
    /// Extra uniform random latency in `0..=latency_jitter_ms`.
    pub latency_jitter_ms: u64,
    /// Probability (0..=1) that a Gateway call answers 503.
    pub error_rate: f64,
    /// Probability (0..=1) that a Gateway call answers 200 with a bad body.
    pub garbage_rate: f64,
    /// Probability (0..=1) that a card changes on a given data or status read.
    pub change_rate: f64,
    /// Default behaviour of `POST /v1/payments`.
    pub payment_mode: PaymentBehaviour,
    /// How long a [`PaymentBehaviour::Hang`] holds its answer.
    pub hang_ms: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            latency_ms: 20,
            latency_jitter_ms: 0,
            error_rate: 0.0,
            garbage_rate: 0.0,
            change_rate: 0.0,
            payment_mode: PaymentBehaviour::Accept,
            hang_ms: 30_000,
        }
    }
}

impl SimConfig {
    /// Checks that every rate is a probability.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, v) in [
            ("error_rate", self.error_rate),
            ("garbage_rate", self.garbage_rate),
            ("change_rate", self.change_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                anyhow::bail!("{name} = {v} is not a probability in 0..=1");
            }
        }
        Ok(())
    }
}

/// A partial update of [`SimConfig`] (`POST /sim/config`): absent fields are kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfigPatch {
    pub latency_ms: Option<u64>,
    pub latency_jitter_ms: Option<u64>,
    pub error_rate: Option<f64>,
    pub garbage_rate: Option<f64>,
    pub change_rate: Option<f64>,
    pub payment_mode: Option<PaymentBehaviour>,
    pub hang_ms: Option<u64>,
}

impl SimConfigPatch {
    fn apply(&self, c: &SimConfig) -> SimConfig {
        SimConfig {
            latency_ms: self.latency_ms.unwrap_or(c.latency_ms),
            latency_jitter_ms: self.latency_jitter_ms.unwrap_or(c.latency_jitter_ms),
            error_rate: self.error_rate.unwrap_or(c.error_rate),
            garbage_rate: self.garbage_rate.unwrap_or(c.garbage_rate),
            change_rate: self.change_rate.unwrap_or(c.change_rate),
            payment_mode: self.payment_mode.unwrap_or(c.payment_mode),
            hang_ms: self.hang_ms.unwrap_or(c.hang_ms),
        }
    }
}

/// One simulated card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimCard {
    pub data: CardData,
    pub status: CardStatus,
    pub behaviour: CardBehaviour,
}

impl Default for SimCard {
    fn default() -> Self {
        Self {
            data: CardData::Pending,
            status: CardStatus::Inactive,
            behaviour: CardBehaviour::Normal,
        }
    }
}

/// A partial update of one card (`POST /sim/cards/{card_ref}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimCardPatch {
    pub data: Option<CardData>,
    pub status: Option<CardStatus>,
    pub behaviour: Option<CardBehaviour>,
}

/// What the simulator saw of one payment id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRecord {
    /// `POST /v1/payments` requests for this payment id.
    pub submissions: u64,
    /// The `Idempotency-Key` header of each submission, in order (`""` when absent).
    pub idempotency_keys: Vec<String>,
    /// What `GET /v1/payments/{id}` answers; `None` means 404.
    pub stored: Option<PaymentResult>,
    /// Behaviour for this payment, overriding `payment_mode`.
    pub behaviour: Option<PaymentBehaviour>,
}

/// One request as the simulator received it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub call: CallKind,
    pub path: String,
    pub correlation_id: Option<String>,
    pub accept: Option<String>,
    pub idempotency_key: Option<String>,
}

/// In-flight accounting (`GET /sim/stats`). Keys are call kinds (`carddata`, `card_status`,
/// `payment_submit`, `payment_query`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimStats {
    pub in_flight: u64,
    pub peak_in_flight: u64,
    pub in_flight_per_call: HashMap<String, u64>,
    pub peak_per_call: HashMap<String, u64>,
    pub calls_total: HashMap<String, u64>,
}

#[derive(Debug, Default)]
struct SimState {
    config: SimConfig,
    cards: HashMap<String, SimCard>,
    payments: HashMap<Uuid, PaymentRecord>,
    requests: VecDeque<RequestRecord>,
}

#[derive(Debug, Default)]
struct Counters {
    in_flight: u64,
    peak_in_flight: u64,
    per_call: HashMap<CallKind, u64>,
    peak_per_call: HashMap<CallKind, u64>,
    calls_total: HashMap<CallKind, u64>,
}

#[derive(Debug)]
struct Inner {
    state: Mutex<SimState>,
    counters: Mutex<Counters>,
    /// Becomes `true` when the server shuts down, cutting every sleep short.
    stopping: watch::Sender<bool>,
}

/// The simulator: shared state plus the axum app. Clones share the same state.
#[derive(Debug, Clone)]
pub struct Simulator {
    inner: Arc<Inner>,
}

/// A running simulator server started by [`Simulator::spawn_on`]. Dropping it does **not** stop
/// the server (it stops with its runtime); call [`SimHandle::shutdown`] for that.
#[derive(Debug)]
pub struct SimHandle {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    join: JoinHandle<anyhow::Result<()>>,
}

impl SimHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, for [`crate::gateway::GatewayClient::new`].
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, cuts pending sleeps short and waits for the server to finish.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            // The server may already have stopped; then there is nobody to tell.
            let _ = stop.send(());
        }
        self.join.await.context("gateway simulator task panicked")?
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts one call in flight from creation to drop.
struct InFlight {
    inner: Arc<Inner>,
    call: CallKind,
}

impl InFlight {
    fn enter(inner: &Arc<Inner>, call: CallKind) -> Self {
        let mut c = lock(&inner.counters);
        c.in_flight += 1;
        c.peak_in_flight = c.peak_in_flight.max(c.in_flight);
        let now = {
            let n = c.per_call.entry(call).or_insert(0);
            *n += 1;
            *n
        };
        let peak = c.peak_per_call.entry(call).or_insert(0);
        *peak = (*peak).max(now);
        *c.calls_total.entry(call).or_insert(0) += 1;
        drop(c);
        Self {
            inner: Arc::clone(inner),
            call,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut c = lock(&self.inner.counters);
        c.in_flight = c.in_flight.saturating_sub(1);
        if let Some(n) = c.per_call.get_mut(&self.call) {
            *n = n.saturating_sub(1);
        }
    }
}

impl Default for Simulator {
    fn default() -> Self {
        Self::new(SimConfig::default())
    }
}

impl Simulator {
    pub fn new(config: SimConfig) -> Self {
        let (stopping, _) = watch::channel(false);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(SimState {
                    config,
                    ..SimState::default()
                }),
                counters: Mutex::new(Counters::default()),
                stopping,
            }),
        }
    }

    /// The axum app (Gateway routes, `/healthz` and the `/sim` control API).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/v1/cards/{card_ref}/data", get(h_card_data))
            .route("/v1/cards/{card_ref}/status", get(h_card_status))
            .route("/v1/payments", post(h_payment_submit))
            .route("/v1/payments/{payment_id}", get(h_payment_query))
            .route("/sim/stats", get(h_stats))
            .route("/sim/stats/reset-peaks", post(h_reset_peaks))
            .route("/sim/config", get(h_get_config).post(h_patch_config))
            .route("/sim/cards/{card_ref}", get(h_get_card).post(h_patch_card))
            .route(
                "/sim/payments/{payment_id}",
                get(h_get_payment).post(h_patch_payment),
            )
            .route("/sim/requests", get(h_requests))
            .with_state(self.clone())
    }

    /// Serves on `listener` until `shutdown` completes, then lets in-flight requests finish
    /// (every simulated sleep is cut short).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let addr = listener
            .local_addr()
            .context("reading the listener address")?;
        tracing::info!(%addr, "gateway simulator listening");
        let inner = Arc::clone(&self.inner);
        let app = self.router();
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown.await;
                inner.stopping.send_replace(true);
            })
            .await
            .with_context(|| format!("gateway simulator on {addr}"))
    }

    /// Binds `addr` (port 0 picks a free port) and serves in a spawned task with the default
    /// config.
    pub async fn spawn_on(addr: &str) -> anyhow::Result<(SocketAddr, Simulator, SimHandle)> {
        Self::spawn_with(addr, SimConfig::default()).await
    }

    /// Like [`Simulator::spawn_on`] with an explicit config.
    pub async fn spawn_with(
        addr: &str,
        config: SimConfig,
    ) -> anyhow::Result<(SocketAddr, Simulator, SimHandle)> {
        config.validate()?;
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the gateway simulator to {addr}"))?;
        let local = listener
            .local_addr()
            .context("reading the listener address")?;
        let sim = Simulator::new(config);
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            if stopped.await.is_err() {
                // The handle was dropped without shutdown(): keep serving.
                std::future::pending::<()>().await;
            }
        };
        let join = tokio::spawn(sim.clone().serve(listener, shutdown));
        Ok((
            local,
            sim,
            SimHandle {
                addr: local,
                stop: Some(stop),
                join,
            },
        ))
    }

    // ----- config -----

    pub fn config(&self) -> SimConfig {
        lock(&self.inner.state).config.clone()
    }

    /// Applies a partial update and returns the new config; refuses rates outside 0..=1.
    pub fn update_config(&self, patch: &SimConfigPatch) -> anyhow::Result<SimConfig> {
        let mut st = lock(&self.inner.state);
        let next = patch.apply(&st.config);
        next.validate()?;
        st.config = next.clone();
        Ok(next)
    }

    pub fn set_latency(&self, latency_ms: u64, jitter_ms: u64) {
        let mut st = lock(&self.inner.state);
        st.config.latency_ms = latency_ms;
        st.config.latency_jitter_ms = jitter_ms;
    }

    /// Sets the 503 rate (clamped to 0..=1).
    pub fn set_error_rate(&self, rate: f64) {
        lock(&self.inner.state).config.error_rate = clamp01(rate);
    }

    /// Sets the bad-body rate (clamped to 0..=1).
    pub fn set_garbage_rate(&self, rate: f64) {
        lock(&self.inner.state).config.garbage_rate = clamp01(rate);
    }

    /// Sets the card change rate (clamped to 0..=1).
    pub fn set_change_rate(&self, rate: f64) {
        lock(&self.inner.state).config.change_rate = clamp01(rate);
    }

    pub fn set_payment_mode(&self, mode: PaymentBehaviour) {
        lock(&self.inner.state).config.payment_mode = mode;
    }

    // ----- cards -----

    /// The card as stored, without creating it.
    pub fn card(&self, card_ref: &str) -> Option<SimCard> {
        lock(&self.inner.state).cards.get(card_ref).cloned()
    }

    fn with_card(&self, card_ref: &str, f: impl FnOnce(&mut SimCard)) {
        let mut st = lock(&self.inner.state);
        f(st.cards.entry(card_ref.to_owned()).or_default());
    }

    /// Applies a partial update to a card, creating it when needed.
    pub fn patch_card(&self, card_ref: &str, patch: &SimCardPatch) -> SimCard {
        let mut st = lock(&self.inner.state);
        let card = st.cards.entry(card_ref.to_owned()).or_default();
        if let Some(d) = &patch.data {
            card.data = d.clone();
        }
        if let Some(s) = patch.status {
            card.status = s;
        }
        if let Some(b) = patch.behaviour {
            card.behaviour = b;
        }
        card.clone()
    }

    pub fn set_card_status(&self, card_ref: &str, status: CardStatus) {
        self.with_card(card_ref, |c| c.status = status);
    }

    pub fn set_card_ready(
        &self,
        card_ref: &str,
        card_token: &str,
        pan_last4: &str,
        expiry_month: u32,
        expiry_year: u32,
    ) {
        let data = CardData::Ready {
            card_token: card_token.to_owned(),
            pan_last4: pan_last4.to_owned(),
            expiry_month,
            expiry_year,
        };
        self.with_card(card_ref, |c| c.data = data);
    }

    pub fn set_card_pending(&self, card_ref: &str) {
        self.with_card(card_ref, |c| c.data = CardData::Pending);
    }

    pub fn set_card_behaviour(&self, card_ref: &str, behaviour: CardBehaviour) {
        self.with_card(card_ref, |c| c.behaviour = behaviour);
    }

    /// Every call about this card answers 503.
    pub fn fail_card(&self, card_ref: &str) {
        self.set_card_behaviour(card_ref, CardBehaviour::Fail);
    }

    /// Every call about this card answers 200 with a body that is not JSON.
    pub fn garbage_card(&self, card_ref: &str) {
        self.set_card_behaviour(card_ref, CardBehaviour::Garbage(GarbageKind::NotJson));
    }

    /// Back to the global rates for this card.
    pub fn heal_card(&self, card_ref: &str) {
        self.set_card_behaviour(card_ref, CardBehaviour::Normal);
    }

    // ----- payments -----

    pub fn set_payment_behaviour(&self, payment_id: Uuid, behaviour: PaymentBehaviour) {
        lock(&self.inner.state)
            .payments
            .entry(payment_id)
            .or_default()
            .behaviour = Some(behaviour);
    }

    /// Makes `GET /v1/payments/{id}` answer 404 from now on.
    pub fn forget_payment(&self, payment_id: Uuid) {
        if let Some(p) = lock(&self.inner.state).payments.get_mut(&payment_id) {
            p.stored = None;
        }
    }

    /// Stores a result as if the payment had been submitted earlier.
    pub fn store_payment(&self, result: PaymentResult) {
        let id = result.payment_id;
        lock(&self.inner.state)
            .payments
            .entry(id)
            .or_default()
            .stored = Some(result);
    }

    pub fn payment_record(&self, payment_id: Uuid) -> Option<PaymentRecord> {
        lock(&self.inner.state).payments.get(&payment_id).cloned()
    }

    /// How many times this payment was submitted.
    pub fn submissions(&self, payment_id: Uuid) -> u64 {
        self.payment_record(payment_id).map_or(0, |p| p.submissions)
    }

    // ----- observation -----

    /// The last [`REQUEST_LOG_CAPACITY`] requests, oldest first.
    pub fn recent_requests(&self) -> Vec<RequestRecord> {
        lock(&self.inner.state).requests.iter().cloned().collect()
    }

    /// The correlation ids of the recent requests, oldest first (`None` when absent).
    pub fn correlation_ids(&self) -> Vec<Option<String>> {
        lock(&self.inner.state)
            .requests
            .iter()
            .map(|r| r.correlation_id.clone())
            .collect()
    }

    pub fn stats(&self) -> SimStats {
        let c = lock(&self.inner.counters);
        let named = |m: &HashMap<CallKind, u64>| {
            m.iter()
                .map(|(k, v)| (k.as_str().to_owned(), *v))
                .collect::<HashMap<_, _>>()
        };
        SimStats {
            in_flight: c.in_flight,
            peak_in_flight: c.peak_in_flight,
            in_flight_per_call: named(&c.per_call),
            peak_per_call: named(&c.peak_per_call),
            calls_total: named(&c.calls_total),
        }
    }

    /// Sets every peak to the current in-flight count.
    pub fn reset_peaks(&self) {
        let mut c = lock(&self.inner.counters);
        c.peak_in_flight = c.in_flight;
        let current = c.per_call.clone();
        c.peak_per_call = current;
    }

    // ----- internals -----

    fn record(&self, call: CallKind, path: String, headers: &HeaderMap) {
        let h = |name: &str| {
            headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        let rec = RequestRecord {
            call,
            path,
            correlation_id: h(CORRELATION_HEADER),
            accept: h(header::ACCEPT.as_str()),
            idempotency_key: h(IDEMPOTENCY_HEADER),
        };
        let mut st = lock(&self.inner.state);
        if st.requests.len() >= REQUEST_LOG_CAPACITY {
            st.requests.pop_front();
        }
        st.requests.push_back(rec);
    }

    /// Sleeps `ms`, or less when the server stops.
    async fn sleep(&self, ms: u64) {
        if ms == 0 {
            return;
        }
        let mut stopping = self.inner.stopping.subscribe();
        if *stopping.borrow() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(ms)) => {}
            _ = stopping.changed() => {}
        }
    }

    /// Latency, then the global error / garbage dice. `None` means answer normally.
    async fn prelude(&self) -> Option<Disturbance> {
        let (delay, error, garbage) = {
            let cfg = self.config();
            let mut rng = rand::rng();
            let jitter = if cfg.latency_jitter_ms > 0 {
                rng.random_range(0..=cfg.latency_jitter_ms)
            } else {
                0
            };
            let error = rng.random::<f64>() < cfg.error_rate;
            let garbage = if rng.random::<f64>() < cfg.garbage_rate {
                Some(GarbageKind::ALL[rng.random_range(0..GarbageKind::ALL.len())])
            } else {
                None
            };
            (cfg.latency_ms.saturating_add(jitter), error, garbage)
        };
        self.sleep(delay).await;
        if error {
            Some(Disturbance::Error)
        } else {
            garbage.map(Disturbance::Garbage)
        }
    }
}

enum Disturbance {
    Error,
    Garbage(GarbageKind),
}

fn clamp01(v: f64) -> f64 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(0.0, 1.0)
    }
}

fn unavailable() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"error": "simulated outage"})),
    )
        .into_response()
}

fn not_json() -> Response {
    let mut r = (StatusCode::OK, "<html><body>upstream hiccup</body></html>").into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r
}

fn random_token() -> String {
    let s: String = rand::rng()
        .sample_iter(&Alphanumeric)
        .take(16)
        .map(char::from)
        .collect();
    format!("tok_{s}")
}

/// Maybe changes the card (with probability `change_rate`) as a read of `call` is served.
fn maybe_change(card: &mut SimCard, call: CallKind, change_rate: f64) {
    let mut rng = rand::rng();
    if rng.random::<f64>() >= change_rate {
        return;
    }
    match call {
        CallKind::Carddata => {
            if card.data == CardData::Pending {
                card.data = CardData::Ready {
                    card_token: random_token(),
                    pan_last4: format!("{:04}", rng.random_range(0..10_000u32)),
                    expiry_month: rng.random_range(1..=12),
                    expiry_year: rng.random_range(2028..=2033),
                };
            }
        }
        _ => {
            card.status = match card.status {
                CardStatus::Inactive | CardStatus::Frozen => CardStatus::Active,
                CardStatus::Active if rng.random::<f64>() < 0.02 => CardStatus::Cancelled,
                CardStatus::Active => CardStatus::Frozen,
                final_status => final_status,
            };
        }
    }
}

/// Serves one card read: in-flight accounting, request log, latency, behaviour, change.
async fn card_read(
    sim: Simulator,
    call: CallKind,
    card_ref: String,
    headers: HeaderMap,
) -> Response {
    let _guard = InFlight::enter(&sim.inner, call);
    let suffix = if call == CallKind::Carddata {
        "data"
    } else {
        "status"
    };
    sim.record(call, format!("/v1/cards/{card_ref}/{suffix}"), &headers);
    let disturbance = sim.prelude().await;
    let card = {
        let mut st = lock(&sim.inner.state);
        let change_rate = st.config.change_rate;
        let card = st.cards.entry(card_ref.clone()).or_default();
        if card.behaviour == CardBehaviour::Normal && disturbance.is_none() {
            maybe_change(card, call, change_rate);
        }
        card.clone()
    };
    let garbage = match (card.behaviour, disturbance) {
        (CardBehaviour::Fail, _) | (_, Some(Disturbance::Error)) => return unavailable(),
        (CardBehaviour::Garbage(k), _) | (_, Some(Disturbance::Garbage(k))) => Some(k),
        (CardBehaviour::Normal, None) => None,
    };
    let field = if call == CallKind::Carddata {
        "state"
    } else {
        "status"
    };
    let body = match garbage {
        Some(GarbageKind::NotJson) => return not_json(),
        Some(GarbageKind::MissingField) => json!({ "card_ref": card_ref }),
        Some(GarbageKind::BadValue) => json!({ "card_ref": card_ref, field: "weird" }),
        Some(GarbageKind::OtherRef) => card_body(&format!("{card_ref}-other"), call, &card),
        None => card_body(&card_ref, call, &card),
    };
    (StatusCode::OK, Json(body)).into_response()
}

fn card_body(card_ref: &str, call: CallKind, card: &SimCard) -> serde_json::Value {
    if call == CallKind::Carddata {
        match &card.data {
            CardData::Pending => json!({"card_ref": card_ref, "state": "pending"}),
            CardData::Ready {
                card_token,
                pan_last4,
                expiry_month,
                expiry_year,
            } => json!({
                "card_ref": card_ref,
                "state": "ready",
                "card_token": card_token,
                "pan_last4": pan_last4,
                "expiry_month": expiry_month,
                "expiry_year": expiry_year,
            }),
        }
    } else {
        json!({"card_ref": card_ref, "status": card.status.as_str()})
    }
}

async fn h_card_data(
    State(sim): State<Simulator>,
    Path(card_ref): Path<String>,
    headers: HeaderMap,
) -> Response {
    card_read(sim, CallKind::Carddata, card_ref, headers).await
}

async fn h_card_status(
    State(sim): State<Simulator>,
    Path(card_ref): Path<String>,
    headers: HeaderMap,
) -> Response {
    card_read(sim, CallKind::CardStatus, card_ref, headers).await
}

fn payment_garbage(kind: GarbageKind, payment_id: Uuid) -> Response {
    let body = match kind {
        GarbageKind::NotJson => return not_json(),
        GarbageKind::MissingField => json!({ "payment_id": payment_id }),
        GarbageKind::BadValue => {
            json!({ "payment_id": payment_id, "status": "weird", "channel_ref": "ch_x" })
        }
        GarbageKind::OtherRef => {
            json!({ "payment_id": Uuid::new_v4(), "status": "accepted", "channel_ref": "ch_x" })
        }
    };
    (StatusCode::OK, Json(body)).into_response()
}

async fn h_payment_submit(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = CallKind::PaymentSubmit;
    let _guard = InFlight::enter(&sim.inner, call);
    sim.record(call, "/v1/payments".to_owned(), &headers);
    let req: PaymentRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("bad payment request: {e}")})),
            )
                .into_response()
        }
    };
    let key = headers
        .get(IDEMPOTENCY_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    // Record the submission before any simulated trouble: the Gateway did receive it.
    let behaviour = {
        let mut st = lock(&sim.inner.state);
        let mode = st.config.payment_mode;
        let rec = st.payments.entry(req.payment_id).or_default();
        rec.submissions += 1;
        rec.idempotency_keys.push(key.clone().unwrap_or_default());
        rec.behaviour.unwrap_or(mode)
    };
    let disturbance = sim.prelude().await;
    if key.as_deref() != Some(req.payment_id.to_string().as_str()) {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "Idempotency-Key must equal payment_id"})),
        )
            .into_response();
    }
    match disturbance {
        Some(Disturbance::Error) => return unavailable(),
        Some(Disturbance::Garbage(k)) => return payment_garbage(k, req.payment_id),
        None => {}
    }
    if behaviour == PaymentBehaviour::ServerError {
        return unavailable();
    }
    let (result, hang) = {
        let mut st = lock(&sim.inner.state);
        let hang_ms = st.config.hang_ms;
        let rec = st.payments.entry(req.payment_id).or_default();
        let fresh = |status| PaymentResult {
            payment_id: req.payment_id,
            status,
            channel_ref: format!("ch_{}", req.payment_id.simple()),
        };
        match (&rec.stored, behaviour) {
            // Idempotent: a payment already decided is answered as decided.
            (Some(stored), b) => (
                stored.clone(),
                (b == PaymentBehaviour::Hang).then_some(hang_ms),
            ),
            (None, PaymentBehaviour::Forget) => (fresh(PaymentStatus::Accepted), None),
            (None, b) => {
                let status = if b == PaymentBehaviour::Reject {
                    PaymentStatus::Rejected
                } else {
                    PaymentStatus::Accepted
                };
                let r = fresh(status);
                rec.stored = Some(r.clone());
                (r, (b == PaymentBehaviour::Hang).then_some(hang_ms))
            }
        }
    };
    if let Some(ms) = hang {
        sim.sleep(ms).await;
    }
    (StatusCode::OK, Json(result)).into_response()
}

async fn h_payment_query(
    State(sim): State<Simulator>,
    Path(payment_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let call = CallKind::PaymentQuery;
    let _guard = InFlight::enter(&sim.inner, call);
    sim.record(call, format!("/v1/payments/{payment_id}"), &headers);
    let disturbance = sim.prelude().await;
    let Ok(id) = Uuid::parse_str(&payment_id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    match disturbance {
        Some(Disturbance::Error) => return unavailable(),
        Some(Disturbance::Garbage(k)) => return payment_garbage(k, id),
        None => {}
    }
    let stored = sim.payment_record(id).and_then(|p| p.stored);
    match stored {
        Some(r) => (StatusCode::OK, Json(r)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "unknown payment"})),
        )
            .into_response(),
    }
}

async fn h_stats(State(sim): State<Simulator>) -> Json<SimStats> {
    Json(sim.stats())
}

async fn h_reset_peaks(State(sim): State<Simulator>) -> Json<SimStats> {
    sim.reset_peaks();
    Json(sim.stats())
}

async fn h_get_config(State(sim): State<Simulator>) -> Json<SimConfig> {
    Json(sim.config())
}

fn bad_request(msg: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": msg }))).into_response()
}

async fn h_patch_config(State(sim): State<Simulator>, body: Bytes) -> Response {
    let patch: SimConfigPatch = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => return bad_request(format!("bad config patch: {e}")),
    };
    match sim.update_config(&patch) {
        Ok(c) => Json(c).into_response(),
        Err(e) => bad_request(format!("{e:#}")),
    }
}

async fn h_get_card(State(sim): State<Simulator>, Path(card_ref): Path<String>) -> Response {
    match sim.card(&card_ref) {
        Some(c) => Json(c).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn h_patch_card(
    State(sim): State<Simulator>,
    Path(card_ref): Path<String>,
    body: Bytes,
) -> Response {
    match serde_json::from_slice::<SimCardPatch>(&body) {
        Ok(p) => Json(sim.patch_card(&card_ref, &p)).into_response(),
        Err(e) => bad_request(format!("bad card patch: {e}")),
    }
}

async fn h_get_payment(State(sim): State<Simulator>, Path(payment_id): Path<Uuid>) -> Response {
    match sim.payment_record(payment_id) {
        Some(p) => Json(p).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PaymentPatch {
    behaviour: PaymentBehaviour,
}

async fn h_patch_payment(
    State(sim): State<Simulator>,
    Path(payment_id): Path<Uuid>,
    body: Bytes,
) -> Response {
    match serde_json::from_slice::<PaymentPatch>(&body) {
        Ok(p) => {
            sim.set_payment_behaviour(payment_id, p.behaviour);
            Json(sim.payment_record(payment_id).unwrap_or_default()).into_response()
        }
        Err(e) => bad_request(format!("bad payment patch: {e}")),
    }
}

async fn h_requests(State(sim): State<Simulator>) -> Json<Vec<RequestRecord>> {
    Json(sim.recent_requests())
}
