//! The values a ledger stores, and their versioned byte encoding.

mod codec;
mod fields;
mod headers;

use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Uri, Version};

use super::StoreError;
use crate::key::{hex, length_prefixed_sha256, IdempotencyKey};
use crate::FrozenRequest;
use codec::{corrupt, version_code, version_from_code, Reader, Writer, ENCODING_VERSION};
pub use fields::FieldDigests;
use fields::Gathered;
pub(crate) use headers::{entries_size, BlockWriter, HeaderBlock, REQUEST_DIGEST_SIZE};

/// The key of a ledger record: 32 bytes, already scoped.
///
/// Three derivations, each domain-separated so they can never collide:
///
/// - an [`OperationId`](crate::OperationId)'s key is used as is (its derivation already
///   covers the scope): [`LedgerKey::for_operation`];
/// - a caller's own `Idempotency-Key` on the client:
///   `SHA-256("tower-idempotency/ledger/client/v3" || lp(scope) || lp(principal) ||
///   lp(scheme) || lp(authority) || lp(key))`, so one key sent to two hosts, or for two
///   principals, is two operations;
/// - the server: `SHA-256("tower-idempotency/ledger/server/v2" || lp(scope) || lp(key))`,
///   so one tenant's key never touches another's record, and one key is one request
///   whatever method or path it is reused on (the fingerprint tells those apart: a reuse
///   is a `422`, never a second execution).
///
/// `lp(x)` is `x` behind its length as a big-endian `u64`.
///
/// ```
/// use tower_idempotency::ledger::LedgerKey;
///
/// let a = LedgerKey::server("tenant-a", "k1");
/// let b = LedgerKey::server("tenant-b", "k1");
/// assert_ne!(a, b);
/// let payments = LedgerKey::client_header("", "", "https", "payments.example", "k1");
/// let shipping = LedgerKey::client_header("", "", "https", "shipping.example", "k1");
/// assert_ne!(payments, shipping);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LedgerKey([u8; 32]);

impl LedgerKey {
    /// The record key of an operation identified by a derived [`IdempotencyKey`].
    pub fn for_operation(key: IdempotencyKey) -> Self {
        Self(*key.as_bytes())
    }

    /// The record key of a caller-supplied `Idempotency-Key` on the client side, sent for
    /// `principal` (by default a hash of the request's `Authorization` header: see
    /// [`client::Builder::caller_key_scope`](crate::client::Builder::caller_key_scope))
    /// to the target `scheme://authority`, as the client face spells them: the scheme and
    /// host in lower case, the scheme's default port left out.
    pub fn client_header(
        scope: &str,
        principal: &str,
        scheme: &str,
        authority: &str,
        key: &str,
    ) -> Self {
        Self::client_header_of(scope, principal, scheme, authority, key.as_bytes())
    }

    /// [`client_header`](Self::client_header) of a key given as its bytes (a
    /// [`HeaderKey`](crate::HeaderKey)'s, which are ASCII).
    pub(crate) fn client_header_of(
        scope: &str,
        principal: &str,
        scheme: &str,
        authority: &str,
        key: &[u8],
    ) -> Self {
        Self::hash(
            b"tower-idempotency/ledger/client/v3",
            &[
                scope.as_bytes(),
                principal.as_bytes(),
                scheme.as_bytes(),
                authority.as_bytes(),
                key,
            ],
        )
    }

    /// The record key of an `Idempotency-Key` received by a server, in `scope`.
    pub fn server(scope: &str, key: &str) -> Self {
        Self::server_of(scope, key.as_bytes())
    }

    /// [`server`](Self::server) of a key given as its bytes (a
    /// [`HeaderKey`](crate::HeaderKey)'s, which are ASCII).
    pub(crate) fn server_of(scope: &str, key: &[u8]) -> Self {
        Self::hash(
            b"tower-idempotency/ledger/server/v2",
            &[scope.as_bytes(), key],
        )
    }

    fn hash(tag: &[u8], fields: &[&[u8]]) -> Self {
        // The tag keeps the derivations (and each one's versions) apart; the length prefixes
        // keep the fields apart, so ("ab", "c") and ("a", "bc") never meet. Changing either
        // changes every key of that derivation: records made before are no longer found.
        Self(length_prefixed_sha256(tag, fields))
    }

    /// Wrap raw bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// 64 lowercase hex digits (how the Redis store names its keys).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// The key that 64 hex digits spell (as [`to_hex`](Self::to_hex) writes it, either
    /// case); `None` for any other text.
    ///
    /// ```
    /// use tower_idempotency::ledger::LedgerKey;
    ///
    /// let key = LedgerKey::from_bytes([0xab; 32]);
    /// assert_eq!(LedgerKey::from_hex(&key.to_hex()), Some(key));
    /// assert_eq!(LedgerKey::from_hex("+b"), None);
    /// ```
    pub fn from_hex(text: &str) -> Option<Self> {
        crate::key::derived::from_hex32(text).map(Self)
    }
}

impl fmt::Debug for LedgerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LedgerKey({})", self.to_hex())
    }
}

/// Hashes a [`LedgerKey`] for in-memory maps: an FxHash-style fold of its four words,
/// started from its map's secret seed ([`DigestState`]).
///
/// Keys the layers make are SHA-256 digests, so SipHash (the default) would buy nothing
/// but time. The seed still matters: a digest's bits cannot be chosen, but they can be
/// searched for, and with a known fold a client could try keys until thousands share the
/// low bits that pick a bucket, one cheap search each, and turn every lookup in that map
/// into a walk along them. Every byte goes into the fold, so keys built by hand
/// ([`LedgerKey::from_bytes`]) with long constant runs spread as well.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DigestHasher(u64);

impl std::hash::Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word)).wrapping_mul(SEED);
        }
    }

    // The length prefix of the key's byte array is the same for every key.
    fn write_usize(&mut self, _: usize) {}
}

/// Builds [`DigestHasher`]s from a random seed of its own, drawn when the map is made.
#[derive(Clone, Debug)]
pub(crate) struct DigestState {
    seed: u64,
}

impl Default for DigestState {
    fn default() -> Self {
        Self {
            seed: fastrand::u64(..),
        }
    }
}

impl std::hash::BuildHasher for DigestState {
    type Hasher = DigestHasher;

    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(self.seed)
    }
}

/// A fencing token: proof of ownership of an operation's current lease.
///
/// 128 random bits, unique per `begin` that hands out ownership. Stores compare tokens;
/// nothing else may be read into them.
///
/// ```
/// # use tower_idempotency::ledger::LeaseToken;
/// let token = LeaseToken::generate();
/// assert_ne!(token, LeaseToken::generate());
/// assert_eq!(LeaseToken::from_u128(token.as_u128()), token);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(u128);

impl LeaseToken {
    /// A fresh token.
    pub fn generate() -> Self {
        // Fencing needs tokens that two owners never share, not secret ones: a token only
        // travels between a layer and its store. 128 bits make a repeat out of reach.
        Self(fastrand::u128(..))
    }

    /// Rebuild a token a store encoded.
    pub const fn from_u128(value: u128) -> Self {
        Self(value)
    }

    /// The token's value, for stores to encode.
    pub const fn as_u128(&self) -> u128 {
        self.0
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({:032x})", self.0)
    }
}

/// The recorded result of a completed operation.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Outcome {
    /// A whole response, replayed to later callers.
    Response(StoredResponse),
    /// The response was over the recording cap: the operation is done, but cannot be
    /// replayed. A later caller gets a clear error, never a re-execution, never a truncation.
    Tombstone {
        /// The status the first caller received.
        status: StatusCode,
    },
}

impl Outcome {
    /// The status it answers with (a tombstone's too).
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::Response(response) => response.status(),
            Self::Tombstone { status } => *status,
        }
    }

    /// Bytes this outcome holds in memory, for weighing caches.
    pub fn weight(&self) -> usize {
        match self {
            Self::Response(response) => response.weight(),
            Self::Tombstone { .. } => 16,
        }
    }

    /// Encode as versioned bytes (see [`Outcome::decode`]).
    ///
    /// ```
    /// # use tower_idempotency::ledger::{Outcome, StoredResponse};
    /// let outcome = Outcome::Response(StoredResponse::new(
    ///     http::StatusCode::CREATED, http::Version::HTTP_11, http::HeaderMap::new(), "ok".into()));
    /// let decoded = Outcome::decode(&outcome.encode()).unwrap();
    /// let Outcome::Response(response) = decoded else { panic!() };
    /// assert_eq!(response.body().as_ref(), b"ok");
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        // The first four bytes (version, tag, status) stay where they are: `inspect.lua` reads
        // a recorded status from them without decoding the rest.
        let mut out = Writer::new(ENCODING_VERSION);
        match self {
            Self::Response(response) => {
                out.u8(0);
                out.u16(response.status().as_u16());
                out.u8(version_code(response.version()));
                out.header_block(response.header_block());
                out.bytes(response.body_bytes());
            }
            Self::Tombstone { status } => {
                out.u8(1);
                out.u16(status.as_u16());
            }
        }
        out.0
    }

    /// Decode bytes made by [`Outcome::encode`] of this or an earlier release.
    pub fn decode(bytes: &[u8]) -> Result<Self, StoreError> {
        let mut input = Reader::new(bytes)?;
        let outcome = match input.u8()? {
            0 => {
                let status = input.status()?;
                let version = version_from_code(input.u8()?)?;
                let headers = input.header_pairs()?;
                // The body after the headers, in the block's one buffer, as a client's
                // record holds it.
                let recorded = HeaderBlock::of_checked_pairs(&headers, input.bytes()?, &[]);
                Self::Response(StoredResponse::of_block_with_body(
                    status, version, recorded,
                ))
            }
            1 => Self::Tombstone {
                status: input.status()?,
            },
            other => return Err(corrupt(format!("unknown outcome tag {other}"))),
        };
        input.finish()?;
        Ok(outcome)
    }
}

/// A response as recorded: status, version, headers and the whole body.
///
/// The headers are held in one buffer, in order (repeated names and sensitivity kept), not
/// as a [`HeaderMap`]: a record is written on every operation and read only by its replays,
/// so the writer makes one exact-size buffer and hashes nothing, and a replay builds the
/// map it answers with ([`headers`](Self::headers)).
///
/// Cloning is a reference-count increment.
///
/// ```
/// use tower_idempotency::ledger::StoredResponse;
///
/// let mut headers = http::HeaderMap::new();
/// headers.append(http::header::CONTENT_TYPE, "application/json".parse().unwrap());
/// headers.append("x-charge-id", "ch_1".parse().unwrap());
/// let stored = StoredResponse::new(
///     http::StatusCode::CREATED, http::Version::HTTP_11, &headers, r#"{"id":"ch_1"}"#.into());
/// assert_eq!(stored.status(), http::StatusCode::CREATED);
/// assert_eq!(stored.headers(), headers);
/// assert_eq!(stored.body().as_ref(), br#"{"id":"ch_1"}"#);
/// ```
#[derive(Clone)]
pub struct StoredResponse(Arc<Stored>);

struct Stored {
    status: StatusCode,
    version: Version,
    headers: HeaderBlock,
    /// `None`: the body is held after the headers, in their block.
    body: Option<Bytes>,
    /// What the block holds after the body ([`HeaderBlock::tail`]).
    tail: Tail,
}

/// What a recorded response's block holds after its body, and what a face gathered for it
/// ([`GatheredFields`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tail {
    /// Nothing was gathered of the request: the store keeps what it will of it.
    Ungathered,
    /// The request's field digests were gathered, and there are none to keep (its body is
    /// no JSON object, or they would outweigh the request).
    NoFields,
    /// The request's field digests ([`FieldDigests`]' entries) are the tail.
    Fields,
}

impl Tail {
    /// What a record holds of its request's fields, `entries` being the digests when there
    /// are some.
    fn fields(self, entries: &[u8]) -> RequestFields<'_> {
        match self {
            Tail::Ungathered => RequestFields::Ungathered,
            Tail::NoFields => RequestFields::NoFields,
            Tail::Fields => RequestFields::Entries(entries),
        }
    }
}

/// The field digests a face gathers of the request it records an outcome for, held until
/// the record is made ([`fields`](Self::fields)).
pub(crate) struct GatheredFields {
    held: Tail,
    /// Written in place: the entries are on the stack, and a move of them a copy.
    gathered: Gathered,
}

impl GatheredFields {
    /// The digests of `request`'s fields, when the store keeps them (`None`: it does not).
    /// Digests that may outweigh the request, which the store would not keep, are left to
    /// it to weigh (it makes them again): they always weigh less but for bodies of many
    /// tiny fields.
    // Inlined, so that the gathered entries (on the stack, a few hundred bytes) are
    // written where the caller holds them, not copied there.
    #[inline(always)]
    pub(crate) fn of(request: Option<&FrozenRequest>) -> Self {
        Self::judged_by(request, None)
    }

    /// [`of`](Self::of), with the digests of the values at `defining`'s pointers when set:
    /// what a face that judges drift by those fields needs of a completed request, where a
    /// digest of a whole top-level field cannot tell a change beside a nested defining
    /// field from one to it.
    #[inline(always)]
    pub(crate) fn judged_by(
        request: Option<&FrozenRequest>,
        defining: Option<&crate::fingerprint::PayloadFields>,
    ) -> Self {
        let mut fields = Self {
            held: Tail::Ungathered,
            gathered: Gathered::new(),
        };
        if let Some(request) = request {
            let is_object = fields.gathered.of_body(request.body());
            if let (true, Some(defining)) = (is_object, defining) {
                fields.gathered.of_pointers(request.body(), defining);
            }
            fields.held = if !is_object {
                Tail::NoFields
            } else if FieldDigests::weight_of(fields.gathered.entries().len())
                > request.least_weight()
            {
                // Past what the request weighs at least (cheaper to know than what it
                // weighs), the store decides.
                Tail::Ungathered
            } else {
                Tail::Fields
            };
        }
        fields
    }

    /// What the record will hold of them.
    #[cfg(test)]
    pub(crate) fn fields(&self) -> RequestFields<'_> {
        self.held.fields(self.gathered.entries())
    }
}

/// What a recorded response holds of the field digests of the request it answered
/// ([`FieldDigests`]): gathered by the face that recorded it, outside the store, and held in
/// the record's own buffer ([`StoredResponse::with_request_fields`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestFields<'a> {
    /// None gathered: a store that keeps field digests makes them itself.
    Ungathered,
    /// Gathered, and none to keep.
    NoFields,
    /// Gathered: the digests' entries.
    Entries(&'a [u8]),
}

impl StoredResponse {
    /// Record a response. The headers are copied into the record, so a reference will do
    /// (`&parts.headers`): a response being passed on keeps its own map.
    pub fn new(
        status: StatusCode,
        version: Version,
        headers: impl Borrow<HeaderMap>,
        body: Bytes,
    ) -> Self {
        let headers = headers.borrow();
        if body.len() <= FOLDED_BODY {
            // Headers and body written once, into one buffer of their size.
            let block = HeaderBlock::of_followed_by(headers, &body);
            return Self::of_block_with_body(status, version, block);
        }
        Self::held_apart(status, version, HeaderBlock::of(headers), body)
    }

    /// Record a response whose headers are already in a block, a small body copied in
    /// after them (see [`FOLDED_BODY`]): the reference [`new`](Self::new) and
    /// [`written`](Self::written) are held to, which write the same record once.
    #[cfg(test)]
    pub(crate) fn of_block(
        status: StatusCode,
        version: Version,
        headers: HeaderBlock,
        body: Bytes,
    ) -> Self {
        if body.len() <= FOLDED_BODY && headers.body_bytes().is_empty() {
            return Self::of_block_with_body(status, version, headers.followed_by(&body));
        }
        Self::held_apart(status, version, headers, body)
    }

    /// Record a response whose headers `write` puts into a block, `entries` bytes of them
    /// ([`entries_size`]): a small body is written after them in the same buffer, made at
    /// its full size at once (see [`FOLDED_BODY`]), a larger one held as it came. Inlined
    /// into its one caller, the server face's record, whose closures it runs.
    #[inline]
    pub(crate) fn written(
        status: StatusCode,
        version: Version,
        entries: usize,
        write: impl FnOnce(&mut BlockWriter),
        body: Bytes,
    ) -> Self {
        let folded = body.len() <= FOLDED_BODY;
        let mut block = BlockWriter::with_capacity(entries + if folded { body.len() } else { 0 });
        write(&mut block);
        if folded {
            return Self::of_block_with_body(status, version, block.finish_with_body(&body, &[]));
        }
        Self::held_apart(status, version, block.finish(), body)
    }

    /// Record a response whose body (over [`FOLDED_BODY`]) is held apart from its headers'
    /// block, as it came.
    fn held_apart(status: StatusCode, version: Version, headers: HeaderBlock, body: Bytes) -> Self {
        Self(Arc::new(Stored {
            status,
            version,
            headers,
            body: Some(body),
            tail: Tail::Ungathered,
        }))
    }

    /// Record a response whose body is held after its headers, in their block
    /// ([`HeaderBlock::with_body`]).
    pub(crate) fn of_block_with_body(
        status: StatusCode,
        version: Version,
        headers_and_body: HeaderBlock,
    ) -> Self {
        Self(Arc::new(Stored {
            status,
            version,
            headers: headers_and_body,
            body: None,
            tail: Tail::Ungathered,
        }))
    }

    /// A client's record of a response: its headers and a copy of its body in one buffer
    /// ([`HeaderBlock::with_body`]), and after them the field digests of the request it
    /// answered, gathered by the caller: a store that keeps them
    /// ([`IdempotencyStore::keeps_request_fields`](crate::ledger::IdempotencyStore::keeps_request_fields))
    /// then neither scans the request's body under its lock nor allocates for them.
    pub(crate) fn with_request_fields(
        status: StatusCode,
        version: Version,
        headers: &HeaderMap,
        body: &[u8],
        fields: &GatheredFields,
    ) -> Self {
        Self::of_block_with_fields(
            status,
            version,
            |tail| HeaderBlock::with_body_and_tail(headers, body, tail),
            fields,
        )
    }

    /// [`with_request_fields`](Self::with_request_fields) for a block made by `block`,
    /// handed the tail to hold after the body.
    pub(crate) fn of_block_with_fields(
        status: StatusCode,
        version: Version,
        block: impl FnOnce(&[u8]) -> HeaderBlock,
        fields: &GatheredFields,
    ) -> Self {
        let entries = fields.gathered.entries();
        let (tail, entries): (_, &[u8]) = match fields.held {
            // Entries over 4 GiB (a body of billions of fields) are left to the store.
            Tail::Fields if u32::try_from(entries.len()).is_ok() => (Tail::Fields, entries),
            Tail::Fields => (Tail::Ungathered, &[]),
            held => (held, &[]),
        };
        Self(Arc::new(Stored {
            status,
            version,
            headers: block(entries),
            body: None,
            tail,
        }))
    }

    /// The field digests of the request this response answered, as its recorder gathered
    /// them ([`with_request_fields`](Self::with_request_fields)).
    pub(crate) fn request_fields(&self) -> RequestFields<'_> {
        self.0.tail.fields(self.0.headers.tail())
    }

    /// The recorded status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The recorded HTTP version.
    pub fn version(&self) -> Version {
        self.0.version
    }

    /// The recorded headers, as a map built for the caller (the record holds them in one
    /// buffer; the values share it).
    pub fn headers(&self) -> HeaderMap {
        self.0.headers.to_map()
    }

    /// The recorded headers as they are held.
    pub(crate) fn header_block(&self) -> &HeaderBlock {
        &self.0.headers
    }

    /// The recorded body: a handle sharing the record's bytes (a reference-count
    /// increment, not a copy).
    #[inline]
    pub fn body(&self) -> Bytes {
        match &self.0.body {
            Some(body) => body.clone(),
            None => self.0.headers.body(),
        }
    }

    /// The recorded body as it is held.
    pub(crate) fn body_bytes(&self) -> &[u8] {
        match &self.0.body {
            Some(body) => body,
            None => self.0.headers.body_bytes(),
        }
    }

    /// Bytes held in memory, for weighing caches: the record itself, its header buffer (and
    /// the request's field digests in it, when gathered), its body, and what the allocator
    /// adds to those allocations.
    pub fn weight(&self) -> usize {
        std::mem::size_of::<Stored>()
            + self.0.headers.weight()
            + self.0.body.as_ref().map_or(0, Bytes::len)
            + RESPONSE_ALLOCATIONS
    }
}

/// Bodies up to this size are held in their record's header buffer, copied: a record
/// outlives the response it was made from by its whole retention, and one buffer costs
/// less than the body's own and its shared handle (which would also keep alive whatever
/// buffer the body was sliced from). Larger ones are held as they came, uncopied.
const FOLDED_BODY: usize = 1024;

/// What the allocator adds to a recorded response's allocations (its shared fields, its
/// header buffer, its body and the body's shared handle): chunk headers and rounding.
/// Calibrated with `benches/memory_footprint.rs`, so that a million small records grow the
/// process by about the budget.
const RESPONSE_ALLOCATIONS: usize = 64;

impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoredResponse")
            .field("status", &self.0.status)
            .field("headers", &self.0.headers)
            .field("body_len", &self.body_bytes().len())
            .finish()
    }
}

impl FrozenRequest {
    /// Encode as versioned bytes, for stores that keep requests outside the process.
    ///
    /// ```
    /// # use tower_idempotency::FrozenRequest;
    /// let frozen = FrozenRequest::from_parts(
    ///     http::Method::POST, "http://x.local/a".parse().unwrap(), http::Version::HTTP_11,
    ///     http::HeaderMap::new(), "body".into());
    /// let decoded = FrozenRequest::decode(&frozen.encode()).unwrap();
    /// assert_eq!(decoded.fingerprint(), frozen.fingerprint());
    /// assert_eq!(decoded.uri(), frozen.uri());
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Writer::new(ENCODING_VERSION);
        out.bytes(self.method().as_str().as_bytes());
        out.bytes(self.uri().to_string().as_bytes());
        out.u8(version_code(self.version()));
        out.headers(self.headers());
        out.bytes(self.body());
        out.0
    }

    /// Decode bytes made by [`FrozenRequest::encode`] of this or an earlier release.
    pub fn decode(bytes: &[u8]) -> Result<Self, StoreError> {
        let mut input = Reader::new(bytes)?;
        let method = Method::from_bytes(input.bytes()?).map_err(corrupt)?;
        let uri = Uri::try_from(input.bytes()?).map_err(corrupt)?;
        let version = version_from_code(input.u8()?)?;
        let headers = input.headers()?;
        let body = Bytes::copy_from_slice(input.bytes()?);
        input.finish()?;
        Ok(Self::from_parts(method, uri, version, headers, body))
    }
}

#[cfg(test)]
mod tests;
