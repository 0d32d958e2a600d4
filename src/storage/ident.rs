//! Identifiers: the keys the product stores, compares and returns exactly as received.
//!
//! Spec section 10: a callback id, payment or approval id, `channel`, `channel_ref`, `card_ref`,
//! idempotency key or outbox aggregate id is a key, and two distinct keys must never become one.
//! So an identifier is never masked or normalised on its way to storage; card-number masking
//! (`telemetry::pan`, through `storage::fault::clean`) is for free text only.
//!
//! What an identifier may not be is decided here, once, and refused with a clear reason where it
//! enters the product ([`check`]): empty, longer than [`MAX_CHARS`], or holding a control
//! character (a NUL PostgreSQL refuses, a line break that would forge a log line).
//!
//! In JSON that is stored (audit details, outbox payloads, callback bodies), a field is an
//! identifier by its name ([`is_identifier_field`]): its string values are kept exactly and
//! everything else is free text.

/// The longest identifier accepted, in characters.
pub const MAX_CHARS: usize = 200;

/// Why an identifier is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentError {
    /// Nothing was given.
    #[error("{what} is empty")]
    Empty {
        /// Which identifier (`callback_id`, `card_ref`, …).
        what: &'static str,
    },
    /// Longer than [`MAX_CHARS`].
    #[error("{what} is {chars} characters long; at most {MAX_CHARS} are accepted")]
    TooLong {
        /// Which identifier.
        what: &'static str,
        /// Its length in characters.
        chars: usize,
    },
    /// A control character (U+0000–U+001F, U+007F–U+009F) at a character position.
    #[error("{what} holds a control character (U+{code:04X}) at character {at}")]
    Control {
        /// Which identifier.
        what: &'static str,
        /// The character's code point.
        code: u32,
        /// Its position, from 0, in characters.
        at: usize,
    },
}

/// Checks that `value` may be stored as the identifier `what`: not empty, at most [`MAX_CHARS`]
/// characters, no control character. It is never changed: what passes is stored as it is.
pub fn check(what: &'static str, value: &str) -> Result<(), IdentError> {
    if value.is_empty() {
        return Err(IdentError::Empty { what });
    }
    if let Some((at, c)) = value.chars().enumerate().find(|(_, c)| c.is_control()) {
        return Err(IdentError::Control {
            what,
            code: u32::from(c),
            at,
        });
    }
    let chars = value.chars().count();
    if chars > MAX_CHARS {
        return Err(IdentError::TooLong { what, chars });
    }
    Ok(())
}

/// Whether a JSON field of this name holds an identifier: `channel`, or a name ending in `_id`,
/// `_ids`, `_ref`, `_refs` or `_key` (`card_ref`, `callback_id`, `payment_id`,
/// `arrived_channel_ref`, `resource_id`, `idempotency_key`, …).
pub fn is_identifier_field(name: &str) -> bool {
    name == "channel"
        || ["_id", "_ids", "_ref", "_refs", "_key"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_numeric_id_that_looks_like_a_card_number_is_a_valid_identifier() {
        for id in [
            "4111111111111111",
            "c-1",
            "ch/ref 7",
            "状态-1",
            &"x".repeat(MAX_CHARS),
        ] {
            assert_eq!(check("callback_id", id), Ok(()), "{id}");
        }
    }

    #[test]
    fn empty_overlong_and_control_character_identifiers_are_refused_with_their_reason() {
        assert_eq!(
            check("callback_id", "").unwrap_err().to_string(),
            "callback_id is empty"
        );
        assert_eq!(
            check("card_ref", &"x".repeat(MAX_CHARS + 1))
                .unwrap_err()
                .to_string(),
            format!(
                "card_ref is {} characters long; at most {MAX_CHARS} are accepted",
                MAX_CHARS + 1
            )
        );
        assert_eq!(
            check("channel", "a\nb").unwrap_err().to_string(),
            "channel holds a control character (U+000A) at character 1"
        );
        assert!(matches!(
            check("channel", "a\0"),
            Err(IdentError::Control { code: 0, at: 1, .. })
        ));
    }

    #[test]
    fn identifier_fields_are_known_by_their_names() {
        for name in [
            "channel",
            "card_ref",
            "callback_id",
            "payment_id",
            "arrived_channel_ref",
            "resource_ids",
            "idempotency_key",
        ] {
            assert!(is_identifier_field(name), "{name}");
        }
        for name in [
            "reason", "summary", "status", "body", "identity", "channels",
        ] {
            assert!(!is_identifier_field(name), "{name}");
        }
    }
}
