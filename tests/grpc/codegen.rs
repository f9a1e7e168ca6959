//! The committed code of the payments service is what its `.proto` generates today.
//!
//! No build script and no `protoc`: `protox` compiles the `.proto` in process and
//! `tonic-prost-build` writes the Rust, into a temporary directory. Set
//! `REGENERATE_GRPC=1` to write it over the committed file after changing the `.proto`.

use std::path::{Path, PathBuf};

const PROTO_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/grpc");
const GENERATED: &str = "payments.v1.rs";

fn generate_into(out_dir: &Path) -> String {
    let descriptors =
        protox::compile(["payments.proto"], [PROTO_DIR]).expect("the .proto compiles");
    tonic_prost_build::configure()
        .out_dir(out_dir)
        .emit_rerun_if_changed(false)
        .compile_fds(descriptors)
        .expect("tonic-prost-build generates the service");
    std::fs::read_to_string(out_dir.join(GENERATED)).expect("the generated file is written")
}

fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-grpc-codegen-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

#[test]
fn the_committed_payments_service_is_what_its_proto_generates() {
    let dir = scratch_dir();
    let fresh = generate_into(&dir);
    std::fs::remove_dir_all(&dir).ok();
    let committed_path = Path::new(PROTO_DIR).join(GENERATED);
    if std::env::var_os("REGENERATE_GRPC").is_some() {
        std::fs::write(&committed_path, &fresh).expect("the committed file is rewritten");
    }
    let committed = std::fs::read_to_string(&committed_path).expect("the committed file");
    assert!(
        committed == fresh,
        "tests/support/grpc/{GENERATED} differs from what payments.proto generates: \
         run `REGENERATE_GRPC=1 cargo test --all-features --test grpc codegen` and commit it"
    );
}
