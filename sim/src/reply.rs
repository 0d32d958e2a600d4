//! The HTTP responses the handlers share: an [`Answer`] rendered (`503`, a non-JSON `200`, a JSON
//! body), `409 Conflict` for a concurrent `POST`, and `400` with an error message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::answer::Answer;

/// `409 Conflict`: a `POST` with the same `Idempotency-Key` is still being processed.
pub(crate) fn conflict() -> Response {
    (
        StatusCode::CONFLICT,
        Json(json!({"error": "a request with this Idempotency-Key is still being processed"})),
    )
        .into_response()
}

/// `503 Service Unavailable`: a simulated outage.
pub(crate) fn unavailable() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"error": "simulated outage"})),
    )
        .into_response()
}

/// A `200` whose body is HTML, not JSON (a proxy's error page).
fn not_json() -> Response {
    let mut r = (StatusCode::OK, "<html><body>upstream hiccup</body></html>").into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r
}

/// The HTTP response of an [`Answer`].
pub(crate) fn render(answer: Answer) -> Response {
    match answer {
        Answer::Unavailable => unavailable(),
        Answer::NotJson => not_json(),
        Answer::Json(body) => (StatusCode::OK, Json(body)).into_response(),
    }
}

/// `400 Bad Request` with `msg` as the error.
pub(crate) fn bad_request(msg: String) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": msg }))).into_response()
}
