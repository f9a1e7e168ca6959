//! The tool face's requests, outputs, classes and errors.

use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::idempotency::{InDoubtOperation, Reconciled};
use crate::key::{IdempotencyKey, OperationId};

/// One tool call: the orchestrator's operation, the call's arguments and, once the
/// [`ToolLayer`](super::ToolLayer) has derived it, the operation's key.
///
/// The tool never mints a key: it reads [`key`](Self::key) and hands it to a provider that
/// deduplicates on it.
///
/// ```
/// use tower_idempotency::tool::ToolCall;
/// use tower_idempotency::OperationId;
///
/// let call = ToolCall::new(OperationId::new("task-7", "email"), "hello".to_owned());
/// assert_eq!(call.operation().step_id(), "email");
/// assert_eq!(call.arguments(), "hello");
/// assert!(call.key().is_none(), "set by the layer, never by the caller");
/// ```
#[derive(Clone, Debug)]
pub struct ToolCall<A> {
    operation: OperationId,
    arguments: A,
    key: Option<IdempotencyKey>,
}

impl<A> ToolCall<A> {
    /// A call of `operation` with `arguments`.
    ///
    /// ```
    /// # use tower_idempotency::{tool::ToolCall, OperationId};
    /// let call = ToolCall::new(OperationId::new("t", "s"), 7_u32);
    /// assert_eq!(*call.arguments(), 7);
    /// ```
    pub fn new(operation: OperationId, arguments: A) -> Self {
        Self {
            operation,
            arguments,
            key: None,
        }
    }

    /// The operation this call belongs to.
    ///
    /// ```
    /// # use tower_idempotency::{tool::ToolCall, OperationId};
    /// let call = ToolCall::new(OperationId::new("t", "s"), ());
    /// assert_eq!(call.operation().task_id(), "t");
    /// ```
    pub fn operation(&self) -> &OperationId {
        &self.operation
    }

    /// The arguments. Behind the layer, a side-effect tool always receives the arguments
    /// first frozen for the operation.
    ///
    /// ```
    /// # use tower_idempotency::{tool::ToolCall, OperationId};
    /// let call = ToolCall::new(OperationId::new("t", "s"), "args");
    /// assert_eq!(*call.arguments(), "args");
    /// ```
    pub fn arguments(&self) -> &A {
        &self.arguments
    }

    /// The arguments, by value.
    ///
    /// ```
    /// # use tower_idempotency::{tool::ToolCall, OperationId};
    /// let call = ToolCall::new(OperationId::new("t", "s"), vec![1, 2]);
    /// assert_eq!(call.into_arguments(), [1, 2]);
    /// ```
    pub fn into_arguments(self) -> A {
        self.arguments
    }

    /// The operation's idempotency key, derived by the layer from `(scope, task_id,
    /// step_id)`: pass it to a provider that deduplicates. `None` before the layer.
    ///
    /// ```
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
    /// use tower_idempotency::{ledger::MemoryStore, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let layer = ToolLayer::builder(MemoryStore::new(), "send_email", ProviderKeys::Deduplicates)
    ///     .scope("mailer")
    ///     .build()
    ///     .unwrap();
    /// let tool = layer.layer(service_fn(|call: ToolCall<String>| async move {
    ///     Ok::<_, std::io::Error>(call.key().expect("the layer sets it").to_hex())
    /// }));
    /// let op = OperationId::new("task-1", "welcome-email");
    /// let sent = tool.oneshot(ToolCall::new(op.clone(), "hi".into())).await.unwrap();
    /// assert_eq!(sent.value(), &op.key("mailer").to_hex());
    /// # }
    /// ```
    pub fn key(&self) -> Option<IdempotencyKey> {
        self.key
    }

    pub(crate) fn with_key(mut self, key: IdempotencyKey) -> Self {
        self.key = Some(key);
        self
    }
}

/// What a tool does, declared per tool: only side effects go through the ledger.
///
/// ```
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{ProviderKeys, ToolClass, ToolLayer};
///
/// let lookup = ToolLayer::builder(MemoryStore::new(), "lookup_order", ProviderKeys::Ignored)
///     .class(ToolClass::Read)
///     .build()
///     .unwrap();
/// # let _ = lookup;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ToolClass {
    /// Changes nothing: passed straight through (retried by the policy).
    Read,
    /// Changes something, but running it twice is the same as once (a `PUT`-like upsert):
    /// passed straight through (retried by the policy), with its key.
    IdempotentWrite,
    /// Changes something each time it runs (a charge, an email): once per operation,
    /// through the ledger. The default.
    #[default]
    SideEffect,
}

/// Where a [`ToolOutput`] came from.
///
/// ```
/// use tower_idempotency::tool::ToolSource;
///
/// assert!(ToolSource::Replayed.is_replay());
/// assert!(!ToolSource::Called.is_replay());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolSource {
    /// The tool was called for a new operation.
    Called,
    /// The tool was called again, with the frozen arguments, for an operation in doubt.
    Resumed,
    /// The recorded outcome of an earlier call; the tool was not called.
    Replayed,
    /// An in-doubt operation's outcome, found by the reconciler; the tool was not called.
    Reconciled,
    /// A read or an idempotent write, called outside the ledger.
    PassedThrough,
}

impl ToolSource {
    /// Whether the tool was not called: the output is a recorded or reconciled one.
    ///
    /// ```
    /// # use tower_idempotency::tool::ToolSource;
    /// assert!(ToolSource::Reconciled.is_replay());
    /// ```
    pub fn is_replay(self) -> bool {
        matches!(self, Self::Replayed | Self::Reconciled)
    }
}

/// A regenerated call's arguments, discarded for the ones first frozen: the marker
/// [`ToolOutput::discarded`] carries.
///
/// ```
/// use tower_idempotency::tool::Discarded;
///
/// fn report(discarded: &Discarded) -> String {
///     match discarded.changed_fields() {
///         Some(fields) => format!("kept the first arguments; ignored changes to {fields:?}"),
///         None => "kept the first arguments".to_owned(),
///     }
/// }
/// # let _ = report;
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discarded {
    changed_fields: Option<Vec<String>>,
}

impl Discarded {
    pub(crate) fn new(changed_fields: Option<Vec<String>>) -> Self {
        Self { changed_fields }
    }

    /// The top-level argument fields that differed from the frozen ones (added, removed or
    /// changed), sorted; `None` when the ledger no longer holds enough to name them.
    ///
    /// See [`ToolOutput::discarded`] for an example.
    pub fn changed_fields(&self) -> Option<&[String]> {
        self.changed_fields.as_deref()
    }
}

/// The response of a protected tool: the tool's value, where it came from, and whether
/// arguments handed in were discarded for the frozen ones.
///
/// ```
/// use tower::{service_fn, Layer, ServiceExt};
/// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer, ToolSource};
/// use tower_idempotency::{ledger::MemoryStore, OperationId};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = ToolLayer::builder(MemoryStore::new(), "double", ProviderKeys::Ignored).build().unwrap();
/// let tool = layer.layer(service_fn(|call: ToolCall<u32>| async move {
///     Ok::<_, std::io::Error>(call.arguments() * 2)
/// }));
/// let op = OperationId::new("t", "s");
/// let first = tool.clone().oneshot(ToolCall::new(op.clone(), 21)).await.unwrap();
/// assert_eq!((*first.value(), first.source()), (42, ToolSource::Called));
/// let again = tool.oneshot(ToolCall::new(op, 22)).await.unwrap();
/// assert_eq!(again.source(), ToolSource::Replayed);
/// assert_eq!(again.into_value(), 42);
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ToolOutput<R> {
    value: R,
    source: ToolSource,
    discarded: Option<Discarded>,
}

impl<R> ToolOutput<R> {
    pub(crate) fn new(value: R, source: ToolSource, discarded: Option<Discarded>) -> Self {
        Self {
            value,
            source,
            discarded,
        }
    }

    /// The tool's response.
    ///
    /// See the [type docs](Self) for an example.
    pub fn value(&self) -> &R {
        &self.value
    }

    /// The tool's response, by value.
    ///
    /// See the [type docs](Self) for an example.
    pub fn into_value(self) -> R {
        self.value
    }

    /// Where the response came from.
    ///
    /// See the [type docs](Self) for an example.
    pub fn source(&self) -> ToolSource {
        self.source
    }

    /// `Some` when the arguments handed in differed from those first frozen for the
    /// operation, and were discarded for them.
    ///
    /// ```
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
    /// use tower_idempotency::{ledger::MemoryStore, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let layer = ToolLayer::builder(MemoryStore::new(), "note", ProviderKeys::Ignored).build().unwrap();
    /// let tool = layer.layer(service_fn(|call: ToolCall<serde_json::Value>| async move {
    ///     Ok::<_, std::io::Error>(call.into_arguments()["text"].clone())
    /// }));
    /// let op = OperationId::new("t", "s");
    /// tool.clone().oneshot(ToolCall::new(op.clone(), serde_json::json!({"text": "first"}))).await.unwrap();
    /// let again = tool.oneshot(ToolCall::new(op, serde_json::json!({"text": "second"}))).await.unwrap();
    /// assert_eq!(again.value(), "first");
    /// assert_eq!(again.discarded().unwrap().changed_fields(), Some(&["text".to_owned()][..]));
    /// # }
    /// ```
    pub fn discarded(&self) -> Option<&Discarded> {
        self.discarded.as_ref()
    }
}

/// What a tool error says about the call's effect: the answer of a [`ClassifyToolError`].
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::tool::Verdict;
///
/// let throttled = Verdict::before_effect().retry_after(Duration::from_secs(2));
/// let declined = Verdict::final_answer(serde_json::json!({"declined": "insufficient_funds"}));
/// let timed_out = Verdict::may_have_happened();
/// assert_eq!(throttled.retry_after_hint(), Some(Duration::from_secs(2)));
/// # let _ = (declined, timed_out);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub(crate) kind: VerdictKind,
    pub(crate) retry_after: Option<Duration>,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum VerdictKind {
    BeforeEffect,
    MayHaveHappened,
    Final(serde_json::Value),
}

impl Verdict {
    /// The error happened before the effect could (a refused connection, a validation
    /// error from the SDK): the operation is released and may run again.
    ///
    /// ```
    /// # use tower_idempotency::tool::Verdict;
    /// let refused = Verdict::before_effect();
    /// # let _ = refused;
    /// ```
    pub fn before_effect() -> Self {
        Self {
            kind: VerdictKind::BeforeEffect,
            retry_after: None,
        }
    }

    /// The effect may have happened (a timeout, a dropped connection): the operation is in
    /// doubt, resumed with the frozen arguments (a deduplicating provider) or reconciled.
    /// The default for every error.
    ///
    /// ```
    /// # use tower_idempotency::tool::Verdict;
    /// let unknown = Verdict::may_have_happened();
    /// # let _ = unknown;
    /// ```
    pub fn may_have_happened() -> Self {
        Self {
            kind: VerdictKind::MayHaveHappened,
            retry_after: None,
        }
    }

    /// The error is the operation's answer ("card declined"): recorded and replayed as a
    /// [`ToolError::Final`] carrying `answer`.
    ///
    /// ```
    /// # use tower_idempotency::tool::Verdict;
    /// let declined = Verdict::final_answer(serde_json::json!("card_declined"));
    /// # let _ = declined;
    /// ```
    pub fn final_answer(answer: serde_json::Value) -> Self {
        Self {
            kind: VerdictKind::Final(answer),
            retry_after: None,
        }
    }

    /// The provider asked to wait this long before another attempt (a `Retry-After`-like
    /// hint): a retry waits at least this long.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::tool::Verdict;
    /// let throttled = Verdict::before_effect().retry_after(Duration::from_secs(1));
    /// # let _ = throttled;
    /// ```
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// The wait the provider asked for, if any.
    ///
    /// ```
    /// # use tower_idempotency::tool::Verdict;
    /// assert_eq!(Verdict::may_have_happened().retry_after_hint(), None);
    /// ```
    pub fn retry_after_hint(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// Says what a tool error means for its effect (see [`Verdict`]). Implemented for any
/// `Fn(&E) -> Verdict`.
///
/// ```
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{ProviderKeys, ToolLayer, Verdict};
///
/// #[derive(Debug)]
/// enum SdkError { Connect, Declined(String), Timeout }
///
/// let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
///     .classify(|error: &SdkError| match error {
///         SdkError::Connect => Verdict::before_effect(),
///         SdkError::Declined(why) => Verdict::final_answer(why.as_str().into()),
///         SdkError::Timeout => Verdict::may_have_happened(),
///     })
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub trait ClassifyToolError<E>: Send + Sync + 'static {
    /// What `error` says about the call's effect.
    fn classify(&self, error: &E) -> Verdict;
}

impl<E, F> ClassifyToolError<E> for F
where
    F: Fn(&E) -> Verdict + Send + Sync + 'static,
{
    fn classify(&self, error: &E) -> Verdict {
        self(error)
    }
}

/// The default classifier: every tool error may have happened after the effect.
///
/// ```
/// use tower_idempotency::tool::{ClassifyToolError, MayHaveHappened, Verdict};
///
/// let verdict = ClassifyToolError::<std::io::Error>::classify(&MayHaveHappened, &std::io::ErrorKind::Other.into());
/// assert_eq!(verdict, Verdict::may_have_happened());
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct MayHaveHappened;

impl<E> ClassifyToolError<E> for MayHaveHappened {
    fn classify(&self, _: &E) -> Verdict {
        Verdict::may_have_happened()
    }
}

/// A tool error recorded as the operation's answer: the JSON a [`Verdict::final_answer`]
/// carried, the same on the first call and on every replay.
///
/// ```
/// use tower_idempotency::tool::FinalAnswer;
///
/// let answer = FinalAnswer::new(serde_json::json!({"code": "card_declined"}));
/// #[derive(serde::Deserialize)]
/// struct Declined { code: String }
/// assert_eq!(answer.decode::<Declined>().unwrap().code, "card_declined");
/// assert_eq!(answer.value()["code"], "card_declined");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinalAnswer(serde_json::Value);

impl FinalAnswer {
    /// A final answer carrying `value`.
    ///
    /// See the [type docs](Self) for an example.
    pub fn new(value: serde_json::Value) -> Self {
        Self(value)
    }

    /// The recorded answer.
    ///
    /// See the [type docs](Self) for an example.
    pub fn value(&self) -> &serde_json::Value {
        &self.0
    }

    /// The recorded answer as a `T`.
    ///
    /// See the [type docs](Self) for an example.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        T::deserialize(&self.0)
    }
}

impl fmt::Display for FinalAnswer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the tool's final answer: {}", self.0)
    }
}

/// Why a protected tool call gave no output.
///
/// ```
/// use tower_idempotency::tool::ToolError;
///
/// fn retry_later<E>(error: &ToolError<E>) -> bool {
///     match error {
///         ToolError::Idempotency(ours) => ours.is_busy() || ours.is_store(),
///         _ => false,
///     }
/// }
/// # let _ = retry_later::<std::io::Error>;
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum ToolError<E> {
    /// The tool failed; by its [`Verdict`], the operation was released (before the effect)
    /// or left in doubt (it may have happened).
    Tool(E),
    /// The operation's recorded final answer (see [`Verdict::final_answer`]).
    Final(FinalAnswer),
    /// The ledger refused or could not decide: busy, in doubt, drift under
    /// [`DriftPolicy::Reject`](crate::DriftPolicy::Reject), ledger unavailable or full
    /// (fail closed: the tool was not called), an attempt timed out, or a recorded outcome
    /// that cannot be replayed.
    Idempotency(crate::Error),
    /// The arguments could not be frozen (serialized) or thawed (deserialized): the tool
    /// was not called.
    Arguments(serde_json::Error),
    /// The arguments froze to JSON that does not read back as them (a float that is not
    /// finite, a `HashSet` in its iteration order): refused before the first call, the tool not called and the
    /// operation released, since no retry or resume could call it with them. See
    /// [`NotReadBack`](super::NotReadBack) for an example.
    NotReadBack(super::NotReadBack),
    /// The tool's response could not be serialized for the ledger (the tool ran; the
    /// operation is left in doubt) or a recorded one deserialized.
    Response(serde_json::Error),
}

impl<E> ToolError<E> {
    /// The tool's own error, if this is one.
    ///
    /// ```
    /// # use tower_idempotency::tool::ToolError;
    /// let error: ToolError<&str> = ToolError::Tool("refused");
    /// assert_eq!(error.tool_error(), Some(&"refused"));
    /// ```
    pub fn tool_error(&self) -> Option<&E> {
        match self {
            Self::Tool(error) => Some(error),
            _ => None,
        }
    }

    /// The ledger's error, if this is one.
    ///
    /// ```
    /// # use tower_idempotency::tool::{FinalAnswer, ToolError};
    /// let error: ToolError<()> = ToolError::Final(FinalAnswer::new("declined".into()));
    /// assert!(error.idempotency_error().is_none());
    /// ```
    pub fn idempotency_error(&self) -> Option<&crate::Error> {
        match self {
            Self::Idempotency(error) => Some(error),
            _ => None,
        }
    }
}

impl<E: fmt::Display> fmt::Display for ToolError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tool(error) => write!(f, "the tool failed: {error}"),
            Self::Final(answer) => answer.fmt(f),
            Self::Idempotency(error) => error.fmt(f),
            Self::Arguments(error) => write!(
                f,
                "the tool's arguments could not be frozen or thawed: {error}"
            ),
            Self::NotReadBack(refused) => refused.fmt(f),
            Self::Response(error) => write!(
                f,
                "the tool's response could not be recorded or replayed: {error}"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ToolError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Tool(error) => Some(error),
            Self::Final(_) => None,
            Self::Idempotency(error) => Some(error),
            Self::Arguments(error) | Self::Response(error) => Some(error),
            Self::NotReadBack(refused) => Some(refused),
        }
    }
}

/// The arguments first frozen for an in-doubt tool operation, as a reconciler sees it
/// (a [`Reconcile`](crate::idempotency::Reconcile) set with
/// [`Builder::reconcile`](super::Builder::reconcile)).
///
/// ```
/// use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
/// use tower_idempotency::tool::{applied, frozen_arguments};
///
/// async fn ask_the_provider(operation: InDoubtOperation) -> Result<Reconciled, tower_idempotency::BoxError> {
///     let args: serde_json::Value = frozen_arguments(&operation)?;
///     // Look the charge up by the key the tool passed on.
///     let found = lookup(operation.key(), &args["order_id"]);
///     Ok(match found {
///         Some(receipt) => applied(&receipt)?,
///         None => Reconciled::NotApplied,
///     })
/// }
/// # fn lookup(_: &str, _: &serde_json::Value) -> Option<String> { None }
/// # let _ = ask_the_provider;
/// ```
pub fn frozen_arguments<A: DeserializeOwned>(
    operation: &InDoubtOperation,
) -> Result<A, serde_json::Error> {
    serde_json::from_slice(operation.frozen().body())
}

/// A reconciler's answer that an in-doubt tool operation happened, with the tool's
/// `response`: recorded as the operation's outcome and returned as
/// [`ToolSource::Reconciled`].
///
/// See [`frozen_arguments`] for an example.
pub fn applied<R: Serialize + ?Sized>(response: &R) -> Result<Reconciled, serde_json::Error> {
    let body = serde_json::to_vec(response)?;
    let mut found = http::Response::new(bytes::Bytes::from(body));
    found.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(Reconciled::Applied(found))
}
