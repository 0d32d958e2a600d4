//! Secrets in the configuration: [`SecretUrl`] holds a URL that may carry a password, and
//! [`Config::redacted`] is the copy that is safe to print.
//!
//! The redaction is in `Debug` and `Display` rather than left to each caller, because a
//! `Config` ends up in `{:?}` (a log line, a panic message, a test failure) without anyone
//! deciding to print a password.

use std::fmt;

use serde::{Deserialize, Serialize};
use url::Url;

/// A URL that may carry credentials (user info, a `password` query parameter).
///
/// `Debug` and `Display` show it with the password replaced by `***`; [`SecretUrl::expose`]
/// gives the real text to the one place that connects with it. Serde is transparent: TOML and
/// JSON read and write the plain string, so serializing writes the real password, and what is
/// shown to people goes through [`crate::config::Config::redacted`] first.
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

impl fmt::Debug for SecretUrl {
    /// Like the `Debug` of a `String` (quoted), but redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.redacted(), f)
    }
}

impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl From<String> for SecretUrl {
    fn from(url: String) -> Self {
        Self(url)
    }
}

impl From<&str> for SecretUrl {
    fn from(url: &str) -> Self {
        Self(url.to_owned())
    }
}

/// A token (the console's `admin_token`): `Debug` and `Display` show `***` (or `""` when unset),
/// and [`crate::config::Config::redacted`] blanks it, so it is never printed. Serde is transparent.
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

impl fmt::Debug for SecretToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "\"***\"" })
    }
}

impl fmt::Display for SecretToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "" } else { "***" })
    }
}

/// Replaces the password of a URL by `***`. A URL that does not parse is replaced entirely.
pub(super) fn redact_url(raw: &str) -> String {
    let Ok(mut url) = Url::parse(raw) else {
        return if raw.is_empty() {
            String::new()
        } else {
            "***".to_owned()
        };
    };
    let mut changed = false;
    if url.password().is_some() {
        if url.set_password(Some("***")).is_err() {
            return "***".to_owned();
        }
        changed = true;
    }
    let secret_param = |k: &str| k.eq_ignore_ascii_case("password");
    if url.query_pairs().any(|(k, _)| secret_param(&k)) {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret_param(&k) {
                    "***".to_owned()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
        changed = true;
    }
    if changed {
        url.to_string()
    } else {
        raw.to_owned()
    }
}
