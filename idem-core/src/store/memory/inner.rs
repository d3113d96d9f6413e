//! What the store's clones share ([`Inner`]), and the steps of the
//! [`Store`](crate::Store) trait on it, each under one shard's lock.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::blob::Blob;
use super::clock::{Clock, Nanos, later};
use super::name::Name;
use super::retention::Ref;
use super::scopes::ScopeTable;
use super::shard::Shard;
use super::slot::{Pending, Slot, claim_size};
use super::{MemoryStore, RandomState};
use crate::store::{Claim, ClaimOutcome, ClaimRequest, Record, RecordState, StoreError};
use crate::{IdempotencyKey, Scope, StoredResponse};

pub(super) struct Inner {
    pub(super) shards: Box<[Mutex<Shard>]>,
    pub(super) hasher: RandomState,
    pub(super) max_records: usize,
    pub(super) max_bytes: usize,
    pub(super) max_scope_records: usize,
    pub(super) max_scope_bytes: usize,
    pub(super) records: AtomicUsize,
    pub(super) bytes: AtomicUsize,
    /// What each scope holds, for the per-scope quotas.
    pub(super) scopes: ScopeTable,
    /// Numbers each version of a record, so that an index entry left behind by an
    /// older version is recognised (wrapping: an entry lives far shorter than 2^32
    /// versions of its slot).
    pub(super) generation: AtomicU32,
    pub(super) clock: Clock,
}

/// The refusal of a claim the store has no room for (`limit`: which bound).
fn full(limit: &'static str) -> StoreError {
    crate::metrics::store_full(limit);
    StoreError::Full
}

/// Logs a response kept without its body for want of room (`bound`: whose).
fn squeezed(claim: &Claim, response: &StoredResponse, bound: &str) {
    tracing::warn!(
        target: "idem",
        scope = %claim.scope,
        key = %claim.key.redacted(),
        bytes = response.body.len(),
        "the in-memory store has no room under {bound}; the response is kept without its body, and a retry is answered with a problem",
    );
}

impl Inner {
    pub(super) fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let name = Name::new(&request.scope, &request.key);
        let hash = name.hash(&self.hasher);
        let shard_index = self.shard_of(hash);
        let size = claim_size(&request.scope, &request.key);
        loop {
            let now = self.clock.now();
            let (records_needed, bytes_needed);
            {
                let mut shard = self.lock(shard_index);
                let found = shard.find(hash, &name);
                let replaced = match found.map(|slot| &shard.slots[slot as usize]) {
                    Some(record) if !record.is_expired(now) => match record {
                        Slot::InProgress(pending) if now < pending.lease_until => {
                            return Ok(ClaimOutcome::InProgress {
                                fingerprint: pending.fingerprint,
                                lease_until: self.clock.system_time(pending.lease_until),
                            });
                        }
                        Slot::Completed(blob) => {
                            return Ok(ClaimOutcome::Completed {
                                fingerprint: Blob::fingerprint(blob),
                                response: Blob::response(blob)?,
                            });
                        }
                        // The lease lapsed: the record counts as new.
                        Slot::InProgress(_) => Some(record.size()),
                    },
                    Some(record) => Some(record.size()),
                    None => None,
                };
                records_needed = usize::from(replaced.is_none());
                bytes_needed = size.saturating_sub(replaced.unwrap_or(0));
                if let Some(limit) =
                    self.over_scope_quota(&request.scope, records_needed, bytes_needed)
                {
                    return Err(full(limit));
                }
                if self.reserve(records_needed, bytes_needed) {
                    let generation = self.next_generation();
                    let pending = Slot::InProgress(Box::new(Pending {
                        scope: request.scope.clone(),
                        key: request.key.clone(),
                        fingerprint: request.fingerprint,
                        owner: request.owner,
                        generation,
                        expires_at: later(now, request.retention),
                        lease_until: later(now, request.lease),
                        changed: None,
                    }));
                    let slot = match (found, replaced) {
                        (Some(slot), Some(old_size)) => {
                            self.unreserve(0, old_size.saturating_sub(size));
                            let old = std::mem::replace(&mut shard.slots[slot as usize], pending);
                            self.scopes.update(name.scope, |usage| {
                                usage.bytes = usage.bytes + size - old_size;
                            });
                            old.settle();
                            slot
                        }
                        _ => {
                            self.scopes.add(&request.scope, size);
                            shard.insert(hash, pending)
                        }
                    };
                    shard.push_loose(Ref { slot, generation });
                    return Ok(ClaimOutcome::Claimed(request.to_claim()));
                }
            }
            if !self.remove_one_expired(now) {
                return Err(full(
                    if records_needed > 0
                        && self.records.load(Ordering::Acquire) + records_needed > self.max_records
                    {
                        "records"
                    } else {
                        "bytes"
                    },
                ));
            }
        }
    }

    pub(super) fn renew(&self, claim: &Claim, lease: Duration) -> Result<(), StoreError> {
        let name = Name::new(&claim.scope, &claim.key);
        let hash = name.hash(&self.hasher);
        let now = self.clock.now();
        let mut shard = self.lock(self.shard_of(hash));
        let slot = shard.find(hash, &name);
        match slot.map(|slot| &mut shard.slots[slot as usize]) {
            Some(record) if record.is_held_by(claim.owner, now) => {
                if let Slot::InProgress(pending) = record {
                    pending.lease_until = later(now, lease);
                }
                Ok(())
            }
            _ => Err(StoreError::StaleOwner),
        }
    }

    pub(super) fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let name = Name::new(&claim.scope, &claim.key);
        let hash = name.hash(&self.hasher);
        let shard_index = self.shard_of(hash);
        let headers_len = response.encoded_headers_len();
        let mut keep_body = true;
        loop {
            let now = self.clock.now();
            let expires_at = later(now, retention);
            let generation = self.next_generation();
            // Built before the lock is taken; a copy, so that the bytes counted are
            // the bytes held (a `Bytes` slice may keep a larger buffer alive).
            let blob = Blob::encode(
                &name,
                &claim.fingerprint,
                generation,
                expires_at,
                response,
                headers_len,
                keep_body,
            );
            let size = MemoryStore::RECORD_OVERHEAD + blob.len() - Blob::SCOPE;
            let needed;
            {
                let mut shard = self.lock(shard_index);
                let slot = match shard.find(hash, &name) {
                    Some(slot) if shard.slots[slot as usize].is_held_by(claim.owner, now) => slot,
                    _ => return Err(StoreError::StaleOwner),
                };
                let old_size = shard.slots[slot as usize].size();
                needed = size.saturating_sub(old_size);
                if keep_body && self.over_scope_quota(&claim.scope, 0, needed).is_some() {
                    drop(shard);
                    squeezed(claim, response, "its scope's byte quota");
                    keep_body = false;
                    continue;
                }
                // Squeezed, the response is kept even over the bound: dropping it
                // would run the handler again on a retry.
                if !keep_body {
                    self.bytes.fetch_add(needed, Ordering::AcqRel);
                }
                if !keep_body || self.reserve(0, needed) {
                    self.unreserve(0, old_size.saturating_sub(size));
                    let old =
                        std::mem::replace(&mut shard.slots[slot as usize], Slot::Completed(blob));
                    shard.push_completed(retention, Ref { slot, generation });
                    self.scopes.update(name.scope, |usage| {
                        usage.bytes = usage.bytes + size - old_size;
                    });
                    drop(shard);
                    old.settle();
                    return Ok(());
                }
            }
            if !self.remove_one_expired(now) {
                squeezed(claim, response, "the store's byte bound");
                keep_body = false;
            }
        }
    }

    pub(super) fn release(&self, claim: &Claim) -> Result<(), StoreError> {
        let name = Name::new(&claim.scope, &claim.key);
        let hash = name.hash(&self.hasher);
        let now = self.clock.now();
        let mut shard = self.lock(self.shard_of(hash));
        match shard.find(hash, &name) {
            Some(slot) if shard.slots[slot as usize].is_held_by(claim.owner, now) => {
                let size = shard.remove(&self.scopes, slot);
                drop(shard);
                self.unreserve(1, size);
                Ok(())
            }
            _ => Err(StoreError::StaleOwner),
        }
    }

    pub(super) fn load(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<Record>, StoreError> {
        let name = Name::new(scope, key);
        let hash = name.hash(&self.hasher);
        let now = self.clock.now();
        let mut shard = self.lock(self.shard_of(hash));
        let Some(slot) = shard.find(hash, &name) else {
            return Ok(None);
        };
        let (state, expires_at, fingerprint) = match &shard.slots[slot as usize] {
            record if record.is_expired(now) => {
                let size = shard.remove(&self.scopes, slot);
                drop(shard);
                self.unreserve(1, size);
                return Ok(None);
            }
            Slot::InProgress(pending) => (
                RecordState::InProgress {
                    owner: pending.owner,
                    lease_until: self.clock.system_time(pending.lease_until),
                },
                pending.expires_at,
                pending.fingerprint,
            ),
            Slot::Completed(blob) => (
                RecordState::Completed {
                    response: Blob::response(blob)?,
                },
                Blob::expires_at(blob),
                Blob::fingerprint(blob),
            ),
        };
        Ok(Some(Record {
            scope: scope.clone(),
            key: key.clone(),
            fingerprint,
            state,
            expires_at: self.clock.system_time(expires_at),
        }))
    }

    pub(super) fn delete_expired(&self, batch: usize) -> u64 {
        let now = self.clock.now();
        let mut deleted = 0;
        for index in 0..self.shards.len() {
            if deleted >= batch {
                break;
            }
            let (records, bytes) =
                self.lock(index)
                    .remove_expired(&self.scopes, now, batch - deleted);
            self.unreserve(records, bytes);
            deleted += records;
        }
        deleted as u64
    }

    /// The notifier and lease of the record while it is in progress with a live
    /// lease; `None` once it is not (or, given `same`, is no longer the same claim).
    pub(super) fn watch(
        &self,
        name: &Name<'_>,
        same: Option<&Arc<Notify>>,
    ) -> Option<(Arc<Notify>, Instant)> {
        let hash = name.hash(&self.hasher);
        let now = self.clock.now();
        let mut shard = self.lock(self.shard_of(hash));
        let slot = shard.find(hash, name)?;
        match &mut shard.slots[slot as usize] {
            Slot::InProgress(pending) if now < pending.lease_until => {
                let changed = pending
                    .changed
                    .get_or_insert_with(|| Arc::new(Notify::new()));
                if same.is_some_and(|same| !Arc::ptr_eq(same, changed)) {
                    return None;
                }
                Some((Arc::clone(changed), self.clock.instant(pending.lease_until)))
            }
            _ => None,
        }
    }

    /// Frees room: removes one expired record, if any. `false` when there is
    /// none (nothing else is ever removed for room).
    fn remove_one_expired(&self, now: Nanos) -> bool {
        for index in 0..self.shards.len() {
            let (records, bytes) = self.lock(index).remove_expired(&self.scopes, now, 1);
            if records > 0 {
                self.unreserve(records, bytes);
                return true;
            }
        }
        false
    }

    /// Which quota of `scope` taking `records` more records and `bytes` more
    /// bytes would pass, if one would.
    fn over_scope_quota(
        &self,
        scope: &Scope,
        records: usize,
        bytes: usize,
    ) -> Option<&'static str> {
        if self.max_scope_records == usize::MAX && self.max_scope_bytes == usize::MAX {
            return None;
        }
        let (held_records, held_bytes) = self.scopes.usage(scope).unwrap_or((0, 0));
        if held_records.saturating_add(records) > self.max_scope_records {
            Some("scope_records")
        } else if held_bytes.saturating_add(bytes) > self.max_scope_bytes {
            Some("scope_bytes")
        } else {
            None
        }
    }

    /// Takes room for `records` more records and `bytes` more bytes, if both fit.
    fn reserve(&self, records: usize, bytes: usize) -> bool {
        let grow = |limit: usize, by: usize| {
            move |used: usize| used.checked_add(by).filter(|&total| total <= limit)
        };
        if records > 0
            && self
                .records
                .fetch_update(
                    Ordering::AcqRel,
                    Ordering::Acquire,
                    grow(self.max_records, records),
                )
                .is_err()
        {
            return false;
        }
        if self
            .bytes
            .fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                grow(self.max_bytes, bytes),
            )
            .is_err()
        {
            self.records.fetch_sub(records, Ordering::AcqRel);
            return false;
        }
        true
    }

    fn unreserve(&self, records: usize, bytes: usize) {
        if records > 0 {
            self.records.fetch_sub(records, Ordering::AcqRel);
        }
        if bytes > 0 {
            self.bytes.fetch_sub(bytes, Ordering::AcqRel);
        }
    }

    fn next_generation(&self) -> u32 {
        self.generation.fetch_add(1, Ordering::Relaxed)
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The shard takes the high 32 bits, its table the low 32 (see
        // `table_bits`). The modulo keeps the value below the shard count, so
        // the cast back is exact.
        ((hash >> 32) % self.shards.len() as u64) as usize
    }

    pub(super) fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // Shard updates do not panic halfway, so a poisoned shard is still consistent.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
