//! The one PAN masker: what makes free text fit to be stored or logged.
//!
//! Spec section 1 forbids storing or logging a full card number (PAN), and free text (a Gateway
//! reason or summary, a failure reason, a callback body's free fields, a log line) can carry one
//! however it is written. So a PAN is recognised the way a person would still read it: a run of
//! 13 to 19 digits that passes the Luhn check, whatever sits between the digits, as long as it
//! is only separators ([`separator`]: any whitespace including tabs and line breaks, dashes,
//! dots, slashes, underscores, commas and their full-width forms), in runs of any length; and
//! digits may be ASCII or full-width (`０`–`９`).
//!
//! A separated run may hold more than one number (`4111 1111 1111 1111 2030`): every stretch of
//! whole groups of 13 to 19 digits that passes Luhn is masked, so a PAN next to a year is still
//! found. A run of digits without separators is one number: it is masked when it has 13 to 19
//! digits and passes Luhn, and kept otherwise (an id of 20 digits is not a card number). Anything
//! else is kept as written: fewer than 13 digits (`pan_last4`, years, amounts), or a run that
//! fails Luhn.
//!
//! A UUID (8-4-4-4-12 hex digits with dashes) is read group by group: a group that holds a hex
//! letter is a part of an identifier and never part of a number, and the all-digit groups count
//! as written. So a random UUID is kept (`ffa08263-5281-4469-…` holds the Luhn-passing
//! `08263-5281-4469` only across a lettered group), while a card number written as UUID groups
//! (`41111111-1111-1111-0000-000000000000`) is still masked.
//!
//! Only free text is masked. Identifiers (callback, payment and approval ids, `card_ref`,
//! `channel_ref`, outbox aggregate ids) are stored and compared exactly as received (spec
//! section 10), and never pass through here on their way to storage; a log line is text, so
//! identifiers in it are masked like everything else.
//!
//! It lives at layer 2 so that storage (every stored free text, `storage::fault::clean`), the
//! gateway (summaries and reasons) and the log format (every field of every line) share it.

use std::borrow::Cow;

/// What a masked number is replaced with.
pub const MASK: &str = "[redacted]";

/// Shortest and longest PAN, in digits.
const PAN_DIGITS: std::ops::RangeInclusive<usize> = 13..=19;

/// The value of a decimal digit, ASCII or full-width.
fn digit(c: char) -> Option<u8> {
    match c {
        '0'..='9' => Some(c as u8 - b'0'),
        '\u{FF10}'..='\u{FF19}' => Some((c as u32 - 0xFF10) as u8),
        _ => None,
    }
}

/// A character that may sit between the digits of one written number: whitespace of any kind
/// (space, tab, line breaks, no-break and ideographic spaces), dashes, dots, slashes,
/// underscores, commas, and their full-width forms.
pub fn separator(c: char) -> bool {
    c.is_whitespace()
        || matches!(
            c,
            '-' | '.' | '/' | '_' | ',' | '\u{A0}' | '\u{2010}'
                ..='\u{2015}'
                    | '\u{2212}'
                    | '\u{3001}'
                    | '\u{FF0C}'
                    | '\u{FF0D}'
                    | '\u{FF0E}'
                    | '\u{FF0F}'
                    | '\u{FF3F}'
        )
}

/// Whether `digits` pass the Luhn check.
pub fn luhn(digits: &[u8]) -> bool {
    let sum: u32 = digits
        .iter()
        .rev()
        .enumerate()
        .map(|(i, &d)| {
            let d = u32::from(d);
            if i % 2 == 1 {
                let twice = d * 2;
                if twice > 9 {
                    twice - 9
                } else {
                    twice
                }
            } else {
                d
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

/// One group of digits of a run: its char span and its digits.
struct Group {
    start: usize,
    end: usize,
    digits: Vec<u8>,
}

/// Whether `s` holds a PAN (module docs).
pub fn contains_pan(s: &str) -> bool {
    matches!(mask_pans(s), Cow::Owned(_))
}

/// `s` with every PAN (module docs) replaced by [`MASK`]; borrowed when there was none.
pub fn mask_pans(s: &str) -> Cow<'_, str> {
    mask(s, false)
}

/// [`mask_pans`] of text that holds the escapes `{:?}` writes (a log line): `\t`, `\n`, `\r`
/// and a `\u{…}` that stands for a separator count as separators between digits, so a number
/// split by tabs is found after `{:?}` escaped them.
pub fn mask_pans_escaped(s: &str) -> Cow<'_, str> {
    mask(s, true)
}

/// Each escape of `chars` that stands for a separator (`\t`, `\n`, `\r`, `\u{…}`) overwritten
/// with spaces, char for char, so that spans found in the result are spans of `chars`.
fn unescape_separators(scan: &mut [char]) {
    let mut i = 0;
    while i + 1 < scan.len() {
        if scan[i] != '\\' {
            i += 1;
            continue;
        }
        let len = match scan[i + 1] {
            't' | 'n' | 'r' => 2,
            'u' if scan.get(i + 2) == Some(&'{') => {
                let close = scan[i + 3..].iter().position(|&c| c == '}');
                close
                    .and_then(|n| {
                        let hex: String = scan[i + 3..i + 3 + n].iter().collect();
                        u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32)
                    })
                    .filter(|&c| separator(c))
                    .map_or(0, |_| close.map_or(0, |n| n + 4))
            }
            // An escaped backslash is text: skip both chars so its second is not read as the
            // start of an escape.
            '\\' => {
                i += 2;
                continue;
            }
            _ => 0,
        };
        if len == 0 {
            i += 1;
        } else {
            scan[i..i + len].fill(' ');
            i += len;
        }
    }
}

fn mask(s: &str, escaped: bool) -> Cow<'_, str> {
    // Fast path: fewer than 13 digits cannot hold a PAN.
    if s.chars().filter(|&c| digit(c).is_some()).count() < *PAN_DIGITS.start() {
        return Cow::Borrowed(s);
    }
    let chars: Vec<char> = s.chars().collect();
    // What the scan reads: the text with every lettered group of a UUID blanked out, so that
    // no run starts, ends or passes inside one (module docs), and, in escaped text, each escaped
    // separator written as one.
    let mut scan = chars.clone();
    if escaped {
        unescape_separators(&mut scan);
    }
    for (start, end) in uuid_spans(&chars) {
        for (g_start, g_end) in uuid_groups(start) {
            if scan[g_start..g_end].iter().any(|c| !c.is_ascii_digit()) {
                scan[g_start..g_end].fill('\u{0}');
            }
        }
        debug_assert_eq!(end, start + UUID_LEN);
    }
    let chars_out = chars;
    let chars = scan;
    // Char spans to mask, in order, not overlapping.
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if digit(chars[i]).is_none() {
            i += 1;
            continue;
        }
        // One run: groups of digits joined by runs of separators.
        let mut groups: Vec<Group> = Vec::new();
        let mut j = i;
        loop {
            let start = j;
            let mut digits = Vec::new();
            while let Some(d) = chars.get(j).copied().and_then(digit) {
                digits.push(d);
                j += 1;
            }
            groups.push(Group {
                start,
                end: j,
                digits,
            });
            let mut k = j;
            while k < chars.len() && separator(chars[k]) {
                k += 1;
            }
            if k > j && chars.get(k).copied().and_then(digit).is_some() {
                j = k;
            } else {
                break;
            }
        }
        spans.extend(pan_spans(&groups));
        i = j.max(i + 1);
    }
    if spans.is_empty() {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len());
    let mut at = 0;
    for (start, end) in spans {
        out.extend(&chars_out[at..start]);
        out.push_str(MASK);
        at = end;
    }
    out.extend(&chars_out[at..]);
    Cow::Owned(out)
}

/// The lengths of a UUID's five groups of hex digits.
const UUID_GROUPS: [usize; 5] = [8, 4, 4, 4, 12];

/// A UUID's length in chars, dashes included.
const UUID_LEN: usize = 36;

/// The char spans of the five groups of the UUID that starts at `start`.
fn uuid_groups(start: usize) -> impl Iterator<Item = (usize, usize)> {
    UUID_GROUPS.iter().scan(start, |at, &len| {
        let group = (*at, *at + len);
        *at += len + 1;
        Some(group)
    })
}

/// The char spans of the UUIDs in `chars` (8-4-4-4-12 ASCII hex digits joined by dashes, not part
/// of a longer run of hex digits), in order.
fn uuid_spans(chars: &[char]) -> Vec<(usize, usize)> {
    const GROUPS: [usize; 5] = UUID_GROUPS;
    const LEN: usize = UUID_LEN;
    let hex = |c: &char| c.is_ascii_hexdigit();
    let mut spans = Vec::new();
    let mut i = 0;
    while i + LEN <= chars.len() {
        let glued_before = i > 0 && hex(&chars[i - 1]);
        let glued_after = chars.get(i + LEN).is_some_and(hex);
        let mut at = i;
        let shaped = GROUPS.iter().enumerate().all(|(n, &len)| {
            let group = chars[at..at + len].iter().all(hex);
            at += len;
            let dash = n == GROUPS.len() - 1 || chars[at] == '-';
            at += 1;
            group && dash
        });
        if shaped && !glued_before && !glued_after {
            spans.push((i, i + LEN));
            i += LEN;
        } else {
            i += 1;
        }
    }
    spans
}

/// The spans of a run's PANs: the longest stretches of whole groups, leftmost first, of 13 to 19
/// digits that pass Luhn.
fn pan_spans(groups: &[Group]) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut first = 0;
    while first < groups.len() {
        let mut found = None;
        let mut digits: Vec<u8> = Vec::new();
        for (last, g) in groups.iter().enumerate().skip(first) {
            digits.extend(&g.digits);
            if digits.len() > *PAN_DIGITS.end() {
                break;
            }
            if PAN_DIGITS.contains(&digits.len()) && luhn(&digits) {
                found = Some(last);
            }
        }
        match found {
            Some(last) => {
                spans.push((groups[first].start, groups[last].end));
                first = last + 1;
            }
            None => first += 1,
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn a_uuid_is_never_taken_for_a_pan_and_a_pan_beside_one_still_is() {
        // Digit groups of a UUID can pass as a separated 13-digit run that passes Luhn:
        // `08263-5281-4469` in the first id below, across a lettered group.
        for id in [
            "ffa08263-5281-4469-a0b7-9b403e676268",
            "FFA08263-5281-4469-A0B7-9B403E676268",
            "abcdefab-4111-1111-1111-111111111111",
        ] {
            for text in [
                id.to_owned(),
                format!("payment-{id}"),
                format!("{{\"payment_id\":\"{id}\"}}"),
            ] {
                assert_eq!(mask_pans(&text), text.as_str(), "{text}");
            }
            assert_eq!(
                mask_pans(&format!("4111 1111 1111 1111 for {id}")),
                format!("[redacted] for {id}"),
            );
        }
    }

    #[test]
    fn a_card_number_written_as_the_groups_of_a_uuid_is_masked() {
        for (text, masked) in [
            // Sixteen zeros pass Luhn too.
            (
                "41111111-1111-1111-0000-000000000000",
                "[redacted]-[redacted]",
            ),
            (
                "id 41111111-1111-1111-1111-111111111111 end",
                "id [redacted]-1111-111111111111 end",
            ),
        ] {
            assert_eq!(mask_pans(text), masked, "{text}");
        }
    }

    #[test]
    fn a_pan_is_masked_however_it_is_separated_or_written() {
        for written in [
            "4111111111111111",
            "4111 1111 1111 1111",
            "4111-1111-1111-1111",
            "4111.1111.1111.1111",
            "4111/1111/1111/1111",
            "4111  1111 - 1111 / 1111",
            "４１１１１１１１１１１１１１１１",
            "４１１１　１１１１　１１１１　１１１１",
            "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
            "4111_1111_1111_1111",
            "4111,1111,1111,1111",
            "4111\n1111\r\n1111\n1111",
            "4111     1111 -- 1111 ,, 1111",
            "4111 \t \t 1111\t\t\t\t1111    \n   1111",
            "378282246310005",     // 15 digits (Amex)
            "6011000990139424",    // Discover
            "4111111111111111003", // 19 digits passing Luhn
        ] {
            assert!(luhn_ok(written), "fixture {written} must pass Luhn");
            let text = format!("card {written}!");
            assert_eq!(mask_pans(&text), "card [redacted]!", "{written}");
        }
    }

    fn luhn_ok(written: &str) -> bool {
        let digits: Vec<u8> = written.chars().filter_map(digit).collect();
        luhn(&digits)
    }

    #[test]
    fn numbers_that_are_not_pans_are_kept() {
        for kept in [
            "pan_last4 4242, expiry 12/2030",
            "4111111111111112",     // fails Luhn
            "123456789012",         // 12 digits
            "41111111111111111111", // 20 digits in one run
            "order 2026-12-03 amount 1234",
            "payment_id 0b6c8f7e-1d2a-4c3b-9e8f-7a6b5c4d3e2f",
        ] {
            assert_eq!(mask_pans(kept), kept);
        }
    }

    #[test]
    fn a_pan_next_to_other_numbers_is_still_found() {
        assert_eq!(mask_pans("4111 1111 1111 1111 2030"), "[redacted] 2030");
        assert_eq!(mask_pans("12 4111-1111-1111-1111"), "12 [redacted]");
    }

    /// A random PAN of 13 to 19 digits: random digits with the Luhn check digit last.
    fn random_pan(rng: &mut StdRng) -> Vec<u8> {
        let len = rng.random_range(13..=19);
        let mut digits: Vec<u8> = (0..len - 1).map(|_| rng.random_range(0..10)).collect();
        digits.push(0);
        let check = (0..10)
            .find(|&c| {
                *digits.last_mut().expect("non-empty") = c;
                luhn(&digits)
            })
            .expect("one check digit passes");
        *digits.last_mut().expect("non-empty") = check;
        digits
    }

    /// `digits` written with random digit forms and random separators between random digits.
    fn write(rng: &mut StdRng, digits: &[u8]) -> String {
        const SEPARATORS: [char; 16] = [
            ' ', '-', '.', '/', '\t', '\n', '\r', '_', ',', '\u{A0}', '\u{2013}', '\u{3000}',
            '\u{FF0D}', '\u{FF0E}', '\u{FF0F}', '\u{FF0C}',
        ];
        let full_width = rng.random_bool(0.3);
        let mut s = String::new();
        for (i, d) in digits.iter().enumerate() {
            if i > 0 && rng.random_bool(0.3) {
                for _ in 0..rng.random_range(1..=8) {
                    s.push(SEPARATORS[rng.random_range(0..SEPARATORS.len())]);
                }
            }
            let c = if full_width {
                char::from_u32(0xFF10 + u32::from(*d)).expect("full-width digit")
            } else {
                char::from(b'0' + d)
            };
            s.push(c);
        }
        s
    }

    /// Random text without digits or separators at its ends.
    fn words(rng: &mut StdRng) -> String {
        const WORDS: [&str; 8] = [
            "card",
            "token",
            "déclinée",
            "ref:",
            "x",
            "状态",
            "body=",
            "(ok)",
        ];
        (0..rng.random_range(1..4))
            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
            .collect::<Vec<_>>()
            .join("_")
    }

    #[test]
    fn property_random_pans_with_random_separators_in_random_text_are_always_masked() {
        let mut rng = StdRng::seed_from_u64(0x005e_ed28);
        for case in 0..5_000 {
            let pan = random_pan(&mut rng);
            let written = write(&mut rng, &pan);
            let (before, after) = (words(&mut rng), words(&mut rng));
            let text = format!("{before} {written} {after}");
            let masked = mask_pans(&text);
            assert_eq!(
                masked,
                format!("{before} {MASK} {after}"),
                "case {case}: {text:?}"
            );
            let left: Vec<u8> = masked.chars().filter_map(digit).collect();
            assert!(left.len() < 13, "case {case}: digits left in {masked:?}");
        }
    }

    #[test]
    fn property_digit_runs_that_are_not_pans_are_kept() {
        let mut rng = StdRng::seed_from_u64(0x0028_5eed);
        let mut kept = 0;
        for case in 0..5_000 {
            // Short runs (1..=12 digits), or 13..=19 digits failing Luhn, or a 20+ digit run.
            let digits: Vec<u8> = match case % 3 {
                0 => (0..rng.random_range(1..=12))
                    .map(|_| rng.random_range(0..10))
                    .collect(),
                1 => {
                    let mut d = random_pan(&mut rng);
                    let last = d.len() - 1;
                    d[last] = (d[last] + rng.random_range(1..10)) % 10;
                    d
                }
                _ => (0..rng.random_range(20..=30))
                    .map(|_| rng.random_range(0..10))
                    .collect(),
            };
            let written: String = digits.iter().map(|d| char::from(b'0' + d)).collect();
            let text = format!("{} {written} {}", words(&mut rng), words(&mut rng));
            assert_eq!(mask_pans(&text), text, "case {case}");
            kept += 1;
        }
        assert_eq!(kept, 5_000);
    }

    /// Test card numbers of the card schemes, the oracle's fixed list: known PANs, not generated
    /// with this module's Luhn check.
    const TEST_PANS: [&str; 8] = [
        "4111111111111111",
        "4012888888881881",
        "5555555555554444",
        "5105105105105100",
        "378282246310005",
        "6011111111111117",
        "3530111333300000",
        "4222222222222",
    ];

    /// Each way the oracle writes a card number: the separator put between its digits, every
    /// `every` digits.
    const FORMS: [(&str, usize); 16] = [
        ("", 1),
        (" ", 4),
        ("-", 4),
        (".", 4),
        ("/", 4),
        ("_", 4),
        (",", 4),
        ("\t", 4),
        ("\n", 4),
        ("\r\n", 4),
        (" \t ", 3),
        ("    ", 4),
        (" - ", 2),
        ("\u{A0}", 4),
        ("\u{3000}", 4),
        ("__,,", 1),
    ];

    /// `pan` written with `sep` every `every` digits.
    fn written(pan: &str, sep: &str, every: usize) -> String {
        let mut s = String::new();
        for (i, c) in pan.chars().enumerate() {
            if i > 0 && i % every == 0 {
                s.push_str(sep);
            }
            s.push(c);
        }
        s
    }

    /// The oracle's search: whether the bare digits of `pan` are in `text` once everything but
    /// ASCII digits is taken out. It does not use the masker.
    fn holds(text: &str, pan: &str) -> bool {
        let digits: String = text.chars().filter(char::is_ascii_digit).collect();
        digits.contains(pan)
    }

    #[test]
    fn oracle_no_test_card_number_survives_in_any_separator_form() {
        let mut checked = 0;
        for pan in TEST_PANS {
            for (sep, every) in FORMS {
                let form = written(pan, sep, every);
                for text in [
                    form.clone(),
                    format!("declined: card {form}; try again"),
                    format!("{{\"reason\":\"{form}\"}}"),
                ] {
                    assert!(holds(&text, pan), "the oracle sees its own input: {text:?}");
                    let masked = mask_pans(&text);
                    assert!(!holds(&masked, pan), "{pan} survives in {masked:?}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, TEST_PANS.len() * FORMS.len() * 3);
    }

    #[test]
    fn oracle_no_test_card_number_survives_the_escapes_a_log_line_writes() {
        for pan in TEST_PANS {
            for (sep, every) in FORMS {
                let form = written(pan, sep, every);
                // What `{:?}` and a JSON encoder make of the text.
                for text in [format!("{form:?}"), serde_json::json!(form).to_string()] {
                    let masked = mask_pans_escaped(&text);
                    assert!(!holds(&masked, pan), "{pan} survives in {masked:?}");
                }
            }
        }
    }

    #[test]
    fn an_escaped_backslash_before_a_letter_is_not_a_separator() {
        // `\\t` is a backslash and a `t`: the digits either side are two numbers.
        let text = r"4111111\\t111111111";
        assert_eq!(mask_pans_escaped(text), text);
    }
}
