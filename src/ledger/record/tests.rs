use super::*;
use crate::frozen::test_post;
use http::HeaderValue;

#[test]
fn frozen_requests_round_trip_with_repeated_headers() {
    let mut headers = HeaderMap::new();
    headers.append("x-a", HeaderValue::from_static("1"));
    headers.append("x-a", HeaderValue::from_static("2"));
    let frozen = FrozenRequest::from_parts(
        Method::PATCH,
        "https://h.local:8443/p?q=1".parse().unwrap(),
        Version::HTTP_2,
        headers,
        Bytes::from_static(b"\x00\xffbody"),
    );
    let decoded = FrozenRequest::decode(&frozen.encode()).unwrap();
    assert_eq!(decoded.method(), Method::PATCH);
    assert_eq!(decoded.uri(), frozen.uri());
    assert_eq!(decoded.version(), Version::HTTP_2);
    assert_eq!(decoded.headers(), frozen.headers());
    assert_eq!(decoded.body(), frozen.body());
}

#[test]
fn tombstones_round_trip_and_garbage_is_corrupt() {
    let tomb = Outcome::Tombstone {
        status: StatusCode::OK,
    };
    assert!(matches!(
        Outcome::decode(&tomb.encode()).unwrap(),
        Outcome::Tombstone { status } if status == StatusCode::OK
    ));
    assert!(Outcome::decode(&[1, 0, 0]).unwrap_err().is_corrupt());
    assert!(Outcome::decode(&[9]).unwrap_err().is_corrupt());
    let mut trailing = tomb.encode();
    trailing.push(0);
    assert!(Outcome::decode(&trailing).unwrap_err().is_corrupt());
}

#[test]
fn digest_hashing_spreads_keys_built_by_hand() {
    use std::hash::BuildHasher;
    let state = DigestState::default();
    let mut low_bits = std::collections::HashSet::new();
    let mut hashes = std::collections::HashSet::new();
    for n in 0u64..4096 {
        let mut bytes = [0xf1; 32];
        bytes[..8].copy_from_slice(&n.to_le_bytes());
        let hash = state.hash_one(LedgerKey::from_bytes(bytes));
        hashes.insert(hash);
        low_bits.insert(hash & 0xfff);
    }
    assert_eq!(hashes.len(), 4096);
    assert!(low_bits.len() > 2000, "buckets spread: {}", low_bits.len());
}

#[test]
fn each_map_hashes_with_a_seed_of_its_own() {
    use std::hash::BuildHasher;
    let key = LedgerKey::from_bytes([7; 32]);
    let (one, other) = (DigestState::default(), DigestState::default());
    assert_eq!(one.hash_one(key), one.clone().hash_one(key));
    assert_ne!(
        one.hash_one(key),
        other.hash_one(key),
        "two maps, two seeds"
    );
    // A bucket index known from one map says nothing of another's.
    let buckets = (0..64)
        .map(|_| DigestState::default().hash_one(key) & 0xfff)
        .collect::<std::collections::HashSet<_>>();
    assert!(buckets.len() > 32, "buckets: {}", buckets.len());
}

#[test]
fn ledger_key_derivations_are_domain_separated() {
    let op = IdempotencyKey::derive("s", "k", "");
    assert_ne!(
        LedgerKey::for_operation(op),
        LedgerKey::client_header("s", "", "", "", "k")
    );
    assert_ne!(LedgerKey::server("a", "k"), LedgerKey::server("ak", ""));
    assert_ne!(
        LedgerKey::client_header("", "", "https", "a.example", "k"),
        LedgerKey::client_header("", "", "https", "a.exampl", "ek")
    );
}

#[test]
fn request_fields_ride_after_the_body_and_stay_out_of_the_response() {
    let request = br#"{"order_id":"o_1","summary":"first","total_cents":100}"#;
    let gathered = GatheredFields::of(Some(&test_post(&request[..])));
    let RequestFields::Entries(entries) = gathered.fields() else {
        panic!("a JSON object's fields are gathered");
    };
    let mut headers = HeaderMap::new();
    headers.append("content-type", HeaderValue::from_static("application/json"));
    let body = br#"{"id":"ch_1"}"#;
    let stored = StoredResponse::with_request_fields(
        StatusCode::CREATED,
        Version::HTTP_11,
        &headers,
        body,
        &gathered,
    );
    let plain = StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        &headers,
        Bytes::from_static(body),
    );

    // The response reads as it would without them: body, headers, encoding.
    assert_eq!(stored.body().as_ref(), body);
    assert_eq!(stored.body_bytes(), body);
    assert_eq!(stored.headers(), headers);
    let encoded = Outcome::Response(stored.clone()).encode();
    assert_eq!(encoded, Outcome::Response(plain.clone()).encode());
    // They weigh what they hold, in the same buffer.
    assert_eq!(
        stored.weight(),
        plain.weight() + entries.len(),
        "the digests cost their bytes and no allocation of their own"
    );

    // Read back, they are the digests the store would make itself.
    let RequestFields::Entries(entries) = stored.request_fields() else {
        panic!("gathered fields are held");
    };
    assert_eq!(
        FieldDigests::from_entries(entries),
        FieldDigests::of(request).unwrap()
    );
    assert_eq!(plain.request_fields(), RequestFields::Ungathered);
    let no_object = GatheredFields::of(Some(&test_post(&b"[1]"[..])));
    let none = StoredResponse::with_request_fields(
        StatusCode::OK,
        Version::HTTP_11,
        &headers,
        body,
        &no_object,
    );
    assert_eq!(none.request_fields(), RequestFields::NoFields);
    assert_eq!(none.weight(), plain.weight());
}

#[test]
fn a_response_written_in_place_is_the_record_of_its_block() {
    let mut headers = HeaderMap::new();
    headers.append("content-type", HeaderValue::from_static("application/json"));
    headers.append("link", HeaderValue::from_static("</a>; rel=a"));
    headers.append("link", HeaderValue::from_static("</b>; rel=b"));
    let digest = crate::digest::BodyDigest::of(b"{}");
    let write = |block: &mut BlockWriter| {
        for (name, value) in &headers {
            block.push(name, value);
        }
        block.push_request_digest(&digest);
    };
    let size = entries_size(headers.iter()) + REQUEST_DIGEST_SIZE;
    // Folded (up to 1 KiB) and held apart (past it), around the bound.
    for len in [0, 13, 1024, 1025, 4096] {
        let body = Bytes::from(vec![b'x'; len]);
        let written = StoredResponse::written(
            StatusCode::CREATED,
            Version::HTTP_2,
            size,
            write,
            body.clone(),
        );
        let mut block = BlockWriter::with_capacity(size);
        write(&mut block);
        let of_block =
            StoredResponse::of_block(StatusCode::CREATED, Version::HTTP_2, block.finish(), body);
        assert_eq!(written.headers(), of_block.headers(), "{len}");
        assert_eq!(written.body(), of_block.body(), "{len}");
        assert_eq!(written.weight(), of_block.weight(), "{len}");
        assert_eq!(
            Outcome::Response(written).encode(),
            Outcome::Response(of_block).encode(),
            "{len}"
        );
    }
}
