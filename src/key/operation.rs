//! The identity of one logical operation, as the orchestrator names it.

use std::fmt;

use super::IdempotencyKey;

/// The identity of one logical operation, owned by the orchestrator.
///
/// Insert it into a request's extensions; the client
/// [`IdempotencyLayer`](crate::IdempotencyLayer) derives the request's key from it. Never
/// build it from the payload, a timestamp or anything a model produced: a retry must
/// arrive at the same identity.
///
/// # Example
///
/// ```
/// use tower_idempotency::OperationId;
///
/// let mut req = http::Request::post("http://payments.local/charges").body(()).unwrap();
/// req.extensions_mut().insert(OperationId::new("task-42", "step-3"));
/// assert_eq!(req.extensions().get::<OperationId>().unwrap().step_id(), "step-3");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OperationId {
    /// `task_id` then `step_id`, in one shared allocation: an operation id travels in every
    /// attempt's extensions, so a clone must cost a reference count, not two strings.
    ids: std::sync::Arc<str>,
    /// Where `task_id` ends.
    split: usize,
}

impl OperationId {
    /// Identify step `step_id` of task `task_id`.
    pub fn new(task_id: impl Into<String>, step_id: impl Into<String>) -> Self {
        let mut ids = task_id.into();
        let split = ids.len();
        ids.push_str(&step_id.into());
        Self {
            ids: ids.into(),
            split,
        }
    }

    /// The task this operation belongs to.
    pub fn task_id(&self) -> &str {
        &self.ids[..self.split]
    }

    /// The step within the task.
    pub fn step_id(&self) -> &str {
        &self.ids[self.split..]
    }

    /// The shared `task_id` + `step_id` and where the task's ends: what an
    /// [`Origin`](crate::ledger::Origin) keeps of the operation, without a copy.
    pub(crate) fn shared_parts(&self) -> (&std::sync::Arc<str>, usize) {
        (&self.ids, self.split)
    }

    /// The operation whose ids are `ids`, the task's ending at `split` (a char boundary
    /// [`shared_parts`](Self::shared_parts) gave).
    pub(crate) fn from_shared(ids: std::sync::Arc<str>, split: usize) -> Self {
        Self { ids, split }
    }

    /// The idempotency key of this operation within `scope`.
    ///
    /// ```
    /// # use tower_idempotency::OperationId;
    /// let op = OperationId::new("t", "s");
    /// assert_ne!(op.key("tenant-a"), op.key("tenant-b"));
    /// ```
    pub fn key(&self, scope: &str) -> IdempotencyKey {
        IdempotencyKey::derive(scope, self.task_id(), self.step_id())
    }
}

impl fmt::Debug for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationId")
            .field("task_id", &self.task_id())
            .field("step_id", &self.step_id())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_keep_their_two_parts_apart() {
        let (a, b) = (OperationId::new("ab", "c"), OperationId::new("a", "bc"));
        assert_ne!(a, b);
        assert_eq!((a.task_id(), a.step_id()), ("ab", "c"));
        assert_eq!((b.task_id(), b.step_id()), ("a", "bc"));
        assert_eq!(a.clone(), a);
        assert_eq!(
            format!("{a:?}"),
            r#"OperationId { task_id: "ab", step_id: "c" }"#
        );
    }
}
