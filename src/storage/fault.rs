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
//! Gateway error body may carry one, as free text may carry a card number: every writer of
//! investigable records passes its free text through [`clean`] (and JSON through [`clean_json`])
//! first. Identifiers are not free text: they are stored exactly (`storage::ident`).

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

/// Free `text` fit to be stored: no NUL characters (each becomes U+FFFD) and no card number
/// (every PAN masked, `telemetry::pan`); borrowed when there was nothing to change. Every free
/// text the records write goes through it, so external text (a reason, a summary) never stores a
/// PAN, whoever built it. Never an identifier: two distinct ids must not become one
/// (`storage::ident`).
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

/// `value` fit to be stored as jsonb: its free text [`clean`]ed (no NUL, which jsonb refuses as
/// `\u0000`, and no PAN), and the string values of its identifier fields
/// (`storage::ident::is_identifier_field`) kept exactly, but for a NUL. A number is free text: a
/// number that is a PAN becomes the masked string.
pub fn clean_json(value: &serde_json::Value) -> Cow<'_, serde_json::Value> {
    use serde_json::Value;

    /// How a value is read: as free text, or as the value of an identifier field.
    #[derive(Clone, Copy)]
    enum Read {
        Free,
        Identifier,
    }
    fn string(s: &str, read: Read) -> Cow<'_, str> {
        match read {
            Read::Free => clean(s),
            Read::Identifier if s.contains('\0') => Cow::Owned(s.replace('\0', "\u{FFFD}")),
            Read::Identifier => Cow::Borrowed(s),
        }
    }
    fn field_read(name: &str) -> Read {
        if crate::storage::ident::is_identifier_field(name) {
            Read::Identifier
        } else {
            Read::Free
        }
    }
    fn dirty(v: &Value, read: Read) -> bool {
        match v {
            Value::String(s) => matches!(string(s, read), Cow::Owned(_)),
            Value::Array(a) => a.iter().any(|v| dirty(v, read)),
            Value::Object(o) => o
                .iter()
                .any(|(k, v)| matches!(clean(k), Cow::Owned(_)) || dirty(v, field_read(k))),
            Value::Number(n) => matches!(clean(&n.to_string()), Cow::Owned(_)),
            _ => false,
        }
    }
    fn owned(v: &Value, read: Read) -> Value {
        match v {
            Value::String(s) => Value::String(string(s, read).into_owned()),
            Value::Number(n) => match clean(&n.to_string()) {
                Cow::Owned(masked) => Value::String(masked),
                Cow::Borrowed(_) => v.clone(),
            },
            Value::Array(a) => Value::Array(a.iter().map(|v| owned(v, read)).collect()),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, v)| (clean(k).into_owned(), owned(v, field_read(k))))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
    if dirty(value, Read::Free) {
        Cow::Owned(owned(value, Read::Free))
    } else {
        Cow::Borrowed(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_keeps_identifier_fields_exactly_and_masks_free_text() {
        let value = serde_json::json!({
            "callback_id": "4111111111111111",
            "card_refs": ["4012888888881881"],
            "reason": "unknown card 4111 1111 1111 1111",
            "nested": {"payment_id": "5555555555554444", "note": "5555-5555-5555-4444"},
            "amount": 4111111111111111_u64,
        });
        let cleaned = clean_json(&value);
        assert_eq!(cleaned["callback_id"], "4111111111111111");
        assert_eq!(cleaned["card_refs"][0], "4012888888881881");
        assert_eq!(cleaned["nested"]["payment_id"], "5555555555554444");
        assert_eq!(cleaned["reason"], "unknown card [redacted]");
        assert_eq!(cleaned["nested"]["note"], "[redacted]");
        assert_eq!(cleaned["amount"], "[redacted]");
    }

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
