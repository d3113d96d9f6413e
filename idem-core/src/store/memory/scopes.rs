//! What each scope holds, for the per-scope quotas.

use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;

use super::RandomState;
use crate::Scope;

/// What each scope holds across every shard, sharded by scope. A shard's lock may
/// be taken while a record shard's lock is held, never the other way round.
pub(super) struct ScopeTable {
    shards: Box<[Mutex<HashTable<ScopeUsage>>]>,
    hasher: RandomState,
}

/// A scope's records and bytes. Present only while the scope holds a record.
pub(super) struct ScopeUsage {
    scope: Scope,
    records: usize,
    pub(super) bytes: usize,
}

impl ScopeTable {
    pub(super) fn new(shards: usize) -> Self {
        Self {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            hasher: RandomState::default(),
        }
    }

    /// Counts a new record of `size` bytes.
    pub(super) fn add(&self, scope: &Scope, size: usize) {
        let name = scope.as_str().as_bytes();
        let hash = self.hasher.hash_one(name);
        let mut shard = self.lock(self.shard_of(hash));
        let usage = shard
            .entry(
                hash,
                |usage| usage.scope.as_str().as_bytes() == name,
                |usage| self.hasher.hash_one(usage.scope.as_str().as_bytes()),
            )
            .or_insert_with(|| ScopeUsage {
                scope: scope.clone(),
                records: 0,
                bytes: 0,
            })
            .into_mut();
        usage.records += 1;
        usage.bytes += size;
    }

    /// Changes the usage of a scope that holds records.
    pub(super) fn update(&self, scope: &[u8], change: impl FnOnce(&mut ScopeUsage)) {
        let hash = self.hasher.hash_one(scope);
        let mut shard = self.lock(self.shard_of(hash));
        if let Some(usage) = shard.find_mut(hash, |usage| usage.scope.as_str().as_bytes() == scope)
        {
            change(usage);
        }
    }

    /// Counts a record of `size` bytes gone.
    pub(super) fn remove(&self, scope: &[u8], size: usize) {
        let hash = self.hasher.hash_one(scope);
        let mut shard = self.lock(self.shard_of(hash));
        let Ok(mut entry) =
            shard.find_entry(hash, |usage| usage.scope.as_str().as_bytes() == scope)
        else {
            return;
        };
        let usage = entry.get_mut();
        usage.records = usage.records.saturating_sub(1);
        usage.bytes = usage.bytes.saturating_sub(size);
        if usage.records == 0 {
            entry.remove();
        }
    }

    /// The records and bytes `scope` holds; `None` when it holds none.
    pub(super) fn usage(&self, scope: &Scope) -> Option<(usize, usize)> {
        let name = scope.as_str().as_bytes();
        let hash = self.hasher.hash_one(name);
        let shard = self.lock(self.shard_of(hash));
        shard
            .find(hash, |usage| usage.scope.as_str().as_bytes() == name)
            .map(|usage| (usage.records, usage.bytes))
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The modulo keeps the value below the shard count, so the cast back is exact.
        ((hash >> 32) % self.shards.len() as u64) as usize
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, HashTable<ScopeUsage>> {
        // Updates do not panic halfway, so a poisoned shard is still consistent.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
