//! What the transport produced for one call ([`HttpOutcome`]: a status and body bytes, a status
//! and a lost body, no answer at all, or a request never sent), and how it is read off `reqwest`:
//! the body up to [`MAX_BODY_BYTES`], a transport error reduced to its kind and a short, PAN-safe
//! reason ([`error_reason`], which `reads.rs` shares for the card reads it sends on hyper).
//! Classification (`classify.rs`) reads these plain values, never a `reqwest` or `hyper` type.

use std::error::Error as StdError;
use std::time::Duration;

use super::mask::{redact_digits, truncate};

/// How a transport error happened, as far as classification cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransportErrorKind {
    /// The connection could not be opened: the request never left.
    Connect,
    /// The call (or its connect) ran out of time; the request may have left.
    Timeout,
    /// Anything else, e.g. the connection dropped after the request was sent.
    Other,
}

/// A transport error reduced to what classification needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TransportError {
    pub kind: TransportErrorKind,
    /// Short and PAN-safe, e.g. `connection refused` or `timeout after 5000 ms`.
    pub reason: String,
}

impl TransportError {
    /// A call that ran out of `timeout` (the client's) before it had its answer.
    pub(crate) fn timed_out(timeout: Duration) -> Self {
        Self {
            kind: TransportErrorKind::Timeout,
            reason: timeout_reason(timeout),
        }
    }
}

/// The reason of a call that ran out of `timeout`: `timeout after <ms> ms`.
pub(crate) fn timeout_reason(timeout: Duration) -> String {
    format!("timeout after {} ms", timeout.as_millis())
}

/// What the transport produced for one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HttpOutcome {
    /// The request could not even be built (e.g. a URL that takes no path); nothing was sent.
    NotSent(String),
    /// No status at all.
    NoAnswer(TransportError),
    /// A status, but reading the body failed.
    BodyLost { status: u16, error: TransportError },
    /// A status and a fully read body.
    Answer { status: u16, body: Vec<u8> },
    /// A status and a body longer than [`MAX_BODY_BYTES`]: its first that many
    /// bytes (the rest was not read). A 2xx is unknown; any other status is classified on the cut
    /// body.
    Oversized { status: u16, body: Vec<u8> },
}

/// The most bytes of a response body the client reads (256 KiB; every answer of the contract is
/// well under 1 KiB). A longer 2xx body is unknown; a longer error body is cut to this. A Gateway
/// that streams without end is cut off here, not only by the timeout, and never fills memory.
/// What an oversized answer means is the classification's to decide ([`HttpOutcome::Oversized`]).
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// Appends `chunk` to `body`, up to [`MAX_BODY_BYTES`] in all; true when it was cut there (the
/// answer is [`HttpOutcome::Oversized`], and the rest is not read).
pub(crate) fn append_capped(body: &mut Vec<u8>, chunk: &[u8]) -> bool {
    let room = MAX_BODY_BYTES - body.len();
    body.extend_from_slice(&chunk[..chunk.len().min(room)]);
    chunk.len() > room
}

/// Sends one request and reads the whole body; `timeout` is the client's, for the reason of a
/// call that ran out of time.
pub(crate) async fn exchange(
    req: Result<reqwest::RequestBuilder, String>,
    timeout: Duration,
) -> HttpOutcome {
    match req {
        Err(reason) => HttpOutcome::NotSent(reason),
        Ok(builder) => match builder.send().await {
            Err(error) => HttpOutcome::NoAnswer(transport_error(&error, timeout)),
            Ok(resp) => read_body(resp, timeout).await,
        },
    }
}

/// Reads the body, at most [`MAX_BODY_BYTES`] of it (chunk by chunk: the rest is never read).
async fn read_body(mut resp: reqwest::Response, timeout: Duration) -> HttpOutcome {
    let status = resp.status().as_u16();
    let mut body = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                if append_capped(&mut body, &chunk) {
                    return HttpOutcome::Oversized { status, body };
                }
            }
            Ok(None) => return HttpOutcome::Answer { status, body },
            Err(error) => {
                return HttpOutcome::BodyLost {
                    status,
                    error: transport_error(&error, timeout),
                }
            }
        }
    }
}

/// A `reqwest` error reduced to its kind and a short reason.
fn transport_error(e: &reqwest::Error, timeout: Duration) -> TransportError {
    // A connect that timed out may have raced a request out: it counts as a timeout.
    let kind = if e.is_timeout() {
        TransportErrorKind::Timeout
    } else if e.is_connect() {
        TransportErrorKind::Connect
    } else {
        TransportErrorKind::Other
    };
    TransportError {
        kind,
        reason: transport_reason(e, timeout),
    }
}

/// A short reason for a transport error, e.g. `connection refused` or `timeout after 5000 ms`.
/// Whatever `reqwest` or the OS said is digit-redacted and cut to 256 bytes.
fn transport_reason(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        return timeout_reason(timeout);
    }
    let prefix = if e.is_connect() {
        "connect error"
    } else if e.is_body() || e.is_decode() {
        "error reading body"
    } else {
        "request error"
    };
    error_reason(e, prefix, timeout)
}

/// The reason for an HTTP client's error `e` (reqwest's or hyper's), by its causes: the kind of
/// the OS error under it where it is one that classification names (`connection refused`,
/// `connection reset`, `timeout after <timeout> ms`), else `prefix` and the deepest cause's
/// text, digit-redacted and cut to 256 bytes.
pub(crate) fn error_reason<E: StdError + 'static>(
    e: &E,
    prefix: &str,
    timeout: Duration,
) -> String {
    let mut source: Option<&(dyn StdError + 'static)> = e.source();
    let mut deepest = None;
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            match io.kind() {
                std::io::ErrorKind::ConnectionRefused => return "connection refused".to_owned(),
                std::io::ErrorKind::ConnectionReset => return "connection reset".to_owned(),
                std::io::ErrorKind::TimedOut => return timeout_reason(timeout),
                _ => {}
            }
        }
        deepest = Some(s.to_string());
        source = s.source();
    }
    let detail = deepest.unwrap_or_else(|| e.to_string());
    truncate(format!("{prefix}: {}", redact_digits(&detail)), 256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_refused_connection_is_classified_from_its_kind() -> anyhow::Result<()> {
        // Bind, learn the port, close: nothing listens there any more.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let timeout = Duration::from_secs(2);
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()?;
        let Err(e) = http.get(format!("http://127.0.0.1:{port}/")).send().await else {
            anyhow::bail!("expected a connect error");
        };
        assert_eq!(
            transport_error(&e, timeout),
            TransportError {
                kind: TransportErrorKind::Connect,
                reason: "connection refused".to_owned()
            }
        );
        Ok(())
    }
}
