//! Test support: capture what `tracing` logs, to assert on warnings.
//!
//! ```ignore
//! use crate::support::capture;
//!
//! let (logs, _default) = capture::warnings();
//! // … run the code under test on this thread …
//! assert!(logs.text().contains("noeviction"));
//! ```
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

/// What was logged at `WARN` and above, as text.
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }

    /// Forget what was logged so far.
    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }

    /// What a `fmt` subscriber writes through: each write goes to these logs.
    fn writer(&self) -> impl Fn() -> Self + 'static {
        let logs = self.clone();
        move || logs.clone()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Capture warnings on this thread (a current-thread runtime's tasks included) until the
/// returned guard is dropped.
pub fn warnings() -> (Logs, tracing::subscriber::DefaultGuard) {
    events(tracing::Level::WARN)
}

/// Capture events at `level` and above on this thread until the guard is dropped.
pub fn events(level: tracing::Level) -> (Logs, tracing::subscriber::DefaultGuard) {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.writer())
        .with_ansi(false)
        .with_max_level(level)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

/// Capture, on this thread until the guard is dropped, the events and the closing of every
/// span (each with the fields recorded in it) that `filter` (`EnvFilter` directives, e.g.
/// `"info,my_crate=debug"`) enables.
pub fn spans(filter: &str) -> (Logs, tracing::subscriber::DefaultGuard) {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.writer())
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}
