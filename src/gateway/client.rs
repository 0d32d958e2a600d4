//! The Gateway HTTP client: one method per call kind, each returning a typed, classified
//! [`CallResult`] (spec section 1).
//!
//! The client never returns `Err` for something the Gateway did or did not do: transport errors,
//! HTTP statuses and bad bodies are all classified into [`Outcome::Failed`] or
//! [`Outcome::Unknown`] with a human-readable [`Failure::reason`]. Summaries of requests and
//! responses are built from parsed, whitelisted fields, so a PAN or CVV never reaches a log line
//! or a stored record.

use std::error::Error as StdError;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use reqwest::header::{HeaderMap, HeaderValue, ACCEPT};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use url::Url;
use uuid::Uuid;

/// Histogram of Gateway request durations, labelled with `call` (spec section 4).
pub const REQUEST_DURATION_METRIC: &str = "cardworker_gateway_request_duration_seconds";

/// Header carrying the per-call correlation id.
pub const CORRELATION_HEADER: &str = "X-Correlation-Id";

/// Header carrying the payment id on `POST /v1/payments`.
pub const IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// Longest response or request summary kept, in bytes.
pub const SUMMARY_MAX_BYTES: usize = 512;

/// The four Gateway calls, as named in metric labels and config sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    Carddata,
    CardStatus,
    PaymentSubmit,
    PaymentQuery,
}

impl CallKind {
    /// Every call kind, in a fixed order.
    pub const ALL: [CallKind; 4] = [
        CallKind::Carddata,
        CallKind::CardStatus,
        CallKind::PaymentSubmit,
        CallKind::PaymentQuery,
    ];

    /// The label value used in metrics (`carddata`, `card_status`, `payment_submit`,
    /// `payment_query`).
    pub fn as_str(self) -> &'static str {
        match self {
            CallKind::Carddata => "carddata",
            CallKind::CardStatus => "card_status",
            CallKind::PaymentSubmit => "payment_submit",
            CallKind::PaymentQuery => "payment_query",
        }
    }
}

impl fmt::Display for CallKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a call was not a valid observation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: String,
}

impl Failure {
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// The classification of one call (spec section 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<T> {
    /// A valid observation.
    Valid(T),
    /// The call certainly did not happen or did not answer usefully; safe to repeat.
    Failed(Failure),
    /// The Gateway may have acted, or answered something we cannot read.
    Unknown(Failure),
}

impl<T> Outcome<T> {
    /// `"valid"`, `"failed"` or `"unknown"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Valid(_) => "valid",
            Outcome::Failed(_) => "failed",
            Outcome::Unknown(_) => "unknown",
        }
    }

    pub fn is_valid(&self) -> bool {
        matches!(self, Outcome::Valid(_))
    }

    pub fn is_failed(&self) -> bool {
        matches!(self, Outcome::Failed(_))
    }

    pub fn is_unknown(&self) -> bool {
        matches!(self, Outcome::Unknown(_))
    }

    /// The observation, when valid.
    pub fn valid(&self) -> Option<&T> {
        match self {
            Outcome::Valid(v) => Some(v),
            _ => None,
        }
    }

    /// The failure, when failed or unknown.
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            Outcome::Valid(_) => None,
            Outcome::Failed(f) | Outcome::Unknown(f) => Some(f),
        }
    }
}

/// One classified call with what is needed for an integration log row.
#[derive(Debug, Clone, PartialEq)]
pub struct CallResult<T> {
    pub outcome: Outcome<T>,
    /// Wall time from sending the request to having read (or given up on) the answer.
    pub elapsed: Duration,
    /// The HTTP status, when one was received.
    pub http_status: Option<u16>,
    /// `METHOD path` plus the non-sensitive request fields.
    pub request_summary: String,
    /// Whitelisted response fields or, for a body that is not JSON, a truncated, redacted excerpt.
    pub response_summary: String,
}

/// The answer of `GET /v1/cards/{card_ref}/data`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum CardData {
    Pending,
    Ready {
        card_token: String,
        pan_last4: String,
        expiry_month: u32,
        expiry_year: u32,
    },
}

impl CardData {
    pub fn state(&self) -> &'static str {
        match self {
            CardData::Pending => "pending",
            CardData::Ready { .. } => "ready",
        }
    }
}

/// The answer of `GET /v1/cards/{card_ref}/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CardStatus {
    Inactive,
    Active,
    Frozen,
    Cancelled,
    Expired,
}

impl CardStatus {
    pub const ALL: [CardStatus; 5] = [
        CardStatus::Inactive,
        CardStatus::Active,
        CardStatus::Frozen,
        CardStatus::Cancelled,
        CardStatus::Expired,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CardStatus::Inactive => "inactive",
            CardStatus::Active => "active",
            CardStatus::Frozen => "frozen",
            CardStatus::Cancelled => "cancelled",
            CardStatus::Expired => "expired",
        }
    }

    /// A final status is never left again: the card needs no more status polling.
    pub fn is_final(self) -> bool {
        matches!(self, CardStatus::Cancelled | CardStatus::Expired)
    }
}

impl fmt::Display for CardStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A status string outside the list of spec section 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown status value {0:?}")]
pub struct UnknownStatus(pub String);

impl FromStr for CardStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CardStatus::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

/// The body of `POST /v1/payments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentRequest {
    pub payment_id: Uuid,
    pub card_ref: String,
    pub amount_minor: i64,
    pub currency: String,
}

/// What the Gateway decided about a payment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaymentStatus {
    Accepted,
    Rejected,
}

impl PaymentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PaymentStatus::Accepted => "accepted",
            PaymentStatus::Rejected => "rejected",
        }
    }
}

impl fmt::Display for PaymentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PaymentStatus {
    type Err = UnknownStatus;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "accepted" => Ok(PaymentStatus::Accepted),
            "rejected" => Ok(PaymentStatus::Rejected),
            other => Err(UnknownStatus(other.to_owned())),
        }
    }
}

/// The answer of `POST /v1/payments` and `GET /v1/payments/{payment_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentResult {
    pub payment_id: Uuid,
    pub status: PaymentStatus,
    pub channel_ref: String,
}

/// The answer of `GET /v1/payments/{payment_id}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PaymentQuery {
    Found(PaymentResult),
    /// 404: the Gateway never saw that payment.
    NotFound,
}

/// The Gateway client. Cheap to clone (the connection pool is shared).
#[derive(Debug, Clone)]
pub struct GatewayClient {
    http: reqwest::Client,
    base: Url,
    timeout: Duration,
}

/// What the transport produced, before classification.
enum Transport {
    /// A status and a fully read body.
    Answer { status: u16, body: Vec<u8> },
    /// A status, but reading the body failed.
    BodyError { status: u16, error: reqwest::Error },
    /// No status at all.
    SendError(reqwest::Error),
}

impl GatewayClient {
    /// A client for the Gateway at `base_url` (`http` or `https`, optionally with a path
    /// prefix). `timeout` bounds every call as a whole, connect included.
    pub fn new(base_url: &str, timeout: Duration) -> anyhow::Result<Self> {
        let base = Url::parse(base_url)
            .with_context(|| format!("gateway base URL {base_url:?} is not a valid URL"))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            anyhow::bail!("gateway base URL {base_url:?} must be an http:// or https:// URL");
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
            .user_agent(concat!("cardworker/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("building the Gateway HTTP client")?;
        Ok(Self {
            http,
            base,
            timeout,
        })
    }

    /// The configured per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `GET /v1/cards/{card_ref}/data`.
    #[tracing::instrument(name = "gateway.card_data", skip_all, fields(call = "carddata", card_ref = %card_ref, correlation_id = %correlation_id))]
    pub async fn card_data(&self, card_ref: &str, correlation_id: Uuid) -> CallResult<CardData> {
        let kind = CallKind::Carddata;
        let request_summary = format!("GET /v1/cards/{}/data", summarize_str(card_ref));
        let req = self.url(&["v1", "cards", card_ref, "data"]).map(|url| {
            self.http
                .get(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
        });
        let (transport, elapsed) = self.send(kind, req).await;
        let result = classify_card_call(transport, |v| parse_card_data(v, card_ref), self.timeout);
        finish(kind, result, elapsed, request_summary)
    }

    /// `GET /v1/cards/{card_ref}/status`.
    #[tracing::instrument(name = "gateway.card_status", skip_all, fields(call = "card_status", card_ref = %card_ref, correlation_id = %correlation_id))]
    pub async fn card_status(
        &self,
        card_ref: &str,
        correlation_id: Uuid,
    ) -> CallResult<CardStatus> {
        let kind = CallKind::CardStatus;
        let request_summary = format!("GET /v1/cards/{}/status", summarize_str(card_ref));
        let req = self.url(&["v1", "cards", card_ref, "status"]).map(|url| {
            self.http
                .get(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
        });
        let (transport, elapsed) = self.send(kind, req).await;
        let result =
            classify_card_call(transport, |v| parse_card_status(v, card_ref), self.timeout);
        finish(kind, result, elapsed, request_summary)
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
        let request_summary = format!(
            "POST /v1/payments payment_id={} card_ref={} amount_minor={} currency={}",
            req.payment_id,
            summarize_str(&req.card_ref),
            req.amount_minor,
            summarize_str(&req.currency)
        );
        let builder = self.url(&["v1", "payments"]).map(|url| {
            self.http
                .post(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
                .header(IDEMPOTENCY_HEADER, req.payment_id.to_string())
                .json(req)
        });
        let (transport, elapsed) = self.send(kind, builder).await;
        let result = classify_payment_submit(transport, req.payment_id, self.timeout);
        finish(kind, result, elapsed, request_summary)
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
        let request_summary = format!("GET /v1/payments/{payment_id}");
        let id = payment_id.to_string();
        let req = self.url(&["v1", "payments", &id]).map(|url| {
            self.http
                .get(url)
                .header(CORRELATION_HEADER, correlation_id.to_string())
        });
        let (transport, elapsed) = self.send(kind, req).await;
        let result = classify_payment_query(transport, payment_id, self.timeout);
        finish(kind, result, elapsed, request_summary)
    }

    fn url(&self, segments: &[&str]) -> Result<Url, String> {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| format!("gateway base URL {} cannot take a path", self.base))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    async fn send(
        &self,
        kind: CallKind,
        req: Result<reqwest::RequestBuilder, String>,
    ) -> (Result<Transport, String>, Duration) {
        let started = Instant::now();
        let transport = match req {
            Err(e) => Err(e),
            Ok(builder) => Ok(match builder.send().await {
                Err(error) => Transport::SendError(error),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    match resp.bytes().await {
                        Ok(body) => Transport::Answer {
                            status,
                            body: body.to_vec(),
                        },
                        Err(error) => Transport::BodyError { status, error },
                    }
                }
            }),
        };
        let elapsed = started.elapsed();
        metrics::histogram!(REQUEST_DURATION_METRIC, "call" => kind.as_str())
            .record(elapsed.as_secs_f64());
        (transport, elapsed)
    }
}

/// Classification before timing and the request summary are attached.
struct Classified<T> {
    outcome: Outcome<T>,
    http_status: Option<u16>,
    response_summary: String,
}

impl<T> Classified<T> {
    fn failed(http_status: Option<u16>, reason: String, response_summary: String) -> Self {
        Self {
            outcome: Outcome::Failed(Failure::new(reason)),
            http_status,
            response_summary,
        }
    }

    fn unknown(http_status: Option<u16>, reason: String, response_summary: String) -> Self {
        Self {
            outcome: Outcome::Unknown(Failure::new(reason)),
            http_status,
            response_summary,
        }
    }
}

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
        request_summary: truncate(request_summary, SUMMARY_MAX_BYTES),
        response_summary: c.response_summary,
    }
}

/// Card calls: transport errors and non-2xx are `Failed`; a 2xx that does not parse is `Unknown`.
fn classify_card_call<T>(
    transport: Result<Transport, String>,
    parse: impl FnOnce(&Value) -> Result<T, String>,
    timeout: Duration,
) -> Classified<T>
where
    T: Summarize,
{
    match transport {
        Err(reason) => Classified::failed(None, reason, String::new()),
        Ok(Transport::SendError(e)) => {
            Classified::failed(None, transport_reason(&e, timeout), String::new())
        }
        Ok(Transport::BodyError { status, error }) => Classified::failed(
            Some(status),
            format!("HTTP {status}, then {}", transport_reason(&error, timeout)),
            String::new(),
        ),
        Ok(Transport::Answer { status, body }) => {
            if !(200..300).contains(&status) {
                return Classified::failed(
                    Some(status),
                    format!("HTTP {status}"),
                    body_summary(&body),
                );
            }
            parse_2xx(status, &body, parse)
        }
    }
}

fn classify_payment_submit(
    transport: Result<Transport, String>,
    payment_id: Uuid,
    timeout: Duration,
) -> Classified<PaymentResult> {
    match transport {
        Err(reason) => Classified::failed(None, reason, String::new()),
        Ok(Transport::SendError(e)) => {
            let reason = transport_reason(&e, timeout);
            // A timeout may have fired after the request left: never assume it did not act.
            if e.is_connect() && !e.is_timeout() {
                Classified::failed(None, reason, String::new())
            } else {
                Classified::unknown(None, reason, String::new())
            }
        }
        Ok(Transport::BodyError { status, error }) => Classified::unknown(
            Some(status),
            format!("HTTP {status}, then {}", transport_reason(&error, timeout)),
            String::new(),
        ),
        Ok(Transport::Answer { status, body }) => match status {
            200..=299 => parse_2xx(status, &body, |v| parse_payment_result(v, payment_id)),
            400..=499 => {
                Classified::failed(Some(status), format!("HTTP {status}"), body_summary(&body))
            }
            _ => Classified::unknown(Some(status), format!("HTTP {status}"), body_summary(&body)),
        },
    }
}

fn classify_payment_query(
    transport: Result<Transport, String>,
    payment_id: Uuid,
    timeout: Duration,
) -> Classified<PaymentQuery> {
    match transport {
        Ok(Transport::Answer { status: 404, body }) => Classified {
            outcome: Outcome::Valid(PaymentQuery::NotFound),
            http_status: Some(404),
            response_summary: if body.is_empty() {
                "not found".to_owned()
            } else {
                body_summary(&body)
            },
        },
        other => classify_card_call(
            other,
            |v| parse_payment_result(v, payment_id).map(PaymentQuery::Found),
            timeout,
        ),
    }
}

fn parse_2xx<T: Summarize>(
    status: u16,
    body: &[u8],
    parse: impl FnOnce(&Value) -> Result<T, String>,
) -> Classified<T> {
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => {
            return Classified::unknown(
                Some(status),
                "body is not JSON".to_owned(),
                body_summary(body),
            )
        }
    };
    match parse(&value) {
        Ok(parsed) => Classified {
            response_summary: truncate(parsed.summary(), SUMMARY_MAX_BYTES),
            outcome: Outcome::Valid(parsed),
            http_status: Some(status),
        },
        Err(reason) => Classified::unknown(Some(status), reason, json_summary(&value)),
    }
}

/// A short reason for a transport error, e.g. `connection refused` or `timeout after 5000 ms`.
fn transport_reason(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        return format!("timeout after {} ms", timeout.as_millis());
    }
    let mut source: Option<&(dyn StdError + 'static)> = e.source();
    let mut deepest = None;
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return "connection refused".to_owned(),
                std::io::ErrorKind::ConnectionReset => return "connection reset".to_owned(),
                std::io::ErrorKind::TimedOut => {
                    return format!("timeout after {} ms", timeout.as_millis())
                }
                _ => {}
            }
        }
        deepest = Some(s.to_string());
        source = s.source();
    }
    let detail = deepest.unwrap_or_else(|| e.to_string());
    let prefix = if e.is_connect() {
        "connect error"
    } else if e.is_body() || e.is_decode() {
        "error reading body"
    } else {
        "request error"
    };
    truncate(format!("{prefix}: {}", redact_digits(&detail)), 256)
}

fn obj(v: &Value) -> Result<&Map<String, Value>, String> {
    v.as_object()
        .ok_or_else(|| format!("body is a JSON {}, not an object", json_type(v)))
}

fn field_str<'a>(o: &'a Map<String, Value>, name: &str) -> Result<&'a str, String> {
    match o.get(name) {
        None => Err(format!("missing field {name}")),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!(
            "field {name} is a {}, not a string",
            json_type(other)
        )),
    }
}

fn field_u32(o: &Map<String, Value>, name: &str) -> Result<u32, String> {
    match o.get(name) {
        None => Err(format!("missing field {name}")),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("field {name} is not a small non-negative integer: {n}")),
        Some(other) => Err(format!(
            "field {name} is a {}, not an integer",
            json_type(other)
        )),
    }
}

fn check_card_ref(o: &Map<String, Value>, asked: &str) -> Result<(), String> {
    let got = field_str(o, "card_ref")?;
    if got != asked {
        return Err(format!(
            "card_ref mismatch: asked {}, got {}",
            summarize_str(asked),
            summarize_str(got)
        ));
    }
    Ok(())
}

fn parse_card_data(v: &Value, card_ref: &str) -> Result<CardData, String> {
    let o = obj(v)?;
    check_card_ref(o, card_ref)?;
    match field_str(o, "state")? {
        "pending" => Ok(CardData::Pending),
        "ready" => {
            let card_token = field_str(o, "card_token")?;
            if card_token.is_empty() {
                return Err("field card_token is empty".to_owned());
            }
            let pan_last4 = field_str(o, "pan_last4")?;
            if pan_last4.len() != 4 || !pan_last4.bytes().all(|b| b.is_ascii_digit()) {
                return Err("field pan_last4 is not exactly 4 digits".to_owned());
            }
            let expiry_month = field_u32(o, "expiry_month")?;
            if !(1..=12).contains(&expiry_month) {
                return Err(format!("field expiry_month out of 1..=12: {expiry_month}"));
            }
            let expiry_year = field_u32(o, "expiry_year")?;
            if !(2000..=9999).contains(&expiry_year) {
                return Err(format!(
                    "field expiry_year out of 2000..=9999: {expiry_year}"
                ));
            }
            Ok(CardData::Ready {
                card_token: card_token.to_owned(),
                pan_last4: pan_last4.to_owned(),
                expiry_month,
                expiry_year,
            })
        }
        other => Err(format!("unknown state value {:?}", summarize_str(other))),
    }
}

fn parse_card_status(v: &Value, card_ref: &str) -> Result<CardStatus, String> {
    let o = obj(v)?;
    check_card_ref(o, card_ref)?;
    let status = field_str(o, "status")?;
    status
        .parse::<CardStatus>()
        .map_err(|_| format!("unknown status value {:?}", summarize_str(status)))
}

fn parse_payment_result(v: &Value, payment_id: Uuid) -> Result<PaymentResult, String> {
    let o = obj(v)?;
    let got = field_str(o, "payment_id")?;
    let got_id = Uuid::parse_str(got)
        .map_err(|_| format!("field payment_id is not a UUID: {:?}", summarize_str(got)))?;
    if got_id != payment_id {
        return Err(format!(
            "payment_id mismatch: asked {payment_id}, got {got_id}"
        ));
    }
    let status = field_str(o, "status")?;
    let status = status
        .parse::<PaymentStatus>()
        .map_err(|_| format!("unknown status value {:?}", summarize_str(status)))?;
    let channel_ref = field_str(o, "channel_ref")?;
    Ok(PaymentResult {
        payment_id,
        status,
        channel_ref: channel_ref.to_owned(),
    })
}

/// A log-safe summary of a parsed answer.
trait Summarize {
    fn summary(&self) -> String;
}

impl Summarize for CardData {
    fn summary(&self) -> String {
        match self {
            CardData::Pending => "state=pending".to_owned(),
            CardData::Ready {
                card_token,
                pan_last4,
                expiry_month,
                expiry_year,
            } => format!(
                "state=ready card_token={} pan_last4={pan_last4} expiry={expiry_month:02}/{expiry_year}",
                summarize_str(card_token)
            ),
        }
    }
}

impl Summarize for CardStatus {
    fn summary(&self) -> String {
        format!("status={}", self.as_str())
    }
}

impl Summarize for PaymentResult {
    fn summary(&self) -> String {
        format!(
            "payment_id={} status={} channel_ref={}",
            self.payment_id,
            self.status,
            summarize_str(&self.channel_ref)
        )
    }
}

impl Summarize for PaymentQuery {
    fn summary(&self) -> String {
        match self {
            PaymentQuery::Found(r) => r.summary(),
            PaymentQuery::NotFound => "not found".to_owned(),
        }
    }
}

/// Fields whose values may appear in a summary of a JSON body that did not validate.
const SAFE_FIELDS: &[&str] = &[
    "card_ref",
    "state",
    "status",
    "card_token",
    "pan_last4",
    "expiry_month",
    "expiry_year",
    "payment_id",
    "channel_ref",
    "error",
    "code",
];

/// A summary of a JSON body that did not validate: whitelisted fields with their values, the
/// names of the other fields, never their values.
fn json_summary(v: &Value) -> String {
    let Some(o) = v.as_object() else {
        return format!("JSON {}", json_type(v));
    };
    let mut parts = Vec::new();
    let mut others = Vec::new();
    for (k, val) in o {
        if SAFE_FIELDS.contains(&k.as_str()) {
            let shown = match val {
                Value::String(s) => format!("{:?}", summarize_str(s)),
                Value::Number(n) => redact_digits(&n.to_string()),
                Value::Bool(b) => b.to_string(),
                Value::Null => "null".to_owned(),
                other => format!("<{}>", json_type(other)),
            };
            parts.push(format!("{k}={shown}"));
        } else {
            others.push(summarize_str(k));
        }
    }
    if !others.is_empty() {
        parts.push(format!("other_fields=[{}]", others.join(",")));
    }
    truncate(format!("JSON {{{}}}", parts.join(" ")), SUMMARY_MAX_BYTES)
}

/// A summary of a body that is not (or not known to be) JSON: a truncated excerpt, with long
/// digit runs (possible card numbers) masked.
fn body_summary(body: &[u8]) -> String {
    if body.is_empty() {
        return "empty body".to_owned();
    }
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return json_summary(&v);
    }
    let head = &body[..body.len().min(SUMMARY_MAX_BYTES * 2)];
    let text = String::from_utf8_lossy(head);
    let cleaned: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    truncate(
        format!("{} bytes: {}", body.len(), redact_digits(&cleaned)),
        SUMMARY_MAX_BYTES,
    )
}

/// A short, redacted rendering of one string value.
fn summarize_str(s: &str) -> String {
    truncate(redact_digits(s), 64)
}

/// Masks every run of 12 or more digits (allowing single spaces or dashes between them), which
/// could be a card number.
pub(crate) fn redact_digits(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit() {
            // Extend over digits and single separators between digits.
            let mut j = i;
            let mut digits = 0;
            let mut end = i;
            while j < chars.len() {
                if chars[j].is_ascii_digit() {
                    digits += 1;
                    j += 1;
                    end = j;
                } else if (chars[j] == ' ' || chars[j] == '-')
                    && j + 1 < chars.len()
                    && chars[j + 1].is_ascii_digit()
                {
                    j += 1;
                } else {
                    break;
                }
            }
            if digits >= 12 {
                out.push_str("[redacted]");
            } else {
                out.extend(&chars[i..end]);
            }
            i = end;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut cut = max.saturating_sub(3);
    while cut > 0 && !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push_str("...");
    s
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn long_digit_runs_are_redacted() {
        assert_eq!(
            redact_digits("pan 4242 4242 4242 4242 ok"),
            "pan [redacted] ok"
        );
        assert_eq!(redact_digits("4242424242424242"), "[redacted]");
        assert_eq!(
            redact_digits("last4 4242, year 2030"),
            "last4 4242, year 2030"
        );
    }

    #[test]
    fn a_json_summary_never_shows_unlisted_values() {
        let v = json!({"card_ref": "c-1", "pan": "4242424242424242", "cvv": "123"});
        let s = json_summary(&v);
        assert!(s.contains("card_ref=\"c-1\""), "{s}");
        assert!(!s.contains("4242"), "{s}");
        assert!(!s.contains("123"), "{s}");
    }

    #[test]
    fn a_full_pan_in_the_last4_field_is_unknown_and_masked() {
        let v = json!({"card_ref": "c-1", "state": "ready", "card_token": "tok_1",
                       "pan_last4": "4242424242424242", "expiry_month": 12, "expiry_year": 2030});
        let err = parse_card_data(&v, "c-1").err();
        assert_eq!(
            err.as_deref(),
            Some("field pan_last4 is not exactly 4 digits")
        );
        assert!(!json_summary(&v).contains("4242424242424242"));
    }

    #[test]
    fn summaries_are_truncated_on_a_char_boundary() {
        let s = truncate("é".repeat(600), SUMMARY_MAX_BYTES);
        assert!(s.len() <= SUMMARY_MAX_BYTES);
        assert!(s.ends_with("..."));
    }

    #[test]
    fn card_status_round_trips_and_knows_final_states() {
        for st in CardStatus::ALL {
            assert_eq!(st.as_str().parse::<CardStatus>(), Ok(st));
        }
        assert!(CardStatus::Cancelled.is_final());
        assert!(CardStatus::Expired.is_final());
        assert!(!CardStatus::Frozen.is_final());
        assert_eq!(
            "weird".parse::<CardStatus>().map_err(|e| e.to_string()),
            Err("unknown status value \"weird\"".to_owned())
        );
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
}
