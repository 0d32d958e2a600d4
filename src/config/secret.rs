//! Secrets in the configuration: URL redaction, and [`Config::redacted`], the copy that is safe
//! to print.

use url::Url;

use super::types::Config;

impl Config {
    /// A copy with the passwords in `database.url`, `redis.url` and `gateway.base_url` (user
    /// info and a `password` query parameter) replaced by `***`.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        c.database.url = redact_url(&c.database.url);
        c.redis.url = redact_url(&c.redis.url);
        c.gateway.base_url = redact_url(&c.gateway.base_url);
        c
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_passwords_only() {
        let mut c = Config::default();
        c.database.url = "postgres://app:s3cret@db:5432/cw?sslmode=verify-full".to_owned();
        c.redis.url = "rediss://:r3dis@cache:6380/0".to_owned();
        let r = c.redacted();
        assert_eq!(
            r.database.url,
            "postgres://app:***@db:5432/cw?sslmode=verify-full"
        );
        assert_eq!(r.redis.url, "rediss://:***@cache:6380/0");
        assert_eq!(r.gateway.base_url, c.gateway.base_url);
        let text = r.to_toml_string().expect("renders");
        assert!(
            !text.contains("s3cret") && !text.contains("r3dis"),
            "{text}"
        );
        let json = serde_json::to_string(&r).expect("json");
        assert!(!json.contains("s3cret"), "{json}");
        assert!(json.contains("\"log_format\":\"json\""), "{json}");
        // Without a password the URL is left as written.
        assert_eq!(
            Config::default().redacted().database.url,
            Config::default().database.url
        );
        assert_eq!(
            redact_url("postgres://db/cw?user=a&password=p"),
            "postgres://db/cw?user=a&password=***"
        );
    }
}
