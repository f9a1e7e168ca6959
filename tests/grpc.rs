//! The gRPC face: a real tonic server and client over loopback, with the generated payments
//! service of tests/support/grpc.
//!
//! One test binary per area; each file below is a module of it.

mod support;

#[path = "support/grpc/mod.rs"]
mod payments;

mod grpc {
    mod changed_fields;
    mod client;
    mod codegen;
    mod descriptor;
    mod fixture;
    mod retry;
    mod server;
    mod server_errors;
    mod stores;
    mod whole_stack;
}
