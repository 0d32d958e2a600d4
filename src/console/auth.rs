//! Who may act: the admin token (`Authorization: Bearer`, or the console's login, which sets an
//! HttpOnly session cookie) and a CSRF token on every POST.
//!
//! The CSRF token is a double-submit cookie: every page sets a random `cw_csrf` cookie
//! (SameSite=Strict) and puts the same value in each form; a POST whose form field does not match
//! the cookie is refused. A page of another site can neither read the cookie nor make the browser
//! send it. Sessions live in this process's memory (one console replica; a restart logs everyone
//! out), for [`SESSION_TTL`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use rand::Rng as _;

/// How long a login lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// The session cookie.
pub const SESSION_COOKIE: &str = "cw_session";
/// The CSRF cookie (and form field `csrf`).
pub const CSRF_COOKIE: &str = "cw_csrf";

/// A fresh random token (256 bits, hex).
pub fn random_token() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares two secrets in time independent of where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of cookie `name` in the request, if any.
pub fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty())
}

/// The admin token and the logged-in sessions.
#[derive(Debug)]
pub struct Auth {
    /// `console.admin_token`; `None` = read-only.
    token: Option<String>,
    /// Session id -> expiry.
    sessions: Mutex<HashMap<String, Instant>>,
}

/// Why an action was refused (every one is a 403 and changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No admin token is configured: the console is read-only.
    ReadOnly,
    /// No valid admin token or session.
    NotAuthorized,
    /// The CSRF token is missing or does not match.
    BadCsrf,
}

impl Refusal {
    /// For the 403 page.
    pub fn message(self) -> &'static str {
        match self {
            Refusal::ReadOnly => {
                "this console is read-only: no admin token is configured \
                 (env CARDWORKER__CONSOLE__ADMIN_TOKEN); nothing was changed"
            }
            Refusal::NotAuthorized => {
                "this action needs the admin token (log in, or send Authorization: Bearer); \
                 nothing was changed"
            }
            Refusal::BadCsrf => {
                "the form's CSRF token is missing or stale (reload the page and try again); \
                 nothing was changed"
            }
        }
    }
}

impl Auth {
    /// With the configured token (`None` = read-only).
    pub fn new(token: Option<String>) -> Self {
        Self {
            token,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    /// Whether actions are possible at all.
    pub fn writable(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `presented` is the admin token.
    pub fn is_token(&self, presented: &str) -> bool {
        self.token
            .as_deref()
            .is_some_and(|t| same_secret(t, presented))
    }

    /// Starts a session; returns its id.
    pub fn login(&self) -> String {
        let id = random_token();
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.retain(|_, expiry| *expiry > now);
        sessions.insert(id.clone(), now + SESSION_TTL);
        id
    }

    /// Ends the request's session, if any.
    pub fn logout(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, SESSION_COOKIE) {
            let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            sessions.remove(id);
        }
    }

    /// Whether the request carries the admin token or a live session.
    pub fn is_admin(&self, headers: &HeaderMap) -> bool {
        if !self.writable() {
            return false;
        }
        let bearer = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|t| self.is_token(t.trim())) {
            return true;
        }
        let Some(id) = cookie(headers, SESSION_COOKIE) else {
            return false;
        };
        let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.get(id).is_some_and(|e| *e > Instant::now())
    }

    /// Checks a POST: the admin token (or session) and the CSRF token (`form_csrf` must equal the
    /// request's CSRF cookie).
    pub fn check(&self, headers: &HeaderMap, form_csrf: Option<&str>) -> Result<(), Refusal> {
        if !self.writable() {
            return Err(Refusal::ReadOnly);
        }
        check_csrf(headers, form_csrf)?;
        if !self.is_admin(headers) {
            return Err(Refusal::NotAuthorized);
        }
        Ok(())
    }
}

/// The CSRF check alone (the login form has no session yet).
pub fn check_csrf(headers: &HeaderMap, form_csrf: Option<&str>) -> Result<(), Refusal> {
    match (cookie(headers, CSRF_COOKIE), form_csrf) {
        (Some(c), Some(f)) if same_secret(c, f) => Ok(()),
        _ => Err(Refusal::BadCsrf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    #[test]
    fn an_action_needs_both_the_token_and_a_matching_csrf_token() {
        let auth = Auth::new(Some("0123456789abcdef".to_owned()));
        let ok = headers(&[
            ("authorization", "Bearer 0123456789abcdef"),
            ("cookie", "a=b; cw_csrf=xyz"),
        ]);
        assert_eq!(auth.check(&ok, Some("xyz")), Ok(()));
        assert_eq!(auth.check(&ok, Some("xy")), Err(Refusal::BadCsrf));
        assert_eq!(auth.check(&ok, None), Err(Refusal::BadCsrf));
        let wrong = headers(&[
            ("authorization", "Bearer 0123456789abcdeX"),
            ("cookie", "cw_csrf=xyz"),
        ]);
        assert_eq!(auth.check(&wrong, Some("xyz")), Err(Refusal::NotAuthorized));
        let session = auth.login();
        let logged_in = headers(&[("cookie", &format!("cw_session={session}; cw_csrf=q"))]);
        assert_eq!(auth.check(&logged_in, Some("q")), Ok(()));
        auth.logout(&logged_in);
        assert_eq!(
            auth.check(&logged_in, Some("q")),
            Err(Refusal::NotAuthorized)
        );
        let read_only = Auth::new(None);
        assert_eq!(read_only.check(&ok, Some("xyz")), Err(Refusal::ReadOnly));
        assert!(!read_only.is_admin(&ok));
    }

    #[test]
    fn secrets_compare_equal_only_when_identical() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "abcd"));
        assert!(!same_secret("", "a"));
        assert_ne!(random_token(), random_token());
        assert_eq!(random_token().len(), 64);
    }
}
