//! The in-memory store.

use std::collections::VecDeque;
use std::fmt;
use std::hash::BuildHasher;

/// The store's hasher: foldhash (hashbrown's default; seeded per store, fast on
/// short keys), in place of std's SipHash, which cost a few thousand
/// instructions per request on the key hashed at every step.
type RandomState = foldhash::fast::RandomState;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use hashbrown::HashTable;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Claim, ClaimOutcome, ClaimRequest, OwnerToken, Record, RecordState};
use super::{Store, StoreError, StoreFuture};
use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

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
/// scope, every header name and value (and 8 bytes of their lengths) and the body
/// of each record, plus
/// [`RECORD_OVERHEAD`](Self::RECORD_OVERHEAD) bytes per record.
///
/// **It never evicts a record for room**, in progress or completed: a completed
/// record within its retention is what turns a retry into a replay, and
/// evicting it would let the retry run the handler a second time. When a claim
/// needs room, the store removes expired records; when there are none, the
/// claim answers [`StoreError::Full`], which the engine answers `503
/// store-unavailable` with `Retry-After` (fail closed, as for an outage;
/// `docs/contract.md` §6). Room comes back as records expire. A response that
/// does not fit is kept without its body (`replayable: false`), so its retry
/// gets a problem answer, never a second execution.
///
/// However many scopes a client opens, none can make another scope's retries
/// run twice: nothing is evicted. What a full store costs is new claims, for
/// everyone; a per-scope quota ([`max_scope_records`](MemoryStoreBuilder::max_scope_records),
/// [`max_scope_bytes`](MemoryStoreBuilder::max_scope_bytes), none by default)
/// keeps one scope from filling the store for the others: a scope at its quota
/// has its own new claims refused the same way, and its responses kept without
/// their bodies. [`len`](MemoryStore::len) and [`used_bytes`](MemoryStore::used_bytes)
/// show the store filling, and with the `metrics` feature every refusal counts
/// in `idem_store_full_total{limit}` (`records`, `bytes`, `scope_records`,
/// `scope_bytes`).
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
    max_scope_records: usize,
    max_scope_bytes: usize,
    shards: usize,
}

impl MemoryStore {
    /// The bytes each record counts on top of its key, scope, header fields (each
    /// counted as its name, its value and 8 bytes of lengths) and body: its slot
    /// (32 B) and table entry (8 B and a control byte, the table 7/16 to 7/8
    /// full), the fixed head of its buffer (24 B and the 32-byte fingerprint),
    /// the allocator's header and rounding, and its entries in the expiry queue
    /// (8 B), with their spare capacity.
    ///
    /// Measured, not guessed: `cargo xtask bench` prints the resident bytes per
    /// record beside the counted ones. With 200-byte bodies, UUID keys, one
    /// header field and 100 scopes, a record takes 424–432 B of RSS at 300 k,
    /// 700 k and 1 M records, of which 281 B are key, scope, header and body; so
    /// `max_bytes` bounds the memory really used within a few percent. A record
    /// in progress holds a claim of about 120 B in place of its buffer; it
    /// counts the same overhead.
    pub const RECORD_OVERHEAD: usize = 130;

    /// A store with the default bounds: 1,000,000 records, 512 MiB, 16 shards.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configures bounds and sharding.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_records: 1_000_000,
            max_bytes: 512 * 1024 * 1024,
            max_scope_records: usize::MAX,
            max_scope_bytes: usize::MAX,
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

    /// The most records one scope holds (default: no bound but
    /// [`max_records`](Self::max_records)). A scope at its quota has its new
    /// claims refused ([`StoreError::Full`]), so it cannot fill the store for the
    /// other scopes.
    pub fn max_scope_records(mut self, max_scope_records: usize) -> Self {
        self.max_scope_records = max_scope_records;
        self
    }

    /// The most bytes one scope's records count (default: no bound but
    /// [`max_bytes`](Self::max_bytes)). A scope at its quota has its new claims
    /// refused, and a response that would take it over is kept without its body.
    pub fn max_scope_bytes(mut self, max_scope_bytes: usize) -> Self {
        self.max_scope_bytes = max_scope_bytes;
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
        let hasher = RandomState::default();
        let shards = (0..self.shards.max(1))
            .map(|_| Mutex::new(Shard::new(hasher.clone())))
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                hasher,
                max_records: self.max_records,
                max_bytes: self.max_bytes,
                max_scope_records: self.max_scope_records,
                max_scope_bytes: self.max_scope_bytes,
                records: AtomicUsize::new(0),
                bytes: AtomicUsize::new(0),
                scopes: ScopeTable::new(self.shards.max(1)),
                generation: AtomicU32::new(0),
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
            .field("max_scope_records", &self.inner.max_scope_records)
            .field("max_scope_bytes", &self.inner.max_scope_bytes)
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
        Box::pin(std::future::ready(self.inner.load(scope, key)))
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
            let name = Name::new(scope, key);
            let Some((notify, _)) = self.inner.watch(&name, None) else {
                return Ok(());
            };
            let mut notified = pin!(notify.notified());
            notified.as_mut().enable();
            // The record may have changed between the first look and `enable`: look
            // again now that no wake-up can be lost.
            let Some((_, lease_until)) = self.inner.watch(&name, Some(&notify)) else {
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

/// Durations are clamped to a century so that times never overflow.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A time on the store's clock: nanoseconds since the store was built.
type Nanos = u64;

/// Distinct retentions that get a queue of their own in a shard; records of
/// further retentions go to the shard's unordered list.
const RETENTION_QUEUES: usize = 16;

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    max_records: usize,
    max_bytes: usize,
    max_scope_records: usize,
    max_scope_bytes: usize,
    records: AtomicUsize,
    bytes: AtomicUsize,
    /// What each scope holds, for the per-scope quotas.
    scopes: ScopeTable,
    /// Numbers each version of a record, so that an index entry left behind by an
    /// older version is recognised (wrapping: an entry lives far shorter than 2^32
    /// versions of its slot).
    generation: AtomicU32,
    clock: Clock,
}

/// Maps the store's [`Nanos`] to Tokio instants and wall-clock times, from one
/// reading of both.
struct Clock {
    instant: Instant,
    system: SystemTime,
}

/// `(scope, key)` as the store hashes and compares it.
struct Name<'a> {
    scope: &'a [u8],
    key: &'a [u8],
}

/// One lock's worth of records.
///
/// A record lives in a slot of `slots`; `table` maps its name to the slot's
/// index and 32 bits of the name's hash (8 bytes per entry), and the expiry
/// queues hold [`Ref`]s (8 bytes). Nothing else holds a copy of the name. The
/// hash bits in the table let it grow without reading a record (a rehash that
/// recomputed each hash from its record would stall the shard's lock for
/// milliseconds at a million records, a cache miss per record) and let a
/// lookup skip a record whose bits differ.
struct Shard {
    hasher: RandomState,
    table: HashTable<(u32, u32)>,
    slots: Vec<Slot>,
    /// Indexes of empty slots, reused first.
    free: Vec<u32>,
    /// Completed records, one FIFO per distinct retention: records of one
    /// retention expire in the order they completed.
    queues: Vec<RetentionQueue>,
    /// In-progress records and completed ones of a retention beyond
    /// [`RETENTION_QUEUES`]: swept whole.
    loose: Vec<Ref>,
    /// When a list grows to these lengths, its stale entries are dropped.
    queued_limit: usize,
    loose_limit: usize,
}

struct RetentionQueue {
    retention: Nanos,
    refs: VecDeque<Ref>,
}

/// A version of the record in a slot; stale once the slot holds another.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Ref {
    slot: u32,
    generation: u32,
}

/// A record. Completed, it is one buffer (see [`Blob`]), which replays hand out
/// slices of; in progress, a box of what the claim holds. An empty buffer marks a
/// free slot.
enum Slot {
    Completed(Bytes),
    InProgress(Box<Pending>),
}

struct Pending {
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    owner: OwnerToken,
    generation: u32,
    expires_at: Nanos,
    lease_until: Nanos,
    /// Wakes the requests waiting in `changed` when the record leaves this state;
    /// made by the first of them.
    changed: Option<Arc<Notify>>,
}

/// The layout of a completed record's buffer: a fixed head, then the
/// fingerprint, the scope, the key, the encoded header fields
/// ([`StoredResponse::encode_headers`]) and the body.
struct Blob;

impl Blob {
    const EXPIRES_AT: usize = 0; // u64
    const GENERATION: usize = 8; // u32
    const HEADERS_LEN: usize = 12; // u32
    const SCOPE_LEN: usize = 16; // u32
    const STATUS: usize = 20; // u16
    const KEY_LEN: usize = 22; // u8
    const FLAGS: usize = 23; // u8: bit 0, replayable
    const FINGERPRINT: usize = 24;
    const SCOPE: usize = 56;

    #[allow(clippy::too_many_arguments)]
    fn encode(
        name: &Name<'_>,
        fingerprint: &Fingerprint,
        generation: u32,
        expires_at: Nanos,
        response: &StoredResponse,
        headers_len: usize,
        keep_body: bool,
    ) -> Bytes {
        let body: &[u8] = if keep_body { &response.body } else { &[] };
        let len = Self::SCOPE + name.scope.len() + name.key.len() + headers_len + body.len();
        let mut blob = Vec::with_capacity(len);
        blob.extend_from_slice(&expires_at.to_le_bytes());
        blob.extend_from_slice(&generation.to_le_bytes());
        blob.extend_from_slice(&(headers_len as u32).to_le_bytes());
        blob.extend_from_slice(&(name.scope.len() as u32).to_le_bytes());
        blob.extend_from_slice(&response.status.to_le_bytes());
        // Keys are at most 255 bytes long.
        blob.push(name.key.len() as u8);
        blob.push(u8::from(keep_body && response.replayable));
        blob.extend_from_slice(fingerprint.as_bytes());
        blob.extend_from_slice(name.scope);
        blob.extend_from_slice(name.key);
        response.encode_headers_into(&mut blob);
        blob.extend_from_slice(body);
        // Exactly as long as its allocation, so `Bytes` takes it without copying.
        Bytes::from(blob)
    }

    fn u32_at(blob: &[u8], at: usize) -> u32 {
        let mut bytes = [0; 4];
        bytes.copy_from_slice(&blob[at..at + 4]);
        u32::from_le_bytes(bytes)
    }

    fn expires_at(blob: &[u8]) -> Nanos {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(&blob[Self::EXPIRES_AT..Self::EXPIRES_AT + 8]);
        u64::from_le_bytes(bytes)
    }

    fn generation(blob: &[u8]) -> u32 {
        Self::u32_at(blob, Self::GENERATION)
    }

    fn scope(blob: &[u8]) -> &[u8] {
        let len = Self::u32_at(blob, Self::SCOPE_LEN) as usize;
        &blob[Self::SCOPE..Self::SCOPE + len]
    }

    fn key_range(blob: &[u8]) -> std::ops::Range<usize> {
        let start = Self::SCOPE + Self::u32_at(blob, Self::SCOPE_LEN) as usize;
        start..start + usize::from(blob[Self::KEY_LEN])
    }

    fn fingerprint(blob: &[u8]) -> Fingerprint {
        let mut bytes = [0; 32];
        bytes.copy_from_slice(&blob[Self::FINGERPRINT..Self::FINGERPRINT + 32]);
        Fingerprint::from_bytes(bytes)
    }

    /// The stored answer; its header values and body are slices of `blob`.
    fn response(blob: &Bytes) -> Result<StoredResponse, StoreError> {
        let headers_start = Self::key_range(blob).end;
        let body_start = headers_start + Self::u32_at(blob, Self::HEADERS_LEN) as usize;
        let headers = StoredResponse::decode_shared_headers(blob, headers_start..body_start)
            .ok_or_else(|| StoreError::Corrupt("an in-memory record's headers".to_owned()))?;
        Ok(StoredResponse {
            status: u16::from_le_bytes([blob[Self::STATUS], blob[Self::STATUS + 1]]),
            headers,
            body: blob.slice(body_start..),
            replayable: blob[Self::FLAGS] & 1 == 1,
        })
    }
}

impl Slot {
    const FREE: Slot = Slot::Completed(Bytes::new());

    fn name(&self) -> Name<'_> {
        match self {
            Slot::Completed(blob) if blob.is_empty() => Name {
                scope: &[],
                key: &[],
            },
            Slot::Completed(blob) => Name {
                scope: Blob::scope(blob),
                key: &blob[Blob::key_range(blob)],
            },
            Slot::InProgress(pending) => Name::new(&pending.scope, &pending.key),
        }
    }

    fn generation(&self) -> Option<u32> {
        match self {
            Slot::Completed(blob) if blob.is_empty() => None,
            Slot::Completed(blob) => Some(Blob::generation(blob)),
            Slot::InProgress(pending) => Some(pending.generation),
        }
    }

    /// What the record counts against `max_bytes`.
    fn size(&self) -> usize {
        match self {
            Slot::Completed(blob) => MemoryStore::RECORD_OVERHEAD + blob.len() - Blob::SCOPE,
            Slot::InProgress(pending) => claim_size(&pending.scope, &pending.key),
        }
    }

    /// When the record expires (in progress, its lease may outlast that).
    fn expires_at(&self) -> Nanos {
        match self {
            Slot::Completed(blob) if blob.is_empty() => 0,
            Slot::Completed(blob) => Blob::expires_at(blob),
            Slot::InProgress(pending) => pending.expires_at,
        }
    }

    /// Expired records count as absent. One in progress also needs its lease
    /// lapsed: a handler that renews its lease past the retention keeps its record.
    fn is_expired(&self, now: Nanos) -> bool {
        match self {
            Slot::Completed(blob) => blob.is_empty() || now >= Blob::expires_at(blob),
            Slot::InProgress(pending) => now >= pending.expires_at && now >= pending.lease_until,
        }
    }

    /// Whether `owner` holds the record in progress. An owner whose lease lapsed
    /// still holds it until another request claims it or it expires: the token
    /// fences, and no other request ran the handler meanwhile.
    fn is_held_by(&self, owner: OwnerToken, now: Nanos) -> bool {
        !self.is_expired(now) && matches!(self, Slot::InProgress(pending) if pending.owner == owner)
    }

    /// Wakes the requests waiting for this record in progress to change.
    fn settle(self) {
        if let Slot::InProgress(pending) = self
            && let Some(changed) = pending.changed
        {
            changed.notify_waiters();
        }
    }
}

impl<'a> Name<'a> {
    fn new(scope: &'a Scope, key: &'a IdempotencyKey) -> Self {
        Self {
            scope: scope.as_str().as_bytes(),
            key: key.as_str().as_bytes(),
        }
    }

    fn hash(&self, hasher: &RandomState) -> u64 {
        hasher.hash_one((self.scope, self.key))
    }

    fn is(&self, other: &Name<'_>) -> bool {
        self.key == other.key && self.scope == other.scope
    }
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

/// What a claim counts against `max_bytes`.
fn claim_size(scope: &Scope, key: &IdempotencyKey) -> usize {
    MemoryStore::RECORD_OVERHEAD + scope.as_str().len() + key.as_str().len()
}

impl Inner {
    fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
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

    fn renew(&self, claim: &Claim, lease: Duration) -> Result<(), StoreError> {
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

    fn complete(
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

    fn release(&self, claim: &Claim) -> Result<(), StoreError> {
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

    fn load(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
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

    fn delete_expired(&self, batch: usize) -> u64 {
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
    fn watch(&self, name: &Name<'_>, same: Option<&Arc<Notify>>) -> Option<(Arc<Notify>, Instant)> {
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

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // Shard updates do not panic halfway, so a poisoned shard is still consistent.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The 32 bits of a name's hash a shard's table keeps (the shard was chosen by
/// the other 32).
fn table_bits(hash: u64) -> u32 {
    hash as u32
}

/// The table's hash of `bits`: spread over 64 bits (the table indexes by the
/// low bits and tags by the top 7), the same whether computed from the name or
/// from the table's entry.
fn spread(bits: u32) -> u64 {
    u64::from(bits).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Shard {
    fn new(hasher: RandomState) -> Self {
        Self {
            hasher,
            table: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            queues: Vec::new(),
            loose: Vec::new(),
            queued_limit: 64,
            loose_limit: 64,
        }
    }

    fn find(&self, hash: u64, name: &Name<'_>) -> Option<u32> {
        let (slots, bits) = (&self.slots, table_bits(hash));
        self.table
            .find(spread(bits), |&(slot, other)| {
                other == bits && slots[slot as usize].name().is(name)
            })
            .map(|&(slot, _)| slot)
    }

    /// Puts a new record in a free slot; answers the slot.
    fn insert(&mut self, hash: u64, record: Slot) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = record;
                slot
            }
            None => {
                self.slots.push(record);
                // A shard never holds 2^32 records: memory runs out long before.
                (self.slots.len() - 1) as u32
            }
        };
        let bits = table_bits(hash);
        self.table
            .insert_unique(spread(bits), (slot, bits), |&(_, bits)| spread(bits));
        slot
    }

    /// Removes the record in `slot` from the shard and its scope's count, and wakes
    /// its waiters; answers what it counted.
    fn remove(&mut self, scopes: &ScopeTable, slot: u32) -> usize {
        let record = &self.slots[slot as usize];
        let hash = spread(table_bits(record.name().hash(&self.hasher)));
        if let Ok(entry) = self.table.find_entry(hash, |&(other, _)| other == slot) {
            entry.remove();
        }
        let record = std::mem::replace(&mut self.slots[slot as usize], Slot::FREE);
        self.free.push(slot);
        let size = record.size();
        scopes.remove(record.name().scope, size);
        record.settle();
        size
    }

    fn is_current(&self, entry: Ref) -> bool {
        self.slots
            .get(entry.slot as usize)
            .is_some_and(|record| record.generation() == Some(entry.generation))
    }

    fn push_loose(&mut self, entry: Ref) {
        if self.loose.len() >= self.loose_limit {
            let mut loose = std::mem::take(&mut self.loose);
            loose.retain(|&entry| self.is_current(entry));
            self.loose = loose;
            self.loose_limit = 2 * self.loose.len() + 64;
        }
        self.loose.push(entry);
    }

    fn push_completed(&mut self, retention: Duration, entry: Ref) {
        let retention = later(0, retention);
        if let Some(queue) = self.queues.iter_mut().find(|q| q.retention == retention) {
            queue.refs.push_back(entry);
        } else if self.queues.len() < RETENTION_QUEUES {
            self.queues.push(RetentionQueue {
                retention,
                refs: VecDeque::from([entry]),
            });
        } else {
            return self.push_loose(entry);
        }
        let queued: usize = self.queues.iter().map(|q| q.refs.len()).sum();
        if queued >= self.queued_limit {
            let mut queues = std::mem::take(&mut self.queues);
            for queue in &mut queues {
                queue.refs.retain(|&entry| self.is_current(entry));
            }
            queues.retain(|queue| !queue.refs.is_empty());
            self.queues = queues;
            let queued: usize = self.queues.iter().map(|q| q.refs.len()).sum();
            self.queued_limit = 2 * queued + 64;
        }
    }

    /// Removes up to `limit` expired records, by expiry and then by write (the
    /// generation); answers how many and their bytes.
    fn remove_expired(&mut self, scopes: &ScopeTable, now: Nanos, limit: usize) -> (usize, usize) {
        let (mut records, mut bytes) = (0, 0);
        // The unordered list's expired records, in order; its stale entries go.
        let mut loose = std::mem::take(&mut self.loose);
        loose.retain(|&entry| self.is_current(entry));
        let mut expired: Vec<(Nanos, u32, Ref)> = loose
            .iter()
            .filter_map(|&entry| {
                let record = &self.slots[entry.slot as usize];
                record
                    .is_expired(now)
                    .then(|| (record.expires_at(), entry.generation, entry))
            })
            .collect();
        self.loose = loose;
        expired.sort_unstable_by_key(|&(at, generation, _)| (at, generation));
        let mut expired = expired.into_iter().peekable();
        while records < limit {
            // The queue whose first current record expires first.
            let mut first: Option<(Nanos, u32, usize)> = None;
            for index in 0..self.queues.len() {
                while let Some(&entry) = self.queues[index].refs.front() {
                    if self.is_current(entry) {
                        let at = self.slots[entry.slot as usize].expires_at();
                        if first.is_none_or(|(earliest, generation, _)| {
                            (at, entry.generation) < (earliest, generation)
                        }) {
                            first = Some((at, entry.generation, index));
                        }
                        break;
                    }
                    self.queues[index].refs.pop_front();
                }
            }
            let queued = first.filter(|&(at, _, _)| at <= now);
            let entry = match (queued, expired.peek()) {
                (Some((at, generation, _)), Some(&(loose_at, loose_generation, entry)))
                    if (loose_at, loose_generation) < (at, generation) =>
                {
                    expired.next();
                    entry
                }
                (Some((_, _, index)), _) => match self.queues[index].refs.pop_front() {
                    Some(entry) => entry,
                    None => break,
                },
                (None, Some(&(_, _, entry))) => {
                    expired.next();
                    entry
                }
                (None, None) => break,
            };
            if self.is_current(entry) {
                bytes += self.remove(scopes, entry.slot);
                records += 1;
            }
        }
        if records > 0 {
            let mut loose = std::mem::take(&mut self.loose);
            loose.retain(|&entry| self.is_current(entry));
            self.loose = loose;
        }
        (records, bytes)
    }
}

/// What each scope holds across every shard, sharded by scope. A shard's lock may
/// be taken while a record shard's lock is held, never the other way round.
struct ScopeTable {
    shards: Box<[Mutex<HashTable<ScopeUsage>>]>,
    hasher: RandomState,
}

/// A scope's records and bytes. Present only while the scope holds a record.
struct ScopeUsage {
    scope: Scope,
    records: usize,
    bytes: usize,
}

impl ScopeTable {
    fn new(shards: usize) -> Self {
        Self {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            hasher: RandomState::default(),
        }
    }

    /// Counts a new record of `size` bytes.
    fn add(&self, scope: &Scope, size: usize) {
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
    fn update(&self, scope: &[u8], change: impl FnOnce(&mut ScopeUsage)) {
        let hash = self.hasher.hash_one(scope);
        let mut shard = self.lock(self.shard_of(hash));
        if let Some(usage) = shard.find_mut(hash, |usage| usage.scope.as_str().as_bytes() == scope)
        {
            change(usage);
        }
    }

    /// Counts a record of `size` bytes gone.
    fn remove(&self, scope: &[u8], size: usize) {
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
    fn usage(&self, scope: &Scope) -> Option<(usize, usize)> {
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

impl Clock {
    fn new() -> Self {
        Self {
            instant: Instant::now(),
            system: SystemTime::now(),
        }
    }

    fn now(&self) -> Nanos {
        nanos(Instant::now().saturating_duration_since(self.instant))
    }

    fn system_time(&self, at: Nanos) -> SystemTime {
        self.system
            .checked_add(Duration::from_nanos(at))
            .unwrap_or(self.system)
    }

    fn instant(&self, at: Nanos) -> Instant {
        self.instant
            .checked_add(Duration::from_nanos(at))
            .unwrap_or(self.instant)
    }
}

fn nanos(duration: Duration) -> Nanos {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// `now + duration`, `duration` clamped to a century.
fn later(now: Nanos, duration: Duration) -> Nanos {
    now.saturating_add(nanos(duration.min(FOREVER)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::Header;

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

    #[test]
    fn a_slot_is_as_small_as_its_buffer_handle() {
        // `RECORD_OVERHEAD` counts on it: a record in progress goes in the spare
        // bits of the completed record's `Bytes`.
        assert_eq!(size_of::<Slot>(), size_of::<Bytes>());
        assert_eq!(size_of::<Ref>(), 8);
    }

    #[tokio::test]
    async fn a_full_store_refuses_claims_and_keeps_every_completed_record() {
        let store = MemoryStore::builder().max_records(3).shards(4).build();
        for key in ["a", "b", "c"] {
            let claim = claim(&store, key).await;
            store.complete(&claim, &body(1), RETENTION).await.unwrap();
        }
        assert!(matches!(
            store.claim(&request("d")).await,
            Err(StoreError::Full)
        ));
        for key in ["a", "b", "c"] {
            assert!(is_completed(&store, key).await, "{key} is never evicted");
        }
        assert_eq!(store.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn room_comes_back_as_records_expire() {
        let store = MemoryStore::builder().max_records(2).build();
        let a = claim(&store, "a").await;
        store
            .complete(&a, &body(1), Duration::from_secs(10))
            .await
            .unwrap();
        claim(&store, "b").await;
        assert!(matches!(
            store.claim(&request("c")).await,
            Err(StoreError::Full)
        ));
        tokio::time::advance(Duration::from_secs(11)).await;
        claim(&store, "c").await;
        assert_eq!(
            state(&store, "a").await,
            None,
            "the expired record made room"
        );
        assert!(
            is_in_progress(&store, "b").await,
            "claims are never evicted"
        );
        assert_eq!(store.len(), 2);
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
        store.complete(&a, &body(1), RETENTION).await.unwrap();
        assert!(
            matches!(store.claim(&request("c")).await, Err(StoreError::Full)),
            "a completed record within its retention is not room"
        );
        assert!(is_completed(&store, "a").await);
        assert!(is_in_progress(&store, "b").await);
    }

    #[tokio::test]
    async fn a_response_over_the_byte_bound_is_kept_without_its_body() {
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
        assert!(is_completed(&store, "a").await, "never evicted");
        assert!(is_completed(&store, "b").await, "never evicted");
        assert_eq!(
            state(&store, "c").await,
            Some(RecordState::Completed {
                response: StoredResponse::without_body(200, vec![])
            }),
            "a retry of c is told its answer was not kept"
        );
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
        // Each field counts its name, its value and their two 4-byte lengths.
        let headers = 2 * (8 + "set-cookie".len() + "a=1".len());
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
                .slots
                .iter()
                .filter_map(|slot| match slot {
                    Slot::Completed(blob) if !blob.is_empty() => {
                        Some(String::from_utf8(blob[Blob::key_range(blob)].to_vec()).unwrap())
                    }
                    _ => None,
                })
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

    /// The attack: a victim completes its charges, then many other scopes
    /// send large answers until the store is full. However many scopes there
    /// are, every one of the victim's records stays (its retries replay), and
    /// the others' claims are refused rather than making room.
    #[tokio::test]
    async fn many_scopes_filling_the_store_never_evict_another_scope() {
        let completed = CLAIMED + 1000;
        let store = MemoryStore::builder().max_bytes(40 * completed).build();
        for key in 0..10 {
            complete_in(&store, "victim", &key.to_string(), 1000).await;
        }
        let mut refused = 0;
        for attacker in 0..100 {
            let scope = format!("attacker-{attacker}");
            for key in 0..3 {
                let request = ClaimRequest {
                    scope: Scope::new(scope.as_str()),
                    ..request(&key.to_string())
                };
                match store.claim(&request).await {
                    Ok(ClaimOutcome::Claimed(claim)) => store
                        .complete(&claim, &body(1000), RETENTION)
                        .await
                        .unwrap(),
                    Err(StoreError::Full) => refused += 1,
                    other => panic!("{other:?}"),
                }
            }
        }
        assert!(refused > 250, "the full store refused claims: {refused}");
        for key in 0..10 {
            assert!(
                is_completed_in(&store, "victim", &key.to_string()).await,
                "the victim's record {key} is kept"
            );
        }
    }

    #[tokio::test]
    async fn a_scope_at_its_quota_is_refused_while_others_claim() {
        let store = MemoryStore::builder()
            .max_scope_records(2)
            .max_scope_bytes(CLAIMED + 1000 + CLAIMED)
            .build();
        complete_in(&store, "h", "a", 1000).await;
        let in_h = |key: &str| ClaimRequest {
            scope: Scope::new("h"),
            ..request(key)
        };
        let b = match store.claim(&in_h("b")).await.unwrap() {
            ClaimOutcome::Claimed(claim) => claim,
            other => panic!("{other:?}"),
        };
        assert!(
            matches!(store.claim(&in_h("c")).await, Err(StoreError::Full)),
            "h holds its quota of records"
        );
        complete_in(&store, "q", "a", 1000).await;
        assert!(
            is_completed_in(&store, "q", "a").await,
            "q is not held back by h"
        );
        store.complete(&b, &body(1000), RETENTION).await.unwrap();
        let kept = store.load(&Scope::new("h"), &b.key).await.unwrap();
        assert!(
            matches!(
                kept.map(|record| record.state),
                Some(RecordState::Completed { response }) if !response.replayable
            ),
            "over h's byte quota, the answer is kept without its body"
        );
        assert!(is_completed_in(&store, "h", "a").await);
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
