//! The server face: the wire (`Idempotency-Key`, problems, replays), hostile input, waiting, the
//! transactional PostgreSQL mode.
//!
//! One test binary per area; each file below is a module of it.

mod support;

mod server_side {
    mod content_digest;
    mod hostile_input;
    mod in_flight_wait;
    mod key_syntax;
    mod origin;
    mod postgres_server;
    mod refusals;
    mod scoping;
    mod server;
    mod wire;
}
