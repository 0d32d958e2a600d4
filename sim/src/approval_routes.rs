//! The approval routes (spec section 7): `POST /v1/approvals` and
//! `GET /v1/approvals/{approval_id}`, thin shells over the approval book (`approvals.rs`).
//!
//! Every POST is counted with its `Idempotency-Key`, before any simulated trouble (the Gateway
//! did receive it); the global latency, error and garbage dice apply as to every call.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cardworker_wire::{ApprovalRequest, CallKind, IDEMPOTENCY_HEADER};
use serde_json::json;
use uuid::Uuid;

use super::answer::{Answer, Disturbance};
use super::approvals::{query, submit, ApprovalDice};
use super::reply::{conflict, render};
use super::simulator::{header_value, Simulator};

pub(crate) async fn h_submit(
    State(sim): State<Simulator>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let call = CallKind::ApprovalSubmit;
    let _guard = sim.in_flight(call);
    sim.record(call, "/v1/approvals".to_owned(), &headers);
    let req: ApprovalRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("bad approval request: {e}")})),
            )
                .into_response()
        }
    };
    let key = header_value(&headers, IDEMPOTENCY_HEADER);
    // Counted before any simulated trouble or conflict: the Gateway did receive it.
    sim.with_state(|st| {
        st.approvals
            .entry(req.approval_id)
            .or_default()
            .idempotency_keys
            .push(key.clone().unwrap_or_default())
    });
    let Some(_post) = sim.begin_post(key.as_deref().unwrap_or_default()) else {
        return conflict();
    };
    let disturbance = sim.prelude().await;
    if key.as_deref() != Some(req.approval_id.to_string().as_str()) {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "Idempotency-Key must equal approval_id"})),
        )
            .into_response();
    }
    sim.count_disturbance(call, disturbance);
    match disturbance {
        Some(Disturbance::Error) => return render(Answer::Unavailable),
        Some(Disturbance::Garbage(_)) => return render(Answer::NotJson),
        None => {}
    }
    let config = sim.config();
    sim.sleep(config.post_act_delay_ms).await;
    let dice = ApprovalDice {
        in_review_rate: config.approval_in_review_rate,
        decline_rate: config.approval_decline_rate,
        review_ms: config.approval_review_ms,
    };
    let result = sim.with_state(|st| submit(&mut st.approvals, &req, dice, &mut rand::rng()));
    sim.sleep(config.post_answer_delay_ms).await;
    (StatusCode::OK, Json(result)).into_response()
}

pub(crate) async fn h_query(
    State(sim): State<Simulator>,
    Path(approval_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let call = CallKind::ApprovalQuery;
    let _guard = sim.in_flight(call);
    sim.record(call, format!("/v1/approvals/{approval_id}"), &headers);
    let disturbance = sim.prelude().await;
    let Ok(id) = Uuid::parse_str(&approval_id) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    sim.count_disturbance(call, disturbance);
    match disturbance {
        Some(Disturbance::Error) => return render(Answer::Unavailable),
        Some(Disturbance::Garbage(_)) => return render(Answer::NotJson),
        None => {}
    }
    match sim.with_state(|st| query(&mut st.approvals, id)) {
        Some(r) => (StatusCode::OK, Json(r)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "unknown approval"})),
        )
            .into_response(),
    }
}
