//! What a PostgreSQL error means for the caller, and text that PostgreSQL refuses.
//!
//! Only **connection-level** trouble is transient: the server is unreachable, restarting or out
//! of connections, the pool timed out, the transaction lost a serialization race. A retry later
//! may succeed, so a job keeps its work for later. Everything else (a constraint or data error, a
//! value PostgreSQL refuses, a decoding error) is **deterministic**: the same write fails the
//! same way every time, so retrying it forever would never record anything and never park a
//! chain. Callers record such a failure (sanitised) and move on.
//!
//! PostgreSQL's `text` and `jsonb` refuse the NUL character (SQLSTATE 22021 and 22P05), and a
//! Gateway error body may carry one: every writer of investigable records passes its text through
//! [`clean`] (and JSON through [`clean_json`]) first.

use std::borrow::Cow;

/// What a database error means for whoever hit it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbFault {
    /// Connection-level: try again later, the work is not lost.
    Transient,
    /// The same statement fails the same way every time: record it and move on.
    Deterministic,
}

/// How an `sqlx` error is classified (see the module docs).
pub fn classify(error: &sqlx::Error) -> DbFault {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => DbFault::Transient,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some(code) if is_transient_sqlstate(code) => DbFault::Transient,
            _ => DbFault::Deterministic,
        },
        _ => DbFault::Deterministic,
    }
}

/// SQLSTATEs that say "not now" rather than "never": connection exceptions (08), insufficient
/// resources (53), operator intervention such as a shutdown or a cancelled statement (57),
/// system errors (58), serialization failures and deadlocks (40001, 40P01), lock not available
/// (55P03).
fn is_transient_sqlstate(code: &str) -> bool {
    matches!(&code[..code.len().min(2)], "08" | "53" | "57" | "58")
        || matches!(code, "40001" | "40P01" | "55P03")
}

/// The classification of the first `sqlx` error in an `anyhow` chain; an error with no database
/// error in it (a timeout of our own, say) counts as transient.
pub fn classify_chain(error: &anyhow::Error) -> DbFault {
    error
        .chain()
        .find_map(|e| e.downcast_ref::<sqlx::Error>())
        .map_or(DbFault::Transient, classify)
}

/// `text` fit to be stored: no NUL characters (each becomes U+FFFD) and no card number (every
/// PAN masked, `telemetry::pan`); borrowed when there was nothing to change. Every text the
/// records write goes through it, so external text (a reason, a summary, a `card_ref`) never
/// stores a PAN, whoever built it.
pub fn clean(text: &str) -> Cow<'_, str> {
    let text = if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(text)
    };
    match crate::telemetry::pan::mask_pans(&text) {
        Cow::Borrowed(_) => text,
        Cow::Owned(masked) => Cow::Owned(masked),
    }
}

/// [`clean`] for an optional text.
pub fn clean_opt(text: Option<&str>) -> Option<Cow<'_, str>> {
    text.map(clean)
}

/// `value` with its strings and keys [`clean`]ed: no NUL (jsonb refuses `\u0000`), no PAN.
pub fn clean_json(value: &serde_json::Value) -> Cow<'_, serde_json::Value> {
    fn dirty(s: &str) -> bool {
        matches!(clean(s), Cow::Owned(_))
    }
    fn has_nul(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => dirty(s),
            serde_json::Value::Array(a) => a.iter().any(has_nul),
            serde_json::Value::Object(o) => o.iter().any(|(k, v)| dirty(k) || has_nul(v)),
            // A number that is a PAN is kept as a masked string.
            serde_json::Value::Number(n) => dirty(&n.to_string()),
            _ => false,
        }
    }
    fn owned(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::String(s) => serde_json::Value::String(clean(s).into_owned()),
            serde_json::Value::Number(n) => match clean(&n.to_string()) {
                Cow::Owned(masked) => serde_json::Value::String(masked),
                Cow::Borrowed(_) => v.clone(),
            },
            serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(owned).collect()),
            serde_json::Value::Object(o) => serde_json::Value::Object(
                o.iter()
                    .map(|(k, v)| (clean(k).into_owned(), owned(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
    if has_nul(value) {
        Cow::Owned(owned(value))
    } else {
        Cow::Borrowed(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_trouble_is_transient_and_everything_else_deterministic() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), DbFault::Transient);
        let io = sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert_eq!(classify(&io), DbFault::Transient);
        assert_eq!(classify(&sqlx::Error::RowNotFound), DbFault::Deterministic);
        for code in ["08006", "57P01", "53300", "40001", "40P01"] {
            assert!(is_transient_sqlstate(code), "{code}");
        }
        for code in ["22021", "23505", "23514", "42703", "22P05"] {
            assert!(!is_transient_sqlstate(code), "{code}");
        }
        let plain = anyhow::anyhow!("timed out");
        assert_eq!(classify_chain(&plain), DbFault::Transient);
        let wrapped = anyhow::Error::new(sqlx::Error::RowNotFound).context("writing");
        assert_eq!(classify_chain(&wrapped), DbFault::Deterministic);
    }

    #[test]
    fn nul_characters_are_replaced_in_text_and_json() {
        assert!(matches!(clean("plain"), Cow::Borrowed("plain")));
        assert_eq!(clean("a\0b"), "a\u{FFFD}b");
        let v = serde_json::json!({"e": "x\0", "k\0": [1, "\0"]});
        let c = clean_json(&v);
        assert!(!c.to_string().contains("\\u0000"), "{c}");
        let plain = serde_json::json!({"e": "x"});
        assert!(matches!(clean_json(&plain), Cow::Borrowed(_)));
    }

    #[test]
    fn a_card_number_is_masked_in_text_and_json_wherever_it_is() {
        assert_eq!(
            clean("unknown card 4111.1111.1111.1111"),
            "unknown card [redacted]"
        );
        let v =
            serde_json::json!({"4111111111111111": ["x 4111-1111-1111-1111", 4111111111111111u64]});
        let c = clean_json(&v).to_string();
        assert!(!c.contains("4111"), "{c}");
    }
}
