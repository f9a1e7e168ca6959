//! A method table read from the payments service's descriptor set: each method's kind and
//! `idempotency_level` as its `.proto` declares them.

use prost::Message;
use tower_idempotency::grpc::{MethodEffect, MethodKind, Methods};

use crate::payments::paths::{CHARGE, GET_CHARGE, LIST_CHARGES};

/// The payments service's descriptor set, as `protox` compiles it.
pub(super) fn payments_descriptor_set() -> Vec<u8> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/grpc");
    protox::compile(["payments.proto"], [dir])
        .expect("the .proto compiles")
        .encode_to_vec()
}

#[test]
fn every_method_is_read_with_its_kind_and_idempotency_level() {
    let methods = Methods::from_descriptor_set(&payments_descriptor_set()).unwrap();

    assert_eq!(methods.len(), 3);
    let charge = methods.get(CHARGE).unwrap();
    assert_eq!(
        (charge.kind, charge.effect),
        (MethodKind::Unary, MethodEffect::SideEffect)
    );
    let read = methods.get(GET_CHARGE).unwrap();
    assert_eq!(
        (read.kind, read.effect),
        (MethodKind::Unary, MethodEffect::NoSideEffects)
    );
    let list = methods.get(LIST_CHARGES).unwrap();
    assert_eq!(list.kind, MethodKind::ServerStreaming);
}

#[test]
fn a_truncated_descriptor_set_is_refused() {
    let encoded = payments_descriptor_set();
    assert!(Methods::from_descriptor_set(&encoded[..encoded.len() / 2]).is_err());
}
