//! The HTTP endpoint: `/metrics` in Prometheus text, `/healthz` from worker liveness, `/readyz`
//! from PostgreSQL and Redis.

use std::time::Duration;

use cardworker::telemetry::{http, metrics_handle, Health};

use crate::harness::{redis_url, spawn_app};

#[tokio::test]
async fn metrics_health_and_readiness_answer_while_the_worker_runs() {
    let mut app = spawn_app().await;
    let (status, text) = app.get("/metrics").await;
    assert_eq!(status, 200);
    assert!(
        text.contains("cardworker_worker_up{worker=\"archive\"} 1"),
        "{text}"
    );
    assert!(text.contains("cardworker_maintenance_enabled 0"), "{text}");
    assert!(
        text.contains("cardworker_queue_depth{queue=\"carddata\"}"),
        "{text}"
    );
    assert_eq!(app.get("/healthz").await.0, 200);
    assert_eq!(app.get("/readyz").await.0, 200);
    app.stop().await.expect("clean stop");
}

#[tokio::test]
async fn readiness_fails_when_postgres_does_not_answer() {
    // A pool pointed at a port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&format!("postgres://root@127.0.0.1:{port}/none"))
        .expect("lazy pool");
    let redis = cardworker::context::connect_redis(&redis_url())
        .await
        .expect("redis");
    let health = Health::default();
    health.set("w-1", "archive", true);
    let state = http::EndpointState {
        metrics: metrics_handle().expect("recorder"),
        health: health.clone(),
        pool,
        redis,
        fleet: None,
    };
    let (addr, server) = http::serve("127.0.0.1:0", state, std::future::pending())
        .await
        .expect("serve");
    let _server = tokio::spawn(server);
    let ready = reqwest::get(format!("http://{addr}/readyz"))
        .await
        .expect("get");
    assert_eq!(ready.status().as_u16(), 503);
    let body = ready.text().await.unwrap_or_default();
    assert!(body.contains("postgres: unavailable"), "{body}");

    // Liveness is about workers, not dependencies: still 200 until a worker stops.
    let liveness = || async {
        let resp = reqwest::get(format!("http://{addr}/healthz")).await;
        resp.expect("get").status().as_u16()
    };
    assert_eq!(liveness().await, 200);
    health.set("w-1", "archive", false);
    assert_eq!(liveness().await, 503);
}
