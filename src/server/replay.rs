//! What a keyed request's response leaves in the ledger, and what a replay of it carries.
//!
//! Both sides filter through one allow-list, on purpose twice: when recording, so that a
//! header that must not outlive its response (a session cookie, a credential) is never even
//! stored; and again on every replay, because the record may have been written by another
//! replica with a wider list, or by an earlier release.

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Response, StatusCode, Version};

use super::face::ServerFace;
use super::problem;
use super::report::outcome;
use crate::digest::{BodyDigest, IDEMPOTENT_REQUEST_DIGEST};
use crate::idempotency::body::{Buffered, ResponseBody};
use crate::ledger::{entries_size, BlockWriter, Outcome, StoredResponse, REQUEST_DIGEST_SIZE};

/// `Idempotent-Replayed: true` marks a response replayed from the ledger: the handler was
/// not called for this request.
pub static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response headers recorded and replayed by default (documented on
/// [`Builder::replay_headers`](crate::server::Builder::replay_headers)).
///
/// They describe the representation and where it lives, and stay true when replayed:
/// `Content-Type`, `Content-Encoding`, `Content-Language`, `Content-Location`, `Location`,
/// `ETag`, `Last-Modified`, `Cache-Control`, `Vary`, `Link`; and `Retry-After`, part of
/// what an answer means (a `202` saying when to look again, a `3xx` or a recorded `5xx`
/// saying when to come back): a replay without it would tell the caller less than the
/// first answer did. Left out on purpose: `Expires` (a date the first response computed),
/// `Content-Length` (recomputed from the body), and everything that must never be replayed
/// (see [`Builder::replay_headers`]).
pub(super) const DEFAULT_REPLAY_HEADERS: &[HeaderName] = &[
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::VARY,
    header::LINK,
    header::RETRY_AFTER,
];

/// Headers never recorded nor replayed, whatever the configuration: credentials and
/// session state of the first caller, per-response values, hop-by-hop headers, and the
/// layer's own (a replay's digest is the request's, never a value the handler set).
pub(crate) const NEVER_REPLAYED: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "www-authenticate",
    "proxy-authenticate",
    "authentication-info",
    "proxy-authentication-info",
    "authorization",
    "proxy-authorization",
    "cookie",
    "date",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "idempotent-replayed",
    "idempotent-request-digest",
    "idempotency-fail-open",
];

impl ServerFace {
    /// The allowed name a response header named `name` (in lower case, as names are held)
    /// is replayed under, if it is: cloned from the allow-list, never parsed again.
    fn replays(&self, name: &[u8]) -> Option<&HeaderName> {
        self.replay_headers
            .iter()
            .find(|allowed| allowed.as_str().as_bytes() == name)
    }

    /// The record of a response: its status and version, the headers to record (the allowed
    /// ones, in order, then the request's `digest` field) and its body, written into one
    /// buffer of exactly their size (a large body is held as it came); a replay adds its
    /// `Idempotent-Replayed: true` (see [`replayed_headers`](Self::replayed_headers)).
    pub(super) fn recorded(
        &self,
        (status, version): (StatusCode, Version),
        response: &HeaderMap,
        digest: &BodyDigest,
        body: Bytes,
    ) -> StoredResponse {
        // The builder keeps every `NEVER_REPLAYED` name out of the allow-list, so a digest
        // header the handler set is dropped here and the only one recorded is the request's,
        // pushed last, as its 32 bytes (rendered when a replay reads it).
        let kept = || {
            response
                .iter()
                .filter(|(name, _)| self.replay_headers.contains(name))
        };
        let size = entries_size(kept()) + REQUEST_DIGEST_SIZE;
        let write = |block: &mut BlockWriter| {
            for (name, value) in kept() {
                block.push(name, value);
            }
            block.push_request_digest(digest);
        };
        StoredResponse::written(status, version, size, write, body)
    }

    /// The headers a replay of `stored` carries: the allowed ones, the request's digest
    /// (its first value) and one `Idempotent-Replayed: true`. Filtered on every replay, so
    /// a record made by an earlier release (which held the mark), under another replica's
    /// wider allow-list, or by a store of one's own replays only what this layer allows.
    pub(super) fn replayed_headers(&self, stored: &StoredResponse) -> HeaderMap {
        let block = stored.header_block();
        let mut headers = block.map_sized_for(1);
        let mut digest_kept = false;
        for entry in block.entries() {
            let name = if entry.name == IDEMPOTENT_REQUEST_DIGEST.as_str().as_bytes() {
                // A replay answers one request, so it names one: the first the record holds.
                if std::mem::replace(&mut digest_kept, true) {
                    continue;
                }
                IDEMPOTENT_REQUEST_DIGEST.clone()
            } else if entry.name == IDEMPOTENT_REPLAYED.as_str().as_bytes() {
                // An earlier release's record holds its mark; the replay adds its own.
                continue;
            } else {
                match self.replays(entry.name) {
                    Some(allowed) => allowed.clone(),
                    None => continue,
                }
            };
            // Never stops early: see `HeaderBlock::to_map`.
            if headers.try_append(name, block.value(&entry)).is_err() {
                break;
            }
        }
        // Added here, never taken from the record: the mark says what this layer did with
        // this request, which no record can know.
        headers.append(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        headers
    }
}

pub(super) fn replay<T>(server: &ServerFace, stored: Outcome) -> Response<ResponseBody<T>> {
    match stored {
        Outcome::Response(stored) => {
            outcome("replayed");
            let mut response = Response::new(ResponseBody::buffered(stored.body()));
            *response.status_mut() = stored.status();
            *response.headers_mut() = server.replayed_headers(&stored);
            response
        }
        // The handler ran, but its answer was too large to keep: `410`, never a second run
        // and never a truncated body passed off as the answer.
        Outcome::Tombstone { status } => {
            outcome("response-not-recorded");
            problem::response_not_recorded(status)
        }
        // Outcomes added later are not replayable by this release.
        #[allow(unreachable_patterns)]
        _ => {
            outcome("response-not-recorded");
            problem::outcome_unknown()
        }
    }
}

/// What to record of a buffered response, the body to send, and how it was settled.
pub(super) fn recording<ResBody>(
    server: &ServerFace,
    parts: &http::response::Parts,
    buffered: Buffered<ResBody>,
    digest: &BodyDigest,
) -> (Outcome, ResponseBody<ResBody>, &'static str) {
    let status = parts.status;
    match buffered {
        Buffered::Whole(bytes) => {
            // Replays say which request they answer (see `crate::digest`).
            // The record is made from the very bytes the first caller is sent (a `Bytes`
            // clone is a reference count; a small body is then copied into the record's
            // own buffer), so every replay is byte for byte what the first caller got.
            let head = (status, parts.version);
            let stored = server.recorded(head, &parts.headers, digest, bytes.clone());
            (
                Outcome::Response(stored),
                ResponseBody::buffered(bytes),
                "recorded",
            )
        }
        Buffered::Overflow(prefix, rest) => {
            tracing::info!(
                limit = server.response_limit,
                "response over the recording cap; keeping a tombstone"
            );
            (
                Outcome::Tombstone { status },
                ResponseBody::overflow(prefix, rest),
                "tombstone",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use http::header::{self, HeaderValue};

    use super::*;
    use crate::ledger::MemoryStore;
    use crate::IdempotencyLayer;

    /// The status and version the tests record.
    const HEAD: (StatusCode, Version) = (StatusCode::OK, Version::HTTP_11);

    fn replayed(face: &ServerFace, recorded: HeaderMap) -> HeaderMap {
        let stored = StoredResponse::new(StatusCode::OK, Version::HTTP_11, recorded, Bytes::new());
        face.replayed_headers(&stored)
    }

    #[test]
    fn only_allow_listed_headers_are_recorded() {
        let service = tower_layer::Layer::layer(&IdempotencyLayer::server(MemoryStore::new()), ());
        let digest = &BodyDigest::of(b"{}");
        // A handler's own digest header is never recorded: the record's is the request's.
        let handlers = HeaderValue::from_static("sha-256=:from-the-handler:");
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        headers.append(header::LINK, HeaderValue::from_static("</a>; rel=a"));
        headers.append(header::LINK, HeaderValue::from_static("</b>; rel=b"));
        let mut with_handlers = headers.clone();
        with_handlers.insert(IDEMPOTENT_REQUEST_DIGEST.clone(), handlers);
        let kept = service
            .face
            .recorded(HEAD, &with_handlers, digest, Bytes::new())
            .headers();
        assert_eq!(kept.len(), 4);
        assert!(kept.get(header::SET_COOKIE).is_none());
        assert_eq!(kept.get_all(header::LINK).iter().count(), 2);
        assert_eq!(kept[&IDEMPOTENT_REQUEST_DIGEST], digest.header_value());
        assert!(
            kept.get(&IDEMPOTENT_REPLAYED).is_none(),
            "each replay adds it"
        );

        // Every header allowed: kept whole, every value of every name in its order.
        headers.remove(header::SET_COOKIE);
        let mut kept = service
            .face
            .recorded(HEAD, &headers, digest, Bytes::new())
            .headers();
        kept.remove(&IDEMPOTENT_REQUEST_DIGEST);
        assert_eq!(kept, headers);
        let order = |map: &HeaderMap| {
            map.get_all(header::LINK)
                .iter()
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&kept), order(&headers));
    }

    #[test]
    fn a_replay_carries_the_allowed_headers_the_digest_and_the_replay_mark() {
        let service = tower_layer::Layer::layer(&IdempotencyLayer::server(MemoryStore::new()), ());
        let digest = BodyDigest::of(b"{}");
        let mut response = HeaderMap::new();
        response.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        response.append(header::LINK, HeaderValue::from_static("</a>; rel=a"));
        response.append(header::LINK, HeaderValue::from_static("</b>; rel=b"));
        response.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        let stored = service
            .face
            .recorded(HEAD, &response, &digest, Bytes::new());
        let mut expected = response.clone();
        expected.remove(header::SET_COOKIE);
        expected.insert(IDEMPOTENT_REQUEST_DIGEST.clone(), digest.header_value());
        expected.insert(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        assert_eq!(service.face.replayed_headers(&stored), expected);
        let recorded = stored.headers();

        // A record of an earlier release (which held the mark), one made under a wider
        // allow-list, or one marked otherwise replays only what this one allows, marked.
        let mut earlier = recorded.clone();
        earlier.insert(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        assert_eq!(replayed(&service.face, earlier), expected);
        let mut wider = recorded.clone();
        wider.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        wider.insert("x-internal", HeaderValue::from_static("1"));
        assert_eq!(replayed(&service.face, wider), expected);
        let mut unmarked = recorded.clone();
        unmarked.insert(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("false"),
        );
        assert_eq!(replayed(&service.face, unmarked), expected);
        // Whatever the record holds, a replay carries one mark and one digest: the first.
        let mut repeated = recorded.clone();
        repeated.append(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        repeated.append(
            IDEMPOTENT_REQUEST_DIGEST.clone(),
            HeaderValue::from_static("x"),
        );
        let replayed = replayed(&service.face, repeated);
        assert_eq!(replayed, expected);
        assert_eq!(replayed.get_all(&IDEMPOTENT_REPLAYED).iter().count(), 1);
        assert_eq!(
            replayed.get_all(&IDEMPOTENT_REQUEST_DIGEST).iter().count(),
            1
        );
    }
}
