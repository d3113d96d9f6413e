//! [`ReplayCache`]: completed records kept in this process, in front of any
//! store, so that replays need no round trip.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use super::{Claim, ClaimOutcome, ClaimRequest, Store, StoreFuture, StoreLayer, StoredResponse};
use crate::{Fingerprint, IdempotencyKey, Scope};

/// A bounded cache of completed records in front of a store (opt-in): a
/// replay of a record this process completed is answered from memory, without
/// a round trip to the store, as AWS Powertools' `use_local_cache` does.
///
/// It is safe because a completed record never changes until it expires: the
/// cache keeps only records it saw complete through it (so it knows when they
/// expire), answers for each only until its retention is over (counted from
/// before the completion was sent, so never past the store's own expiry), and
/// never holds an in-progress record, which another instance could still
/// release or complete. Every other step goes to the store. When it is full,
/// the oldest entries go first.
///
/// ```
/// use idem_core::MemoryStore;
/// use idem_core::store::ReplayCache;
///
/// // In front of a durable store in a real application.
/// let store = ReplayCache::new(MemoryStore::new(), 10_000);
/// # drop(store);
/// ```
#[derive(Debug)]
pub struct ReplayCache<S> {
    inner: S,
    shards: Box<[Mutex<Shard>]>,
    hasher: foldhash::fast::RandomState,
    capacity_per_shard: usize,
}

#[derive(Debug, Default)]
struct Shard {
    entries: HashMap<(Scope, IdempotencyKey), Cached, foldhash::fast::RandomState>,
    order: VecDeque<(Scope, IdempotencyKey)>,
}

#[derive(Debug)]
struct Cached {
    fingerprint: Fingerprint,
    response: StoredResponse,
    until: Instant,
}

const SHARDS: usize = 16;

impl<S: Store> ReplayCache<S> {
    /// `inner` with a cache of at most `capacity` completed records.
    pub fn new(inner: S, capacity: usize) -> Self {
        Self {
            inner,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: foldhash::fast::RandomState::default(),
            capacity_per_shard: capacity.div_ceil(SHARDS).max(1),
        }
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn shard(&self, scope: &Scope, key: &IdempotencyKey) -> MutexGuard<'_, Shard> {
        let index = (self.hasher.hash_one((scope, key)) % SHARDS as u64) as usize;
        self.shards[index]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The cached answer of `(scope, key)`, if it is still live.
    fn cached(&self, scope: &Scope, key: &IdempotencyKey) -> Option<ClaimOutcome> {
        let mut shard = self.shard(scope, key);
        let id = (scope.clone(), key.clone());
        let cached = shard.entries.get(&id)?;
        if Instant::now() >= cached.until {
            shard.entries.remove(&id);
            return None;
        }
        Some(ClaimOutcome::Completed {
            fingerprint: cached.fingerprint,
            response: cached.response.clone(),
        })
    }

    fn remember(&self, claim: &Claim, response: &StoredResponse, until: Instant) {
        let mut shard = self.shard(&claim.scope, &claim.key);
        let id = (claim.scope.clone(), claim.key.clone());
        let cached = Cached {
            fingerprint: claim.fingerprint,
            response: response.clone(),
            until,
        };
        if shard.entries.insert(id.clone(), cached).is_none() {
            shard.order.push_back(id);
        }
        while shard.entries.len() > self.capacity_per_shard {
            let Some(oldest) = shard.order.pop_front() else {
                break;
            };
            shard.entries.remove(&oldest);
        }
        // Keys of entries already gone (expired, replaced) are dropped lazily.
        if shard.order.len() > 2 * self.capacity_per_shard {
            let Shard { entries, order } = &mut *shard;
            order.retain(|id| entries.contains_key(id));
        }
    }
}

impl<S: Store> StoreLayer for ReplayCache<S> {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        if let Some(outcome) = self.cached(&request.scope, &request.key) {
            return Box::pin(std::future::ready(Ok(outcome)));
        }
        self.inner.claim(request)
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            // From before the completion is sent: the store's expiry is later.
            let until = Instant::now() + retention;
            self.inner.complete(claim, response, retention).await?;
            self.remember(claim, response, until);
            Ok(())
        })
    }
}
