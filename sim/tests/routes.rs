//! The simulator's routes over a real socket (port 0), with `reqwest` as the caller: the
//! Gateway contract's answers, the injected trouble and the `/sim` control API, through the
//! crate's public API only.

#![allow(clippy::unwrap_used)]

use cardworker_sim::{PaymentBehaviour, SimConfig, SimHandle, SimStats, Simulator};
use cardworker_wire::{PaymentResult, PaymentStatus, CORRELATION_HEADER, IDEMPOTENCY_HEADER};
use reqwest::Client;
use serde_json::{json, Value};
use uuid::Uuid;

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
    let queried: PaymentResult = get_json(&c, format!("{}/v1/payments/{id}", h.base_url())).await;
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
