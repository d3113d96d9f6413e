//! The in-memory store.

use std::time::Duration;

use super::{Store, StoreFuture};
use crate::{Claim, ClaimOutcome, ClaimRequest, IdempotencyKey, Record, Scope, StoredResponse};

/// Records in this process's memory: sharded, bounded by record count and bytes.
#[derive(Clone)]
pub struct MemoryStore {
    _todo: (),
}

/// Configures a [`MemoryStore`].
#[must_use]
pub struct MemoryStoreBuilder {
    _todo: (),
}

impl MemoryStore {
    /// A store with the default bounds.
    pub fn new() -> Self {
        todo!()
    }

    /// Configures bounds and sharding.
    pub fn builder() -> MemoryStoreBuilder {
        todo!()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Store for MemoryStore {
    fn claim<'a>(&'a self, _request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        todo!()
    }
    fn renew<'a>(&'a self, _claim: &'a Claim, _lease: Duration) -> StoreFuture<'a, ()> {
        todo!()
    }
    fn complete<'a>(
        &'a self,
        _claim: &'a Claim,
        _response: &'a StoredResponse,
        _retention: Duration,
    ) -> StoreFuture<'a, ()> {
        todo!()
    }
    fn release<'a>(&'a self, _claim: &'a Claim) -> StoreFuture<'a, ()> {
        todo!()
    }
    fn load<'a>(
        &'a self,
        _scope: &'a Scope,
        _key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        todo!()
    }
    fn delete_expired(&self, _batch: usize) -> StoreFuture<'_, u64> {
        todo!()
    }
}
