//! The simulator's lifecycle: [`Simulator::serve`] on a listener until a shutdown future
//! completes, and [`Simulator::spawn_on`] / [`Simulator::spawn_with`] in a task, stopped through
//! its [`SimHandle`].

use std::future::Future;
use std::net::SocketAddr;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::config::SimConfig;
use super::simulator::Simulator;

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

    /// `http://ADDR`, the base URL for the worker's Gateway client.
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

impl Simulator {
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
        let app = self.router();
        let stopping = self.clone();
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown.await;
                tracing::info!(%addr, "gateway simulator stopping: no new connections, answering the calls in flight at once");
                stopping.stop_sleeping();
            })
            .await
            .with_context(|| format!("gateway simulator on {addr}"))?;
        let stats = self.stats();
        tracing::info!(
            %addr,
            calls = stats.calls_total.values().sum::<u64>(),
            injected_errors = stats.injected_errors_total.values().sum::<u64>(),
            garbage_answers = stats.garbage_answers_total.values().sum::<u64>(),
            "gateway simulator stopped"
        );
        Ok(())
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
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;
    use uuid::Uuid;

    use super::*;
    use crate::PaymentBehaviour;
    use cardworker_wire::{PaymentStatus, IDEMPOTENCY_HEADER};

    #[tokio::test]
    async fn spawn_refuses_a_config_with_an_out_of_range_rate() {
        let config = SimConfig {
            garbage_rate: 2.0,
            ..SimConfig::default()
        };
        let err = Simulator::spawn_with("127.0.0.1:0", config)
            .await
            .expect_err("refused before binding");
        assert!(err.to_string().contains("garbage_rate"), "{err}");
    }

    #[tokio::test]
    async fn spawn_on_port_zero_serves_health_on_the_address_it_reports() {
        let (addr, _sim, h) = Simulator::spawn_on("127.0.0.1:0").await.unwrap();
        assert_ne!(addr.port(), 0);
        assert_eq!(h.addr(), addr);
        assert_eq!(h.base_url(), format!("http://{addr}"));
        let body = reqwest::get(format!("{}/healthz", h.base_url()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(body, "ok");
        h.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn shutdown_cuts_a_hanging_payment_answer_short() {
        let (_, sim, h) = Simulator::spawn_with(
            "127.0.0.1:0",
            SimConfig {
                latency_ms: 0,
                ..SimConfig::default()
            },
        )
        .await
        .unwrap();
        let c = reqwest::Client::new();
        let id = Uuid::new_v4();
        sim.set_payment_behaviour(id, PaymentBehaviour::Hang);
        let url = format!("{}/v1/payments", h.base_url());
        let body = json!({
            "payment_id": id, "card_ref": "c-1", "amount_minor": 1, "currency": "CNY",
        });
        let hanging = tokio::spawn(async move {
            c.post(url)
                .header(IDEMPOTENCY_HEADER, id.to_string())
                .json(&body)
                .send()
                .await
        });
        while sim.stats().in_flight == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::timeout(Duration::from_secs(5), h.shutdown())
            .await
            .expect("shutdown did not wait for the 30 s hang")
            .unwrap();
        let answered = hanging.await.unwrap().unwrap();
        assert_eq!(
            answered.status().as_u16(),
            200,
            "the hang ends with its answer"
        );
        assert_eq!(
            sim.payment_record(id).unwrap().stored.map(|r| r.status),
            Some(PaymentStatus::Accepted)
        );
    }
}
