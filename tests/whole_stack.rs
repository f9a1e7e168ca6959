//! Whole stacks: the demonstration's service end to end, the seams between layers, stores and
//! routers, logs, spans, metrics and settings.
//!
//! One test binary per area; each file below is a module of it.

mod support;

mod whole_stack {
    mod durations;
    mod end_to_end;
    mod log_warnings;
    mod metrics;
    mod redis_stack;
    mod safety_signals;
    mod seams;
}
