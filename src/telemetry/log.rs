//! The log subscriber of the two long-running processes, `cardworker run` and
//! `cardworker gateway-sim`.
//!
//! `make run` starts both in one terminal, and a collector may gather both into one stream, so
//! every line names its process ([`Process`]): a `"process"` key first in each JSON object, and
//! a `worker      | ` column in front of each text line. Unix times in log fields (cron ticks,
//! `scheduled_for`) are rendered with [`rfc3339`], never as a bare integer or `Some(…)`. Every
//! line is masked for card numbers (`telemetry::pan`) before it is written.

use std::fmt;

use chrono::{DateTime, SecondsFormat};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, JsonFields, Writer};
use tracing_subscriber::fmt::{self as subscriber_fmt, FmtContext};
use tracing_subscriber::registry::LookupSpan;

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
        let line = super::pan::mask_pans(&line);
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
        tracing::dispatcher::with_default(&dispatch, || {
            tracing::info!(card_ref = "c-1", "first");
            let span = tracing::info_span!("job", scheduled_for = %rfc3339(1_796_125_020));
            let _entered = span.enter();
            tracing::warn!("second");
        });
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
