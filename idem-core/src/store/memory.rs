//! The in-memory store.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::BuildHasher;

/// The store's hasher: foldhash (hashbrown's default; seeded per store, fast on
/// short keys), in place of std's SipHash, which cost a few thousand
/// instructions per request on the key hashed at every step.
type RandomState = foldhash::fast::RandomState;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Claim, ClaimOutcome, ClaimRequest, OwnerToken, Record, RecordState};
use super::{Store, StoreError, StoreFuture};
use crate::{Fingerprint, Header, IdempotencyKey, Scope, StoredResponse};

/// Records in this process's memory: sharded, bounded by record count and bytes.
///
/// The store suits a single application instance, tests and development: its records
/// are lost on restart and not shared between processes (use a database store for
/// that). Cloning it is cheap; clones share the same records.
///
/// # Bounds and eviction
///
/// The store holds at most [`max_records`](MemoryStoreBuilder::max_records) records
/// and [`max_bytes`](MemoryStoreBuilder::max_bytes) bytes, counted as the key, the
/// scope, every header name and value and the body of each record, plus
/// [`RECORD_OVERHEAD`](Self::RECORD_OVERHEAD) bytes per record. It never evicts a
/// record in progress.
///
/// Eviction is fair between scopes. A scope's *fair share* is `max_records / n`
/// records and `max_bytes / n` bytes, where `n` is the number of scopes holding
/// records (the requesting scope included). When a claim or a completion needs
/// room, the store first drops expired records, then evicts one completed record
/// at a time, oldest completion first within the scope it takes it from:
///
/// 1. from the requesting scope, if that scope (counting the room it asks for) is
///    over its fair share in records or in bytes;
/// 2. else from another scope that is over its fair share;
/// 3. else from the requesting scope.
///
/// So no scope can cause another scope's completed record to be evicted while that
/// other scope is within its fair share: a client sending large responses, or
/// many, evicts its own records first. When nothing may be evicted, a claim
/// answers [`StoreError::Full`], and a response that does not fit is kept without
/// its body (`replayable: false`), so a retry gets a problem answer rather than a
/// second execution.
///
/// # Time
///
/// The store runs on Tokio's clock ([`tokio::time::Instant`]), so tests may pause
/// and advance it. Records report times as [`SystemTime`]s. A lease is live while
/// `now < lease_until`; a record is expired when `now >= expires_at` (and, in
/// progress, its lease has lapsed too). Expired records count as absent and are
/// removed when next touched or by [`Store::delete_expired`]. Durations beyond a
/// century count as a century.
///
/// An owner whose lease lapsed still holds its record until another request claims
/// it (or it expires): its renewal, completion and release are accepted, because no
/// other request ran the handler meanwhile, and [`Store::load`] reports the record
/// in progress with a `lease_until` in the past.
///
/// # Example
///
/// ```
/// use std::time::Duration;
///
/// use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken};
/// use idem_core::{Fingerprint, IdempotencyKey, MemoryStore, Scope, Store, StoredResponse};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::builder().max_records(10_000).max_bytes(64 << 20).build();
/// let request = ClaimRequest {
///     scope: Scope::new("tenant-1"),
///     key: IdempotencyKey::new("order-42")?,
///     fingerprint: Fingerprint::from_bytes([7; 32]),
///     owner: OwnerToken::random(),
///     lease: Duration::from_secs(30),
///     retention: Duration::from_secs(86_400),
/// };
/// let ClaimOutcome::Claimed(claim) = store.claim(&request).await? else {
///     panic!("a new key is claimed");
/// };
/// let response = StoredResponse::new(201, vec![], "{}");
/// store.complete(&claim, &response, request.retention).await?;
///
/// let again = ClaimRequest { owner: OwnerToken::random(), ..request };
/// assert!(matches!(
///     store.claim(&again).await?,
///     ClaimOutcome::Completed { response: stored, .. } if stored == response
/// ));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// Configures a [`MemoryStore`].
///
/// ```
/// let store = idem_core::MemoryStore::builder()
///     .max_records(100_000)
///     .max_bytes(128 * 1024 * 1024)
///     .shards(32)
///     .build();
/// assert!(store.is_empty());
/// ```
#[must_use]
#[derive(Clone, Debug)]
pub struct MemoryStoreBuilder {
    max_records: usize,
    max_bytes: usize,
    shards: usize,
}

impl MemoryStore {
    /// The bytes each record counts on top of its key, scope, headers and body:
    /// its map slot (with the table's spare room), its index entries and its
    /// allocations' headers. Measured, not guessed: `cargo xtask bench` prints
    /// the resident bytes per record beside the counted ones (918 B of RSS for
    /// a 200-byte body and a UUID key, 1 M records), so that `max_bytes` bounds
    /// the memory really used within about 10 %.
    pub const RECORD_OVERHEAD: usize = 600;

    /// A store with the default bounds: 1,000,000 records, 512 MiB, 16 shards.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures bounds and sharding.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_records: 1_000_000,
            max_bytes: 512 * 1024 * 1024,
            shards: 16,
        }
    }

    /// How many records the store holds, counting expired ones not yet removed.
    pub fn len(&self) -> usize {
        self.inner.records.load(Ordering::Acquire)
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the store's records count against
    /// [`max_bytes`](MemoryStoreBuilder::max_bytes).
    pub fn used_bytes(&self) -> usize {
        self.inner.bytes.load(Ordering::Acquire)
    }
}

impl MemoryStoreBuilder {
    /// The most records the store holds (default 1,000,000).
    pub fn max_records(mut self, max_records: usize) -> Self {
        self.max_records = max_records;
        self
    }

    /// The most bytes the store's records count (default 512 MiB); see
    /// [`MemoryStore`] for what a record counts.
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// How many independently locked shards hold the records (default 16; at
    /// least 1). More shards mean less contention between concurrent requests.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// The store.
    pub fn build(self) -> MemoryStore {
        let shards = (0..self.shards.max(1))
            .map(|_| Mutex::new(Shard::default()))
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher: RandomState::default(),
                max_records: self.max_records,
                max_bytes: self.max_bytes,
                records: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                scopes: ScopeTable::new(self.shards.max(1)),
                sequence: AtomicU64::new(0),
                clock: Clock::new(),
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.len())
            .field("bytes", &self.used_bytes())
            .field("max_records", &self.inner.max_records)
            .field("max_bytes", &self.inner.max_bytes)
            .field("shards", &self.inner.shards.len())
            .finish()
    }
}

impl Store for MemoryStore {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(std::future::ready(self.inner.claim(request)))
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(std::future::ready(self.inner.renew(claim, lease)))
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(std::future::ready(
            self.inner.complete(claim, response, retention),
        ))
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        Box::pin(std::future::ready(self.inner.release(claim)))
    }

    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        Box::pin(std::future::ready(Ok(self.inner.load(scope, key))))
    }

    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(std::future::ready(Ok(self.inner.delete_expired(batch))))
    }

    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let record_key = RecordKey::new(scope, key);
            let Some((notify, _)) = self.inner.watch(&record_key, None) else {
                return Ok(());
            };
            let mut notified = pin!(notify.notified());
            notified.as_mut().enable();
            // The record may have changed between the first look and `enable`: look
            // again now that no wake-up can be lost.
            let Some((_, lease_until)) = self.inner.watch(&record_key, Some(&notify)) else {
                return Ok(());
            };
            // Wake at the lapse of the lease too: the record then counts as new.
            let wait = poll.min(lease_until.saturating_duration_since(Instant::now()));
            // Elapsing is an answer too: the caller looks at the record again.
            let _elapsed = tokio::time::timeout(wait, notified).await;
            Ok(())
        })
    }
}

/// Durations are clamped to a century so that instants never overflow.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    max_records: usize,
    max_bytes: usize,
    records: AtomicUsize,
    bytes: AtomicUsize,
    /// What each scope holds, for fair eviction.
    scopes: ScopeTable,
    /// Orders insertions and completions across shards: the oldest completion is
    /// the one with the smallest number.
    sequence: AtomicU64,
    clock: Clock,
}

/// Maps Tokio instants to wall-clock times, from one reading of both.
struct Clock {
    instant: Instant,
    system: SystemTime,
}

#[derive(Default)]
struct Shard {
    records: HashMap<RecordKey, Entry, RandomState>,
    /// Every record, by `(expires_at, sequence)`: cleanup walks it from the front.
    by_expiry: BTreeMap<(Instant, u64), RecordKey>,
}

/// What each scope holds across every shard, sharded by scope. A shard's lock may
/// be taken while a record shard's lock is held, never the other way round.
struct ScopeTable {
    shards: Box<[Mutex<HashMap<Scope, ScopeUsage, RandomState>>]>,
    hasher: RandomState,
    /// How many scopes hold records: `n` in the fair share.
    count: AtomicUsize,
    /// The scope last evicted from on another scope's behalf: likely still over
    /// its share, so it is looked at first.
    hint: Mutex<Option<Scope>>,
}

/// A scope's records and bytes, and its completed records by `sequence` (eviction
/// takes the front). Present only while the scope holds a record.
#[derive(Default)]
struct ScopeUsage {
    records: usize,
    bytes: usize,
    completions: BTreeMap<u64, RecordKey>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct RecordKey {
    scope: Scope,
    key: IdempotencyKey,
}

struct Entry {
    fingerprint: Fingerprint,
    state: EntryState,
    expires_at: Instant,
    /// When the entry was written; its place in the shard's indexes.
    sequence: u64,
    /// What the entry counts against `max_bytes`.
    size: usize,
}

enum EntryState {
    InProgress {
        owner: OwnerToken,
        lease_until: Instant,
        /// Wakes the requests waiting in `changed` when the record leaves this state.
        changed: Arc<Notify>,
    },
    Completed {
        response: StoredResponse,
    },
}

impl Inner {
    fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let record_key = RecordKey::new(&request.scope, &request.key);
        let shard_index = self.shard_of(&record_key);
        let size = entry_size(&record_key, None);
        loop {
            let now = Instant::now();
            let (records_needed, bytes_needed);
            {
                let mut shard = self.lock(shard_index);
                let replaced = match shard.records.get(&record_key) {
                    Some(entry) if !entry.is_expired(now) => match &entry.state {
                        EntryState::InProgress { lease_until, .. } if now < *lease_until => {
                            return Ok(ClaimOutcome::InProgress {
                                fingerprint: entry.fingerprint,
                                lease_until: self.clock.system_time(*lease_until),
                            });
                        }
                        EntryState::Completed { response } => {
                            return Ok(ClaimOutcome::Completed {
                                fingerprint: entry.fingerprint,
                                response: response.clone(),
                            });
                        }
                        // The lease lapsed: the record counts as new.
                        EntryState::InProgress { .. } => Some(entry.size),
                    },
                    Some(entry) => Some(entry.size),
                    None => None,
                };
                records_needed = usize::from(replaced.is_none());
                bytes_needed = size.saturating_sub(replaced.unwrap_or(0));
                if self.reserve(records_needed, bytes_needed) {
                    if let Some(old) = shard.remove(&self.scopes, &record_key) {
                        self.unreserve(0, old.size.saturating_sub(size));
                    }
                    let entry = Entry {
                        fingerprint: request.fingerprint,
                        state: EntryState::InProgress {
                            owner: request.owner,
                            lease_until: later(now, request.lease),
                            changed: Arc::new(Notify::new()),
                        },
                        expires_at: later(now, request.retention),
                        sequence: self.next_sequence(),
                        size,
                    };
                    shard.insert(&self.scopes, record_key, entry);
                    return Ok(ClaimOutcome::Claimed(request.to_claim()));
                }
            }
            if !self.evict_one(now, &request.scope, records_needed, bytes_needed) {
                return Err(StoreError::Full);
            }
        }
    }

    fn renew(&self, claim: &Claim, lease: Duration) -> Result<(), StoreError> {
        let record_key = RecordKey::new(&claim.scope, &claim.key);
        let now = Instant::now();
        let mut shard = self.lock(self.shard_of(&record_key));
        match shard.records.get_mut(&record_key) {
            Some(entry) if entry.is_held_by(claim.owner, now) => {
                if let EntryState::InProgress { lease_until, .. } = &mut entry.state {
                    *lease_until = later(now, lease);
                }
                Ok(())
            }
            _ => Err(StoreError::StaleOwner),
        }
    }

    fn complete(
        &self,
        claim: &Claim,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let record_key = RecordKey::new(&claim.scope, &claim.key);
        let shard_index = self.shard_of(&record_key);
        // Copied, so that the bytes counted are the bytes held (a `Bytes` slice may
        // keep a larger buffer alive).
        let mut response = owned_copy(response);
        let mut size = entry_size(&record_key, Some(&response));
        let mut squeezed = false;
        loop {
            let now = Instant::now();
            let needed;
            {
                let mut shard = self.lock(shard_index);
                let old_size = match shard.records.get(&record_key) {
                    Some(entry) if entry.is_held_by(claim.owner, now) => entry.size,
                    _ => return Err(StoreError::StaleOwner),
                };
                needed = size.saturating_sub(old_size);
                // Squeezed, the response is kept even over the bound: dropping it
                // would run the handler again on a retry.
                if squeezed {
                    self.bytes.fetch_add(needed, Ordering::AcqRel);
                }
                if squeezed || self.reserve(0, needed) {
                    let fingerprint = match shard.remove(&self.scopes, &record_key) {
                        Some(old) => old.fingerprint,
                        None => claim.fingerprint,
                    };
                    self.unreserve(0, old_size.saturating_sub(size));
                    let entry = Entry {
                        fingerprint,
                        state: EntryState::Completed { response },
                        expires_at: later(now, retention),
                        sequence: self.next_sequence(),
                        size,
                    };
                    shard.insert(&self.scopes, record_key, entry);
                    return Ok(());
                }
            }
            // The record being completed is in progress, so it is never evicted here.
            if !self.evict_one(now, &claim.scope, 0, needed) {
                tracing::warn!(
                    target: "idem",
                    scope = %claim.scope,
                    key = %claim.key.redacted(),
                    bytes = response.body.len(),
                    "the in-memory store is full; the response is kept without its body",
                );
                response = StoredResponse::without_body(response.status, response.headers);
                size = entry_size(&record_key, Some(&response));
                squeezed = true;
            }
        }
    }

    fn release(&self, claim: &Claim) -> Result<(), StoreError> {
        let record_key = RecordKey::new(&claim.scope, &claim.key);
        let now = Instant::now();
        let mut shard = self.lock(self.shard_of(&record_key));
        match shard.records.get(&record_key) {
            Some(entry) if entry.is_held_by(claim.owner, now) => {
                if let Some(old) = shard.remove(&self.scopes, &record_key) {
                    self.unreserve(1, old.size);
                }
                Ok(())
            }
            _ => Err(StoreError::StaleOwner),
        }
    }

    fn load(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Record> {
        let record_key = RecordKey::new(scope, key);
        let now = Instant::now();
        let mut shard = self.lock(self.shard_of(&record_key));
        let entry = shard.records.get(&record_key)?;
        if entry.is_expired(now) {
            if let Some(old) = shard.remove(&self.scopes, &record_key) {
                self.unreserve(1, old.size);
            }
            return None;
        }
        let state = match &entry.state {
            EntryState::InProgress {
                owner, lease_until, ..
            } => RecordState::InProgress {
                owner: *owner,
                lease_until: self.clock.system_time(*lease_until),
            },
            EntryState::Completed { response } => RecordState::Completed {
                response: response.clone(),
            },
        };
        Some(Record {
            scope: record_key.scope,
            key: record_key.key,
            fingerprint: entry.fingerprint,
            state,
            expires_at: self.clock.system_time(entry.expires_at),
        })
    }

    fn delete_expired(&self, batch: usize) -> u64 {
        let now = Instant::now();
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
    fn watch(
        &self,
        record_key: &RecordKey,
        same: Option<&Arc<Notify>>,
    ) -> Option<(Arc<Notify>, Instant)> {
        let now = Instant::now();
        let shard = self.lock(self.shard_of(record_key));
        match &shard.records.get(record_key)?.state {
            EntryState::InProgress {
                lease_until,
                changed,
                ..
            } if now < *lease_until && same.is_none_or(|same| Arc::ptr_eq(same, changed)) => {
                Some((Arc::clone(changed), *lease_until))
            }
            _ => None,
        }
    }

    /// Frees room for one record: removes an expired record if any, else evicts a
    /// completed record as [`MemoryStore`] describes, on behalf of `requester`, who
    /// needs room for `records` more records and `bytes` more bytes. `false` when
    /// there is nothing it may remove.
    fn evict_one(&self, now: Instant, requester: &Scope, records: usize, bytes: usize) -> bool {
        // A few attempts, because another request may take the chosen record first.
        for _ in 0..3 {
            for index in 0..self.shards.len() {
                let mut shard = self.lock(index);
                let (records, bytes) = shard.remove_expired(&self.scopes, now, 1);
                if records > 0 {
                    drop(shard);
                    self.unreserve(records, bytes);
                    return true;
                }
            }
            let Some(record_key) = self.victim(requester, records, bytes) else {
                return false;
            };
            let mut shard = self.lock(self.shard_of(&record_key));
            let completed = shard
                .records
                .get(&record_key)
                .is_some_and(|entry| matches!(entry.state, EntryState::Completed { .. }));
            let evicted = if completed {
                shard.remove(&self.scopes, &record_key)
            } else {
                None
            };
            drop(shard);
            if let Some(entry) = evicted {
                self.unreserve(1, entry.size);
                return true;
            }
        }
        false
    }

    /// The completed record to evict for `requester`, who needs room for `records`
    /// more records and `bytes` more bytes.
    fn victim(&self, requester: &Scope, records: usize, bytes: usize) -> Option<RecordKey> {
        let own = self.scopes.usage(requester);
        let scopes = self.scopes.count.load(Ordering::Acquire) + usize::from(own.is_none());
        let over_share = |records: usize, bytes: usize| {
            records.saturating_mul(scopes) > self.max_records
                || bytes.saturating_mul(scopes) > self.max_bytes
        };
        let (own_records, own_bytes) = own.unwrap_or((0, 0));
        if over_share(
            own_records.saturating_add(records),
            own_bytes.saturating_add(bytes),
        ) && let Some(record_key) = self.scopes.oldest_completion(requester)
        {
            return Some(record_key);
        }
        if let Some(record_key) = self.scopes.over_share(requester, over_share) {
            return Some(record_key);
        }
        self.scopes.oldest_completion(requester)
    }

    /// Takes room for `records` more records and `bytes` more bytes, if both fit.
    fn reserve(&self, records: usize, bytes: usize) -> bool {
        let grow = |limit: usize, by: usize| {
            move |used: usize| used.checked_add(by).filter(|&total| total <= limit)
        };
        if self
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
        self.records.fetch_sub(records, Ordering::AcqRel);
        self.bytes.fetch_sub(bytes, Ordering::AcqRel);
    }

    fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    fn shard_of(&self, record_key: &RecordKey) -> usize {
        // The modulo keeps the value below the shard count, so the cast back is exact.
        (self.hasher.hash_one(record_key) % self.shards.len() as u64) as usize
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // Shard updates do not panic halfway, so a poisoned shard is still consistent.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Shard {
    fn insert(&mut self, scopes: &ScopeTable, record_key: RecordKey, entry: Entry) {
        self.by_expiry
            .insert((entry.expires_at, entry.sequence), record_key.clone());
        let completed = matches!(entry.state, EntryState::Completed { .. });
        scopes.add(&record_key, &entry, completed);
        self.records.insert(record_key, entry);
    }

    /// Removes the record from the map and the indexes, and wakes its waiters.
    fn remove(&mut self, scopes: &ScopeTable, record_key: &RecordKey) -> Option<Entry> {
        let entry = self.records.remove(record_key)?;
        self.by_expiry.remove(&(entry.expires_at, entry.sequence));
        scopes.remove(&record_key.scope, &entry);
        if let EntryState::InProgress { changed, .. } = &entry.state {
            changed.notify_waiters();
        }
        Some(entry)
    }

    /// Removes up to `limit` expired records; answers how many and their bytes.
    fn remove_expired(
        &mut self,
        scopes: &ScopeTable,
        now: Instant,
        limit: usize,
    ) -> (usize, usize) {
        let expired: Vec<RecordKey> = self
            .by_expiry
            .range(..=(now, u64::MAX))
            .filter(|(_, record_key)| {
                self.records
                    .get(*record_key)
                    .is_some_and(|entry| entry.is_expired(now))
            })
            .take(limit)
            .map(|(_, record_key)| record_key.clone())
            .collect();
        let mut bytes = 0;
        for record_key in &expired {
            if let Some(entry) = self.remove(scopes, record_key) {
                bytes += entry.size;
            }
        }
        (expired.len(), bytes)
    }
}

impl ScopeTable {
    fn new(shards: usize) -> Self {
        Self {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            hasher: RandomState::default(),
            count: AtomicUsize::new(0),
            hint: Mutex::new(None),
        }
    }

    fn add(&self, record_key: &RecordKey, entry: &Entry, completed: bool) {
        let mut shard = self.lock(self.shard_of(&record_key.scope));
        let usage = match shard.get_mut(&record_key.scope) {
            Some(usage) => usage,
            None => {
                self.count.fetch_add(1, Ordering::AcqRel);
                shard.entry(record_key.scope.clone()).or_default()
            }
        };
        usage.records += 1;
        usage.bytes += entry.size;
        if completed {
            usage.completions.insert(entry.sequence, record_key.clone());
        }
    }

    fn remove(&self, scope: &Scope, entry: &Entry) {
        let mut shard = self.lock(self.shard_of(scope));
        let Some(usage) = shard.get_mut(scope) else {
            return;
        };
        usage.records = usage.records.saturating_sub(1);
        usage.bytes = usage.bytes.saturating_sub(entry.size);
        if matches!(entry.state, EntryState::Completed { .. }) {
            usage.completions.remove(&entry.sequence);
        }
        if usage.records == 0 {
            shard.remove(scope);
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The records and bytes `scope` holds; `None` when it holds none.
    fn usage(&self, scope: &Scope) -> Option<(usize, usize)> {
        let shard = self.lock(self.shard_of(scope));
        shard.get(scope).map(|usage| (usage.records, usage.bytes))
    }

    fn oldest_completion(&self, scope: &Scope) -> Option<RecordKey> {
        let shard = self.lock(self.shard_of(scope));
        let (_, record_key) = shard.get(scope)?.completions.first_key_value()?;
        Some(record_key.clone())
    }

    /// The oldest completion of a scope other than `requester` that is over its
    /// share (`over_share(records, bytes)`): the hinted scope first, then the others.
    fn over_share(
        &self,
        requester: &Scope,
        over_share: impl Fn(usize, usize) -> bool,
    ) -> Option<RecordKey> {
        let candidate = |usage: &ScopeUsage| {
            if over_share(usage.records, usage.bytes) {
                usage
                    .completions
                    .first_key_value()
                    .map(|(_, key)| key.clone())
            } else {
                None
            }
        };
        let hint = self
            .hint
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(hint) = hint.filter(|hint| hint != requester) {
            let shard = self.lock(self.shard_of(&hint));
            if let Some(record_key) = shard.get(&hint).and_then(candidate) {
                return Some(record_key);
            }
        }
        let found = (0..self.shards.len()).find_map(|index| {
            let shard = self.lock(index);
            shard
                .iter()
                .filter(|(scope, _)| *scope != requester)
                .find_map(|(_, usage)| candidate(usage))
        })?;
        *self.hint.lock().unwrap_or_else(PoisonError::into_inner) = Some(found.scope.clone());
        Some(found)
    }

    fn shard_of(&self, scope: &Scope) -> usize {
        // The modulo keeps the value below the shard count, so the cast back is exact.
        (self.hasher.hash_one(scope) % self.shards.len() as u64) as usize
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, HashMap<Scope, ScopeUsage, RandomState>> {
        // Updates do not panic halfway, so a poisoned shard is still consistent.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Entry {
    /// Expired records count as absent. One in progress also needs its lease lapsed:
    /// a handler that renews its lease past the retention keeps its record.
    fn is_expired(&self, now: Instant) -> bool {
        now >= self.expires_at
            && match &self.state {
                EntryState::InProgress { lease_until, .. } => now >= *lease_until,
                EntryState::Completed { .. } => true,
            }
    }

    /// Whether `owner` holds the record in progress. An owner whose lease lapsed
    /// still holds it until another request claims it or it expires: the token
    /// fences, and no other request ran the handler meanwhile.
    fn is_held_by(&self, owner: OwnerToken, now: Instant) -> bool {
        !self.is_expired(now)
            && matches!(&self.state, EntryState::InProgress { owner: holder, .. } if *holder == owner)
    }
}

impl RecordKey {
    fn new(scope: &Scope, key: &IdempotencyKey) -> Self {
        Self {
            scope: scope.clone(),
            key: key.clone(),
        }
    }
}

impl Clock {
    fn new() -> Self {
        Self {
            instant: Instant::now(),
            system: SystemTime::now(),
        }
    }

    fn system_time(&self, at: Instant) -> SystemTime {
        let mapped = if at >= self.instant {
            self.system
                .checked_add(at.saturating_duration_since(self.instant))
        } else {
            self.system
                .checked_sub(self.instant.saturating_duration_since(at))
        };
        mapped.unwrap_or(self.system)
    }
}

/// `now + duration`, clamped to a century.
fn later(now: Instant, duration: Duration) -> Instant {
    now.checked_add(duration.min(FOREVER)).unwrap_or(now)
}

/// What a record counts against `max_bytes`.
fn entry_size(record_key: &RecordKey, response: Option<&StoredResponse>) -> usize {
    let response = response.map_or(0, |response| {
        let headers: usize = response
            .headers
            .iter()
            .map(|h| size_of::<Header>() + h.name.len() + h.value.len())
            .sum();
        headers + response.body.len()
    });
    MemoryStore::RECORD_OVERHEAD
        + record_key.scope.as_str().len()
        + record_key.key.as_str().len()
        + response
}

fn owned_copy(response: &StoredResponse) -> StoredResponse {
    StoredResponse {
        status: response.status,
        headers: response
            .headers
            .iter()
            .map(|h| Header {
                name: h.name.clone(),
                value: Bytes::copy_from_slice(&h.value),
            })
            .collect(),
        body: Bytes::copy_from_slice(&response.body),
        replayable: response.replayable,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);
    const RETENTION: Duration = Duration::from_secs(60);

    fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            scope: Scope::new("s"),
            key: IdempotencyKey::new(key).unwrap(),
            fingerprint: Fingerprint::from_bytes([1; 32]),
            owner: OwnerToken::random(),
            lease: LEASE,
            retention: RETENTION,
        }
    }

    async fn claim(store: &MemoryStore, key: &str) -> Claim {
        match store.claim(&request(key)).await.unwrap() {
            ClaimOutcome::Claimed(claim) => claim,
            other => panic!("{key} was not claimed: {other:?}"),
        }
    }

    async fn state(store: &MemoryStore, key: &str) -> Option<RecordState> {
        let key = IdempotencyKey::new(key).unwrap();
        let record = store.load(&Scope::new("s"), &key).await.unwrap();
        record.map(|record| record.state)
    }

    async fn is_completed(store: &MemoryStore, key: &str) -> bool {
        matches!(state(store, key).await, Some(RecordState::Completed { .. }))
    }

    async fn is_in_progress(store: &MemoryStore, key: &str) -> bool {
        matches!(
            state(store, key).await,
            Some(RecordState::InProgress { .. })
        )
    }

    fn body(len: usize) -> StoredResponse {
        StoredResponse::new(200, vec![], vec![b'x'; len])
    }

    /// What a record of scope `s` and a one-character key counts, in progress.
    const CLAIMED: usize = MemoryStore::RECORD_OVERHEAD + 2;

    #[tokio::test]
    async fn eviction_takes_the_oldest_completion_first() {
        let store = MemoryStore::builder().max_records(3).shards(4).build();
        let (a, b, c) = (
            claim(&store, "a").await,
            claim(&store, "b").await,
            claim(&store, "c").await,
        );
        // Completed in the order c, a, b: the claims' order does not count.
        for claim in [&c, &a, &b] {
            store.complete(claim, &body(1), RETENTION).await.unwrap();
        }
        claim(&store, "d").await;
        assert_eq!(state(&store, "c").await, None, "c completed first");
        claim(&store, "e").await;
        assert_eq!(state(&store, "a").await, None, "a completed second");
        assert!(is_completed(&store, "b").await);
        assert!(is_in_progress(&store, "d").await);
        assert!(is_in_progress(&store, "e").await);
        assert_eq!(store.len(), 3);
    }

    #[tokio::test]
    async fn a_store_full_of_claims_answers_full() {
        let store = MemoryStore::builder().max_records(2).build();
        let a = claim(&store, "a").await;
        claim(&store, "b").await;
        assert!(matches!(
            store.claim(&request("c")).await,
            Err(StoreError::Full)
        ));
        assert!(
            is_in_progress(&store, "a").await,
            "claims are never evicted"
        );
        assert!(
            is_in_progress(&store, "b").await,
            "claims are never evicted"
        );

        store.complete(&a, &body(1), RETENTION).await.unwrap();
        claim(&store, "c").await;
        assert_eq!(
            state(&store, "a").await,
            None,
            "the completed record made room"
        );
        assert!(is_in_progress(&store, "b").await);
        assert_eq!(store.len(), 2);
    }

    #[tokio::test]
    async fn bytes_bound_evicts_completed_records() {
        let completed = CLAIMED + 1000;
        // Room for two completed records and one claim.
        let store = MemoryStore::builder()
            .max_bytes(2 * completed + CLAIMED)
            .build();
        for key in ["a", "b"] {
            let claim = claim(&store, key).await;
            store
                .complete(&claim, &body(1000), RETENTION)
                .await
                .unwrap();
        }
        let c = claim(&store, "c").await;
        assert_eq!(
            store.used_bytes(),
            2 * completed + CLAIMED,
            "a claim fits exactly"
        );

        store.complete(&c, &body(1000), RETENTION).await.unwrap();
        assert_eq!(
            state(&store, "a").await,
            None,
            "the oldest completion made room"
        );
        assert!(is_completed(&store, "b").await);
        assert!(is_completed(&store, "c").await);
        assert_eq!(store.used_bytes(), 2 * completed);
    }

    #[tokio::test]
    async fn claims_fill_the_byte_bound() {
        let store = MemoryStore::builder().max_bytes(2 * CLAIMED).build();
        claim(&store, "a").await;
        claim(&store, "b").await;
        assert!(matches!(
            store.claim(&request("c")).await,
            Err(StoreError::Full)
        ));
        assert_eq!(store.used_bytes(), 2 * CLAIMED);
    }

    #[tokio::test]
    async fn a_response_larger_than_the_store_is_kept_without_body() {
        let store = MemoryStore::builder().max_bytes(CLAIMED + 500).build();
        let a = claim(&store, "a").await;
        let headers = vec![Header::new("location", "/charges/1")];
        let response = StoredResponse::new(201, headers.clone(), vec![7; 1000]);
        store.complete(&a, &response, RETENTION).await.unwrap();
        assert_eq!(
            state(&store, "a").await,
            Some(RecordState::Completed {
                response: StoredResponse::without_body(201, headers)
            }),
            "a retry is told the response was not kept, and never runs the handler again"
        );
    }

    #[tokio::test]
    async fn bytes_count_key_scope_headers_and_body() {
        let store = MemoryStore::new();
        let a = claim(&store, "a").await;
        assert_eq!(
            store.used_bytes(),
            MemoryStore::RECORD_OVERHEAD + "s".len() + "a".len()
        );
        let response = StoredResponse::new(
            201,
            vec![
                Header::new("set-cookie", "a=1"),
                Header::new("set-cookie", "b=2"),
            ],
            "body",
        );
        store.complete(&a, &response, RETENTION).await.unwrap();
        let headers = 2 * (size_of::<Header>() + "set-cookie".len() + "a=1".len());
        assert_eq!(store.used_bytes(), CLAIMED + headers + "body".len());

        let b = claim(&store, "b").await;
        assert_eq!(store.len(), 2);
        store.release(&b).await.unwrap();
        assert_eq!(store.used_bytes(), CLAIMED + headers + "body".len());
        assert_eq!(store.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn leases_lapse_and_records_expire_on_the_tokio_clock() {
        let store = MemoryStore::new();
        let first = claim(&store, "a").await;
        tokio::time::advance(LEASE - Duration::from_millis(1)).await;
        assert!(matches!(
            store.claim(&request("a")).await.unwrap(),
            ClaimOutcome::InProgress { .. }
        ));
        tokio::time::advance(Duration::from_millis(1)).await;
        let second = claim(&store, "a").await;
        assert!(matches!(
            store.renew(&first, LEASE).await,
            Err(StoreError::StaleOwner)
        ));

        store.complete(&second, &body(3), RETENTION).await.unwrap();
        tokio::time::advance(RETENTION - Duration::from_millis(1)).await;
        assert!(is_completed(&store, "a").await);
        assert_eq!(store.len(), 1);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(store.len(), 1, "expiry is lazy");
        assert_eq!(state(&store, "a").await, None);
        assert_eq!((store.len(), store.used_bytes()), (0, 0), "load removed it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapsed_owner_not_yet_replaced_may_still_complete() {
        let store = MemoryStore::new();
        let claim = claim(&store, "a").await;
        tokio::time::advance(2 * LEASE).await;
        assert!(
            is_in_progress(&store, "a").await,
            "load still shows the lapsed claim"
        );
        store.renew(&claim, LEASE).await.unwrap();
        store.complete(&claim, &body(1), RETENTION).await.unwrap();
        assert!(is_completed(&store, "a").await);
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_make_room_before_completed_ones() {
        let store = MemoryStore::builder().max_records(2).build();
        let a = claim(&store, "a").await;
        store.complete(&a, &body(1), RETENTION).await.unwrap();
        let b = claim(&store, "b").await;
        store
            .complete(&b, &body(1), Duration::from_secs(1))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        claim(&store, "c").await;
        assert!(
            is_completed(&store, "a").await,
            "the expired b made room, not a"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn delete_expired_takes_records_in_expiry_order() {
        let store = MemoryStore::builder().shards(1).build();
        for (key, retention) in [("a", 3), ("b", 1), ("c", 2)] {
            let claim = claim(&store, key).await;
            let retention = Duration::from_secs(retention);
            store.complete(&claim, &body(1), retention).await.unwrap();
        }
        tokio::time::advance(Duration::from_secs(3)).await;
        let held = || {
            let shard = store.inner.lock(0);
            let mut keys: Vec<String> = shard
                .records
                .keys()
                .map(|k| k.key.as_str().to_owned())
                .collect();
            keys.sort();
            keys
        };
        for remaining in [&["a", "c"][..], &["a"], &[]] {
            assert_eq!(store.delete_expired(1).await.unwrap(), 1);
            assert_eq!(held(), remaining);
        }
        assert_eq!(store.delete_expired(1).await.unwrap(), 0);
        assert_eq!((store.len(), store.used_bytes()), (0, 0));
    }

    /// Runs `changed` for key `a` in the background; answers how long it took.
    fn watch(store: &MemoryStore, poll: Duration) -> tokio::task::JoinHandle<Duration> {
        let store = store.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let key = IdempotencyKey::new("a").unwrap();
            store.changed(&Scope::new("s"), &key, poll).await.unwrap();
            start.elapsed()
        })
    }

    const POLL: Duration = Duration::from_secs(3600);

    #[tokio::test(start_paused = true)]
    async fn changed_wakes_when_the_record_completes() {
        let store = MemoryStore::new();
        let claim = claim(&store, "a").await;
        let waiter = watch(&store, POLL);
        tokio::time::sleep(Duration::from_secs(1)).await;
        store.complete(&claim, &body(1), RETENTION).await.unwrap();
        assert_eq!(waiter.await.unwrap(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn changed_wakes_when_the_record_is_released() {
        let store = MemoryStore::new();
        let claim = claim(&store, "a").await;
        let waiter = watch(&store, POLL);
        tokio::time::sleep(Duration::from_secs(2)).await;
        store.release(&claim).await.unwrap();
        assert_eq!(waiter.await.unwrap(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn changed_wakes_when_the_lease_lapses() {
        let store = MemoryStore::new();
        claim(&store, "a").await;
        assert_eq!(watch(&store, POLL).await.unwrap(), LEASE);
        assert_eq!(
            watch(&store, POLL).await.unwrap(),
            Duration::ZERO,
            "lapsed: at once"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn changed_waits_at_most_poll() {
        let store = MemoryStore::new();
        claim(&store, "a").await;
        let poll = Duration::from_secs(3);
        assert_eq!(watch(&store, poll).await.unwrap(), poll);
    }

    #[tokio::test(start_paused = true)]
    async fn changed_answers_at_once_unless_in_progress() {
        let store = MemoryStore::new();
        assert_eq!(watch(&store, POLL).await.unwrap(), Duration::ZERO, "absent");
        let claim = claim(&store, "a").await;
        store.complete(&claim, &body(1), RETENTION).await.unwrap();
        assert_eq!(
            watch(&store, POLL).await.unwrap(),
            Duration::ZERO,
            "completed"
        );
    }

    async fn complete_in(store: &MemoryStore, scope: &str, key: &str, body_len: usize) {
        let request = ClaimRequest {
            scope: Scope::new(scope),
            ..request(key)
        };
        let ClaimOutcome::Claimed(claim) = store.claim(&request).await.unwrap() else {
            panic!("{scope}/{key} was not claimed");
        };
        store
            .complete(&claim, &body(body_len), RETENTION)
            .await
            .unwrap();
    }

    async fn is_completed_in(store: &MemoryStore, scope: &str, key: &str) -> bool {
        let key = IdempotencyKey::new(key).unwrap();
        let record = store.load(&Scope::new(scope), &key).await.unwrap();
        matches!(
            record.map(|record| record.state),
            Some(RecordState::Completed { .. })
        )
    }

    #[tokio::test]
    async fn large_responses_of_one_scope_do_not_evict_another_scope_within_its_share() {
        // Room for four completed records: each scope's share is two.
        let completed = CLAIMED + 1000;
        let store = MemoryStore::builder().max_bytes(4 * completed).build();
        complete_in(&store, "q", "a", 1000).await;
        for key in 'a'..='t' {
            complete_in(&store, "h", &key.to_string(), 1000).await;
        }
        assert!(
            is_completed_in(&store, "q", "a").await,
            "the oldest completion, but its scope is within its share"
        );
        for key in ["r", "s", "t"] {
            assert!(is_completed_in(&store, "h", key).await, "{key}");
        }
        assert!(
            !is_completed_in(&store, "h", "q").await,
            "h evicted its own"
        );
        assert_eq!(store.used_bytes(), 4 * completed);
    }

    #[tokio::test]
    async fn many_records_of_one_scope_do_not_evict_another_scope_within_its_share() {
        let store = MemoryStore::builder().max_records(4).build();
        complete_in(&store, "q", "a", 1).await;
        complete_in(&store, "q", "b", 1).await;
        for key in 0..10 {
            complete_in(&store, "h", &key.to_string(), 1).await;
        }
        assert!(is_completed_in(&store, "q", "a").await);
        assert!(is_completed_in(&store, "q", "b").await);
        assert!(is_completed_in(&store, "h", "8").await);
        assert!(is_completed_in(&store, "h", "9").await);
        assert_eq!(store.len(), 4);

        // A scope within its share evicts from the one over it.
        let store = MemoryStore::builder().max_records(4).build();
        for key in 0..4 {
            complete_in(&store, "h", &key.to_string(), 1).await;
        }
        complete_in(&store, "q", "a", 1).await;
        complete_in(&store, "q", "b", 1).await;
        assert!(!is_completed_in(&store, "h", "0").await);
        assert!(!is_completed_in(&store, "h", "1").await);
        assert!(is_completed_in(&store, "h", "2").await);
        assert!(is_completed_in(&store, "q", "a").await);
        assert!(is_completed_in(&store, "q", "b").await);
    }

    #[tokio::test]
    async fn clones_share_records() {
        let store = MemoryStore::new();
        let clone = store.clone();
        claim(&store, "a").await;
        assert!(is_in_progress(&clone, "a").await);
        assert_eq!(clone.len(), 1);
    }
}
