//! The `Store` trait: where records live, each step atomic.

use std::any::{Any, TypeId};
use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::{IdempotencyKey, Scope};

mod cache;
mod layer;
mod memory;
mod record;

pub use crate::response::{Header, StoredResponse};
pub use cache::ReplayCache;
pub use layer::StoreLayer;
pub use memory::{MemoryStore, MemoryStoreBuilder};
pub use record::{Claim, ClaimOutcome, ClaimRequest, OwnerToken, Record, RecordState};

/// The future a store step returns: `Send`, so one trait serves Tower and actix.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A source error, boxed.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What a store hands the handler of a claimed request (see
/// [`Store::execution_context`]): any type, shared.
pub type ExecutionContext = Arc<dyn Any + Send + Sync>;

/// Where records live.
///
/// A store makes each step of the state machine atomic; it decides nothing. The
/// engine ([`crate::Engine`]) calls it. Every store, ours and third parties', must
/// pass the conformance suite in the `conformance` module (feature
/// `test-util`).
///
/// Times are the store's own: a database store compares with the database's clock,
/// so that application instances with skewed clocks still agree on when a lease
/// lapsed. Durations (`lease`, `retention`) are relative to that clock.
///
/// The trait is object-safe: `Arc<dyn Store>` is a store.
pub trait Store: Send + Sync + 'static {
    /// Claims `(scope, key)` in one atomic step.
    ///
    /// An absent record, an expired one and one whose lease has lapsed all count as
    /// new: the store writes an in-progress record owned by `request.owner`, with
    /// `lease_until = now + lease` and `expires_at = now + retention`, and answers
    /// [`ClaimOutcome::Claimed`]. Otherwise it answers what it found, without
    /// changing it. Of any number of concurrent claims of a new record, exactly one
    /// is granted.
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome>;

    /// Extends the claim's lease to `now + lease`. Refused with
    /// [`StoreError::StaleOwner`] unless `claim.owner` holds the record in progress.
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()>;

    /// Completes the record with `response`, kept until `now + retention`. Refused
    /// with [`StoreError::StaleOwner`] unless `claim.owner` holds the record in
    /// progress.
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()>;

    /// Deletes the in-progress record so that the next request runs the handler
    /// again. Refused with [`StoreError::StaleOwner`] unless `claim.owner` holds it.
    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()>;

    /// The record of `(scope, key)`, if present and not expired. Reads the primary.
    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>>;

    /// Deletes up to `batch` expired records (completed ones past `expires_at`, and
    /// in-progress ones past both `expires_at` and their lease) and answers how many
    /// it deleted. Cleanup jobs call it until it answers less than `batch`.
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64>;

    /// Resolves when the record of `(scope, key)` may have changed from in progress
    /// (completed, released, lapsed), or after `poll` at the latest. The engine
    /// calls it in wait mode between claims. The default sleeps for `poll` (the
    /// Redis store keeps it). The in-memory store is notified when the record
    /// settles and resolves at once; idem-diesel's PostgreSQL and SQLite stores
    /// poll the record (a primary-key lookup 10 ms after the call, then backing off
    /// to every 200 ms), not `LISTEN`/`NOTIFY`, so that they work through
    /// transaction-pooling proxies and hold no connection open to listen.
    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        let _ = (scope, key);
        Box::pin(async move {
            tokio::time::sleep(poll).await;
            Ok(())
        })
    }

    /// What the handler of `claim` gets from the store, if anything: for a
    /// transactional store, the open transaction the claim was made in, so that
    /// the handler's own writes commit (or roll back) with the completion.
    ///
    /// The engine asks once, right after the claim is granted, and hands the
    /// answer to the adapter through [`Execution::context`](crate::Execution::context).
    /// The default is `None`: the handler's effects are its own business.
    fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
        let _ = claim;
        None
    }

    /// The type of what [`execution_context`](Self::execution_context) hands
    /// every claim, for a store that hands one (idem-diesel's
    /// `TransactionalPgStore`: a `PgTransaction`). The adapters' `on`, which
    /// mounts a handler that takes a [`StoreContext<T>`](crate::StoreContext),
    /// compares it with `T` when the route is built
    /// ([`Engine::check_context`](crate::Engine::check_context)), so that a
    /// route whose store hands no `T` fails the start. The default is `None`:
    /// the store hands nothing.
    fn execution_context_type(&self) -> Option<ContextType> {
        None
    }

    /// Whether the store may serve requests: a store with a schema answers
    /// [`NotReady`] until its schema was verified in this process (idem-diesel's
    /// stores: `migrate()` or `check_schema()` succeeded), unless the check was
    /// explicitly skipped. [`Engine::new`](crate::Engine::new) asks once, when
    /// an application builds a route's layer at start-up, and refuses to build
    /// on a store that is not ready, so a forgotten migration stops the start
    /// instead of answering every keyed request `503`. The default: ready.
    fn readiness(&self) -> Result<(), NotReady> {
        Ok(())
    }
}

/// The type of what a store hands each execution
/// ([`Store::execution_context_type`]): compared by identity, named by
/// [`std::any::type_name`] in messages.
///
/// ```
/// use idem_core::store::ContextType;
///
/// struct Till;
/// assert!(ContextType::of::<Till>().is::<Till>());
/// assert!(!ContextType::of::<Till>().is::<String>());
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ContextType {
    id: TypeId,
    name: &'static str,
}

impl ContextType {
    /// The type `T`.
    pub fn of<T: Any>() -> Self {
        Self {
            id: TypeId::of::<T>(),
            name: std::any::type_name::<T>(),
        }
    }

    /// Whether this is `T`.
    pub fn is<T: Any>(&self) -> bool {
        self.id == TypeId::of::<T>()
    }

    /// The type's name, for messages.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl PartialEq for ContextType {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for ContextType {}

/// Why a store may not serve requests yet ([`Store::readiness`]): the message
/// names the fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotReady(pub String);

/// Why a store step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller's claim is no longer held: its lease lapsed and another request
    /// claimed the record, or the record was released or completed.
    #[error("the claim is no longer held by this owner")]
    StaleOwner,
    /// The store has no room for a new record within its bounds (or the
    /// scope's quota), and evicts nothing to make some: a completed record
    /// within its retention is what makes a retry a replay. Answered like an
    /// outage: `503 store-unavailable` with `Retry-After`.
    #[error("the store is full: no room for a new record until records expire")]
    Full,
    /// A stored record could not be read back.
    #[error("a stored record is corrupt: {0}")]
    Corrupt(String),
    /// The store could not be reached or failed.
    #[error("the store is unavailable")]
    Unavailable(#[source] BoxError),
    /// A transactional store could not commit the completion, so the handler's
    /// writes in the same transaction were rolled back with it (or, when the
    /// connection broke during the commit, their fate is unknown to this
    /// process). The client must not be told the request succeeded: a retry with
    /// the same key finds out, replaying the answer if the commit happened and
    /// running the handler again if not.
    #[error("the completion was not committed; the execution's writes were rolled back with it")]
    Uncommitted(#[source] BoxError),
}

impl StoreError {
    /// A failure of the backend, keeping its cause.
    pub fn unavailable(source: impl Into<BoxError>) -> Self {
        Self::Unavailable(source.into())
    }

    /// A completion that was not committed, keeping its cause.
    pub fn uncommitted(source: impl Into<BoxError>) -> Self {
        Self::Uncommitted(source.into())
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        (**self).claim(request)
    }
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        (**self).renew(claim, lease)
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        (**self).complete(claim, response, retention)
    }
    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        (**self).release(claim)
    }
    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        (**self).load(scope, key)
    }
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        (**self).delete_expired(batch)
    }
    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        (**self).changed(scope, key, poll)
    }
    fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
        (**self).execution_context(claim)
    }
    fn execution_context_type(&self) -> Option<ContextType> {
        (**self).execution_context_type()
    }
    fn readiness(&self) -> Result<(), NotReady> {
        (**self).readiness()
    }
}
