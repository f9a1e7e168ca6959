//! A call's arguments, frozen once: their canonical bytes, fingerprint and digest.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Version};

use crate::digest::BodyDigest;
use crate::fingerprint::Fingerprint;
use crate::tool::face::ToolFace;
use crate::FrozenRequest;

/// A call's arguments, frozen: the canonical bytes as the ledger stores them, and the
/// fingerprint and digest that identify them.
pub(super) struct Frozen {
    pub(super) request: FrozenRequest,
    pub(super) fingerprint: Fingerprint,
    pub(super) digest: HeaderValue,
}

impl Frozen {
    pub(super) fn new<C>(face: &ToolFace<C>, body: Bytes, value: &serde_json::Value) -> Self {
        let digest = BodyDigest::of(&body);
        let fingerprint = match &face.fields {
            Some(fields) => Fingerprint::of(&Method::POST, &face.target, &fields.canonical(value)),
            None => Fingerprint::from_digest(&Method::POST, &face.target, &digest),
        };
        let request = FrozenRequest::from_parts(
            Method::POST,
            face.uri.clone(),
            Version::HTTP_11,
            HeaderMap::new(),
            body,
        );
        Self {
            request,
            fingerprint,
            digest: digest.header_value(),
        }
    }

    pub(super) fn body(&self) -> &[u8] {
        self.request.body()
    }

    /// Whether `first` is these frozen arguments (the same bytes, not a copy).
    pub(super) fn is(&self, first: &FrozenRequest) -> bool {
        let (mine, theirs) = (self.request.body(), first.body());
        mine.as_ptr() == theirs.as_ptr() && mine.len() == theirs.len()
    }

    /// The digest of `first`, the arguments an operation goes on with: ours, already made,
    /// when they are ours (the same bytes), else made now.
    pub(super) fn digest_of(&self, first: &FrozenRequest) -> HeaderValue {
        if self.is(first) {
            return self.digest.clone();
        }
        first.body_digest().header_value()
    }
}
