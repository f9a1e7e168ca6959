//! A call's arguments, frozen once: their canonical bytes, fingerprint and digest.

use http::{HeaderMap, Method, Version};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::digest::BodyDigest;
use crate::fingerprint::{canonical, Fingerprint};
use crate::tool::face::ToolFace;
use crate::tool::NotReadBack;
use crate::FrozenRequest;

/// A call's arguments, frozen: the canonical bytes as the ledger stores them, and the
/// fingerprint and digest that identify them.
pub(super) struct Frozen {
    pub(super) request: FrozenRequest,
    pub(super) fingerprint: Fingerprint,
    pub(super) digest: BodyDigest,
}

impl Frozen {
    /// `arguments`, frozen for `face`: written straight to canonical bytes, or through a
    /// JSON value when only some of its fields define the operation (they are picked from
    /// the value).
    pub(super) fn new<C, A: Serialize + ?Sized>(
        face: &ToolFace<C>,
        arguments: &A,
    ) -> Result<Self, serde_json::Error> {
        let (body, defining) = match &face.fields {
            Some(fields) => {
                let (body, value) = canonical::freeze(arguments)?;
                (body, Some(fields.canonical(&value)))
            }
            None => (canonical::to_bytes(arguments)?, None),
        };
        let digest = BodyDigest::of(&body);
        let fingerprint = match defining {
            Some(defining) => Fingerprint::of(&Method::POST, &face.target, &defining),
            None => Fingerprint::from_digest(&Method::POST, &face.target, &digest),
        };
        let request = FrozenRequest::from_parts(
            Method::POST,
            face.uri.clone(),
            Version::HTTP_11,
            HeaderMap::new(),
            body,
        );
        Ok(Self {
            request,
            fingerprint,
            digest,
        })
    }

    /// The arguments as every attempt and every resume will call the tool with them: the
    /// frozen bytes read back. Refused when they do not freeze again to the same bytes:
    /// what a resume would call the tool with is not what was frozen (or cannot be read
    /// at all), and an operation that no resume can finish must not be started.
    pub(super) fn read_back<A: Serialize + DeserializeOwned>(&self) -> Result<A, NotReadBack> {
        let body = self.body();
        let thawed: A =
            serde_json::from_slice(body).map_err(|err| NotReadBack::unreadable(body, err))?;
        match canonical::to_bytes(&thawed) {
            Ok(again) if again == body => Ok(thawed),
            Ok(again) => Err(NotReadBack::changed(body, &again)),
            Err(err) => Err(NotReadBack::unreadable(body, err)),
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
    pub(super) fn digest_of(&self, first: &FrozenRequest) -> BodyDigest {
        if self.is(first) {
            return self.digest;
        }
        first.body_digest()
    }
}
