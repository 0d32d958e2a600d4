//! The Gateway HTTP client: one method per call kind, each returning a typed, classified
//! [`CallResult`] (spec section 1).
//!
//! This module is the HTTP half only: `reqwest` (and, for card reads, `reads.rs`), the URL, the
//! headers (`Accept`, `X-Correlation-Id`, `Idempotency-Key`), the timeout, the request-duration
//! histogram and one log line per call. `transport.rs` sends a request and reads its answer into
//! plain values (the status and body bytes, or a transport error reduced to its kind and a short
//! reason); what the answer *means* is decided by `classify.rs`; what may be written about it
//! comes from `redact.rs`.
//!
//! The client never returns `Err` for something the Gateway did or did not do: transport errors,
//! HTTP statuses and bad bodies are all classified into [`Outcome::Failed`] or
//! [`Outcome::Unknown`] with a human-readable [`Failure::reason`](super::Failure).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::future::Either;
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT};
use url::Url;
use uuid::Uuid;

use super::classify::{self, Classified};
use super::mask::truncate;
use super::outcome::{CallResult, Outcome};
use super::reads::ReadTransport;
use super::redact;
use super::transport::{self, HttpOutcome, TransportError, TransportErrorKind};
use super::wire::{
    ApprovalQuery, ApprovalRequest, ApprovalResult, CallKind, CardData, CardStatus, PaymentQuery,
    PaymentRequest, PaymentResult, CORRELATION_HEADER, IDEMPOTENCY_HEADER,
};
use crate::secret::SecretUrl;
use crate::telemetry::metrics::GATEWAY_REQUEST_DURATION;

/// The `User-Agent` of every call.
const USER_AGENT: &str = concat!("cardworker/", env!("CARGO_PKG_VERSION"));

/// The Gateway client. Cheap to clone (the connection pool is shared).
#[derive(Debug, Clone)]
pub struct GatewayClient {
    http: reqwest::Client,
    /// The card reads' transport; `None` when reqwest sends them too (a proxy, credentials in
    /// the base URL: [`ReadTransport::for_base`]).
    reads: Option<Arc<ReadTransport>>,
    base: Url,
    timeout: Duration,
    /// How long a card read the caller stopped waiting for (at `timeout`) is left to run before
    /// its connection is closed ([`GatewayClient::holding_reads_for`]); `timeout` by default.
    hold: Duration,
}

/// A card read under way: its exchange with the Gateway runs on a task of its own, from the
/// moment it is sent to its answer (or until the client's hold is over), whatever becomes of the
/// caller. [`SentRead::answer`] waits for it up to the client's timeout;
/// [`SentRead::at_gateway`] says, to whoever holds it, when the Gateway is done with it.
pub struct SentRead<T> {
    kind: CallKind,
    request_summary: String,
    started: Instant,
    timeout: Duration,
    exchange: tokio::task::JoinHandle<HttpOutcome>,
    at_gateway: AtGateway,
    classify: Box<dyn FnOnce(HttpOutcome) -> Classified<T> + Send>,
}

/// One card read as the Gateway may still see it: when it was sent, and a signal that its
/// exchange has ended (answered, failed, or cut off at the client's hold). Cheap to clone.
#[derive(Debug, Clone)]
pub struct AtGateway {
    sent: Instant,
    ended: tokio::sync::watch::Receiver<bool>,
}

impl AtGateway {
    /// When the request was sent.
    pub fn sent(&self) -> Instant {
        self.sent
    }

    /// Whether the exchange has ended (the Gateway answered or the connection is gone).
    pub fn has_ended(&self) -> bool {
        *self.ended.borrow() || self.ended.has_changed().is_err()
    }

    /// Resolves once the exchange has ended.
    pub async fn ended(mut self) {
        // The sender is dropped (or set) when the exchange task ends: either way it is over.
        let _ = self.ended.wait_for(|ended| *ended).await;
    }
}

impl GatewayClient {
    /// A client for the Gateway at `base_url` (`http` or `https`, optionally with a path
    /// prefix). `timeout` bounds every call as a whole, connect included.
    pub fn new(base_url: &str, timeout: Duration) -> anyhow::Result<Self> {
        // The URL may carry a password: errors show it redacted.
        let shown = SecretUrl::new(base_url);
        let base = Url::parse(base_url)
            .with_context(|| format!("gateway base URL {shown} is not a valid URL"))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            anyhow::bail!("gateway base URL {shown} must be an http:// or https:// URL");
        }
        if timeout.is_zero() {
            anyhow::bail!("gateway timeout must be greater than zero");
        }
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .default_headers(headers)
            .timeout(timeout)
            .connect_timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(USER_AGENT)
            .build()
            .context("building the Gateway HTTP client")?;
        // reqwest reads the same variables for its proxies.
        let proxies = hyper_util::client::proxy::matcher::Matcher::from_env();
        let reads = ReadTransport::for_base(&base, timeout, &proxies, USER_AGENT)
            .context("building the card reads' HTTP client")?
            .map(Arc::new);
        Ok(Self {
            http,
            reads,
            base,
            timeout,
            hold: timeout,
        })
    }

    /// This client leaving a card read it stopped waiting for (at its timeout) to run on until
    /// `hold` after it was sent: the Gateway may still be working on it, and whoever holds its
    /// [`AtGateway`] learns when it is done. Never shorter than the timeout.
    pub fn holding_reads_for(mut self, hold: Duration) -> Self {
        self.hold = hold.max(self.timeout);
        self
    }

    /// The configured per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `GET /v1/cards/{card_ref}/data`.
    #[tracing::instrument(name = "gateway.card_data", skip_all, fields(call = "carddata", card_ref = %card_ref, correlation_id = %correlation_id))]
    pub async fn card_data(&self, card_ref: &str, correlation_id: Uuid) -> CallResult<CardData> {
        self.send_card_data(card_ref, correlation_id).answer().await
    }

    /// `GET /v1/cards/{card_ref}/data`, sent now on a task of its own ([`SentRead`]).
    pub fn send_card_data(&self, card_ref: &str, correlation_id: Uuid) -> SentRead<CardData> {
        let owned = card_ref.to_owned();
        self.send_read(
            CallKind::Carddata,
            card_ref,
            "data",
            correlation_id,
            Box::new(move |outcome| classify::card_data(outcome, &owned)),
        )
    }

    /// `GET /v1/cards/{card_ref}/status`.
    #[tracing::instrument(name = "gateway.card_status", skip_all, fields(call = "card_status", card_ref = %card_ref, correlation_id = %correlation_id))]
    pub async fn card_status(
        &self,
        card_ref: &str,
        correlation_id: Uuid,
    ) -> CallResult<CardStatus> {
        self.send_card_status(card_ref, correlation_id)
            .answer()
            .await
    }

    /// `GET /v1/cards/{card_ref}/status`, sent now on a task of its own ([`SentRead`]).
    pub fn send_card_status(&self, card_ref: &str, correlation_id: Uuid) -> SentRead<CardStatus> {
        let owned = card_ref.to_owned();
        self.send_read(
            CallKind::CardStatus,
            card_ref,
            "status",
            correlation_id,
            Box::new(move |outcome| classify::card_status(outcome, &owned)),
        )
    }

    /// Sends one card read on a task of its own, bounded by the client's hold (not its timeout):
    /// a read the caller stops waiting for stays at the Gateway until it is answered or the hold
    /// is over, and [`AtGateway`] tells when.
    fn send_read<T>(
        &self,
        kind: CallKind,
        card_ref: &str,
        suffix: &str,
        correlation_id: Uuid,
        classify: Box<dyn FnOnce(HttpOutcome) -> Classified<T> + Send>,
    ) -> SentRead<T> {
        let request_summary = redact::card_request_summary(card_ref, suffix);
        let started = Instant::now();
        let timeout = self.timeout;
        let (done, ended) = tokio::sync::watch::channel(false);
        let call = match &self.reads {
            Some(reads) => {
                let reads = reads.clone();
                let hold = self.hold;
                let url = reads.path_of(card_ref, suffix).map_or_else(
                    || {
                        self.url(&["v1", "cards", card_ref, suffix])
                            .map(|url| url.to_string())
                    },
                    Ok,
                );
                Either::Left(async move { reads.exchange(url, correlation_id, hold).await })
            }
            None => {
                let req = self.url(&["v1", "cards", card_ref, suffix]).map(|url| {
                    self.http
                        .get(url)
                        .timeout(self.hold)
                        .header(CORRELATION_HEADER, correlation_id.to_string())
                });
                Either::Right(transport::exchange(req, timeout))
            }
        };
        let exchange = tokio::spawn(async move {
            let outcome = call.await;
            done.send_replace(true);
            outcome
        });
        SentRead {
            kind,
            request_summary,
            started,
            timeout: self.timeout,
            exchange,
            at_gateway: AtGateway {
                sent: started,
                ended,
            },
            classify,
        }
    }

    /// `POST /v1/payments` with `Idempotency-Key: <payment_id>`.
    ///
    /// Only a connection that could not be opened is `Failed`; a timeout, a connection dropped
    /// after sending, a 5xx or an unreadable 2xx are `Unknown`, because the Gateway may have
    /// acted on the request.
    #[tracing::instrument(name = "gateway.submit_payment", skip_all, fields(call = "payment_submit", card_ref = %req.card_ref, payment_id = %req.payment_id, correlation_id = %correlation_id))]
    pub async fn submit_payment(
        &self,
        req: &PaymentRequest,
        correlation_id: Uuid,
    ) -> CallResult<PaymentResult> {
        let kind = CallKind::PaymentSubmit;
        let request_summary = redact::submit_request_summary(req);
        let builder = self.url(&["v1", "payments"]).map(|url| {
            self.http
                .post(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
                .header(IDEMPOTENCY_HEADER, req.payment_id.to_string())
                .json(req)
        });
        let (outcome, elapsed) = self.send(kind, builder).await;
        let classified = classify::payment_submit(outcome, req.payment_id);
        finish(kind, classified, elapsed, request_summary)
    }

    /// `GET /v1/payments/{payment_id}`. A 404 is the valid answer [`PaymentQuery::NotFound`];
    /// transport errors and other non-2xx are `Failed` (a query is safe to repeat).
    #[tracing::instrument(name = "gateway.query_payment", skip_all, fields(call = "payment_query", payment_id = %payment_id, correlation_id = %correlation_id))]
    pub async fn query_payment(
        &self,
        payment_id: Uuid,
        correlation_id: Uuid,
    ) -> CallResult<PaymentQuery> {
        let kind = CallKind::PaymentQuery;
        let request_summary = redact::query_request_summary(payment_id);
        let id = payment_id.to_string();
        let req = self.url(&["v1", "payments", &id]).map(|url| {
            self.http
                .get(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
        });
        let (outcome, elapsed) = self.send(kind, req).await;
        let classified = classify::payment_query(outcome, payment_id);
        finish(kind, classified, elapsed, request_summary)
    }

    /// `POST /v1/approvals` with `Idempotency-Key: <approval_id>`; classified as a payment
    /// submission (a 4xx is `Failed`, whatever may have reached the Gateway is `Unknown`).
    #[tracing::instrument(name = "gateway.submit_approval", skip_all, fields(call = "approval_submit", card_ref = %req.card_ref, approval_id = %req.approval_id, correlation_id = %correlation_id))]
    pub async fn submit_approval(
        &self,
        req: &ApprovalRequest,
        correlation_id: Uuid,
    ) -> CallResult<ApprovalResult> {
        let kind = CallKind::ApprovalSubmit;
        let request_summary = redact::approval_request_summary(req);
        let builder = self.url(&["v1", "approvals"]).map(|url| {
            self.http
                .post(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
                .header(IDEMPOTENCY_HEADER, req.approval_id.to_string())
                .json(req)
        });
        let (outcome, elapsed) = self.send(kind, builder).await;
        let classified = classify::approval_submit(outcome, req.approval_id);
        finish(kind, classified, elapsed, request_summary)
    }

    /// `GET /v1/approvals/{approval_id}`. A 404 is the valid answer [`ApprovalQuery::NotFound`].
    #[tracing::instrument(name = "gateway.query_approval", skip_all, fields(call = "approval_query", approval_id = %approval_id, correlation_id = %correlation_id))]
    pub async fn query_approval(
        &self,
        approval_id: Uuid,
        correlation_id: Uuid,
    ) -> CallResult<ApprovalQuery> {
        let kind = CallKind::ApprovalQuery;
        let request_summary = redact::approval_query_summary(approval_id);
        let id = approval_id.to_string();
        let req = self.url(&["v1", "approvals", &id]).map(|url| {
            self.http
                .get(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
        });
        let (outcome, elapsed) = self.send(kind, req).await;
        let classified = classify::approval_query(outcome, approval_id);
        finish(kind, classified, elapsed, request_summary)
    }

    fn url(&self, segments: &[&str]) -> Result<Url, String> {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| format!("gateway base URL {} cannot take a path", self.base))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    /// Sends one request, reads the whole body, and records the call's duration.
    async fn send(
        &self,
        kind: CallKind,
        req: Result<reqwest::RequestBuilder, String>,
    ) -> (HttpOutcome, Duration) {
        let started = Instant::now();
        let outcome = transport::exchange(req, self.timeout).await;
        let elapsed = started.elapsed();
        metrics::histogram!(GATEWAY_REQUEST_DURATION, "call" => kind.as_str())
            .record(elapsed.as_secs_f64());
        (outcome, elapsed)
    }
}

impl<T> SentRead<T> {
    /// The read as the Gateway may still see it, for whoever must know when it is done there.
    pub fn at_gateway(&self) -> AtGateway {
        self.at_gateway.clone()
    }
}

impl<T: fmt::Debug> SentRead<T> {
    /// Waits for the answer up to the client's timeout, and classifies it. A read not answered
    /// by then is a timeout (`Failed`, as for any card read); its exchange runs on, and
    /// [`AtGateway`] tells when it ends. Records the call's duration as the caller waited it.
    pub async fn answer(self) -> CallResult<T> {
        let outcome = match tokio::time::timeout_at(
            (self.started + self.timeout).into(),
            self.exchange,
        )
        .await
        {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(e)) => HttpOutcome::NoAnswer(TransportError {
                kind: TransportErrorKind::Other,
                reason: truncate(format!("request error: {e}"), 256),
            }),
            Err(_) => HttpOutcome::NoAnswer(TransportError::timed_out(self.timeout)),
        };
        let elapsed = self.started.elapsed();
        metrics::histogram!(GATEWAY_REQUEST_DURATION, "call" => self.kind.as_str())
            .record(elapsed.as_secs_f64());
        let classified = (self.classify)(outcome);
        finish(self.kind, classified, elapsed, self.request_summary)
    }
}

/// Attaches timing and the request summary, and logs the call.
fn finish<T: fmt::Debug>(
    kind: CallKind,
    c: Classified<T>,
    elapsed: Duration,
    request_summary: String,
) -> CallResult<T> {
    let elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
    match &c.outcome {
        Outcome::Valid(_) => tracing::debug!(
            call = kind.as_str(),
            outcome = "valid",
            http_status = c.http_status,
            elapsed_ms,
            "gateway call"
        ),
        Outcome::Failed(f) | Outcome::Unknown(f) => tracing::info!(
            call = kind.as_str(),
            outcome = c.outcome.kind(),
            http_status = c.http_status,
            elapsed_ms,
            reason = %f.reason,
            "gateway call not valid"
        ),
    }
    CallResult {
        outcome: c.outcome,
        elapsed,
        http_status: c.http_status,
        request_summary,
        response_summary: c.response_summary,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::transport::MAX_BODY_BYTES;

    /// A one-shot HTTP server that answers every request with `status` and `body`.
    async fn answering(status: u16, body: Vec<u8>) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let body = body.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let _ = socket.read(&mut buf).await;
                    let head = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = socket.write_all(head.as_bytes()).await;
                    let _ = socket.write_all(&body).await;
                });
            }
        });
        Ok(format!("http://{addr}"))
    }

    /// A valid answer padded past the cap with whitespace: still valid JSON if read whole.
    fn padded(json: &str, to: usize) -> Vec<u8> {
        let mut body = json.as_bytes().to_vec();
        body.resize(to, b' ');
        body
    }

    #[tokio::test]
    async fn a_2xx_body_longer_than_the_cap_is_unknown_even_when_it_would_decode(
    ) -> anyhow::Result<()> {
        let json = r#"{"card_ref":"c-1","status":"active"}"#;
        let base = answering(200, padded(json, MAX_BODY_BYTES + 1)).await?;
        let c = GatewayClient::new(&base, Duration::from_secs(5))?;
        let r = c.card_status("c-1", Uuid::now_v7()).await;
        assert!(r.outcome.is_unknown(), "{:?}", r.outcome);
        assert_eq!(r.http_status, Some(200));
        // At the cap exactly, it is read whole and valid.
        let base = answering(200, padded(json, MAX_BODY_BYTES)).await?;
        let c = GatewayClient::new(&base, Duration::from_secs(5))?;
        let r = c.card_status("c-1", Uuid::now_v7()).await;
        assert!(r.outcome.is_valid(), "{:?}", r.outcome);
        Ok(())
    }

    #[tokio::test]
    async fn an_error_body_longer_than_the_cap_is_cut_and_the_call_classified_by_its_status(
    ) -> anyhow::Result<()> {
        let base = answering(503, vec![b'x'; 4 * MAX_BODY_BYTES]).await?;
        let c = GatewayClient::new(&base, Duration::from_secs(5))?;
        let r = c.card_status("c-1", Uuid::now_v7()).await;
        assert!(r.outcome.is_failed(), "{:?}", r.outcome);
        assert_eq!(r.http_status, Some(503));
        assert!(
            r.response_summary.len() < 4096,
            "{}",
            r.response_summary.len()
        );
        let r = c
            .submit_payment(
                &PaymentRequest {
                    payment_id: Uuid::new_v4(),
                    card_ref: "c-1".to_owned(),
                    amount_minor: 1,
                    currency: "CNY".to_owned(),
                },
                Uuid::now_v7(),
            )
            .await;
        assert!(
            r.outcome.is_unknown(),
            "a 5xx of a payment stays unknown: {:?}",
            r.outcome
        );
        Ok(())
    }

    #[test]
    fn a_base_url_with_a_prefix_keeps_it() -> anyhow::Result<()> {
        let c = GatewayClient::new("http://127.0.0.1:1/gw/", Duration::from_secs(1))?;
        let url = c
            .url(&["v1", "cards", "c/1", "data"])
            .map_err(anyhow::Error::msg)?;
        assert_eq!(url.as_str(), "http://127.0.0.1:1/gw/v1/cards/c%2F1/data");
        assert!(GatewayClient::new("ftp://x", Duration::from_secs(1)).is_err());
        Ok(())
    }

    #[test]
    fn a_bad_base_url_or_timeout_is_refused() {
        assert!(GatewayClient::new("not a url", Duration::from_secs(1)).is_err());
        assert!(GatewayClient::new("mailto:x@example.com", Duration::from_secs(1)).is_err());
        assert!(GatewayClient::new("http://127.0.0.1:1", Duration::ZERO).is_err());
    }
}
