//! The in-memory store: [`MemoryStore`], its builder and its [`Store`] impl;
//! the submodules hold its parts.

mod blob;
mod clock;
mod inner;
mod name;
mod retention;
mod scopes;
mod shard;
mod slot;

use std::fmt;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use self::clock::Clock;
use self::inner::Inner;
use self::name::Name;
use self::scopes::ScopeTable;
use self::shard::Shard;
use super::{Claim, ClaimOutcome, ClaimRequest, Record, Store, StoreFuture};
use crate::{IdempotencyKey, Scope, StoredResponse};

/// The store's hasher: foldhash (hashbrown's default; seeded per store, fast on
/// short keys), in place of std's SipHash, which cost a few thousand
/// instructions per request on the key hashed at every step.
type RandomState = foldhash::fast::RandomState;

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
/// claim answers [`StoreError::Full`](super::StoreError::Full), which the
/// engine answers `503 store-unavailable` with `Retry-After` (fail closed, as
/// for an outage; `docs/contract.md` §6). Room comes back as records expire. A response that
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
/// and advance it. Records report times as
/// [`SystemTime`](std::time::SystemTime)s. A lease is live while
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
    /// claims refused ([`StoreError::Full`](super::StoreError::Full)), so it
    /// cannot fill the store for the other scopes.
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::blob::Blob;
    use super::slot::Slot;
    use super::*;
    use crate::store::{OwnerToken, RecordState, StoreError};
    use crate::{Fingerprint, Header};

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
