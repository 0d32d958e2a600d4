//! The HTTP endpoint on `telemetry.listen`: `/metrics` (Prometheus text, rendered from memory),
//! `/healthz` (200 while every worker of the process runs) and `/readyz` (200 when PostgreSQL and
//! Redis answer).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use axum::{extract::State, http::StatusCode, routing::get, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use redis::aio::ConnectionManager;
use sqlx::PgPool;
use tokio::net::TcpListener;

use super::Health;

/// What the endpoint reads.
#[derive(Clone)]
pub struct EndpointState {
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// Worker liveness for `/healthz`.
    pub health: Health,
    /// Checked by `/readyz`.
    pub pool: PgPool,
    /// Checked by `/readyz`.
    pub redis: ConnectionManager,
    /// The fleet-wide gauges' refresher: a scrape publishes their age and keeps it reading
    /// (`None`: no fleet-wide gauges, as in a test of the endpoint alone).
    pub fleet: Option<super::fleet::FleetGauges>,
}

/// Binds `listen` and returns the bound address (port 0 works) and the server, which serves until
/// `shutdown` resolves. The caller spawns the server (`cardworker run` through its task tracker).
pub async fn serve(
    listen: &str,
    state: EndpointState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<(SocketAddr, futures::future::BoxFuture<'static, ()>)> {
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the telemetry endpoint on {listen}"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state);
    let server = Box::pin(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "telemetry endpoint failed");
        }
    });
    Ok((addr, server))
}

/// Renders what the process holds: never a read of Redis or PostgreSQL (the fleet-wide gauges are
/// the last values read in the background). A scrape that wakes their paused refresh waits for
/// that round, up to `fleet::FRESH_WAIT`; otherwise, and during an outage, it answers at once.
async fn metrics(State(state): State<EndpointState>) -> String {
    if let Some(fleet) = &state.fleet {
        fleet.on_scrape().await;
    }
    state.metrics.render()
}

async fn healthz(State(state): State<EndpointState>) -> (StatusCode, String) {
    if state.health.healthy() {
        (StatusCode::OK, "ok\n".into())
    } else {
        let stopped = state.health.stopped();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("workers not running: {}\n", stopped.join(", ")),
        )
    }
}

async fn readyz(State(state): State<EndpointState>) -> (StatusCode, String) {
    let limit = Duration::from_secs(2);
    let pg = tokio::time::timeout(limit, sqlx::query("SELECT 1").execute(&state.pool)).await;
    let mut conn = state.redis.clone();
    let rd = tokio::time::timeout(limit, redis::cmd("PING").query_async::<String>(&mut conn)).await;
    match (pg, rd) {
        (Ok(Ok(_)), Ok(Ok(_))) => (StatusCode::OK, "ready\n".into()),
        (pg, rd) => {
            let pg_ok = matches!(pg, Ok(Ok(_)));
            let rd_ok = matches!(rd, Ok(Ok(_)));
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("postgres: {}, redis: {}\n", ok(pg_ok), ok(rd_ok)),
            )
        }
    }
}

fn ok(b: bool) -> &'static str {
    if b {
        "ok"
    } else {
        "unavailable"
    }
}
