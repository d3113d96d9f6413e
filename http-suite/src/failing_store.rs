//! A store that is down: every step fails.

use std::time::Duration;

use idem_core::store::{Claim, ClaimOutcome, ClaimRequest, Record, StoreFuture};
use idem_core::{IdempotencyKey, Scope, Store, StoreError, StoredResponse};

/// Words in the failing store's error that must never reach a client.
pub const FAILING_STORE_SECRET: &str = "db-password-in-error-message";

/// A [`Store`] whose every step fails with [`StoreError::Unavailable`], as a
/// database that cannot be reached does. The scenario of a failing store starts
/// the app over it.
#[derive(Clone, Copy, Debug, Default)]
pub struct FailingStore;

/// The cause the failing store reports (kept as the error's source).
#[derive(Debug, thiserror::Error)]
#[error("connection refused to postgres://app:{FAILING_STORE_SECRET}@db.invalid/idem")]
struct Unreachable;

fn down<'a, T: Send + 'a>() -> StoreFuture<'a, T> {
    Box::pin(async { Err(StoreError::unavailable(Unreachable)) })
}

impl Store for FailingStore {
    fn claim<'a>(&'a self, _request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        down()
    }
    fn renew<'a>(&'a self, _claim: &'a Claim, _lease: Duration) -> StoreFuture<'a, ()> {
        down()
    }
    fn complete<'a>(
        &'a self,
        _claim: &'a Claim,
        _response: &'a StoredResponse,
        _retention: Duration,
    ) -> StoreFuture<'a, ()> {
        down()
    }
    fn release<'a>(&'a self, _claim: &'a Claim) -> StoreFuture<'a, ()> {
        down()
    }
    fn load<'a>(
        &'a self,
        _scope: &'a Scope,
        _key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        down()
    }
    fn delete_expired(&self, _batch: usize) -> StoreFuture<'_, u64> {
        down()
    }
}
