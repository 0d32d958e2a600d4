//! Who may act, and who they are: the admin token (`Authorization: Bearer`, or the console's
//! login, which asks for the operator's name as well and sets an HttpOnly session cookie) and a
//! CSRF token on every POST.
//!
//! CSRF tokens are bound to what they protect: the console issues, in every form, the HMAC-SHA256
//! of the login session's id under a key drawn when the process starts (`Auth::csrf_token`).
//! A POST from a logged-in browser is accepted only with the token of its own session, so a
//! value the console did not issue for that session (an equal cookie and field an attacker chose,
//! a token of another session, of an older process) is refused. Before login (the login form
//! itself) and for a caller with the Bearer token, the token is bound the same way to a random
//! per-browser cookie (`cw_csrf`, SameSite=Strict) instead. Sessions live in this process's memory
//! (one console replica; a restart logs everyone out and invalidates every token), for
//! [`SESSION_TTL`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use hmac::{Hmac, Mac as _};
use rand::Rng as _;
use sha2::Sha256;

use crate::commands::operator::Operator;

/// How long a login lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// The session cookie.
pub const SESSION_COOKIE: &str = "cw_session";
/// The per-browser cookie that a CSRF token is bound to before login (form field `csrf`).
pub const CSRF_COOKIE: &str = "cw_csrf";
/// The header naming the operator of a Bearer-token request (else [`BEARER_OPERATOR`]).
pub const OPERATOR_HEADER: &str = "x-cardworker-operator";
/// The operator recorded for a Bearer-token request that names nobody.
pub const BEARER_OPERATOR: &str = "admin-token";
/// Longest operator name accepted at login, in characters.
pub const OPERATOR_NAME_MAX: usize = 64;

/// A fresh random token (256 bits, hex).
pub fn random_token() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    hex(&bytes)
}

fn hex(bytes: &[u8]) -> String {
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

/// A name given at login, checked: trimmed, 1..=[`OPERATOR_NAME_MAX`] characters, no control
/// characters.
pub fn operator_name(raw: &str) -> Option<String> {
    let name = raw.trim();
    (!name.is_empty()
        && name.chars().count() <= OPERATOR_NAME_MAX
        && !name.chars().any(char::is_control))
    .then(|| name.to_owned())
}

/// One login.
#[derive(Debug, Clone)]
struct Session {
    /// When it ends.
    expiry: Instant,
    /// The name given at login.
    operator: String,
}

/// The admin token, the logged-in sessions and the key of the CSRF tokens.
pub struct Auth {
    /// `console.admin_token`; `None` = read-only.
    token: Option<String>,
    /// The key of the CSRF tokens, drawn when the process starts.
    csrf_key: [u8; 32],
    /// Session id -> its login.
    sessions: Mutex<HashMap<String, Session>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("writable", &self.writable())
            .finish_non_exhaustive()
    }
}

/// Why an action was refused (every one is a 403 and changes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No admin token is configured: the console is read-only.
    ReadOnly,
    /// No valid admin token or session.
    NotAuthorized,
    /// The CSRF token is missing, or not the one the console issued for this session.
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
                "the form's CSRF token is missing, stale or not issued for this session (reload \
                 the page and try again); nothing was changed"
            }
        }
    }
}

impl Auth {
    /// With the configured token (`None` = read-only) and a fresh CSRF key.
    pub fn new(token: Option<String>) -> Self {
        Self {
            token,
            csrf_key: rand::rng().random(),
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

    /// Starts a session for `operator`; returns its id.
    pub fn login(&self, operator: &str) -> String {
        let id = random_token();
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.retain(|_, s| s.expiry > now);
        sessions.insert(
            id.clone(),
            Session {
                expiry: now + SESSION_TTL,
                operator: operator.to_owned(),
            },
        );
        id
    }

    /// Ends the request's session, if any.
    pub fn logout(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, SESSION_COOKIE) {
            let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            sessions.remove(id);
        }
    }

    /// The request's live session: its id and operator.
    fn session(&self, headers: &HeaderMap) -> Option<(String, String)> {
        let id = cookie(headers, SESSION_COOKIE)?;
        let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions
            .get(id)
            .filter(|s| s.expiry > Instant::now())
            .map(|s| (id.to_owned(), s.operator.clone()))
    }

    fn bearer(&self, headers: &HeaderMap) -> bool {
        headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|t| self.is_token(t.trim()))
    }

    /// Whether the request carries the admin token or a live session.
    pub fn is_admin(&self, headers: &HeaderMap) -> bool {
        self.writable() && (self.bearer(headers) || self.session(headers).is_some())
    }

    /// The CSRF token the console issues for `binding` (`session:<id>` or `browser:<cookie>`).
    fn csrf_token(&self, binding: &str) -> String {
        // An HMAC takes a key of any length: this cannot fail.
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.csrf_key) else {
            return random_token();
        };
        mac.update(binding.as_bytes());
        hex(&mac.finalize().into_bytes())
    }

    /// The CSRF token to put in this request's forms: bound to its live session, else to its
    /// browser cookie `browser` (the `cw_csrf` value it has or is about to be given).
    pub fn form_token(&self, headers: &HeaderMap, browser: &str) -> String {
        match self.session(headers) {
            Some((id, _)) => self.csrf_token(&format!("session:{id}")),
            None => self.csrf_token(&format!("browser:{browser}")),
        }
    }

    /// Checks an action's POST and names who is acting: a live session with the CSRF token of
    /// that session, or the Bearer token with the CSRF token of its browser cookie.
    pub fn check(&self, headers: &HeaderMap, form_csrf: Option<&str>) -> Result<Operator, Refusal> {
        if !self.writable() {
            return Err(Refusal::ReadOnly);
        }
        if let Some((id, operator)) = self.session(headers) {
            let issued = self.csrf_token(&format!("session:{id}"));
            return match form_csrf {
                Some(f) if same_secret(&issued, f) => Ok(Operator::console(&operator)),
                _ => Err(Refusal::BadCsrf),
            };
        }
        if self.bearer(headers) {
            self.check_browser_csrf(headers, form_csrf)?;
            let name = headers
                .get(OPERATOR_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(operator_name)
                .unwrap_or_else(|| BEARER_OPERATOR.to_owned());
            return Ok(Operator::console(&name));
        }
        Err(Refusal::NotAuthorized)
    }

    /// The CSRF check of a POST without a session (the login form): the token the console
    /// issued for the request's browser cookie.
    pub fn check_browser_csrf(
        &self,
        headers: &HeaderMap,
        form_csrf: Option<&str>,
    ) -> Result<(), Refusal> {
        let Some(browser) = cookie(headers, CSRF_COOKIE) else {
            return Err(Refusal::BadCsrf);
        };
        let issued = self.csrf_token(&format!("browser:{browser}"));
        match form_csrf {
            Some(f) if same_secret(&issued, f) => Ok(()),
            _ => Err(Refusal::BadCsrf),
        }
    }

    /// The CSRF check of a POST that needs no admin rights (logout): the session's token when
    /// there is a session, else the browser cookie's.
    pub fn check_any_csrf(
        &self,
        headers: &HeaderMap,
        form_csrf: Option<&str>,
    ) -> Result<(), Refusal> {
        match self.session(headers) {
            Some((id, _)) => {
                let issued = self.csrf_token(&format!("session:{id}"));
                match form_csrf {
                    Some(f) if same_secret(&issued, f) => Ok(()),
                    _ => Err(Refusal::BadCsrf),
                }
            }
            None => self.check_browser_csrf(headers, form_csrf),
        }
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
    fn a_session_acts_only_with_the_csrf_token_issued_for_that_session_and_names_its_operator() {
        let auth = Auth::new(Some("0123456789abcdef".to_owned()));
        let session = auth.login("Grace Hopper");
        let logged_in = headers(&[("cookie", &format!("cw_session={session}; cw_csrf=b1"))]);
        let issued = auth.form_token(&logged_in, "b1");
        let by = auth.check(&logged_in, Some(&issued)).expect("accepted");
        assert_eq!(by.actor(), "operator:Grace Hopper");
        // An equal cookie and field the attacker chose, another session's token, none at all.
        let forged = headers(&[("cookie", &format!("cw_session={session}; cw_csrf=x"))]);
        assert_eq!(auth.check(&forged, Some("x")), Err(Refusal::BadCsrf));
        let other = auth.login("Mallory");
        let other_headers = headers(&[("cookie", &format!("cw_session={other}"))]);
        let other_token = auth.form_token(&other_headers, "b1");
        assert_eq!(
            auth.check(&logged_in, Some(&other_token)),
            Err(Refusal::BadCsrf)
        );
        assert_eq!(auth.check(&logged_in, None), Err(Refusal::BadCsrf));
        // The browser token (before login) is not the session's.
        let anon = auth.form_token(&headers(&[]), "b1");
        assert_eq!(auth.check(&logged_in, Some(&anon)), Err(Refusal::BadCsrf));
        // Another process (another key) never issued it either.
        let restarted = Auth::new(Some("0123456789abcdef".to_owned()));
        assert_ne!(restarted.form_token(&logged_in, "b1"), issued);
        auth.logout(&logged_in);
        assert_eq!(
            auth.check(&logged_in, Some(&issued)),
            Err(Refusal::NotAuthorized)
        );
    }

    #[test]
    fn a_bearer_request_needs_the_token_and_the_csrf_token_of_its_browser_cookie() {
        let auth = Auth::new(Some("0123456789abcdef".to_owned()));
        let ok = headers(&[
            ("authorization", "Bearer 0123456789abcdef"),
            ("cookie", "a=b; cw_csrf=xyz"),
            ("x-cardworker-operator", "Ops Bot"),
        ]);
        let issued = auth.form_token(&ok, "xyz");
        assert_eq!(
            auth.check(&ok, Some(&issued)).map(|o| o.actor()),
            Ok("operator:Ops Bot".to_owned())
        );
        assert_eq!(auth.check(&ok, Some("xyz")), Err(Refusal::BadCsrf));
        assert_eq!(auth.check(&ok, None), Err(Refusal::BadCsrf));
        let wrong = headers(&[
            ("authorization", "Bearer 0123456789abcdeX"),
            ("cookie", "cw_csrf=xyz"),
        ]);
        assert_eq!(
            auth.check(&wrong, Some(&issued)),
            Err(Refusal::NotAuthorized)
        );
        let read_only = Auth::new(None);
        assert_eq!(read_only.check(&ok, Some(&issued)), Err(Refusal::ReadOnly));
        assert!(!read_only.is_admin(&ok));
    }

    #[test]
    fn an_operator_name_is_trimmed_bounded_and_free_of_control_characters() {
        assert_eq!(operator_name("  Ada  ").as_deref(), Some("Ada"));
        assert_eq!(operator_name("   "), None);
        assert_eq!(operator_name("a\u{7}b"), None);
        assert_eq!(operator_name(&"x".repeat(65)), None);
        assert!(operator_name(&"x".repeat(64)).is_some());
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
