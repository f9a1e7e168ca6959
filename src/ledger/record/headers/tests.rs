use super::*;
use crate::ledger::{Outcome, StoredResponse};
use http::{StatusCode, Version};
use proptest::prelude::*;

/// Names: standard ones, this crate's own, and other custom ones, so that a map holds
/// repeated names as well as several of each kind.
const NAMES: &[&str] = &[
    "content-type",
    "link",
    "set-cookie",
    "idempotent-request-digest",
    "idempotent-replayed",
    "x-charge-id",
    "x-a",
];

fn header_map() -> impl Strategy<Value = Vec<(usize, Vec<u8>, bool)>> {
    let value =
        proptest::collection::vec(prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff], 0..40);
    proptest::collection::vec((0..NAMES.len(), value, any::<bool>()), 0..12)
}

fn build(entries: &[(usize, Vec<u8>, bool)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value, sensitive) in entries {
        let mut value = HeaderValue::from_bytes(value).unwrap();
        value.set_sensitive(*sensitive);
        map.append(HeaderName::from_static(NAMES[*name]), value);
    }
    map
}

/// Every `(name, value, sensitive)` in the map's own order.
fn listed(map: &HeaderMap) -> Vec<(String, Vec<u8>, bool)> {
    map.iter()
        .map(|(name, value)| {
            (
                name.to_string(),
                value.as_bytes().to_vec(),
                value.is_sensitive(),
            )
        })
        .collect()
}

proptest! {
    /// A block gives back the map it was made of: every value of every name, in order,
    /// sensitivity kept; its weight is its exact size.
    #[test]
    fn a_block_holds_its_map_whole(entries in header_map()) {
        let map = build(&entries);
        let block = HeaderBlock::of(&map);
        prop_assert_eq!(block.len(), map.len());
        prop_assert_eq!(listed(&block.to_map()), listed(&map));
        let size: usize = map
            .iter()
            .map(|(name, value)| entry_size(name.as_str().len(), value.len()))
            .sum();
        prop_assert_eq!(block.weight(), size);
    }

    /// A record written once ([`StoredResponse::new`]) holds exactly the bytes of the block
    /// written first and then copied with the body ([`HeaderBlock::followed_by`]): the same
    /// entries, the first request digest held short when its spelling is the rendered one
    /// (sensitivity kept), any later or differently spelled one kept as written; a large
    /// body held apart, as it came. The digests go before or after the other entries, so
    /// that the first one by name is sometimes one that a record holds short.
    #[test]
    fn a_record_written_once_is_the_block_then_its_copy(
        entries in header_map(),
        digests_first in any::<bool>(),
        digests in proptest::collection::vec(
            (any::<[u8; 32]>(), any::<bool>(), any::<bool>()),
            0..3,
        ),
        body_len in prop_oneof![0usize..64, 1000usize..1100],
    ) {
        let mut map = if digests_first { HeaderMap::new() } else { build(&entries) };
        for (digest, rendered, sensitive) in digests {
            let digest = crate::digest::BodyDigest::from_bytes(digest);
            let mut value = if rendered {
                digest.header_value()
            } else {
                // Valid base64 of the wrong length: not the spelling a replay renders.
                HeaderValue::from_static("sha-256=:AAAA:")
            };
            value.set_sensitive(sensitive);
            map.append(&IDEMPOTENT_REQUEST_DIGEST, value);
        }
        if digests_first {
            for (name, value) in &build(&entries) {
                map.append(name, value.clone());
            }
        }
        let body = bytes::Bytes::from(vec![b'b'; body_len]);
        let once = StoredResponse::new(StatusCode::OK, Version::HTTP_11, &map, body.clone());
        let reference = StoredResponse::of_block(
            StatusCode::OK,
            Version::HTTP_11,
            HeaderBlock::of(&map),
            body.clone(),
        );
        let (once_block, reference_block) = (once.header_block(), reference.header_block());
        prop_assert_eq!(&once_block.bytes[..], &reference_block.bytes[..]);
        prop_assert_eq!(once_block.len, reference_block.len);
        prop_assert_eq!(once_block.end, reference_block.end);
        prop_assert_eq!(once_block.tail, reference_block.tail);
        prop_assert_eq!(once.weight(), reference.weight());
        prop_assert_eq!(once.body(), body);
        prop_assert_eq!(listed(&once.headers()), listed(&map));
    }

    /// Stored and read back, a response keeps its headers, in order; sensitivity is
    /// not stored (as before the block).
    #[test]
    fn a_stored_response_round_trips_through_its_encoding(entries in header_map()) {
        let map = build(&entries);
        let stored = StoredResponse::new(StatusCode::CREATED, Version::HTTP_2, map.clone(), "b".into());
        let Outcome::Response(decoded) = Outcome::decode(&Outcome::Response(stored).encode()).unwrap() else {
            panic!("a response")
        };
        let plain = |map: &HeaderMap| {
            listed(map).into_iter().map(|(n, v, _)| (n, v)).collect::<Vec<_>>()
        };
        prop_assert_eq!(plain(&decoded.headers()), plain(&map));
        prop_assert!(decoded.headers().values().all(|value| !value.is_sensitive()));
        prop_assert_eq!(&decoded.body()[..], b"b");
    }

    /// A block written as a server records a response (its headers, then the request's
    /// digest held short) reads as the map with the digest rendered last, whether the body
    /// is folded into the block or kept apart, and through the encoding of other stores.
    #[test]
    fn a_request_digest_written_short_reads_back_anywhere(
        entries in header_map(),
        digest in any::<[u8; 32]>(),
        body_len in prop_oneof![0usize..64, 1000usize..1100],
    ) {
        let map = build(&entries);
        let digest = crate::digest::BodyDigest::from_bytes(digest);
        let mut writer = BlockWriter::with_capacity(entries_size(map.iter()) + REQUEST_DIGEST_SIZE);
        for (name, value) in &map {
            writer.push(name, value);
        }
        writer.push_request_digest(&digest);
        let block = writer.finish();
        let mut expected = map.clone();
        expected.append(&IDEMPOTENT_REQUEST_DIGEST, digest.header_value());
        prop_assert_eq!(listed(&block.to_map()), listed(&expected));

        let body = bytes::Bytes::from(vec![b'b'; body_len]);
        let stored = StoredResponse::of_block(StatusCode::OK, Version::HTTP_11, block, body.clone());
        prop_assert_eq!(listed(&stored.headers()), listed(&expected));
        prop_assert_eq!(stored.body(), body.clone());
        let Outcome::Response(decoded) = Outcome::decode(&Outcome::Response(stored).encode()).unwrap() else {
            panic!("a response")
        };
        let plain = |map: &HeaderMap| {
            listed(map).into_iter().map(|(n, v, _)| (n, v)).collect::<Vec<_>>()
        };
        prop_assert_eq!(plain(&decoded.headers()), plain(&expected));
        prop_assert_eq!(decoded.body(), body);
    }
}

#[test]
fn values_share_the_block_and_the_crates_names_are_not_copied() {
    let mut map = HeaderMap::new();
    map.append(
        &crate::digest::IDEMPOTENT_REQUEST_DIGEST,
        HeaderValue::from_static("sha-256=:AAAA:"),
    );
    map.append("x-charge-id", HeaderValue::from_static("ch_1"));
    let block = HeaderBlock::of(&map);
    let held = block.bytes.as_ptr() as usize..block.bytes.as_ptr() as usize + block.weight();
    for entry in block.entries() {
        let value = block.value(&entry);
        assert!(held.contains(&(value.as_bytes().as_ptr() as usize)));
    }
    let digest = block.entries().next().unwrap();
    let name = HeaderBlock::name(&digest);
    assert_eq!(name, crate::digest::IDEMPOTENT_REQUEST_DIGEST);
    assert_eq!(
        name.as_str().as_ptr(),
        crate::digest::IDEMPOTENT_REQUEST_DIGEST.as_str().as_ptr(),
        "the static name, not a copy"
    );
}

#[test]
fn a_request_digest_is_held_as_its_32_bytes_and_rendered_again() {
    let digest = crate::digest::BodyDigest::of(b"{}");
    let mut map = HeaderMap::new();
    map.append(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    map.append(&IDEMPOTENT_REQUEST_DIGEST, digest.header_value());
    map.append("x-charge-id", HeaderValue::from_static("ch_1"));
    // As a server records a response: its block, then the body folded in.
    let stored = StoredResponse::of_block(
        StatusCode::OK,
        Version::HTTP_11,
        HeaderBlock::of(&map),
        bytes::Bytes::from_static(b"ok"),
    );
    let block = stored.header_block();
    assert_eq!(
        block.weight(),
        entry_size("content-type".len(), "application/json".len())
            + ENTRY_OVERHEAD
            + 32
            + entry_size("x-charge-id".len(), "ch_1".len())
            + 2
    );
    assert_eq!(block.to_map(), map);
    assert_eq!(&stored.body()[..], b"ok");
    let values: Vec<Vec<u8>> = block
        .entries()
        .map(|entry| block.value_bytes(&entry).into_owned())
        .collect();
    assert_eq!(values[1], digest.header_value().as_bytes());

    // Stored elsewhere, it is written out whole.
    let encoded = Outcome::Response(stored.clone()).encode();
    let needle = digest.header_value();
    assert!(encoded
        .windows(needle.len())
        .any(|window| window == needle.as_bytes()));
    let Outcome::Response(decoded) = Outcome::decode(&encoded).unwrap() else {
        panic!("a response")
    };
    assert_eq!(decoded.headers(), map);
    assert_eq!(&decoded.body()[..], b"ok");

    // Any other spelling is held as it came.
    for other in ["sha-256=:AAAA:", "sha-512=:AAAA:"] {
        let mut map = HeaderMap::new();
        map.append(&IDEMPOTENT_REQUEST_DIGEST, HeaderValue::from_static(other));
        let stored = StoredResponse::of_block(
            StatusCode::OK,
            Version::HTTP_11,
            HeaderBlock::of(&map),
            bytes::Bytes::new(),
        );
        assert_eq!(stored.header_block().weight(), entry_size(25, other.len()));
        assert_eq!(stored.headers(), map);
    }
}

#[test]
fn a_small_body_is_held_in_the_header_buffer() {
    let mut map = HeaderMap::new();
    map.append("x-charge-id", HeaderValue::from_static("ch_1"));
    let small = bytes::Bytes::from(vec![b's'; 1024]);
    let stored = StoredResponse::of_block(
        StatusCode::OK,
        Version::HTTP_11,
        HeaderBlock::of(&map),
        small.clone(),
    );
    assert_eq!(stored.header_block().body_bytes(), &small[..]);
    assert_eq!(stored.body(), small);
    assert_eq!(stored.headers(), map);
    let large = bytes::Bytes::from(vec![b'l'; 1025]);
    let stored = StoredResponse::of_block(
        StatusCode::OK,
        Version::HTTP_11,
        HeaderBlock::of(&map),
        large.clone(),
    );
    assert!(stored.header_block().body_bytes().is_empty());
    assert_eq!(stored.body().as_ptr(), large.as_ptr(), "held, not copied");
}

/// Writes an encoded response record holding `headers` as stored pairs.
fn record_with(pairs: &[(&[u8], &[u8])], count: u32) -> Vec<u8> {
    let mut out = vec![1, 0, 0, 201, 2];
    out.extend_from_slice(&count.to_be_bytes());
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u32).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    out.extend_from_slice(&0u32.to_be_bytes());
    out
}

#[test]
fn stored_headers_are_checked_when_read() {
    let good = record_with(&[(b"Content-Type", b"text/plain")], 1);
    let Outcome::Response(stored) = Outcome::decode(&good).unwrap() else {
        panic!("a response")
    };
    assert_eq!(
        stored.headers()["content-type"],
        "text/plain",
        "names held in lower case"
    );
    // Too many distinct names: `tests/server_side/hostile_input.rs`.
    let cases: [(&str, Vec<u8>); 3] = [
        ("bad name", record_with(&[(b"bad name", b"v")], 1)),
        ("bad value", record_with(&[(b"x-a", b"line\nbreak")], 1)),
        ("missing pair", record_with(&[(b"x-a", b"v")], 2)),
    ];
    for (case, bytes) in cases {
        let err = Outcome::decode(&bytes).unwrap_err();
        assert!(err.is_corrupt(), "{case}: {err}");
    }
}

#[test]
fn a_recorded_body_shares_its_buffer_only_once_a_replay_reads_it() {
    let mut headers = HeaderMap::new();
    headers.append(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let recorded = HeaderBlock::with_body(&headers, b"{\"id\":\"ch_1\"}");
    let stored =
        StoredResponse::of_block_with_body(StatusCode::CREATED, Version::HTTP_11, recorded);
    // Written, the record holds its one buffer alone: no shared handle allocated yet.
    assert!(stored.header_block().bytes.is_unique());
    assert_eq!(stored.body_bytes(), b"{\"id\":\"ch_1\"}");
    // A replay's body shares the buffer (a handle, not a copy).
    let body = stored.body();
    assert_eq!(&body[..], b"{\"id\":\"ch_1\"}");
    assert!(!stored.header_block().bytes.is_unique());
    assert_eq!(stored.headers(), headers);
}

#[test]
fn a_request_digest_written_short_reads_as_the_rendered_field() {
    let digest = crate::digest::BodyDigest::of(b"{\"order\":1}");
    let mut writer = BlockWriter::with_capacity(entry_size(4, 2) + REQUEST_DIGEST_SIZE);
    writer.push(
        &HeaderName::from_static("x-id"),
        &HeaderValue::from_static("42"),
    );
    writer.push_request_digest(&digest);
    let block = writer.finish();
    assert_eq!(block.weight(), entry_size(4, 2) + REQUEST_DIGEST_SIZE);
    let mut expected = HeaderMap::new();
    expected.append("x-id", HeaderValue::from_static("42"));
    expected.append(&IDEMPOTENT_REQUEST_DIGEST, digest.header_value());
    assert_eq!(block.to_map(), expected);
    // What a record keeps of it: the same short entry, the body after it; a large body
    // stays apart with the block as written.
    for body in [&b"ok"[..], &[b'l'; 2048][..]] {
        let stored = StoredResponse::of_block(
            StatusCode::OK,
            Version::HTTP_11,
            block.clone(),
            bytes::Bytes::copy_from_slice(body),
        );
        assert_eq!(stored.headers(), expected);
        assert_eq!(&stored.body()[..], body);
        let held = stored.header_block();
        assert_eq!(held.weight() - held.body_bytes().len(), block.weight());
        // Written out whole for a store of its own, and read back the same.
        let encoded = Outcome::Response(stored.clone()).encode();
        let Outcome::Response(decoded) = Outcome::decode(&encoded).unwrap() else {
            panic!("a response")
        };
        assert_eq!(decoded.headers(), expected);
    }
}
