//! The simulator's HTTP routes: the Gateway contract (`/v1/…`), `/healthz` and the `/sim`
//! control API, each handler a thin shell over the state's decisions and [`super::answer`].

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

#[cfg(test)]
mod tests {
    //! A few behaviours over a real socket (port 0), with `reqwest` as the caller.

    use reqwest::Client;
    use serde_json::Value;

    use super::*;
    use crate::SimHandle;
    use cardworker_wire::{PaymentResult, PaymentStatus, CORRELATION_HEADER};

    async fn start() -> (Simulator, SimHandle, Client) {
        let config = SimConfig {
            latency_ms: 0,
            ..SimConfig::default()
        };
        let (_, sim, handle) = Simulator::spawn_with("127.0.0.1:0", config).await.unwrap();
        (sim, handle, Client::new())
    }

    fn payment(payment_id: Uuid) -> Value {
        json!({"payment_id": payment_id, "card_ref": "c-1", "amount_minor": 1234, "currency": "CNY"})
    }

    async fn submit(c: &Client, h: &SimHandle, id: Uuid, key: &str) -> reqwest::Response {
        c.post(format!("{}/v1/payments", h.base_url()))
            .header(IDEMPOTENCY_HEADER, key)
            .json(&payment(id))
            .send()
            .await
            .unwrap()
    }

    /// GET `url` and read its JSON body as `T`.
    async fn get_json<T: serde::de::DeserializeOwned>(c: &Client, url: String) -> T {
        c.get(url).send().await.unwrap().json().await.unwrap()
    }

    async fn status(c: &Client, url: String) -> u16 {
        c.get(url).send().await.unwrap().status().as_u16()
    }

    #[tokio::test]
    async fn error_rate_one_answers_503_on_every_gateway_route_and_health_stays_200() {
        let (sim, h, c) = start().await;
        sim.set_error_rate(1.0);
        let base = h.base_url();
        for _ in 0..5 {
            assert_eq!(status(&c, format!("{base}/v1/cards/c-1/data")).await, 503);
            assert_eq!(status(&c, format!("{base}/v1/cards/c-1/status")).await, 503);
            let id = Uuid::new_v4();
            assert_eq!(submit(&c, &h, id, &id.to_string()).await.status(), 503);
            assert_eq!(status(&c, format!("{base}/v1/payments/{id}")).await, 503);
        }
        assert_eq!(status(&c, format!("{base}/healthz")).await, 200);
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn stats_count_each_injected_error_and_garbage_answer_against_its_call_kind() {
        let (sim, h, c) = start().await;
        let base = h.base_url();
        sim.set_error_rate(1.0);
        for _ in 0..3 {
            status(&c, format!("{base}/v1/cards/c-1/data")).await;
        }
        let id = Uuid::new_v4();
        submit(&c, &h, id, &id.to_string()).await;
        status(&c, format!("{base}/v1/payments/{id}")).await;
        sim.set_error_rate(0.0);
        sim.garbage_card("c-2");
        sim.fail_card("c-3");
        for _ in 0..2 {
            assert_eq!(status(&c, format!("{base}/v1/cards/c-2/status")).await, 200);
        }
        assert_eq!(status(&c, format!("{base}/v1/cards/c-3/status")).await, 503);
        let other = Uuid::new_v4();
        sim.set_payment_behaviour(other, PaymentBehaviour::ServerError);
        submit(&c, &h, other, &other.to_string()).await;
        // A healthy call counts as a call, never as trouble.
        assert_eq!(status(&c, format!("{base}/v1/cards/c-4/status")).await, 200);

        let stats: SimStats = get_json(&c, format!("{base}/sim/stats")).await;
        let n = |m: &std::collections::HashMap<String, u64>, k: &str| m.get(k).copied();
        assert_eq!(n(&stats.injected_errors_total, "carddata"), Some(3));
        assert_eq!(n(&stats.injected_errors_total, "card_status"), Some(1));
        assert_eq!(n(&stats.injected_errors_total, "payment_submit"), Some(2));
        assert_eq!(n(&stats.injected_errors_total, "payment_query"), Some(1));
        assert_eq!(n(&stats.garbage_answers_total, "card_status"), Some(2));
        assert_eq!(n(&stats.garbage_answers_total, "carddata"), None);
        assert_eq!(n(&stats.calls_total, "card_status"), Some(4));
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_card_read_answers_the_contract_body_and_logs_the_correlation_id() {
        let (sim, h, c) = start().await;
        sim.set_card_ready("c-1", "tok_abc", "4242", 12, 2030);
        let body: Value = c
            .get(format!("{}/v1/cards/c-1/data", h.base_url()))
            .header(CORRELATION_HEADER, "corr-7")
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            body,
            json!({"card_ref": "c-1", "state": "ready", "card_token": "tok_abc",
                   "pan_last4": "4242", "expiry_month": 12, "expiry_year": 2030})
        );
        let log = sim.recent_requests();
        assert_eq!(log.last().unwrap().path, "/v1/cards/c-1/data");
        assert_eq!(sim.correlation_ids(), vec![Some("corr-7".to_owned())]);
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_garbage_card_answers_200_with_a_body_that_is_not_json() {
        let (sim, h, c) = start().await;
        sim.garbage_card("c-1");
        let r = c
            .get(format!("{}/v1/cards/c-1/status", h.base_url()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let text = r.text().await.unwrap();
        assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn the_same_payment_posted_twice_is_one_record_with_two_submissions_and_one_answer() {
        let (sim, h, c) = start().await;
        let id = Uuid::new_v4();
        let first: PaymentResult = submit(&c, &h, id, &id.to_string())
            .await
            .json()
            .await
            .unwrap();
        let second: PaymentResult = submit(&c, &h, id, &id.to_string())
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(first, second);
        assert_eq!(first.status, PaymentStatus::Accepted);
        let rec = sim.payment_record(id).unwrap();
        assert_eq!(rec.submissions, 2);
        assert_eq!(rec.stored, Some(first.clone()));
        let queried: PaymentResult =
            get_json(&c, format!("{}/v1/payments/{id}", h.base_url())).await;
        assert_eq!(queried, first);
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn forget_over_http_answers_accepted_but_a_later_query_is_404() {
        let (sim, h, c) = start().await;
        let id = Uuid::new_v4();
        let patched = c
            .post(format!("{}/sim/payments/{id}", h.base_url()))
            .json(&json!({"behaviour": "forget"}))
            .send()
            .await
            .unwrap();
        assert_eq!(patched.status().as_u16(), 200);
        let answer: PaymentResult = submit(&c, &h, id, &id.to_string())
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(answer.status, PaymentStatus::Accepted);
        assert_eq!(
            status(&c, format!("{}/v1/payments/{id}", h.base_url())).await,
            404
        );
        assert_eq!(sim.submissions(id), 1);
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_submission_whose_idempotency_key_is_not_the_payment_id_is_refused_but_counted() {
        let (sim, h, c) = start().await;
        let id = Uuid::new_v4();
        assert_eq!(submit(&c, &h, id, "other").await.status().as_u16(), 422);
        let rec = sim.payment_record(id).unwrap();
        assert_eq!(rec.submissions, 1);
        assert_eq!(rec.idempotency_keys, vec!["other".to_owned()]);
        assert_eq!(rec.stored, None);
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_config_patch_with_an_out_of_range_rate_is_answered_400_and_changes_nothing() {
        let (sim, h, c) = start().await;
        let before = sim.config();
        let url = format!("{}/sim/config", h.base_url());
        let r = c
            .post(&url)
            .json(&json!({"error_rate": 1.5, "latency_ms": 9}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400);
        assert_eq!(sim.config(), before);
        let ok: SimConfig = c
            .post(&url)
            .json(&json!({"error_rate": 0.5}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(ok.error_rate, 0.5);
        assert_eq!(sim.config(), ok);
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn stats_over_http_show_the_peak_of_calls_held_in_flight() {
        let (sim, h, c) = start().await;
        sim.set_latency(500, 0);
        let base = h.base_url();
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let (c, url) = (c.clone(), format!("{base}/v1/cards/c-{i}/status"));
                tokio::spawn(async move { c.get(url).send().await.map(|r| r.status()) })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().as_u16(), 200);
        }
        let stats: SimStats = get_json(&c, format!("{base}/sim/stats")).await;
        assert_eq!(stats.in_flight, 0);
        assert_eq!(stats.peak_in_flight, 3);
        assert_eq!(stats.peak_per_call.get("card_status"), Some(&3));
        assert_eq!(stats, sim.stats());
        let reset: SimStats = c
            .post(format!("{base}/sim/stats/reset-peaks"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(reset.peak_in_flight, 0);
        h.shutdown().await.unwrap();
    }
}
