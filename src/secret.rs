//! Secrets the configuration carries: [`SecretUrl`] and [`SecretToken`] redact themselves in
//! `Debug` and `Display`, because a `Config` ends up in `{:?}` (a log line, a panic message, a
//! test failure) without anyone deciding to print a password. Serde is transparent for both, so
//! serializing writes the real value: what is shown goes through
//! [`Config::redacted`](crate::config::Config::redacted) first.

use std::fmt;

use serde::{Deserialize, Serialize};
use url::Url;

/// A URL that may carry credentials (user info, a `password` query parameter), shown with the
/// password replaced by `***`; [`SecretUrl::expose`] gives the real text to what connects.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// Wraps a URL as written.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The URL as written, password included: only for connecting.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with its password replaced by `***` (the URL as written if it has none).
    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }
}

impl From<&str> for SecretUrl {
    fn from(url: &str) -> Self {
        Self::new(url)
    }
}

impl From<String> for SecretUrl {
    fn from(url: String) -> Self {
        Self(url)
    }
}

/// A token (the console's `admin_token`), shown as `***` (or empty when unset).
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretToken(String);

impl SecretToken {
    /// Wraps a token.
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// The token, `None` when unset: only for comparing with what a request presents.
    pub fn expose(&self) -> Option<&str> {
        (!self.0.is_empty()).then_some(self.0.as_str())
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Display for SecretToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "" } else { "***" })
    }
}

/// Like the `Debug` of a `String` (quoted), but of what `Display` shows.
impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// Like the `Debug` of a `String` (quoted), but of what `Display` shows.
impl fmt::Debug for SecretToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// Replaces the password of a URL (user info, a `password` query parameter) by `***`. A URL
/// that does not parse is replaced entirely.
pub fn redact_url(raw: &str) -> String {
    let Ok(mut url) = Url::parse(raw) else {
        return if raw.is_empty() { "" } else { "***" }.to_owned();
    };
    let secret = |k: &str| k.eq_ignore_ascii_case("password");
    let in_query = url.query_pairs().any(|(k, _)| secret(&k));
    if url.password().is_none() && !in_query {
        return raw.to_owned();
    }
    if url.password().is_some() && url.set_password(Some("***")).is_err() {
        return "***".to_owned();
    }
    if in_query {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret(&k) {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    url.to_string()
}
