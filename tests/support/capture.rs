//! Test support: capture what `tracing` logs, to assert on warnings.
//!
//! ```ignore
//! use crate::support::capture;
//!
//! let (logs, _default) = capture::warnings();
//! // … run the code under test on this thread …
//! assert!(logs.text().contains("noeviction"));
//! ```
//!
//! Each capture is a subscriber scoped to its thread, so tests running side by side hear only
//! themselves. Scoped subscribers alone are not enough, though: `tracing` caches, per callsite
//! and for every thread at once, whether any subscriber may want its events, and when only one
//! subscriber is registered it fills that cache from whatever subscriber the thread reaching
//! the callsite first has, which is none on a thread of another test. The callsite is then
//! `never` everywhere, and the test listening for it hears nothing. The captures therefore
//! install, once, a global subscriber that keeps every callsite's interest at `sometimes`
//! ([`AskPerEvent`]), so that each event asks the subscriber of its own thread.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, Once};

use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

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
    AskPerEvent::install();
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
    AskPerEvent::install();
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.writer())
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

/// The global subscriber under the captures: it hears nothing itself, but answers every
/// callsite `sometimes`, so that `tracing` asks, at each event, the subscriber of the thread the
/// event is on instead of caching a `never` found on a thread nobody listens to.
///
/// Being registered, it also takes `tracing` off its single-subscriber shortcut: with two
/// subscribers or more, a callsite's interest is combined over all of them, and a `sometimes`
/// in the combination is `sometimes` whatever the others answer.
struct AskPerEvent;

impl AskPerEvent {
    /// Installs it once in the process, before the first capture registers its subscriber: a
    /// capture registered before it could still meet the single-subscriber shortcut.
    fn install() {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            tracing::subscriber::set_global_default(AskPerEvent)
                .expect("the test binaries set no other global subscriber")
        });
    }
}

impl Subscriber for AskPerEvent {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }

    fn enabled(&self, _: &Metadata<'_>) -> bool {
        false
    }

    /// Adds no level to the global maximum: that maximum is recomputed, over every live
    /// subscriber, each time a capture registers one, so a capture's level is in it for as long
    /// as the capture lives.
    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::OFF)
    }

    // Never called: it enables nothing, so no span or event reaches it.
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, _: &Event<'_>) {}

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
