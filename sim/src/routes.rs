//! The simulator's HTTP routes: the Gateway contract (`/v1/…`), `/healthz` and the `/sim`
//! control API, each handler a thin shell over the state's decisions and [`super::answer`]
//! (the approval handlers are `approval_routes.rs`). `tests/routes.rs` drives them over a socket.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use super::answer::{card_answer, card_disturbance, payment_garbage, Disturbance};
use super::approval_routes;
use super::config::{PaymentBehaviour, SimConfig, SimConfigPatch};
use super::reply::{bad_request, conflict, render, unavailable};
use super::simulator::{header_value, InFlight, Simulator};
use super::state::{RequestRecord, SimCardPatch};
use super::stats::SimStats;
use cardworker_wire::{CallKind, PaymentRequest, IDEMPOTENCY_HEADER};

impl Simulator {
    /// The axum app (Gateway routes, `/healthz` and the `/sim` control API).
    pub fn router(&self) -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route("/v1/cards/{card_ref}/data", get(h_card_data))
            .route("/v1/cards/{card_ref}/status", get(h_card_status))
            .route("/v1/payments", post(h_payment_submit))
            .route("/v1/payments/{payment_id}", get(h_payment_query))
            .route("/v1/approvals", post(approval_routes::h_submit))
            .route("/v1/approvals/{approval_id}", get(approval_routes::h_query))
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
}

/// Serves one card read: in-flight accounting, request log, latency, behaviour, change. The read
/// runs on a task of its own, as a real Gateway goes on with a request whose client hung up: it
/// counts in flight from its arrival to its answer, whether or not the caller still waits.
async fn card_read(
    sim: Simulator,
    call: CallKind,
    card_ref: String,
    headers: HeaderMap,
) -> Response {
    let guard = sim.in_flight_card(call, &card_ref);
    match tokio::spawn(card_read_to_the_end(sim, call, card_ref, headers, guard)).await {
        Ok(response) => response,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn card_read_to_the_end(
    sim: Simulator,
    call: CallKind,
    card_ref: String,
    headers: HeaderMap,
    _guard: InFlight,
) -> Response {
    let suffix = if call == CallKind::Carddata {
        "data"
    } else {
        "status"
    };
    sim.record(call, format!("/v1/cards/{card_ref}/{suffix}"), &headers);
    let disturbance = sim.prelude_with(sim.card_latency(&card_ref)).await;
    let card =
        sim.with_state(|st| st.read_card(&card_ref, call, disturbance.is_some(), &mut rand::rng()));
    sim.count_disturbance(call, card_disturbance(card.behaviour, disturbance));
    render(card_answer(&card_ref, call, &card, disturbance))
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

async fn h_payment_submit(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = CallKind::PaymentSubmit;
    let _guard = sim.in_flight(call);
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
    let key = header_value(&headers, IDEMPOTENCY_HEADER);
    // Record the submission before any simulated trouble: the Gateway did receive it.
    let behaviour = sim.with_state(|st| st.record_submission(req.payment_id, key.as_deref()));
    let Some(_post) = sim.begin_post(key.as_deref().unwrap_or_default()) else {
        return conflict();
    };
    let disturbance = sim.prelude().await;
    if key.as_deref() != Some(req.payment_id.to_string().as_str()) {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "Idempotency-Key must equal payment_id"})),
        )
            .into_response();
    }
    let disturbance =
        disturbance.or((behaviour == PaymentBehaviour::ServerError).then_some(Disturbance::Error));
    sim.count_disturbance(call, disturbance);
    match disturbance {
        Some(Disturbance::Error) => return unavailable(),
        Some(Disturbance::Garbage(k)) => return render(payment_garbage(k, req.payment_id)),
        None => {}
    }
    let config = sim.config();
    sim.sleep(config.post_act_delay_ms).await;
    let (result, hang) = sim.with_state(|st| st.decide_payment(&req, behaviour));
    sim.sleep(hang.unwrap_or(0).max(config.post_answer_delay_ms))
        .await;
    (StatusCode::OK, Json(result)).into_response()
}

async fn h_payment_query(
    State(sim): State<Simulator>,
    Path(payment_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let call = CallKind::PaymentQuery;
    let _guard = sim.in_flight(call);
    sim.record(call, format!("/v1/payments/{payment_id}"), &headers);
    let disturbance = sim.prelude().await;
    let Ok(id) = Uuid::parse_str(&payment_id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    sim.count_disturbance(call, disturbance);
    match disturbance {
        Some(Disturbance::Error) => return unavailable(),
        Some(Disturbance::Garbage(k)) => return render(payment_garbage(k, id)),
        None => {}
    }
    match sim.with_state(|st| st.stored_payment(id)) {
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
