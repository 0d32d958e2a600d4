//! The Gateway client against the real simulator: one test per classification of spec section 1.

use std::time::Duration;

use cardworker::gateway::{
    CallResult, CardData, CardStatus, GatewayClient, Outcome, PaymentQuery, PaymentRequest,
    PaymentResult, PaymentStatus,
};
use cardworker::sim::{CardBehaviour, GarbageKind, PaymentBehaviour, SimHandle, Simulator};
use uuid::Uuid;

const PATIENT: Duration = Duration::from_secs(5);
const IMPATIENT: Duration = Duration::from_millis(200);

async fn start() -> (Simulator, SimHandle, GatewayClient) {
    let (_, sim, handle) = Simulator::spawn_on("127.0.0.1:0").await.unwrap();
    sim.set_latency(0, 0);
    let client = GatewayClient::new(&handle.base_url(), PATIENT).unwrap();
    (sim, handle, client)
}

fn payment(card_ref: &str) -> PaymentRequest {
    PaymentRequest {
        payment_id: Uuid::new_v4(),
        card_ref: card_ref.to_owned(),
        amount_minor: 1234,
        currency: "CNY".to_owned(),
    }
}

fn reason<T: std::fmt::Debug>(o: &Outcome<T>) -> String {
    o.failure()
        .unwrap_or_else(|| panic!("expected a failure, got {o:?}"))
        .reason
        .clone()
}

/// [`start`], and a payment of card `c-1` that the simulator answers as `behaviour` says.
async fn paying(
    behaviour: PaymentBehaviour,
) -> (Simulator, SimHandle, GatewayClient, PaymentRequest) {
    let (sim, handle, client) = start().await;
    let req = payment("c-1");
    sim.set_payment_behaviour(req.payment_id, behaviour);
    (sim, handle, client, req)
}

/// A POST of the JSON `body` to `url`: its response.
async fn post_json(
    http: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    http.post(url).json(body).send().await.unwrap()
}

/// The simulator answers card `c-1` with garbage of `kind`.
fn garble(sim: &Simulator, kind: GarbageKind) {
    sim.set_card_behaviour("c-1", CardBehaviour::Garbage(kind));
}

/// Card `c-1`'s data, read once.
async fn data_of_c1(client: &GatewayClient) -> CallResult<CardData> {
    client.card_data("c-1", Uuid::new_v4()).await
}

/// Card `c-1`'s status, read once.
async fn status_of_c1(client: &GatewayClient) -> CallResult<CardStatus> {
    client.card_status("c-1", Uuid::new_v4()).await
}

/// Asserts that `o` is unknown.
fn assert_unknown<T: std::fmt::Debug>(o: &Outcome<T>) {
    assert!(o.is_unknown(), "{o:?}");
}

/// Asserts that `o` is unknown for the reason `why`.
fn unknown_because<T: std::fmt::Debug>(o: &Outcome<T>, why: &str) {
    assert_unknown(o);
    assert_eq!(reason(o), why);
}

#[tokio::test]
async fn a_ready_card_is_a_valid_observation() {
    let (sim, _h, client) = start().await;
    sim.set_card_ready("c-1", "tok_abc", "4242", 12, 2030);
    sim.set_card_status("c-1", CardStatus::Active);

    let data = data_of_c1(&client).await;
    assert_eq!(
        data.outcome,
        Outcome::Valid(CardData::Ready {
            card_token: "tok_abc".into(),
            pan_last4: "4242".into(),
            expiry_month: 12,
            expiry_year: 2030,
        })
    );
    assert_eq!(data.http_status, Some(200));
    assert_eq!(data.request_summary, "GET /v1/cards/c-1/data");
    assert!(
        data.response_summary.contains("tok_abc"),
        "{}",
        data.response_summary
    );

    let status = status_of_c1(&client).await;
    assert_eq!(status.outcome, Outcome::Valid(CardStatus::Active));

    // A card the simulator never heard of is created pending and inactive.
    let fresh = client.card_data("c-new", Uuid::new_v4()).await;
    assert_eq!(fresh.outcome, Outcome::Valid(CardData::Pending));
    let fresh = client.card_status("c-new", Uuid::new_v4()).await;
    assert_eq!(fresh.outcome, Outcome::Valid(CardStatus::Inactive));
}

#[tokio::test]
async fn a_503_on_a_card_call_is_failed() {
    let (sim, _h, client) = start().await;
    sim.fail_card("c-1");

    let data = data_of_c1(&client).await;
    assert!(data.outcome.is_failed(), "{:?}", data.outcome);
    assert_eq!(reason(&data.outcome), "HTTP 503");
    assert_eq!(data.http_status, Some(503));

    let status = status_of_c1(&client).await;
    assert!(status.outcome.is_failed(), "{:?}", status.outcome);
    assert_eq!(reason(&status.outcome), "HTTP 503");
}

#[tokio::test]
async fn a_card_call_timeout_is_failed() {
    let (sim, h, _) = start().await;
    // An answer far later than the timeout: a call that waited for it would take this long.
    const ANSWER_AFTER: Duration = Duration::from_secs(60);
    sim.set_latency(ANSWER_AFTER.as_millis() as u64, 0);
    let client = GatewayClient::new(&h.base_url(), IMPATIENT).unwrap();

    let data = data_of_c1(&client).await;
    assert!(data.outcome.is_failed(), "{:?}", data.outcome);
    assert_eq!(reason(&data.outcome), "timeout after 200 ms");
    assert_eq!(data.http_status, None);
    // The call gave up at its timeout instead of waiting for the answer.
    assert!(
        data.elapsed >= IMPATIENT && data.elapsed < ANSWER_AFTER,
        "{:?}",
        data.elapsed
    );

    let status = status_of_c1(&client).await;
    assert!(status.outcome.is_failed(), "{:?}", status.outcome);
}

#[tokio::test]
async fn connection_refused_is_failed() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let client = GatewayClient::new(&format!("http://127.0.0.1:{port}"), PATIENT).unwrap();

    let data = data_of_c1(&client).await;
    assert!(data.outcome.is_failed(), "{:?}", data.outcome);
    assert_eq!(reason(&data.outcome), "connection refused");

    // Refused before sending: a payment submit is certainly not done, so failed too.
    let submit = client.submit_payment(&payment("c-1"), Uuid::new_v4()).await;
    assert!(submit.outcome.is_failed(), "{:?}", submit.outcome);
    assert_eq!(reason(&submit.outcome), "connection refused");

    let query = client.query_payment(Uuid::new_v4(), Uuid::new_v4()).await;
    assert!(query.outcome.is_failed(), "{:?}", query.outcome);
}

#[tokio::test]
async fn a_body_that_is_not_json_is_unknown() {
    let (sim, _h, client) = start().await;
    sim.garbage_card("c-1");

    let data = data_of_c1(&client).await;
    unknown_because(&data.outcome, "body is not JSON");
    assert_eq!(data.http_status, Some(200));
    assert!(
        data.response_summary.contains("upstream hiccup"),
        "{}",
        data.response_summary
    );

    assert_unknown(&status_of_c1(&client).await.outcome);
}

#[tokio::test]
async fn another_card_ref_is_unknown() {
    let (sim, _h, client) = start().await;
    garble(&sim, GarbageKind::OtherRef);

    let mismatch = "card_ref mismatch: asked c-1, got c-1-other";
    unknown_because(&data_of_c1(&client).await.outcome, mismatch);

    assert_unknown(&status_of_c1(&client).await.outcome);
}

#[tokio::test]
async fn a_status_outside_the_list_is_unknown() {
    let (sim, _h, client) = start().await;
    garble(&sim, GarbageKind::BadValue);

    let status = status_of_c1(&client).await.outcome;
    unknown_because(&status, "unknown status value \"weird\"");
    let data = data_of_c1(&client).await.outcome;
    unknown_because(&data, "unknown state value \"weird\"");

    // A missing field is unknown as well.
    garble(&sim, GarbageKind::MissingField);
    let status = status_of_c1(&client).await;
    unknown_because(&status.outcome, "missing field status");
}

#[tokio::test]
async fn a_payment_submit_timeout_is_unknown_not_failed() {
    let (_sim, h, patient, req) = paying(PaymentBehaviour::Hang).await;
    let client = GatewayClient::new(&h.base_url(), IMPATIENT).unwrap();

    let submit = client.submit_payment(&req, Uuid::new_v4()).await;
    unknown_because(&submit.outcome, "timeout after 200 ms");

    // And indeed the Gateway acted on it.
    let query = patient.query_payment(req.payment_id, Uuid::new_v4()).await;
    assert_eq!(
        query.outcome,
        Outcome::Valid(PaymentQuery::Found(PaymentResult {
            payment_id: req.payment_id,
            status: PaymentStatus::Accepted,
            channel_ref: format!("ch_{}", req.payment_id.simple()),
        }))
    );
}

#[tokio::test]
async fn a_payment_5xx_is_unknown() {
    let (sim, _h, client, req) = paying(PaymentBehaviour::ServerError).await;

    let submit = client.submit_payment(&req, Uuid::new_v4()).await;
    unknown_because(&submit.outcome, "HTTP 503");
    assert_eq!(submit.http_status, Some(503));

    // A 5xx on a query is merely failed: a read is safe to repeat.
    sim.set_error_rate(1.0);
    let query = client.query_payment(req.payment_id, Uuid::new_v4()).await;
    assert!(query.outcome.is_failed(), "{:?}", query.outcome);

    // A garbage 2xx on a submit is unknown.
    sim.set_error_rate(0.0);
    sim.set_garbage_rate(1.0);
    let other = payment("c-1");
    let submit = client.submit_payment(&other, Uuid::new_v4()).await;
    assert_unknown(&submit.outcome);
}

#[tokio::test]
async fn a_payment_connection_dropped_after_sending_is_unknown() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 1024];
        // Read the request head, then hang up without answering.
        let _ = socket.read(&mut buf).await;
    });
    let client = GatewayClient::new(&format!("http://{addr}"), PATIENT).unwrap();

    let submit = client.submit_payment(&payment("c-1"), Uuid::new_v4()).await;
    assert_unknown(&submit.outcome);
    assert_eq!(submit.http_status, None);
}

#[tokio::test]
async fn a_payment_4xx_is_failed() {
    let app = axum::Router::new().route(
        "/v1/payments",
        axum::routing::post(|| async { (axum::http::StatusCode::UNPROCESSABLE_ENTITY, "no") }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = GatewayClient::new(&format!("http://{addr}"), PATIENT).unwrap();

    let submit = client.submit_payment(&payment("c-1"), Uuid::new_v4()).await;
    assert!(submit.outcome.is_failed(), "{:?}", submit.outcome);
    assert_eq!(reason(&submit.outcome), "HTTP 422");
}

#[tokio::test]
async fn a_payment_query_404_is_not_found() {
    let (sim, _h, client) = start().await;

    let never = client.query_payment(Uuid::new_v4(), Uuid::new_v4()).await;
    assert_eq!(never.outcome, Outcome::Valid(PaymentQuery::NotFound));
    assert_eq!(never.http_status, Some(404));

    // A payment the Gateway answered but then forgot.
    let req = payment("c-1");
    sim.set_payment_behaviour(req.payment_id, PaymentBehaviour::Forget);
    let submit = client.submit_payment(&req, Uuid::new_v4()).await;
    assert!(submit.outcome.is_valid(), "{:?}", submit.outcome);
    let query = client.query_payment(req.payment_id, Uuid::new_v4()).await;
    assert_eq!(query.outcome, Outcome::Valid(PaymentQuery::NotFound));
}

#[tokio::test]
async fn the_correlation_header_reaches_the_gateway() {
    let (sim, _h, client) = start().await;
    let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();

    client.card_data("c-1", ids[0]).await;
    client.card_status("c-1", ids[1]).await;
    client.submit_payment(&payment("c-1"), ids[2]).await;
    client.query_payment(Uuid::new_v4(), ids[3]).await;

    let seen = sim.recent_requests();
    assert_eq!(
        seen.iter()
            .map(|r| r.correlation_id.clone())
            .collect::<Vec<_>>(),
        ids.iter().map(|i| Some(i.to_string())).collect::<Vec<_>>()
    );
    assert!(seen
        .iter()
        .all(|r| r.accept.as_deref() == Some("application/json")));
}

#[tokio::test]
async fn the_idempotency_key_is_the_payment_id() {
    let (sim, _h, client, req) = paying(PaymentBehaviour::Reject).await;

    let first = client.submit_payment(&req, Uuid::new_v4()).await;
    let again = client.submit_payment(&req, Uuid::new_v4()).await;
    let Outcome::Valid(result) = &first.outcome else {
        panic!("{:?}", first.outcome)
    };
    assert_eq!(result.status, PaymentStatus::Rejected);
    assert_eq!(again.outcome, first.outcome, "the Gateway is idempotent");

    let record = sim.payment_record(req.payment_id).unwrap();
    assert_eq!(record.submissions, 2);
    assert_eq!(
        record.idempotency_keys,
        vec![req.payment_id.to_string(), req.payment_id.to_string()]
    );
}

#[tokio::test]
async fn peak_in_flight_counts_concurrent_calls() {
    let (sim, h, client) = start().await;
    sim.set_latency(500, 0);

    let data = (0..3).map(|i| {
        let c = client.clone();
        async move { c.card_data(&format!("c-{i}"), Uuid::new_v4()).await.outcome }
    });
    let status = (0..2).map(|i| {
        let c = client.clone();
        async move {
            c.card_status(&format!("c-{i}"), Uuid::new_v4())
                .await
                .outcome
                .is_valid()
        }
    });
    let (data, status) = tokio::join!(
        futures::future::join_all(data),
        futures::future::join_all(status)
    );
    assert!(data.iter().all(|o| o.is_valid()), "{data:?}");
    assert!(status.iter().all(|ok| *ok));

    let stats = sim.stats();
    assert_eq!(stats.in_flight, 0, "every guard was released");
    assert_eq!(stats.peak_in_flight, 5);
    assert_eq!(stats.peak_per_call.get("carddata"), Some(&3));
    assert_eq!(stats.peak_per_call.get("card_status"), Some(&2));
    assert_eq!(stats.calls_total.get("carddata"), Some(&3));

    // The HTTP control API reports the same, and reset_peaks lowers them to what is in flight.
    let over_http: cardworker::sim::SimStats = reqwest::get(format!("{}/sim/stats", h.base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(over_http, stats);
    sim.reset_peaks();
    assert_eq!(sim.stats().peak_in_flight, 0);
}

#[tokio::test]
async fn the_control_api_speaks_http() {
    let (sim, h, client) = start().await;
    let http = reqwest::Client::new();
    let base = h.base_url();

    assert!(http
        .get(format!("{base}/healthz"))
        .send()
        .await
        .unwrap()
        .status()
        .is_success());
    let resp = post_json(&http, &format!("{base}/sim/cards/c-9"), &serde_json::json!({"status": "frozen", "data": {"state": "ready", "card_token": "tok_9", "pan_last4": "0009", "expiry_month": 1, "expiry_year": 2031}})).await;
    assert!(resp.status().is_success(), "{resp:?}");
    assert_eq!(
        client.card_status("c-9", Uuid::new_v4()).await.outcome,
        Outcome::Valid(CardStatus::Frozen)
    );

    let resp = post_json(
        &http,
        &format!("{base}/sim/config"),
        &serde_json::json!({"error_rate": 1.0}),
    )
    .await;
    assert!(resp.status().is_success());
    assert!(client
        .card_data("c-9", Uuid::new_v4())
        .await
        .outcome
        .is_failed());

    let bad = post_json(
        &http,
        &format!("{base}/sim/config"),
        &serde_json::json!({"error_rate": 2.0}),
    )
    .await;
    assert_eq!(bad.status(), 400);
    assert_eq!(sim.config().error_rate, 1.0);

    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_changing_card_becomes_ready_and_active() {
    let (sim, _h, client) = start().await;
    sim.set_change_rate(1.0);

    let data = data_of_c1(&client).await;
    let Outcome::Valid(CardData::Ready {
        card_token,
        pan_last4,
        ..
    }) = data.outcome
    else {
        panic!("{:?}", data.outcome)
    };
    assert!(card_token.starts_with("tok_"));
    assert_eq!(pan_last4.len(), 4);
    let status = status_of_c1(&client).await;
    assert_eq!(status.outcome, Outcome::Valid(CardStatus::Active));
}

#[test]
fn every_call_records_its_duration() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let (_sim, _h, client) = start().await;
            data_of_c1(&client).await;
            status_of_c1(&client).await;
            client.submit_payment(&payment("c-1"), Uuid::new_v4()).await;
            client.query_payment(Uuid::new_v4(), Uuid::new_v4()).await;
        })
    });
    let text = handle.render();
    for call in ["carddata", "card_status", "payment_submit", "payment_query"] {
        let needle =
            format!("cardworker_gateway_request_duration_seconds_count{{call=\"{call}\"}} 1");
        assert!(text.contains(&needle), "{needle} missing in\n{text}");
    }
}
