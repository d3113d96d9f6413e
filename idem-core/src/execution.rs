//! What the handler of a keyed request is told about its execution.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::store::ExecutionContext;
use crate::{IdempotencyKey, Scope};

/// What the middleware tells the handler of a keyed request it let run: the key,
/// the scope, whether the execution is guarded, what the store hands it, and
/// whether its lease is still held. Each adapter hands it to handlers through an
/// extractor of its own.
///
/// A replayed answer never reaches the handler. So a handler that sees a guarded
/// `ExecutionInfo` is *the* execution of its `(scope, key)`: while it runs, no
/// other request with the key runs, and its answer (when the status is stored)
/// is what every retry gets. It may still be a re-run of an earlier attempt that
/// failed (a 5xx, a panic) and was released, so effects outside the handler's
/// own answer should be idempotent downstream; forwarding [`key`](Self::key)
/// (with the scope) to a payment provider is the usual way.
#[derive(Clone, Debug)]
pub struct ExecutionInfo {
    key: IdempotencyKey,
    scope: Scope,
    guarded: bool,
    context: Option<ExecutionContext>,
    lease_lost: Arc<AtomicBool>,
}

impl ExecutionInfo {
    pub(crate) fn new(
        key: IdempotencyKey,
        scope: Scope,
        guarded: bool,
        context: Option<ExecutionContext>,
        lease_lost: Arc<AtomicBool>,
    ) -> Self {
        Self {
            key,
            scope,
            guarded,
            context,
            lease_lost,
        }
    }

    /// The execution of a request whose store failed while its route fails
    /// open: no claim, no context.
    pub(crate) fn unguarded(key: IdempotencyKey, scope: Scope) -> Self {
        Self::new(key, scope, false, None, Arc::new(AtomicBool::new(false)))
    }

    /// The request's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The scope the key belongs to.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// `true` when this execution holds the claim of its `(scope, key)`; `false`
    /// when the store failed and the route fails open
    /// ([`OnStoreFailure::FailOpen`](crate::OnStoreFailure::FailOpen)): the
    /// handler then runs unguarded, and a retry runs it again.
    pub fn is_guarded(&self) -> bool {
        self.guarded
    }

    /// `true` once the claim's lease is known to be lost while the handler runs
    /// (the store refused a renewal, or renewals failed until the lease ran
    /// out): another request with the key may now run. Check it before an
    /// irreversible call (a payment provider); the answer of an execution whose
    /// lease was lost is still sent to its client but is not recorded.
    pub fn lease_lost(&self) -> bool {
        self.lease_lost.load(Ordering::Acquire)
    }

    /// What the store hands the handler, as a `T`
    /// ([`Store::execution_context`](crate::Store::execution_context)): with
    /// idem-diesel's transactional store, the open `PgTransaction` that commits
    /// the handler's writes with the record. `None` with plain stores, for
    /// another type, and when the handler runs unguarded.
    pub fn context<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        Arc::clone(self.context.as_ref()?).downcast().ok()
    }
}
