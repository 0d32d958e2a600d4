//! How a card read goes over the wire: hyper's pooled client (hyper-util's), with nothing of
//! reqwest in between.
//!
//! A card read is the one call every poll makes, so its per-request work is the worker's: reqwest
//! adds a redirect policy and a response that each parse the request's URL again (even with
//! redirects off), a merge of its default headers and a proxy match, on top of the hyper client
//! it wraps (docs/BENCHMARKS.md, bench-redis-ab). Here a read is a request built once, sent on
//! the same kind of pool. Payments and approvals, a few a second, stay on reqwest.
//!
//! The connections are the ones reqwest makes: `TCP_NODELAY`, idle ones kept 90 s, a connect
//! bounded by the client's timeout, HTTP/1.1 only, rustls with the ring provider, rustls's safe
//! default protocol versions and the webpki roots (reqwest's `rustls-tls`). What reqwest does that
//! this does not, the Gateway client keeps reqwest for ([`ReadTransport::for_base`] is `None`): a
//! Gateway reached through a proxy from the environment (`HTTP_PROXY`, `HTTPS_PROXY`,
//! `ALL_PROXY`, less `NO_PROXY`, read as reqwest reads them), and a base URL with credentials, a
//! query or a fragment.
//!
//! What a read produced is the same [`HttpOutcome`] as reqwest's (`transport.rs`): a status and
//! the body up to [`MAX_BODY_BYTES`], or a transport error reduced to its kind and a PAN-safe
//! reason by the same rules.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper::header::{HeaderValue, ACCEPT, USER_AGENT};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use url::Url;
use uuid::Uuid;

use super::transport::{
    append_capped, error_reason, timeout_reason, HttpOutcome, TransportError, TransportErrorKind,
};
use super::wire::CORRELATION_HEADER;

/// How long an idle connection stays in the pool (reqwest's default).
const POOL_IDLE: Duration = Duration::from_secs(90);

/// The card reads' HTTP client: one per Gateway client, whose reads share its pool.
#[derive(Debug)]
pub(crate) struct ReadTransport {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    /// The base URL without its trailing `/`, to which a read's path is appended.
    base: String,
    user_agent: HeaderValue,
    /// The client's timeout, which a timeout's reason names.
    timeout: Duration,
}

impl ReadTransport {
    /// The transport of the card reads of the Gateway at `base`, or `None` when reqwest must
    /// send them: `proxies` (the environment's, [`Matcher::from_env`]) sends the base URL
    /// through a proxy, or the URL carries credentials, a query or a fragment.
    pub(crate) fn for_base(
        base: &Url,
        timeout: Duration,
        proxies: &Matcher,
        user_agent: &'static str,
    ) -> anyhow::Result<Option<Self>> {
        if !base.username().is_empty()
            || base.password().is_some()
            || base.query().is_some()
            || base.fragment().is_some()
        {
            return Ok(None);
        }
        let uri: hyper::Uri = base
            .as_str()
            .parse()
            .map_err(|e| anyhow::anyhow!("the gateway base URL as an HTTP URI: {e}"))?;
        if proxies.intercept(&uri).is_some() {
            return Ok(None);
        }
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        // The TLS connector wraps it for https.
        http.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
            .map_err(|e| anyhow::anyhow!("the card reads' TLS settings: {e}"))?
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE)
            .build(https);
        Ok(Some(Self {
            client,
            base: base.as_str().trim_end_matches('/').to_owned(),
            user_agent: HeaderValue::from_static(user_agent),
            timeout,
        }))
    }

    /// `GET <base>/v1/cards/<card_ref>/<suffix>`, or `None` when `card_ref` is not written in
    /// a URL path as it is (the caller builds its URL with [`Url`] then, which escapes it).
    pub(crate) fn path_of(&self, card_ref: &str, suffix: &str) -> Option<String> {
        let plain = !matches!(card_ref, "" | "." | "..")
            && card_ref
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~'));
        plain.then(|| format!("{}/v1/cards/{card_ref}/{suffix}", self.base))
    }

    /// Sends `GET url` and reads the answer, all within `hold` of now (a read the caller stopped
    /// waiting for runs on until then).
    pub(crate) async fn exchange(
        &self,
        url: Result<String, String>,
        correlation_id: Uuid,
        hold: Duration,
    ) -> HttpOutcome {
        let request = match url.and_then(|url| self.request(url, correlation_id)) {
            Ok(request) => request,
            Err(reason) => return HttpOutcome::NotSent(reason),
        };
        let deadline = tokio::time::Instant::now() + hold;
        let response = match tokio::time::timeout_at(deadline, self.client.request(request)).await {
            Err(_) => return HttpOutcome::NoAnswer(TransportError::timed_out(self.timeout)),
            Ok(Err(error)) => return HttpOutcome::NoAnswer(self.request_error(&error)),
            Ok(Ok(response)) => response,
        };
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut read = Vec::new();
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => {
                    return HttpOutcome::BodyLost {
                        status,
                        error: TransportError::timed_out(self.timeout),
                    }
                }
                Ok(None) => return HttpOutcome::Answer { status, body: read },
                Ok(Some(Err(error))) => {
                    return HttpOutcome::BodyLost {
                        status,
                        error: TransportError {
                            kind: TransportErrorKind::Other,
                            reason: error_reason(&error, "error reading body", self.timeout),
                        },
                    }
                }
                Ok(Some(Ok(frame))) => frame,
            };
            // Trailers carry no body.
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            if append_capped(&mut read, &chunk) {
                return HttpOutcome::Oversized { status, body: read };
            }
        }
    }

    fn request(
        &self,
        url: String,
        correlation_id: Uuid,
    ) -> Result<hyper::Request<Empty<Bytes>>, String> {
        let mut id = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let id = correlation_id.hyphenated().encode_lower(&mut id);
        hyper::Request::get(url)
            .header(ACCEPT, HeaderValue::from_static("application/json"))
            .header(USER_AGENT, self.user_agent.clone())
            .header(CORRELATION_HEADER, &*id)
            .body(Empty::new())
            .map_err(|e| format!("request error: {e}"))
    }

    /// A request that got no answer: a connection that could not be opened is `Connect`, one
    /// whose connect ran out of time a `Timeout` (as reqwest counts it), anything else `Other`.
    fn request_error(&self, error: &hyper_util::client::legacy::Error) -> TransportError {
        let reason = error_reason(
            error,
            if error.is_connect() {
                "connect error"
            } else {
                "request error"
            },
            self.timeout,
        );
        let kind = if reason == timeout_reason(self.timeout) {
            TransportErrorKind::Timeout
        } else if error.is_connect() {
            TransportErrorKind::Connect
        } else {
            TransportErrorKind::Other
        };
        TransportError { kind, reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transport(base: &str, proxies: &Matcher) -> anyhow::Result<Option<ReadTransport>> {
        ReadTransport::for_base(&Url::parse(base)?, Duration::from_secs(1), proxies, "t/1")
    }

    #[test]
    fn a_read_path_is_the_one_the_url_builder_writes_or_left_to_it() -> anyhow::Result<()> {
        let none = Matcher::builder().build();
        for base in [
            "http://127.0.0.1:1",
            "http://127.0.0.1:1/gw/",
            "https://gw.example/x",
        ] {
            let reads = transport(base, &none)?.ok_or_else(|| anyhow::anyhow!("no transport"))?;
            let plain = ["c-1", "C_2.x~", "01J9ZQ3K7Y"];
            let escaped = [
                "a/b", "..", ".", "", "a b", "%41", "ü", "a?b#c", "a\\b", "x\t",
            ];
            for card_ref in plain.into_iter().chain(escaped) {
                let mut url = Url::parse(base)?;
                url.path_segments_mut()
                    .map_err(|()| anyhow::anyhow!("no path"))?
                    .pop_if_empty()
                    .extend(["v1", "cards", card_ref, "data"]);
                match reads.path_of(card_ref, "data") {
                    Some(path) => assert_eq!(path, url.as_str(), "{base} {card_ref:?}"),
                    None => assert!(
                        escaped.contains(&card_ref),
                        "{card_ref:?} is plain but left to the URL builder"
                    ),
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_gateway_behind_a_proxy_or_with_credentials_is_read_through_reqwest() -> anyhow::Result<()>
    {
        let proxied = Matcher::builder()
            .http("http://proxy.internal:3128")
            .build();
        assert!(transport("http://gw.example", &proxied)?.is_none());
        let bypassed = Matcher::builder()
            .http("http://proxy.internal:3128")
            .no("gw.example")
            .build();
        assert!(transport("http://gw.example", &bypassed)?.is_some());
        // An https Gateway is proxied only by an https (or all) proxy, as reqwest reads them.
        assert!(transport("https://gw.example", &proxied)?.is_some());
        let none = Matcher::builder().build();
        assert!(transport("http://u:p@gw.example", &none)?.is_none());
        assert!(transport("http://gw.example/?k=v", &none)?.is_none());
        assert!(transport("http://gw.example", &none)?.is_some());
        Ok(())
    }

    /// A server that answers one request with `answer` and hands back the request's head.
    async fn recording(
        answer: &'static str,
    ) -> anyhow::Result<(String, tokio::sync::oneshot::Receiver<String>)> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.ends_with(b"\r\n\r\n") {
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = tx.send(String::from_utf8_lossy(&head).into_owned());
            let _ = socket.write_all(answer.as_bytes()).await;
        });
        Ok((base, rx))
    }

    #[tokio::test]
    async fn a_card_read_sends_the_contracts_path_and_headers_and_reads_the_answer(
    ) -> anyhow::Result<()> {
        let (base, head) =
            recording("HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"a\":\"b\"}  ").await?;
        let reads = transport(&base, &Matcher::builder().build())?
            .ok_or_else(|| anyhow::anyhow!("no transport"))?;
        let id = Uuid::now_v7();
        let outcome = reads
            .exchange(
                reads
                    .path_of("c-1", "status")
                    .ok_or_else(|| anyhow::anyhow!("no path"))
                    .map_err(|e| e.to_string()),
                id,
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(
            outcome,
            HttpOutcome::Answer {
                status: 200,
                body: b"{\"a\":\"b\"}  ".to_vec()
            }
        );
        let head = head.await?.to_ascii_lowercase();
        assert!(
            head.starts_with("get /v1/cards/c-1/status http/1.1\r\n"),
            "{head}"
        );
        for line in [
            "accept: application/json".to_owned(),
            "user-agent: t/1".to_owned(),
            format!("x-correlation-id: {id}"),
        ] {
            assert!(
                head.contains(&format!("\r\n{line}\r\n")),
                "{line} not in {head}"
            );
        }
        Ok(())
    }

    /// A read of card `c-1`'s data from the Gateway at `base`, no proxy, within `hold`.
    async fn read_data(base: &str, hold: Duration) -> anyhow::Result<HttpOutcome> {
        let reads = transport(base, &Matcher::builder().build())?
            .ok_or_else(|| anyhow::anyhow!("no transport"))?;
        let url = reads
            .path_of("c-1", "data")
            .ok_or_else(|| anyhow::anyhow!("no path"))?;
        Ok(reads.exchange(Ok(url), Uuid::now_v7(), hold).await)
    }

    #[tokio::test]
    async fn a_refused_read_is_a_connect_failure_and_a_silent_gateway_a_timeout(
    ) -> anyhow::Result<()> {
        // Bind, learn the port, close: nothing listens there any more.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let base = format!("http://127.0.0.1:{port}");
        assert_eq!(
            read_data(&base, Duration::from_secs(5)).await?,
            HttpOutcome::NoAnswer(TransportError {
                kind: TransportErrorKind::Connect,
                reason: "connection refused".to_owned()
            })
        );

        // A Gateway that takes the request and never answers: no answer within the hold.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let held = tokio::spawn(async move { listener.accept().await.map(|(socket, _)| socket) });
        assert_eq!(
            read_data(&base, Duration::from_millis(200)).await?,
            HttpOutcome::NoAnswer(TransportError {
                kind: TransportErrorKind::Timeout,
                reason: "timeout after 1000 ms".to_owned()
            })
        );
        drop(held.await?);
        Ok(())
    }

    #[tokio::test]
    async fn an_https_read_of_a_server_that_speaks_no_tls_is_a_connect_failure(
    ) -> anyhow::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        // It answers in plain HTTP at once, whatever it is sent.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("https://{}", listener.local_addr()?);
        tokio::spawn(async move {
            if let Ok((mut socket, _)) = listener.accept().await {
                let _ = socket
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await;
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        });
        let HttpOutcome::NoAnswer(error) = read_data(&base, Duration::from_secs(5)).await? else {
            anyhow::bail!("expected no answer");
        };
        assert_eq!(error.kind, TransportErrorKind::Connect, "{}", error.reason);
        assert!(
            error.reason.starts_with("connect error: "),
            "{}",
            error.reason
        );
        Ok(())
    }
}
