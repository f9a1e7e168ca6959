//! [`ToolDouble`]: an SDK-like tool double for the tool face.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};
use tower_service::Service;

use crate::tool::{ToolCall, Verdict};
use crate::OperationId;

/// A fault for one call of a [`ToolDouble`], taken from its queue in order.
///
/// ```
/// use tower_idempotency::testing::{ToolDouble, ToolFault};
///
/// let sdk = ToolDouble::new().with_faults([ToolFault::FailBefore, ToolFault::Panic { after_commit: true }]);
/// assert_eq!(sdk.pending_faults().len(), 2);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolFault {
    /// Make the effect, then fail with a [timed out](ToolDoubleError::TimedOut) error: the
    /// SDK's own timeout fired after the provider committed. The first incident.
    CommitThenTimeout,
    /// Fail with a [refused](ToolDoubleError::Refused) error, no effect made: a connect
    /// error, a rate limit in front of the provider, a validation error before anything
    /// was sent. The call never reaches the provider, so a
    /// [deduplicating](ToolDouble::deduplicating) one refuses it too, even for a key it
    /// has seen.
    FailBefore,
    /// Fail with a [declined](ToolDoubleError::Declined) error, no effect made: the
    /// provider's final answer ("card declined").
    Decline,
    /// Panic, after making the effect when `after_commit` is `true`.
    Panic {
        /// Whether the effect happens before the panic.
        after_commit: bool,
    },
    /// Never answer, after making the effect when `after_commit` is `true`.
    Hang {
        /// Whether the effect happens before the hang.
        after_commit: bool,
    },
    /// Wait this long (with [`tokio::time::sleep`]), then answer normally.
    Latency(Duration),
}

/// A [`ToolDouble`]'s errors.
///
/// ```
/// use tower_idempotency::testing::ToolDoubleError;
///
/// assert_eq!(ToolDoubleError::Refused.to_string(), "the provider refused the call before any effect");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolDoubleError {
    /// The call timed out after the effect may have happened.
    TimedOut,
    /// The call was refused before any effect.
    Refused,
    /// The provider declined the call: its final answer.
    Declined,
}

impl fmt::Display for ToolDoubleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TimedOut => "the call timed out; it may have happened",
            Self::Refused => "the provider refused the call before any effect",
            Self::Declined => "the provider declined the call",
        })
    }
}

impl std::error::Error for ToolDoubleError {}

/// An SDK-like tool that counts effects per operation and injects queued faults.
///
/// [`ToolDouble`]: an SDK-like tool for the [tool face](crate::tool) that counts effects per
/// operation and injects the faults of [`SideEffectService`](super::SideEffectService):
/// commit then time out, fail before, panic, hang.
///
/// It is a `tower::Service<ToolCall<A>>` for any serializable arguments, answering a JSON
/// receipt (`{"receipt": n, "arguments": …}`: the effect's number and the arguments it was
/// made with). Clones share one fault queue and one effect count. By default it ignores
/// keys, as a key-less SDK does; [`deduplicating`](ToolDouble::deduplicating) makes it a
/// provider that runs each key once.
///
/// # Example
///
/// ```
/// use tower::{Layer, ServiceExt};
/// use tower_idempotency::testing::{ToolDouble, ToolFault};
/// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
/// use tower_idempotency::{ledger::MemoryStore, OperationId};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
/// let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
///     .classify(ToolDouble::classifier())
///     .build()
///     .unwrap();
/// let charge = layer.layer(sdk.clone());
/// let op = OperationId::new("task-1", "charge");
/// let call = || ToolCall::new(op.clone(), serde_json::json!({"cents": 1999}));
///
/// // Charged, then the SDK timed out: in doubt, and never charged again blindly.
/// assert!(charge.clone().oneshot(call()).await.is_err());
/// let again = charge.oneshot(call()).await.unwrap_err();
/// assert!(again.idempotency_error().unwrap().is_in_doubt());
/// assert_eq!(sdk.effects_of(&op), 1);
/// # }
/// ```
#[derive(Clone, Default)]
pub struct ToolDouble {
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    faults: Mutex<VecDeque<ToolFault>>,
    /// Per operation: the arguments of each effect made for it.
    effects: Mutex<HashMap<OperationId, Vec<Value>>>,
    /// Per operation: the arguments of each call made for it, effect or not.
    called: Mutex<HashMap<OperationId, Vec<Value>>>,
    /// Per key, when deduplicating: the receipt first answered.
    receipts: Mutex<HashMap<String, Value>>,
    deduplicates: bool,
    calls: AtomicUsize,
    made: AtomicUsize,
}

impl fmt::Debug for ToolDouble {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolDouble")
            .field("pending", &self.pending_faults())
            .field("calls", &self.calls())
            .field("effects", &self.effects())
            .field("deduplicates", &self.state.deduplicates)
            .finish()
    }
}

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic injected while a lock is held cannot leave a half-made update: every
    // update below is one statement.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ToolDouble {
    /// A double that ignores keys, with no faults queued.
    ///
    /// ```
    /// # use tower_idempotency::testing::ToolDouble;
    /// assert_eq!(ToolDouble::new().effects(), 0);
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// A double whose provider runs each key once: a second call with a key already seen
    /// answers the first receipt and makes no effect.
    ///
    /// ```
    /// # use tower_idempotency::testing::ToolDouble;
    /// let provider = ToolDouble::deduplicating();
    /// # let _ = provider;
    /// ```
    pub fn deduplicating() -> Self {
        Self {
            state: Arc::new(State {
                deduplicates: true,
                ..State::default()
            }),
        }
    }

    /// Queue `faults` after those already queued.
    ///
    /// See [`ToolFault`] for an example.
    pub fn with_faults(self, faults: impl IntoIterator<Item = ToolFault>) -> Self {
        locked(&self.state.faults).extend(faults);
        self
    }

    /// Queue one fault.
    ///
    /// ```
    /// # use tower_idempotency::testing::{ToolDouble, ToolFault};
    /// let sdk = ToolDouble::new();
    /// sdk.push_fault(ToolFault::Decline);
    /// assert_eq!(sdk.pending_faults(), [ToolFault::Decline]);
    /// ```
    pub fn push_fault(&self, fault: ToolFault) {
        locked(&self.state.faults).push_back(fault);
    }

    /// Drop the faults still queued.
    ///
    /// ```
    /// # use tower_idempotency::testing::{ToolDouble, ToolFault};
    /// let sdk = ToolDouble::new().with_faults([ToolFault::FailBefore]);
    /// sdk.clear_faults();
    /// assert!(sdk.pending_faults().is_empty());
    /// ```
    pub fn clear_faults(&self) {
        locked(&self.state.faults).clear();
    }

    /// The faults still queued, next first.
    ///
    /// See [`ToolFault`] for an example.
    pub fn pending_faults(&self) -> Vec<ToolFault> {
        locked(&self.state.faults).iter().cloned().collect()
    }

    /// How many times the double was called.
    ///
    /// See [`ToolDouble`] for an example.
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    /// How many effects were made, over every operation.
    ///
    /// See [`ToolDouble`] for an example.
    pub fn effects(&self) -> usize {
        self.state.made.load(Ordering::SeqCst)
    }

    /// How many effects were made for `operation`.
    ///
    /// See [`ToolDouble`] for an example.
    pub fn effects_of(&self, operation: &OperationId) -> usize {
        locked(&self.state.effects)
            .get(operation)
            .map_or(0, Vec::len)
    }

    /// The arguments each effect of `operation` was made with, in order.
    ///
    /// ```
    /// use tower::ServiceExt;
    /// use tower_idempotency::testing::ToolDouble;
    /// use tower_idempotency::{tool::ToolCall, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let sdk = ToolDouble::new();
    /// let op = OperationId::new("t", "s");
    /// sdk.clone().oneshot(ToolCall::new(op.clone(), 7)).await.unwrap();
    /// assert_eq!(sdk.arguments_of(&op), [serde_json::json!(7)]);
    /// # }
    /// ```
    pub fn arguments_of(&self, operation: &OperationId) -> Vec<Value> {
        locked(&self.state.effects)
            .get(operation)
            .cloned()
            .unwrap_or_default()
    }

    /// The arguments of every call made for `operation`, in order, whether it made an
    /// effect or not (a refusal, a fault before the effect, a deduplicated repeat): what
    /// shows that every retry and resume sent the arguments first frozen.
    ///
    /// ```
    /// use tower::ServiceExt;
    /// use tower_idempotency::testing::{ToolDouble, ToolFault};
    /// use tower_idempotency::{tool::ToolCall, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let sdk = ToolDouble::new().with_faults([ToolFault::FailBefore]);
    /// let op = OperationId::new("t", "s");
    /// assert!(sdk.clone().oneshot(ToolCall::new(op.clone(), 7)).await.is_err());
    /// sdk.clone().oneshot(ToolCall::new(op.clone(), 8)).await.unwrap();
    /// assert_eq!(sdk.calls_of(&op), [serde_json::json!(7), serde_json::json!(8)]);
    /// assert_eq!(sdk.arguments_of(&op), [serde_json::json!(8)]);
    /// # }
    /// ```
    pub fn calls_of(&self, operation: &OperationId) -> Vec<Value> {
        locked(&self.state.called)
            .get(operation)
            .cloned()
            .unwrap_or_default()
    }

    /// Every operation with the number of effects made for it.
    ///
    /// ```
    /// # use tower_idempotency::testing::ToolDouble;
    /// assert!(ToolDouble::new().effects_per_operation().is_empty());
    /// ```
    pub fn effects_per_operation(&self) -> HashMap<OperationId, usize> {
        locked(&self.state.effects)
            .iter()
            .map(|(op, made)| (op.clone(), made.len()))
            .collect()
    }

    /// The classifier that reads the double's errors as a real SDK's would be read:
    /// refused is before the effect, timed out may have happened, declined is final.
    ///
    /// See [`ToolDouble`] for an example.
    pub fn classifier() -> fn(&ToolDoubleError) -> Verdict {
        |error| match error {
            ToolDoubleError::Refused => Verdict::before_effect(),
            ToolDoubleError::TimedOut => Verdict::may_have_happened(),
            ToolDoubleError::Declined => Verdict::final_answer(json!("declined")),
        }
    }

    /// The receipt a deduplicating provider first answered for `key`.
    fn first_receipt(&self, key: Option<&str>) -> Option<Value> {
        if !self.state.deduplicates {
            return None;
        }
        locked(&self.state.receipts).get(key?).cloned()
    }

    /// Make the effect of `call` (or, deduplicating, find the one its key made).
    fn commit(&self, operation: &OperationId, key: Option<String>, arguments: Value) -> Value {
        let number = self.state.made.fetch_add(1, Ordering::SeqCst) + 1;
        let receipt = json!({"receipt": number, "arguments": arguments});
        locked(&self.state.effects)
            .entry(operation.clone())
            .or_default()
            .push(arguments);
        if let (true, Some(key)) = (self.state.deduplicates, key) {
            locked(&self.state.receipts).insert(key, receipt.clone());
        }
        receipt
    }
}

/// The future of a [`ToolDouble`] call.
type DoubleFuture = Pin<Box<dyn Future<Output = Result<Value, ToolDoubleError>> + Send>>;

impl<A: Serialize> Service<ToolCall<A>> for ToolDouble {
    type Response = Value;
    type Error = ToolDoubleError;
    type Future = DoubleFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: ToolCall<A>) -> Self::Future {
        self.state.calls.fetch_add(1, Ordering::SeqCst);
        let fault = locked(&self.state.faults).pop_front();
        let arguments = serde_json::to_value(call.arguments()).unwrap_or(Value::Null);
        let key = call.key().map(|key| key.to_hex());
        let operation = call.operation().clone();
        locked(&self.state.called)
            .entry(operation.clone())
            .or_default()
            .push(arguments.clone());
        let double = self.clone();
        Box::pin(async move {
            // Refused before it reaches the provider (a connect error, a rate limit in
            // front of it): no provider, deduplicating or not, sees this call.
            if let Some(ToolFault::FailBefore) = fault {
                return Err(ToolDoubleError::Refused);
            }
            // A deduplicating provider answers a key it has seen with its first receipt,
            // whatever else this call would have done.
            if let Some(first) = double.first_receipt(key.as_deref()) {
                return Ok(first);
            }
            let commit = || double.commit(&operation, key.clone(), arguments.clone());
            match fault {
                None => Ok(commit()),
                Some(ToolFault::Latency(delay)) => {
                    tokio::time::sleep(delay).await;
                    Ok(commit())
                }
                Some(ToolFault::CommitThenTimeout) => {
                    commit();
                    Err(ToolDoubleError::TimedOut)
                }
                Some(ToolFault::FailBefore) => Err(ToolDoubleError::Refused),
                Some(ToolFault::Decline) => Err(ToolDoubleError::Declined),
                Some(ToolFault::Panic { after_commit }) => {
                    if after_commit {
                        commit();
                    }
                    panic!("ToolDouble: injected panic");
                }
                Some(ToolFault::Hang { after_commit }) => {
                    if after_commit {
                        commit();
                    }
                    std::future::pending().await
                }
            }
        })
    }
}
