//! Where log lines go: stderr, through one buffer ([`LogSink`]).
//!
//! Every line used to be its own `write(2)`: with an access line per request that syscall
//! alone was 2.9 % of turnguard's CPU at c=64 (the flame graph of bench/RESULTS.md's issue 13
//! run 10). Lines now gather in a buffer that is written out, in order, when
//! - a line at `WARN` or `ERROR` arrives (it and everything before it are written at once),
//! - the buffer holds [`LOG_BUFFER_BYTES`] (or the next line would not fit),
//! - the oldest line in it has waited `log_flush_ms` (the `turnguard-logs` thread), or
//! - the process ends ([`LogGuard`]'s drop, or a panic).
//!
//! This is nginx's `access_log … buffer= flush=`: an SRE sees every line, at most
//! `log_flush_ms` late, and warnings at once. `log_flush_ms = 0` writes every line as it is
//! made. A `SIGKILL` loses what the buffer held (at most `log_flush_ms` of lines).

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use tracing::Level;

/// Bytes of lines the buffer holds before they are written without waiting for the flush
/// interval: at c=64 that is about a hundred access lines a `write(2)`.
pub const LOG_BUFFER_BYTES: usize = 32 << 10;

/// The buffered log writer: a [`tracing_subscriber::fmt::MakeWriter`] whose writers append a
/// formatted line to the shared buffer. Cheap to clone.
#[derive(Clone)]
pub struct LogSink {
    shared: Arc<Shared>,
}

struct Shared {
    inner: Mutex<Inner>,
    /// Signalled when a line lands in an empty buffer, and at close.
    wake: Condvar,
    /// Longest a line waits in the buffer.
    flush_after: Duration,
}

struct Inner {
    buf: Vec<u8>,
    out: Box<dyn Write + Send>,
    /// No flusher runs (the interval is zero, the thread could not start, or the guard was
    /// dropped): every line is written as it is made.
    unbuffered: bool,
    /// The guard was dropped: the flusher ends.
    closed: bool,
}

impl Inner {
    /// Writes the buffer out and empties it. A failed write (stderr closed) drops the lines:
    /// there is nowhere left to report it.
    fn drain(&mut self) {
        if !self.buf.is_empty() {
            let _ = self.out.write_all(&self.buf);
            let _ = self.out.flush();
            self.buf.clear();
        }
    }
}

impl Shared {
    /// The buffer, whoever panicked while holding it (its bytes are whole lines or a
    /// prefix of one; writing them is still the right thing to do).
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Writes what the [`LogSink`] holds when dropped (keep it alive for as long as the process
/// logs: `main` holds it).
pub struct LogGuard {
    shared: Arc<Shared>,
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        let mut inner = self.shared.lock();
        inner.closed = true;
        inner.unbuffered = true;
        inner.drain();
        drop(inner);
        self.shared.wake.notify_all();
    }
}

impl LogSink {
    /// A sink writing to `out`; lines wait at most `flush_after` (zero: none waits). Starts
    /// the `turnguard-logs` flusher thread when `flush_after` is not zero; it ends when the
    /// [`LogGuard`] is dropped. If the thread cannot be started, every line is written as it
    /// is made.
    pub fn new(out: Box<dyn Write + Send>, flush_after: Duration) -> (Self, LogGuard) {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                buf: Vec::with_capacity(if flush_after.is_zero() {
                    0
                } else {
                    LOG_BUFFER_BYTES
                }),
                out,
                unbuffered: true,
                closed: false,
            }),
            wake: Condvar::new(),
            flush_after,
        });
        if !flush_after.is_zero() {
            let flusher = shared.clone();
            let started = std::thread::Builder::new()
                .name("turnguard-logs".to_owned())
                .spawn(move || flush_loop(&flusher));
            shared.lock().unbuffered = started.is_err();
        }
        let sink = Self {
            shared: shared.clone(),
        };
        (sink, LogGuard { shared })
    }

    /// Writes what the buffer holds now (the panic hook calls this; it never blocks on a
    /// writer that holds the buffer).
    pub fn flush_now(&self) {
        if let Ok(mut inner) = self.shared.inner.try_lock() {
            inner.drain();
        }
    }
}

/// The flusher: waits for a line in an empty buffer, lets it wait `flush_after` (more lines
/// join it meanwhile), writes the buffer, and again, until the guard closes the sink.
fn flush_loop(shared: &Shared) {
    loop {
        let mut inner = shared.lock();
        while inner.buf.is_empty() && !inner.closed {
            inner = shared.wake.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        if inner.closed {
            inner.drain();
            return;
        }
        drop(inner);
        std::thread::sleep(shared.flush_after);
        shared.lock().drain();
    }
}

/// One line's writer ([`LogSink`]'s `MakeWriter`): tracing-subscriber's `fmt` layer formats
/// an event into one buffer and hands it over in one `write_all`.
pub struct LineWriter<'a> {
    shared: &'a Shared,
    /// A `WARN` or `ERROR` line: written at once, with everything before it.
    urgent: bool,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, line: &[u8]) -> std::io::Result<usize> {
        let mut inner = self.shared.lock();
        // The buffer never grows past its capacity for a line that would not fit.
        if inner.buf.len() + line.len() > LOG_BUFFER_BYTES {
            inner.drain();
        }
        let was_empty = inner.buf.is_empty();
        inner.buf.extend_from_slice(line);
        if self.urgent || inner.unbuffered || inner.buf.len() >= LOG_BUFFER_BYTES {
            inner.drain();
        } else if was_empty {
            self.shared.wake.notify_one();
        }
        Ok(line.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
            urgent: true,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
            // tracing orders levels by verbosity: `WARN` and `ERROR` are the least verbose.
            urgent: *meta.level() <= Level::WARN,
        }
    }
}

/// The line format of `log_format = "json"`: one JSON object a line,
/// `{"timestamp":…,"level":…,"message":…,<the event's fields, in order>,"target":…}`. That is
/// tracing-subscriber's own JSON format with `flatten_event(true)`, byte for byte
/// (`tests::json_lines_are_tracing_subscribers_json_lines`), at about a quarter of the cost:
/// its formatter serializes through an `io::Write`-to-`fmt::Write` adaptor that checks every
/// piece of every value for UTF-8 again, and formats the time through `fmt::Display`: 23k
/// instructions an access line under callgrind, 4.7 % of the json cell's instructions per
/// request; this one took ~6k (bench/RESULTS.md, issue 13 run 14) with tracing-serde's visitor
/// serializing the fields through serde_json's map serializer, and writes the fields itself
/// now ([`LineFields`]), into one byte buffer checked once.
///
/// An event inside a span (only `debug`-level dependency spans exist: turnguard opens none) is
/// handed to tracing-subscriber's formatter, which also writes the `span` and `spans` members.
pub struct JsonLines {
    within_spans: tracing_subscriber::fmt::format::Format<tracing_subscriber::fmt::format::Json>,
}

impl Default for JsonLines {
    fn default() -> Self {
        Self {
            within_spans: tracing_subscriber::fmt::format().json().flatten_event(true),
        }
    }
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for JsonLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use tracing_log::NormalizeEvent;
        if event.parent().and_then(|id| ctx.span(id)).is_some() || ctx.lookup_current().is_some() {
            return self.within_spans.format_event(ctx, writer, event);
        }
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        // "2026-12-05T05:32:56.331982Z": what tracing-subscriber's `SystemTime` writes.
        let mut stamp = [0u8; 40];
        let stamp = {
            let mut at = std::io::Cursor::new(&mut stamp[..]);
            write!(
                at,
                "{}",
                humantime::format_rfc3339_micros(std::time::SystemTime::now())
            )
            .map_err(|_| std::fmt::Error)?;
            let end = at.position() as usize;
            std::str::from_utf8(&stamp[..end]).map_err(|_| std::fmt::Error)?
        };
        let mut line = Vec::with_capacity(512);
        line.extend_from_slice(b"{\"timestamp\":");
        crate::jcs::write_str(&mut line, stamp);
        let mut fields = LineFields { line };
        fields.member("level");
        crate::jcs::write_str(&mut fields.line, meta.level().as_str());
        event.record(&mut fields);
        let LineFields { mut line } = fields;
        line.extend_from_slice(b",\"target\":");
        crate::jcs::write_str(&mut line, meta.target());
        line.extend_from_slice(b"}\n");
        writer.write_str(std::str::from_utf8(&line).map_err(|_| std::fmt::Error)?)
    }
}

/// An event's fields written as members of its line's JSON object, each as tracing-serde's
/// `SerdeMapVisitor` has serde_json serialize it (the test
/// `json_lines_are_tracing_subscribers_json_lines` holds the lines byte for byte equal):
/// names and strings as JSON strings ([`crate::jcs::write_str`], serde_json's escapes),
/// numbers and booleans by serde_json (a float that is not finite is `null`), anything else
/// (`Debug` values, the message, errors, 128-bit integers, bytes) as its `Debug` text in a
/// string. Written straight into the line, without serde's map serializer around each field
/// and without tracing-serde (issue 13: the access line is ~3.5 % of the json cell's
/// instructions a request under callgrind).
struct LineFields {
    line: Vec<u8>,
}

impl LineFields {
    /// Starts the member `name` (never the object's first: `timestamp` is).
    fn member(&mut self, name: &str) {
        self.line.push(b',');
        crate::jcs::write_str(&mut self.line, name);
        self.line.push(b':');
    }

    /// A number or boolean as serde_json writes it (writing into a `Vec` cannot fail).
    fn scalar<T: serde::Serialize>(&mut self, name: &str, value: T) {
        self.member(name);
        let _ = serde_json::to_writer(&mut self.line, &value);
    }
}

impl tracing::field::Visit for LineFields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.member(field.name());
        crate::jcs::write_str(&mut self.line, value);
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.scalar(field.name(), value);
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.scalar(field.name(), value);
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.scalar(field.name(), value);
    }

    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.scalar(field.name(), value);
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        self.member(field.name());
        self.line.push(b'"');
        // Formatted straight into the line, each piece escaped (serde_json's `collect_str`
        // does the same); formatting into a `Vec` cannot fail.
        let _ = write!(Escaped(&mut self.line), "{value:?}");
        self.line.push(b'"');
    }
}

/// A `fmt::Write` that appends what it is given to a JSON string's text, escaped
/// ([`crate::jcs::write_str_contents`]).
struct Escaped<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for Escaped<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        crate::jcs::write_str_contents(self.0, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// An `out` the test can read.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<u8>>>);

    impl Write for Seen {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Seen {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    /// Emits one event at `level` through a fmt subscriber writing to `sink` (the way
    /// `main` wires it).
    fn line(sink: &LogSink, level: Level, text: &str) {
        let subscriber = tracing_subscriber::fmt()
            .with_writer(sink.clone())
            .with_level(false)
            .with_target(false)
            .without_time()
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || match level {
            Level::WARN => tracing::warn!("{text}"),
            _ => tracing::info!("{text}"),
        });
    }

    /// The same events through tracing-subscriber's JSON format and through [`JsonLines`].
    fn both_formats(emit: fn()) -> (String, String) {
        let theirs = Seen::default();
        let ours = Seen::default();
        let (t, o) = (theirs.clone(), ours.clone());
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_writer(move || t.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, emit);
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .event_format(JsonLines::default())
            .with_writer(move || o.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, emit);
        (theirs.text(), ours.text())
    }

    /// Replaces each line's time (the two runs differ in it) after checking its shape.
    fn without_time(lines: &str) -> String {
        let stamp =
            regex::Regex::new(r#"^\{"timestamp":"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z)","#)
                .unwrap();
        lines
            .lines()
            .map(|l| {
                let m = stamp
                    .captures(l)
                    .unwrap_or_else(|| panic!("no time in {l}"));
                l.replacen(&m[1], "T", 1)
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn json_lines_are_tracing_subscribers_json_lines() {
        #[derive(Debug)]
        struct Failed;
        impl std::fmt::Display for Failed {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("upstream closed \"early\"")
            }
        }
        impl std::error::Error for Failed {}
        let (theirs, ours) = both_formats(|| {
            tracing::info!("plain");
            tracing::info!(
                target: "turnguard::access",
                request_id = %"01a244b0-f11c",
                api = "openai_chat",
                status = 200u16,
                stream = false,
                duration_ms = 1.197f64,
                bytes = 306u64,
                skew = -3i64,
                trace_id = "",
                "request"
            );
            tracing::warn!(
                error = %"quote \" backslash \\ newline \n tab \t bell \u{7} \u{e9} \u{1f389} \u{2028}",
                "refused {} of {}",
                5,
                "six"
            );
            tracing::error!(
                r#type = "raw identifier",
                list = ?vec!["a", "b"],
                wide = 1u128 << 100,
                nan = f64::NAN,
                infinite = f64::INFINITY,
                tiny = 5e-324f64,
                cause = &Failed as &dyn std::error::Error,
                "several kinds"
            );
            tracing::info!(message = "a message field", after = 1);
            tracing::info!("a \"quoted\"\tname" = 1, "dotted.name" = "v", "named");
            let span = tracing::info_span!("outer", k = 1);
            let _entered = span.enter();
            tracing::info!(inner = true, "inside a span");
        });
        assert_eq!(theirs.lines().count(), 7, "{theirs}");
        assert!(ours.contains(r#""span":{"k":1,"name":"outer"}"#), "{ours}");
        assert_eq!(without_time(&theirs), without_time(&ours));
    }

    #[test]
    fn an_info_line_waits_for_the_flush_interval_and_no_longer() {
        let seen = Seen::default();
        let (sink, _guard) = LogSink::new(Box::new(seen.clone()), Duration::from_millis(200));
        let start = Instant::now();
        line(&sink, Level::INFO, "one");
        line(&sink, Level::INFO, "two");
        assert_eq!(seen.text(), "", "an info line is buffered");
        while seen.text().is_empty() {
            assert!(start.elapsed() < Duration::from_secs(5), "never flushed");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            start.elapsed() >= Duration::from_millis(150),
            "flushed early"
        );
        assert_eq!(seen.text(), "one\ntwo\n");
        // The flusher goes back to waiting: a later line is written too.
        line(&sink, Level::INFO, "three");
        while !seen.text().ends_with("three\n") {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "second line never flushed"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_warning_writes_itself_and_everything_before_it_at_once_in_order() {
        let seen = Seen::default();
        let (sink, _guard) = LogSink::new(Box::new(seen.clone()), Duration::from_secs(3600));
        line(&sink, Level::INFO, "access");
        line(&sink, Level::WARN, "journal slow");
        assert_eq!(seen.text(), "access\njournal slow\n");
    }

    #[test]
    fn a_full_buffer_is_written_without_waiting() {
        let seen = Seen::default();
        let (sink, _guard) = LogSink::new(Box::new(seen.clone()), Duration::from_secs(3600));
        let text = "x".repeat(1023);
        for _ in 0..LOG_BUFFER_BYTES / 1024 - 1 {
            line(&sink, Level::INFO, &text);
        }
        assert_eq!(seen.text(), "", "under the cap nothing is written");
        line(&sink, Level::INFO, &text);
        assert_eq!(seen.text().len(), LOG_BUFFER_BYTES);
        // A line that would not fit sends what is buffered first and waits in its place.
        for _ in 0..LOG_BUFFER_BYTES / 1024 - 1 {
            line(&sink, Level::INFO, &text);
        }
        line(&sink, Level::INFO, &"y".repeat(1999));
        assert_eq!(seen.text().len(), 2 * LOG_BUFFER_BYTES - 1024);
        assert!(
            !seen.text().contains('y'),
            "the line that did not fit waits"
        );
    }

    #[test]
    fn dropping_the_guard_writes_what_is_left_and_later_lines_go_straight_out() {
        let seen = Seen::default();
        let (sink, guard) = LogSink::new(Box::new(seen.clone()), Duration::from_secs(3600));
        line(&sink, Level::INFO, "last words");
        drop(guard);
        assert_eq!(seen.text(), "last words\n");
        line(&sink, Level::INFO, "after close");
        assert_eq!(seen.text(), "last words\nafter close\n");
    }

    #[test]
    fn a_zero_interval_writes_every_line_as_it_is_made() {
        let seen = Seen::default();
        let (sink, _guard) = LogSink::new(Box::new(seen.clone()), Duration::ZERO);
        line(&sink, Level::INFO, "now");
        assert_eq!(seen.text(), "now\n");
    }
}
