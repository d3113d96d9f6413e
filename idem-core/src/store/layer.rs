//! [`StoreLayer`]: a store in front of another, written as only what it
//! changes.

use std::time::Duration;

use super::{
    Claim, ClaimOutcome, ClaimRequest, ContextType, ExecutionContext, NotReady, Record, Store,
    StoreFuture,
};
use crate::{IdempotencyKey, Scope, StoredResponse};

/// A store in front of another (a cache, a fault injector, a wrapper that
/// owns what its store needs): implement [`inner`](Self::inner) and only the
/// steps it changes; every other step goes to the inner store. Every
/// `StoreLayer` is a [`Store`].
///
/// ```
/// use idem_core::store::{Claim, StoreFuture, StoreLayer};
/// use idem_core::{MemoryStore, Store};
///
/// /// Counts renewals, and changes nothing else.
/// struct CountRenewals {
///     inner: MemoryStore,
///     renewals: std::sync::atomic::AtomicU64,
/// }
///
/// impl StoreLayer for CountRenewals {
///     fn inner(&self) -> &dyn Store {
///         &self.inner
///     }
///     fn renew<'a>(&'a self, claim: &'a Claim, lease: std::time::Duration) -> StoreFuture<'a, ()> {
///         self.renewals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///         self.inner.renew(claim, lease)
///     }
/// }
/// ```
pub trait StoreLayer: Send + Sync + 'static {
    /// The store behind this one.
    fn inner(&self) -> &dyn Store;

    /// [`Store::claim`]; by default the inner store's.
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        self.inner().claim(request)
    }
    /// [`Store::renew`]; by default the inner store's.
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        self.inner().renew(claim, lease)
    }
    /// [`Store::complete`]; by default the inner store's.
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        self.inner().complete(claim, response, retention)
    }
    /// [`Store::release`]; by default the inner store's.
    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        self.inner().release(claim)
    }
    /// [`Store::load`]; by default the inner store's.
    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        self.inner().load(scope, key)
    }
    /// [`Store::delete_expired`]; by default the inner store's.
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        self.inner().delete_expired(batch)
    }
    /// [`Store::changed`]; by default the inner store's.
    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        self.inner().changed(scope, key, poll)
    }
    /// [`Store::execution_context`]; by default the inner store's.
    fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
        self.inner().execution_context(claim)
    }
    /// [`Store::execution_context_type`]; by default the inner store's. A
    /// layer that hands a context of its own declares its type here.
    fn execution_context_type(&self) -> Option<ContextType> {
        self.inner().execution_context_type()
    }
    /// [`Store::readiness`]; by default the inner store's.
    fn readiness(&self) -> Result<(), NotReady> {
        self.inner().readiness()
    }
}

impl<L: StoreLayer> Store for L {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        StoreLayer::claim(self, request)
    }
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        StoreLayer::renew(self, claim, lease)
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        StoreLayer::complete(self, claim, response, retention)
    }
    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        StoreLayer::release(self, claim)
    }
    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        StoreLayer::load(self, scope, key)
    }
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        StoreLayer::delete_expired(self, batch)
    }
    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        StoreLayer::changed(self, scope, key, poll)
    }
    fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
        StoreLayer::execution_context(self, claim)
    }
    fn execution_context_type(&self) -> Option<ContextType> {
        StoreLayer::execution_context_type(self)
    }
    fn readiness(&self) -> Result<(), NotReady> {
        StoreLayer::readiness(self)
    }
}
