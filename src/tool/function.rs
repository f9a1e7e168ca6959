//! The function form: [`idempotent_call`], for tool code that is not a tower service.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::layer::ToolLayer;
use super::operation::{run, Invoke};
use super::types::{ClassifyToolError, ToolCall, ToolError, ToolOutput};
use crate::key::{IdempotencyKey, OperationId};

/// Run `tool` once per `operation`, as a [`ToolLayer`] runs a service: in the spirit of
/// AWS Powertools' `idempotent_function`, for a plain async function (an SDK call, a
/// database write).
///
/// `tool` receives the arguments and the operation's key, to pass to a provider that
/// deduplicates. A new operation's first attempt gets `arguments` as handed in (the frozen
/// bytes were made from them); every retry and every resume gets the **frozen** arguments,
/// thawed: on a resume, the ones first frozen, never `arguments` if they differ.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{idempotent_call, ProviderKeys, ToolLayer};
/// use tower_idempotency::OperationId;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// static CHARGES: AtomicUsize = AtomicUsize::new(0);
/// let layer = ToolLayer::builder(MemoryStore::new(), "charge_via_sdk", ProviderKeys::Ignored)
///     .build()
///     .unwrap();
/// let op = OperationId::new("task-42", "charge");
/// for summary in ["charge order 42", "bill the customer for order 42"] {
///     let args = serde_json::json!({"order_id": "o-42", "cents": 1999, "summary": summary});
///     let receipt = idempotent_call(&layer, op.clone(), args, |args: serde_json::Value, key| async move {
///         CHARGES.fetch_add(1, Ordering::SeqCst);
///         let _ = key; // sdk.charges.create(args, idempotency_key = key)
///         Ok::<_, std::io::Error>(format!("ch_{}", args["order_id"].as_str().unwrap()))
///     })
///     .await
///     .unwrap();
///     assert_eq!(receipt.value(), "ch_o-42");
/// }
/// assert_eq!(CHARGES.load(Ordering::SeqCst), 1, "charged once, whatever the summary said");
/// # }
/// ```
pub async fn idempotent_call<C, A, R, E, F, Fut>(
    layer: &ToolLayer<C>,
    operation: OperationId,
    arguments: A,
    tool: F,
) -> Result<ToolOutput<R>, ToolError<E>>
where
    C: ClassifyToolError<E>,
    A: Serialize + DeserializeOwned + Send,
    R: Serialize + DeserializeOwned,
    F: FnMut(A, IdempotencyKey) -> Fut + Send,
    Fut: Future<Output = Result<R, E>> + Send,
{
    let mut tool = Closure(tool);
    run(&layer.face, ToolCall::new(operation, arguments), &mut tool).await
}

/// A closure as an [`Invoke`].
struct Closure<F>(F);

impl<A, R, E, F, Fut> Invoke<A, R, E> for Closure<F>
where
    F: FnMut(A, IdempotencyKey) -> Fut + Send,
    Fut: Future<Output = Result<R, E>> + Send,
{
    fn invoke(&mut self, call: ToolCall<A>) -> impl Future<Output = Result<R, E>> + Send {
        let key = call
            .key()
            .expect("the face sets the key before calling the tool");
        (self.0)(call.into_arguments(), key)
    }
}
