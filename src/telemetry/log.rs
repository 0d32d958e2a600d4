//! The log subscriber of the two long-running processes, `cardworker run` and
//! `cardworker gateway-sim`.
//!
//! `make run` starts both in one terminal, and a collector may gather both into one stream, so
//! every line names its process ([`Process`]): a `"process"` key first in each JSON object, and
//! a `worker      | ` column in front of each text line. Unix times in log fields (cron ticks,
//! `scheduled_for`) are rendered with [`rfc3339`], never as a bare integer or `Some(…)`.
//!
//! Every line is masked for card numbers (`telemetry::pan`) before it is written, and the masker
//! reads each value as it was logged, not as an escape made it look: a JSON line is masked string
//! by string and number by number on the decoded values (`mask_json_line`), and the escapes
//! that `{:?}` writes (`\t`, `\n`, `\u{a0}`) count as the separators they stand for
//! ([`pan::mask_pans_escaped`]). So a number split by tabs or line breaks is still found in
//! either format. Identifiers in a line are masked too: a log line is text.

use std::borrow::Cow;
use std::fmt;

use chrono::{DateTime, SecondsFormat};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, JsonFields, Writer};
use tracing_subscriber::fmt::{self as subscriber_fmt, FmtContext};
use tracing_subscriber::registry::LookupSpan;

use super::pan;
use crate::config::LogFormat;

/// The process a log line comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Process {
    /// `cardworker run`.
    Worker,
    /// `cardworker gateway-sim`.
    GatewaySim,
    /// `cardworker console`.
    Console,
}

impl Process {
    /// The name in each log line: `worker`, `gateway-sim` or `console` (the subcommand's name).
    pub const fn as_str(self) -> &'static str {
        match self {
            Process::Worker => "worker",
            Process::GatewaySim => "gateway-sim",
            Process::Console => "console",
        }
    }
}

impl fmt::Display for Process {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Width of the process column of text lines (the longest name), so the two processes of
/// `make run` line up.
const COLUMN: usize = 11;

/// Wraps an event format so that each line names [`Process`].
struct Labelled<F> {
    process: Process,
    json: bool,
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for Labelled<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        // Formatted whole first, so that a card number in any field or message is masked
        // (`telemetry::pan`) before the line leaves the process.
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        let line = if self.json {
            mask_json_line(&line)
        } else {
            pan::mask_pans_escaped(&line)
        };
        if !self.json {
            write!(writer, "{:<COLUMN$} | ", self.process.as_str())?;
            return writer.write_str(&line);
        }
        // The JSON formatter writes one object; the key goes in right after its `{`.
        match line.strip_prefix('{') {
            Some(rest) => {
                let sep = if rest.starts_with('}') { "" } else { "," };
                write!(
                    writer,
                    "{{\"process\":\"{}\"{sep}{rest}",
                    self.process.as_str()
                )
            }
            None => writer.write_str(&line),
        }
    }
}

/// One JSON object with every string (keys included) and every number masked as the text it
/// stands for: each string is decoded, masked and, when the masker changed it, encoded again; a
/// number that is a card number becomes the string `"[redacted]"`. Borrowed when nothing changed.
/// A line that is not well-formed JSON (never written by the JSON formatter) is masked as text.
fn mask_json_line(line: &str) -> Cow<'_, str> {
    if line.chars().filter(char::is_ascii_digit).count() < 13
        && !line.chars().any(|c| ('\u{FF10}'..='\u{FF19}').contains(&c))
    {
        return Cow::Borrowed(line);
    }
    let bytes = line.as_bytes();
    let mut out = String::with_capacity(line.len());
    let mut changed = false;
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'"' => {
                let Some(end) = string_end(bytes, at) else {
                    return pan::mask_pans_escaped(line);
                };
                let literal = &line[at..=end];
                let masked = serde_json::from_str::<String>(literal)
                    .ok()
                    .and_then(|text| match pan::mask_pans_escaped(&text) {
                        Cow::Owned(masked) => serde_json::to_string(&masked).ok(),
                        Cow::Borrowed(_) => None,
                    });
                match masked {
                    Some(masked) => {
                        out.push_str(&masked);
                        changed = true;
                    }
                    None => out.push_str(literal),
                }
                at = end + 1;
            }
            b'-' | b'0'..=b'9' => {
                let end = bytes[at..]
                    .iter()
                    .position(|b| !matches!(b, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                    .map_or(bytes.len(), |n| at + n);
                let number = &line[at..end];
                if pan::contains_pan(number) {
                    out.push('"');
                    out.push_str(pan::MASK);
                    out.push('"');
                    changed = true;
                } else {
                    out.push_str(number);
                }
                at = end;
            }
            _ => {
                let end = bytes[at..]
                    .iter()
                    .position(|b| matches!(b, b'"' | b'-' | b'0'..=b'9'))
                    .map_or(bytes.len(), |n| at + n);
                out.push_str(&line[at..end]);
                at = end;
            }
        }
    }
    if changed {
        Cow::Owned(out)
    } else {
        Cow::Borrowed(line)
    }
}

/// The index of the quote that closes the JSON string opening at `start`.
fn string_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The default filter: info, with sqlx's and apalis's chatter at warn. `RUST_LOG` overrides it.
const DEFAULT_FILTER: &str = "info,sqlx=warn,apalis=warn,apalis_core=warn";

/// Whether text lines are coloured: only when stderr is a terminal and `NO_COLOR` is unset, so
/// that a log redirected to a file or a pipe holds plain text that `grep 'change=data ready'`
/// finds.
fn colour(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the global tracing subscriber of `process` on stderr (once per process; later calls
/// are no-ops).
pub fn init_logging(format: LogFormat, process: Process) {
    use std::io::IsTerminal as _;
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let ansi = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Json => builder
            .fmt_fields(JsonFields::new())
            .event_format(Labelled {
                process,
                json: true,
                inner: subscriber_fmt::format().json().with_current_span(true),
            })
            .try_init(),
        LogFormat::Pretty => builder
            .event_format(Labelled {
                process,
                json: false,
                inner: subscriber_fmt::format(),
            })
            .try_init(),
    };
    // A second init (tests start several apps in one process) keeps the first subscriber.
    drop(result);
}

/// A unix time (seconds) as RFC 3339 in UTC, e.g. `2026-12-01T19:37:00Z`: how log fields and
/// spans show a cron tick or `scheduled_for`. A time outside chrono's range shows the integer.
pub fn rfc3339(unix_secs: i64) -> String {
    DateTime::from_timestamp(unix_secs, 0).map_or_else(
        || unix_secs.to_string(),
        |t| t.to_rfc3339_opts(SecondsFormat::Secs, true),
    )
}

/// [`rfc3339`] of a time that may be absent (`scheduled_for` of a run enqueued by hand):
/// `none` then.
pub fn rfc3339_opt(unix_secs: Option<i64>) -> String {
    unix_secs.map_or_else(|| "none".to_owned(), rfc3339)
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// Collects what the subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    /// The lines one event and one event in a span produce under `format` for `process`.
    fn lines(json: bool, process: Process) -> Vec<String> {
        lines_of(json, process, || {
            tracing::info!(card_ref = "c-1", "first");
            let span = tracing::info_span!("job", scheduled_for = %rfc3339(1_796_125_020));
            let _entered = span.enter();
            tracing::warn!("second");
        })
    }

    /// The lines `log` produces under `format` for `process`.
    fn lines_of(json: bool, process: Process, log: impl FnOnce()) -> Vec<String> {
        let out = Captured::default();
        let builder = tracing_subscriber::fmt()
            .with_writer(out.clone())
            .with_ansi(false);
        let dispatch: tracing::Dispatch = if json {
            builder
                .fmt_fields(JsonFields::new())
                .event_format(Labelled {
                    process,
                    json,
                    inner: subscriber_fmt::format().json().with_current_span(true),
                })
                .finish()
                .into()
        } else {
            builder
                .event_format(Labelled {
                    process,
                    json,
                    inner: subscriber_fmt::format(),
                })
                .finish()
                .into()
        };
        tracing::dispatcher::with_default(&dispatch, log);
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn every_json_line_is_an_object_whose_process_key_names_the_process() {
        for process in [Process::Worker, Process::GatewaySim] {
            let lines = lines(true, process);
            assert_eq!(lines.len(), 2, "{lines:?}");
            for line in &lines {
                let v: serde_json::Value = serde_json::from_str(line).expect(line);
                assert_eq!(v["process"], process.as_str(), "{line}");
                assert!(v["timestamp"].is_string(), "the rest is kept: {line}");
            }
            let first: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
            assert_eq!(first["fields"]["card_ref"], "c-1");
            let second: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
            assert_eq!(second["span"]["scheduled_for"], "2026-12-01T11:37:00Z");
        }
    }

    #[test]
    fn every_text_line_starts_with_the_process_in_an_aligned_column() {
        for (process, prefix) in [
            (Process::Worker, "worker      | "),
            (Process::GatewaySim, "gateway-sim | "),
        ] {
            let lines = lines(false, process);
            assert_eq!(lines.len(), 2, "{lines:?}");
            for line in &lines {
                assert!(line.starts_with(prefix), "{line}");
            }
            assert!(lines[0].contains("first") && lines[0].contains("card_ref=\"c-1\""));
            assert!(
                lines[1].contains("scheduled_for=2026-12-01T11:37:00Z"),
                "{}",
                lines[1]
            );
        }
    }

    /// The oracle's search (independent of the masker): whether the bare digits of `pan` are in
    /// `text` once everything but ASCII digits is taken out.
    fn holds(text: &str, pan: &str) -> bool {
        let digits: String = text.chars().filter(char::is_ascii_digit).collect();
        digits.contains(pan)
    }

    #[test]
    fn a_card_number_split_by_escaped_separators_is_masked_in_json_and_text_lines() {
        const PAN: &str = "4111111111111111";
        for json in [true, false] {
            let lines = lines_of(json, Process::Worker, || {
                let tabbed = "4111\t1111\t1111\t1111";
                let broken = "4111\n1111\r\n1111\u{a0}1111";
                tracing::info!(reason = tabbed, "first");
                tracing::info!(reason = ?broken, "second");
                tracing::info!(reason = %tabbed, number = 4_111_111_111_111_111_u64, "third");
                let span = tracing::info_span!("job", card = tabbed);
                let _entered = span.enter();
                tracing::warn!("declined {broken} and {tabbed:?}");
            });
            let text = lines.join("\n");
            // Each of the four events holds the number at least once (a text line's message
            // keeps its raw line break, so it is not counted by line).
            assert!(text.matches("[redacted]").count() >= 5, "{text}");
            assert!(!holds(&text, PAN), "json={json}: {text}");
            if json {
                for line in &lines {
                    serde_json::from_str::<serde_json::Value>(line).expect(line);
                }
            }
        }
    }

    #[test]
    fn a_json_line_without_a_card_number_is_written_as_it_was() {
        let line = r#"{"a":"4111\t1111","n":-12.5e3,"id":"ffa08263-5281-4469-a0b7-9b403e676268"}"#;
        assert!(matches!(mask_json_line(line), Cow::Borrowed(_)));
        let masked = mask_json_line(r#"{"n":4111111111111111,"s":"x\t4111 1111\t1111 1111"}"#);
        assert_eq!(masked, r#"{"n":"[redacted]","s":"x\t[redacted]"}"#);
    }

    #[test]
    fn text_is_coloured_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(
            !colour(false, None),
            "a log redirected to a file is plain text"
        );
        assert!(!colour(true, Some("1".into())));
        assert!(colour(true, Some("".into())), "an empty NO_COLOR is unset");
    }

    #[test]
    fn unix_times_render_as_rfc3339_in_utc_and_an_absent_one_as_none() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_125_020), "2026-12-01T11:37:00Z");
        assert_eq!(rfc3339_opt(Some(1_796_125_020)), "2026-12-01T11:37:00Z");
        assert_eq!(rfc3339_opt(None), "none");
        assert_eq!(rfc3339(i64::MAX), i64::MAX.to_string());
    }
}
