//! The masking primitives of the gateway: what turns a value from a body into text that may be
//! logged and stored. A card number (PAN; `telemetry::pan` says how one is recognised) is
//! masked, as spec section 1 forbids keeping one; values are truncated so that a reason stays
//! short.
//!
//! Both the wire decoders (`wire.rs`, whose errors quote values only as [`Redacted`]) and the
//! summaries (`redact.rs`) use these, which is why they sit in a file of their own below both.

use std::fmt;

use serde_json::Value;

/// Longest single value quoted in a summary or a reason, in bytes.
const VALUE_MAX_BYTES: usize = 64;

/// A value from a body, redacted and truncated, fit to be quoted in a failure reason. The only
/// way to build one is [`Redacted::value`], so an error type that holds body values only as
/// `Redacted` cannot carry a card number.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Redacted(String);

impl Redacted {
    pub(crate) fn value(s: &str) -> Self {
        Self(summarize_str(s))
    }
}

impl fmt::Display for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Quotes like a `String` does, so `{:?}` renders `"value"`.
impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// A short, redacted rendering of one string value.
pub(super) fn summarize_str(s: &str) -> String {
    truncate(redact_digits(s), VALUE_MAX_BYTES)
}

/// Masks every card number (PAN) in `s`: a run of 13 to 19 digits passing Luhn, whatever
/// separators sit between them (`telemetry::pan`, the one masker).
pub fn redact_digits(s: &str) -> String {
    crate::telemetry::pan::mask_pans(s).into_owned()
}

/// Cuts `s` to at most `max` bytes on a char boundary, marking the cut with `...`.
pub(super) fn truncate(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut cut = max.saturating_sub(3);
    while cut > 0 && !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push_str("...");
    s
}

/// The JSON type of a value, for messages that must not quote the value itself.
pub(super) fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_numbers_are_redacted() {
        assert_eq!(
            redact_digits("pan 4242 4242 4242 4242 ok"),
            "pan [redacted] ok"
        );
        assert_eq!(redact_digits("4242424242424242"), "[redacted]");
        assert_eq!(redact_digits("4242-4242-4242-4242"), "[redacted]");
        assert_eq!(redact_digits("4242.4242/4242  4242"), "[redacted]");
        assert_eq!(redact_digits("tok_4242424242424242x"), "tok_[redacted]x");
        assert_eq!(
            redact_digits("last4 4242, year 2030"),
            "last4 4242, year 2030"
        );
        // Twelve digits, or sixteen that fail Luhn, are no card number.
        assert_eq!(redact_digits("123456789012"), "123456789012");
        assert_eq!(redact_digits("4242424242424243"), "4242424242424243");
    }

    #[test]
    fn summaries_are_truncated_on_a_char_boundary() {
        let s = truncate("é".repeat(600), 512);
        assert!(s.len() <= 512);
        assert!(s.ends_with("..."));
        assert_eq!(truncate("short".to_owned(), 512), "short");
    }

    #[test]
    fn a_redacted_value_quotes_like_a_string() {
        let r = Redacted::value("pan 4111111111111111");
        assert_eq!(format!("{r:?}"), "\"pan [redacted]\"");
        assert_eq!(r.to_string(), "pan [redacted]");
    }
}
