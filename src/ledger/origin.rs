//! What a record is of: the orchestrator's step that made it, and what it acts on
//! ([`Origin`]), so an operator listing operations in doubt can tell them apart.

use std::fmt;
use std::sync::Arc;

use crate::OperationId;

/// Which face made a record.
///
/// ```
/// use tower_idempotency::ledger::OriginFace;
///
/// assert_eq!(OriginFace::Client.as_str(), "client");
/// assert_eq!(OriginFace::parse("tool"), Some(OriginFace::Tool));
/// assert_eq!(OriginFace::parse("teapot"), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum OriginFace {
    /// The client face: a request sent out, to `METHOD scheme://host/path`.
    Client,
    /// The server face: a request received, at `METHOD /path`.
    Server,
    /// The tool face: a call of the named tool.
    Tool,
}

impl OriginFace {
    /// The face's name, as the stores keep it: `client`, `server` or `tool`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Server => "server",
            Self::Tool => "tool",
        }
    }

    /// The face named `name` ([`as_str`](Self::as_str)), if any.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "client" => Some(Self::Client),
            "server" => Some(Self::Server),
            "tool" => Some(Self::Tool),
            _ => None,
        }
    }
}

impl fmt::Display for OriginFace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a record is of: which face made it, what it acts on (its *target*), and, when an
/// [`OperationId`] named the operation, its `(task_id, step_id)`.
///
/// The target is, for the client face, `METHOD scheme://host[:port]/path` (never the query
/// string nor any user info: they may hold secrets); for the server face `METHOD /path`,
/// as the client sent it; for the tool face the tool's name.
///
/// Compact, so a record in memory can keep it: a fixed 56 bytes (the memory store boxes it
/// beside the record, in 64). Of the target, a standard method and an `http` or `https`
/// scheme are kept as codes, and the rest (the host and path, a path, a tool's name)
/// inline, cut to its first [`TARGET_CAP`](Self::TARGET_CAP) bytes at a character
/// boundary: a list filtered by a target prefix matches what is kept. The operation's ids
/// are copied in beside it when both fit in 47 bytes (a task and step of up to ~20 bytes
/// each, besides a typical target), and otherwise shared with the [`OperationId`] (a
/// reference count): they are never cut.
///
/// ```
/// use tower_idempotency::ledger::{Origin, OriginFace};
/// use tower_idempotency::OperationId;
///
/// let uri: http::Uri = "https://payments.example/v1/charges?api_key=secret".parse().unwrap();
/// let origin = Origin::client(&http::Method::POST, &uri)
///     .with_operation(&OperationId::new("task-42", "step-3"));
/// assert_eq!(origin.face(), OriginFace::Client);
/// assert_eq!(origin.target(), "POST https://payments.example/v1/charges");
/// assert_eq!(origin.task_id(), Some("task-42"));
/// assert_eq!(origin.step_id(), Some("step-3"));
///
/// assert_eq!(Origin::server(&http::Method::PUT, "/orders/7").target(), "PUT /orders/7");
/// assert_eq!(Origin::tool("send_email").task_id(), None);
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct Origin {
    /// Where `task_id` ends in the ids.
    split: u16,
    /// The length of the ids held inline (see [`Text::Inline`]).
    ids_len: u8,
    face: OriginFace,
    /// The target's method, as its place in [`METHODS`] plus one; `0` for none, or one
    /// written out at the start of `rest`.
    method: u8,
    /// The target's scheme, as its place in [`SCHEMES`] plus one; `0` for none, or one
    /// written out in `rest`.
    scheme: u8,
    /// How many bytes of the rest are used (the low six bits), whether the target was cut to
    /// fit ([`CUT`]) and whether the ids are held inline ([`INLINE_IDS`]).
    len: u8,
    /// The rest of the target, and the operation's ids.
    text: Text,
}

/// The text an [`Origin`] holds: the rest of its target, and its operation's `task_id`
/// then `step_id`.
#[derive(Clone)]
enum Text {
    /// The rest from the start, and the ids, if any, in the last `ids_len` bytes.
    Inline([u8; INLINE]),
    /// The rest, and the ids shared with the [`OperationId`].
    Shared([u8; Origin::TARGET_CAP], Arc<str>),
}

/// The bytes [`Text::Inline`] holds: the rest and the ids together.
const INLINE: usize = 47;

// A record in memory boxes one, in an allocation of 64 bytes (56 and the allocator's 8).
const _: () = assert!(std::mem::size_of::<Origin>() == 56);
const _: () = assert!(std::mem::size_of::<Option<Origin>>() == 56);

/// The methods a target keeps as a code.
const METHODS: [&str; 9] = [
    "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "CONNECT", "TRACE",
];

/// The schemes a client's target keeps as a code.
const SCHEMES: [&str; 2] = ["http", "https"];

/// The code of `word` in `table`, `0` for none.
fn code_of(table: &[&str], word: &str) -> u8 {
    table
        .iter()
        .position(|known| *known == word)
        .map_or(0, |at| at as u8 + 1)
}

impl Origin {
    /// The most bytes of a target an origin keeps besides a standard method and an `http`
    /// or `https` scheme (the host and path, a path, a tool's name): a longer target is cut
    /// (at a character boundary) to at most this.
    pub const TARGET_CAP: usize = 31;

    /// The origin of a record `face` made, acting on `target` (as [`target`](Self::target)
    /// shows it, cut to fit): for a store reading one back.
    ///
    /// ```
    /// use tower_idempotency::ledger::{Origin, OriginFace};
    ///
    /// let origin = Origin::new(OriginFace::Server, "POST /charges");
    /// assert_eq!(origin.target(), "POST /charges");
    /// let long = "x".repeat(100);
    /// assert_eq!(Origin::new(OriginFace::Tool, &long).target().len(), Origin::TARGET_CAP);
    /// ```
    pub fn new(face: OriginFace, target: &str) -> Self {
        let mut origin = Self::empty(face);
        if face == OriginFace::Tool {
            origin.push(target);
        } else {
            origin.push_target(target);
        }
        origin
    }

    /// A request the client face sends: `METHOD scheme://host[:port]/path`, without its
    /// query string or user info.
    ///
    /// ```
    /// use tower_idempotency::ledger::Origin;
    ///
    /// let uri: http::Uri = "http://user:pw@localhost:8080/charges?x=1".parse().unwrap();
    /// assert_eq!(Origin::client(&http::Method::POST, &uri).target(), "POST http://localhost:8080/charges");
    /// ```
    pub fn client(method: &http::Method, uri: &http::Uri) -> Self {
        let mut origin = Self::empty(OriginFace::Client);
        origin.push_method(method.as_str());
        if let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) {
            // A method written out is in the rest, which the scheme then follows.
            if origin.method != 0 {
                origin.scheme = code_of(&SCHEMES, scheme);
            }
            if origin.scheme == 0 {
                origin.push(scheme);
                origin.push("://");
            }
            // The host and port as written, without any user info: one scan, no parsing.
            let authority = authority.as_str();
            let host_and_port = authority.rsplit_once('@').map_or(authority, |(_, at)| at);
            origin.push(host_and_port);
        }
        origin.push(uri.path());
        origin
    }

    /// A request the server face received: `METHOD /path`, without its query string.
    ///
    /// ```
    /// use tower_idempotency::ledger::{Origin, OriginFace};
    ///
    /// let origin = Origin::server(&http::Method::POST, "/charges");
    /// assert_eq!((origin.face(), origin.target().as_str()), (OriginFace::Server, "POST /charges"));
    /// ```
    pub fn server(method: &http::Method, path: &str) -> Self {
        let mut origin = Self::empty(OriginFace::Server);
        origin.push_method(method.as_str());
        origin.push(path.split('?').next().unwrap_or(path));
        origin
    }

    /// A call of the tool `name`, by the tool face.
    ///
    /// ```
    /// use tower_idempotency::ledger::{Origin, OriginFace};
    ///
    /// assert_eq!(Origin::tool("refund").target(), "refund");
    /// assert_eq!(Origin::tool("refund").face(), OriginFace::Tool);
    /// ```
    pub fn tool(name: &str) -> Self {
        Self::new(OriginFace::Tool, name)
    }

    /// What a claim with `frozen` and no origin of its own is of
    /// ([`BeginRequest::named_origin`](super::BeginRequest::named_origin)): the request the
    /// client face sends, and the operation its key was derived from, if it was.
    pub(crate) fn of_frozen(frozen: &crate::FrozenRequest) -> Self {
        let origin = Self::client(frozen.method(), frozen.uri());
        match frozen.operation() {
            Some(operation) => origin.with_operation(operation),
            None => origin,
        }
    }

    /// What this origin weighs in a record that boxes it: the box, and the operation's ids
    /// (shared with the face's [`OperationId`] while it lives, then the record's own).
    pub(crate) fn weight(&self) -> u64 {
        let ids = match &self.text {
            Text::Inline(_) => 0,
            Text::Shared(_, ids) => 16 + ids.len(),
        };
        (64 + ids) as u64
    }

    /// The origin, of the operation `operation` names: its ids copied in when they fit
    /// beside the target, else shared.
    ///
    /// ```
    /// use tower_idempotency::ledger::Origin;
    /// use tower_idempotency::OperationId;
    ///
    /// let op = OperationId::new("task-1", "step-2");
    /// let origin = Origin::tool("refund").with_operation(&op);
    /// assert_eq!(origin.operation(), Some(op));
    /// ```
    pub fn with_operation(mut self, operation: &OperationId) -> Self {
        let (ids, split) = operation.shared_parts();
        // A task id of 64 KiB is no id an orchestrator makes: such an origin names none.
        let Ok(split) = u16::try_from(split) else {
            return self;
        };
        self.split = split;
        let rest = self.kept_len();
        match &mut self.text {
            // Written in place, after the rest.
            Text::Inline(bytes) if rest + ids.len() <= INLINE => {
                bytes[INLINE - ids.len()..].copy_from_slice(ids.as_bytes());
                // At most `INLINE` (47).
                self.ids_len = ids.len() as u8;
                self.len |= INLINE_IDS;
            }
            Text::Shared(_, shared) if rest + ids.len() > INLINE => *shared = ids.clone(),
            _ => {
                let mut bytes = [0; Self::TARGET_CAP];
                bytes[..rest].copy_from_slice(self.rest().as_bytes());
                let text = if rest + ids.len() <= INLINE {
                    let mut inline = [0; INLINE];
                    inline[..rest].copy_from_slice(&bytes[..rest]);
                    inline[INLINE - ids.len()..].copy_from_slice(ids.as_bytes());
                    self.ids_len = ids.len() as u8;
                    self.len |= INLINE_IDS;
                    Text::Inline(inline)
                } else {
                    self.ids_len = 0;
                    self.len &= !INLINE_IDS;
                    Text::Shared(bytes, ids.clone())
                };
                self.text = text;
            }
        }
        self
    }

    /// `task_id` then `step_id`, when an [`OperationId`] named the operation.
    fn ids(&self) -> Option<&str> {
        match &self.text {
            Text::Inline(bytes) if self.len & INLINE_IDS != 0 => {
                std::str::from_utf8(&bytes[INLINE - usize::from(self.ids_len)..]).ok()
            }
            Text::Inline(_) => None,
            Text::Shared(_, ids) => Some(ids),
        }
    }

    /// Which face made the record.
    pub fn face(&self) -> OriginFace {
        self.face
    }

    /// What the operation acts on (see [`Origin`]), its host and path, path or name cut to
    /// [`TARGET_CAP`](Self::TARGET_CAP) bytes.
    pub fn target(&self) -> String {
        self.pieces().concat()
    }

    /// The task the operation belongs to, when an [`OperationId`] named it.
    pub fn task_id(&self) -> Option<&str> {
        self.ids()?.get(..usize::from(self.split))
    }

    /// The step within the task, when an [`OperationId`] named it.
    pub fn step_id(&self) -> Option<&str> {
        self.ids()?.get(usize::from(self.split)..)
    }

    /// The [`OperationId`] that named the operation, if one did (sharing its ids when the
    /// origin does).
    pub fn operation(&self) -> Option<OperationId> {
        match &self.text {
            Text::Shared(_, ids) => Some(OperationId::from_shared(
                ids.clone(),
                usize::from(self.split),
            )),
            Text::Inline(_) => Some(OperationId::new(self.task_id()?, self.step_id()?)),
        }
    }

    /// Whether the target starts with `prefix`, both as kept (a prefix of a longer target
    /// than an origin keeps is matched on its kept part). No allocation: a list filtered by
    /// target asks it of every record.
    ///
    /// ```
    /// use tower_idempotency::ledger::Origin;
    ///
    /// let uri: http::Uri = "https://payments.example/v1/charges".parse().unwrap();
    /// let origin = Origin::client(&http::Method::POST, &uri);
    /// assert!(origin.target_starts_with("POST https://payments.example/"));
    /// assert!(origin.target_starts_with("PO"));
    /// assert!(!origin.target_starts_with("GET "));
    /// ```
    pub fn target_starts_with(&self, prefix: &str) -> bool {
        let [method, space, scheme, separator, _] = self.pieces();
        let mut left = prefix;
        for piece in [method, space, scheme, separator] {
            if left.len() <= piece.len() {
                return piece.starts_with(left);
            }
            match left.strip_prefix(piece) {
                Some(after) => left = after,
                None => return false,
            }
        }
        self.rest().starts_with(cut(left))
    }

    /// Whether this is a call of the tool `name` (as kept).
    ///
    /// ```
    /// use tower_idempotency::ledger::Origin;
    ///
    /// assert!(Origin::tool("refund").is_tool("refund"));
    /// assert!(!Origin::tool("refund").is_tool("ref"));
    /// ```
    pub fn is_tool(&self, name: &str) -> bool {
        self.face == OriginFace::Tool && self.rest() == Self::kept_tool(name)
    }

    /// A target prefix as an origin keeps a target ([`target`](Self::target) of what is
    /// kept): what a store that keeps targets as text compares a filter's prefix with.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn kept_target(prefix: &str) -> String {
        Self::new(OriginFace::Client, prefix).target()
    }

    /// A tool's name as an origin keeps it.
    pub(crate) fn kept_tool(name: &str) -> &str {
        cut(name)
    }

    fn empty(face: OriginFace) -> Self {
        Self {
            split: 0,
            ids_len: 0,
            face,
            method: 0,
            scheme: 0,
            len: 0,
            text: Text::Inline([0; INLINE]),
        }
    }

    /// The target's pieces, in order: its method and a space, its scheme and `://` (each
    /// empty when not kept as a code), and the rest.
    fn pieces(&self) -> [&str; 5] {
        let method = match self.method {
            0 => "",
            code => METHODS[usize::from(code - 1)],
        };
        let scheme = match self.scheme {
            0 => "",
            code => SCHEMES[usize::from(code - 1)],
        };
        [
            method,
            if method.is_empty() { "" } else { " " },
            scheme,
            if scheme.is_empty() { "" } else { "://" },
            self.rest(),
        ]
    }

    /// The part of the target kept as text.
    fn rest(&self) -> &str {
        let bytes = match &self.text {
            Text::Inline(bytes) => &bytes[..],
            Text::Shared(bytes, _) => &bytes[..],
        };
        // Only whole characters are ever written: see `push`.
        std::str::from_utf8(&bytes[..self.kept_len()]).unwrap_or_default()
    }

    /// The method: a standard one as a code, any other written out with its space.
    fn push_method(&mut self, method: &str) {
        self.method = code_of(&METHODS, method);
        if self.method == 0 {
            self.push(method);
            self.push(" ");
        }
    }

    /// A target as [`target`](Self::target) shows one: its method (when a space follows
    /// it), its scheme (when `://` follows it) and the rest.
    fn push_target(&mut self, target: &str) {
        let mut rest = target;
        if let Some((word, after)) = rest.split_once(' ') {
            self.method = code_of(&METHODS, word);
            if self.method != 0 {
                rest = after;
            }
        }
        match rest.split_once("://") {
            Some((scheme, after)) if self.method != 0 => {
                self.scheme = code_of(&SCHEMES, scheme);
                if self.scheme != 0 {
                    rest = after;
                }
            }
            _ => {}
        }
        self.push(rest);
    }

    /// Append `text` to the rest, as much of it as fits in whole characters; nothing once
    /// a piece was cut, so the kept target is always a prefix of the whole one.
    fn push(&mut self, text: &str) {
        if self.is_target_cut() {
            return;
        }
        let at = self.kept_len();
        let taken = cut_to(text, Self::TARGET_CAP - at);
        let end = at + taken.len();
        if end + usize::from(self.ids_len) > INLINE {
            // Inline ids would be overwritten: share them instead.
            if let Some(operation) = self.operation() {
                self.len &= !INLINE_IDS;
                self.ids_len = 0;
                let mut bytes = [0; Self::TARGET_CAP];
                bytes[..at].copy_from_slice(self.rest().as_bytes());
                let (ids, _) = operation.shared_parts();
                self.text = Text::Shared(bytes, ids.clone());
            }
        }
        match &mut self.text {
            Text::Inline(bytes) => bytes[at..end].copy_from_slice(taken.as_bytes()),
            Text::Shared(bytes, _) => bytes[at..end].copy_from_slice(taken.as_bytes()),
        }
        // At most `TARGET_CAP` (31): the low six bits hold it.
        self.len = (self.len & INLINE_IDS) | end as u8;
        if taken.len() < text.len() {
            self.len |= CUT;
        }
    }

    /// Whether the target was longer than an origin keeps, and [`target`](Self::target) is
    /// its first part.
    ///
    /// ```
    /// use tower_idempotency::ledger::Origin;
    ///
    /// assert!(!Origin::tool("refund").is_target_cut());
    /// assert!(Origin::tool(&"é".repeat(40)).is_target_cut());
    /// assert_eq!(Origin::tool(&"é".repeat(40)).target().len(), 30);
    /// ```
    pub fn is_target_cut(&self) -> bool {
        self.len & CUT != 0
    }

    fn kept_len(&self) -> usize {
        usize::from(self.len & !(CUT | INLINE_IDS))
    }
}

/// The flag in [`Origin`]'s `len` of a target cut to fit.
const CUT: u8 = 0x80;

/// The flag in [`Origin`]'s `len` of ids held inline.
const INLINE_IDS: u8 = 0x40;

/// Origins are equal when they show the same: face, target and ids, however held.
impl PartialEq for Origin {
    fn eq(&self, other: &Self) -> bool {
        self.face == other.face
            && (self.method, self.scheme) == (other.method, other.scheme)
            && self.len & CUT == other.len & CUT
            && self.rest() == other.rest()
            && self.split == other.split
            && self.ids() == other.ids()
    }
}

impl Eq for Origin {}

impl std::hash::Hash for Origin {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.face, self.method, self.scheme, self.len & CUT).hash(state);
        (self.rest(), self.split, self.ids()).hash(state);
    }
}

impl fmt::Debug for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Origin")
            .field("face", &self.face)
            .field("target", &self.target())
            .field("task_id", &self.task_id())
            .field("step_id", &self.step_id())
            .finish()
    }
}

/// `text` as an origin keeps the rest of a target: its first [`Origin::TARGET_CAP`] bytes,
/// in whole characters.
fn cut(text: &str) -> &str {
    cut_to(text, Origin::TARGET_CAP)
}

/// The longest prefix of `text` of at most `room` bytes that ends at a character boundary.
fn cut_to(text: &str, room: usize) -> &str {
    if text.len() <= room {
        return text;
    }
    let mut end = room;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_target_is_a_prefix_of_the_whole() {
        // A two-byte character straddles the cap: cut before it, and nothing after.
        let name = format!("{}é and more", "a".repeat(Origin::TARGET_CAP - 1));
        let origin = Origin::tool(&name);
        assert!(origin.is_target_cut());
        assert_eq!(origin.target(), "a".repeat(Origin::TARGET_CAP - 1));
        assert!(origin.is_tool(&name), "a name is matched on its kept part");

        // A host that fills the cap: the path that follows is not written after the cut.
        let host = format!("{}.example", "h".repeat(40));
        let uri: http::Uri = format!("https://{host}/path").parse().expect("a URI");
        let origin = Origin::client(&http::Method::GET, &uri);
        assert!(origin.is_target_cut());
        assert!(format!("GET https://{host}/path").starts_with(&origin.target()));
        assert!(!origin.target().contains("/path"));

        let long = format!("/{}", "ab".repeat(40));
        let origin = Origin::server(&http::Method::POST, &long);
        assert_eq!(origin.target().len(), "POST ".len() + Origin::TARGET_CAP);
        assert!(origin.target_starts_with(&format!("POST {long}")));
        assert!(!origin.target_starts_with("POST /ba"));
    }

    #[test]
    fn a_target_read_back_is_the_origin_kept() {
        let targets = [
            ("POST", "https://payments.example/v1/charges?x=1"),
            ("GET", "http://127.0.0.1:8080/"),
            ("PURGE", "http://cache.local/item"),
            ("DELETE", "ftp://files.local/a"),
            ("POST", "/relative"),
        ];
        for (method, uri) in targets {
            let method = http::Method::from_bytes(method.as_bytes()).expect("a method");
            let origin = Origin::client(&method, &uri.parse().expect("a URI"));
            let back = Origin::new(OriginFace::Client, &origin.target());
            assert_eq!(back, origin, "{uri}");
            assert!(origin.target_starts_with(&origin.target()), "{uri}");
            assert_eq!(Origin::kept_target(&origin.target()), origin.target());
        }
        let origin = Origin::client(
            &http::Method::from_bytes(b"PURGE").unwrap(),
            &"http://c.local/i".parse().unwrap(),
        );
        assert_eq!(origin.target(), "PURGE http://c.local/i");
        let server = Origin::server(&http::Method::PATCH, "/a://b");
        assert_eq!(Origin::new(OriginFace::Server, &server.target()), server);
        // The codes keep the cap for the host and path: a typical target is whole.
        let uri = "https://api.stripe.com/v1/refunds".parse().unwrap();
        let origin = Origin::client(&http::Method::POST, &uri);
        assert!(!origin.is_target_cut());
        assert_eq!(origin.target(), "POST https://api.stripe.com/v1/refunds");
        // A longer prefix than is kept matches on its kept part, as a store's text does.
        let uri = format!(
            "https://api.stripe.com/v1/payment_intents/{}",
            "x".repeat(40)
        );
        let origin = Origin::client(&http::Method::POST, &uri.parse().unwrap());
        let long = format!("POST {uri}");
        assert!(origin.target_starts_with(&long));
        assert!(long.starts_with(&Origin::kept_target(&long)));
        assert_eq!(Origin::kept_target(&long), origin.target());
    }

    #[test]
    fn short_ids_are_held_inline_and_long_ones_shared_never_cut() {
        let uri: http::Uri = "https://payments.example/v1/charges".parse().unwrap();
        let short = OperationId::new("task-42", "charge");
        let origin = Origin::client(&http::Method::POST, &uri).with_operation(&short);
        assert!(matches!(origin.text, Text::Inline(_)));
        assert_eq!(origin.weight(), 64, "inline ids weigh nothing more");
        assert_eq!(
            (origin.task_id(), origin.step_id()),
            (Some("task-42"), Some("charge"))
        );
        assert_eq!(origin.operation(), Some(short.clone()));
        assert_eq!(origin.target(), "POST https://payments.example/v1/charges");

        let task = "0f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a";
        let long = OperationId::new(task, "call_7Yx2kQ9mN3pL8rT1");
        let origin = Origin::client(&http::Method::POST, &uri).with_operation(&long);
        assert!(matches!(origin.text, Text::Shared(..)));
        assert_eq!(
            origin.weight(),
            64 + 16 + 57,
            "shared ids: their allocation"
        );
        assert_eq!(origin.task_id(), Some(task));
        assert_eq!(origin.step_id(), Some("call_7Yx2kQ9mN3pL8rT1"));
        assert_eq!(origin.operation(), Some(long));
        assert_eq!(origin.target(), "POST https://payments.example/v1/charges");

        // Named before its target is written: the ids move out of the target's way.
        let mut origin = Origin::empty(OriginFace::Server)
            .with_operation(&OperationId::new("t".repeat(20), "s".repeat(20)));
        assert!(matches!(origin.text, Text::Inline(_)));
        origin.push_target(&format!("POST /{}", "p".repeat(40)));
        assert!(matches!(origin.text, Text::Shared(..)));
        assert_eq!(origin.task_id(), Some("t".repeat(20).as_str()));
        assert_eq!(origin.step_id(), Some("s".repeat(20).as_str()));
        assert_eq!(origin.target().len(), "POST ".len() + Origin::TARGET_CAP);

        // Equal by what they show, however the ids are held.
        let inline = Origin::tool("refund").with_operation(&short);
        let mut shared = inline.clone();
        let mut bytes = [0; Origin::TARGET_CAP];
        bytes[..6].copy_from_slice(b"refund");
        shared.text = Text::Shared(bytes, short.shared_parts().0.clone());
        shared.len &= !INLINE_IDS;
        shared.ids_len = 0;
        assert_eq!(inline, shared);
    }

    #[test]
    fn an_origin_shares_its_operation_ids() {
        let op = OperationId::new("task", "step");
        let origin = Origin::server(&http::Method::POST, "/x?secret=1").with_operation(&op);
        assert_eq!(origin.target(), "POST /x");
        assert_eq!(
            (origin.task_id(), origin.step_id()),
            (Some("task"), Some("step"))
        );
        assert_eq!(origin.operation(), Some(op));
        assert!(format!("{origin:?}").contains("task"));
    }
}
