//! The in-memory store against the conformance suite, and its state machine
//! against a plain model on Tokio's paused clock.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use idem_core::MemoryStore;

async fn fresh_memory_store() -> MemoryStore {
    MemoryStore::new()
}

idem_core::conformance_tests!(fresh_memory_store);

/// The replay cache in front of the in-memory store answers as the store.
mod replay_cache {
    use idem_core::MemoryStore;
    use idem_core::store::ReplayCache;

    async fn fresh_cached_store() -> ReplayCache<MemoryStore> {
        ReplayCache::new(MemoryStore::new(), 100)
    }

    idem_core::conformance_tests!(fresh_cached_store);
}

/// Sequences of claims, renewals, completions, releases, loads, cleanups and clock
/// jumps give the same answers from a [`MemoryStore`] and from a model that is a
/// map with explicit times.
mod state_machine {
    use std::collections::HashMap;
    use std::time::{Duration, SystemTime};

    use idem_core::store::{Claim, ClaimOutcome, ClaimRequest, OwnerToken, Record, RecordState};
    use idem_core::{
        Fingerprint, Header, IdempotencyKey, MemoryStore, Scope, Store, StoreError, StoredResponse,
    };
    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    const LEASE: Duration = Duration::from_secs(10);
    const SHORT_RETENTION: Duration = Duration::from_secs(5);
    const LONG_RETENTION: Duration = Duration::from_secs(100);
    const REQUESTS: usize = 3;
    const SCOPES: [&str; 2] = ["alice", "bob"];

    #[derive(Clone, Debug)]
    enum Op {
        /// Request `request` claims the record of scope `record` with a fresh owner.
        Claim {
            record: usize,
            request: usize,
            fingerprint: u8,
            retention: Duration,
        },
        /// Renews the request's latest claim (granted or not).
        Renew {
            request: usize,
        },
        /// Completes the request's latest claim with a response of `status`.
        Complete {
            request: usize,
            status: u16,
            retention: Duration,
        },
        /// Releases the request's latest claim.
        Release {
            request: usize,
        },
        Load {
            record: usize,
        },
        DeleteExpired {
            batch: usize,
        },
        Advance(Duration),
    }

    /// What a step answered, with times as offsets from the start.
    #[derive(Debug, PartialEq)]
    enum Observed {
        Claimed(Claim),
        InProgress {
            fingerprint: Fingerprint,
            lease_until: Duration,
        },
        Completed {
            fingerprint: Fingerprint,
            response: StoredResponse,
        },
        Done,
        StaleOwner,
        Loaded(Option<Loaded>),
        Deleted(u64),
        Skipped,
    }

    #[derive(Debug, PartialEq)]
    struct Loaded {
        fingerprint: Fingerprint,
        state: ModelState,
        expires_at: Duration,
    }

    #[derive(Clone, Debug, PartialEq)]
    enum ModelState {
        InProgress {
            owner: OwnerToken,
            lease_until: Duration,
        },
        Completed {
            response: StoredResponse,
        },
    }

    #[derive(Clone, Debug)]
    struct ModelRecord {
        fingerprint: Fingerprint,
        state: ModelState,
        expires_at: Duration,
        /// When the record was last written (claimed or completed): cleanup takes
        /// expired records by `(expires_at, written)`.
        written: u64,
    }

    /// The contract, spelled out over a map and a clock that only moves when told.
    #[derive(Default)]
    struct Model {
        now: Duration,
        records: HashMap<usize, ModelRecord>,
        writes: u64,
    }

    impl ModelRecord {
        fn is_expired(&self, now: Duration) -> bool {
            now >= self.expires_at
                && match self.state {
                    ModelState::InProgress { lease_until, .. } => now >= lease_until,
                    ModelState::Completed { .. } => true,
                }
        }

        fn is_held_by(&self, owner: OwnerToken, now: Duration) -> bool {
            !self.is_expired(now)
                && matches!(self.state, ModelState::InProgress { owner: holder, .. } if holder == owner)
        }
    }

    impl Model {
        fn claim(&mut self, record: usize, request: &ClaimRequest) -> Observed {
            let now = self.now;
            if let Some(found) = self.records.get(&record).filter(|r| !r.is_expired(now)) {
                match &found.state {
                    ModelState::InProgress { lease_until, .. } if now < *lease_until => {
                        return Observed::InProgress {
                            fingerprint: found.fingerprint,
                            lease_until: *lease_until,
                        };
                    }
                    ModelState::Completed { response } => {
                        return Observed::Completed {
                            fingerprint: found.fingerprint,
                            response: response.clone(),
                        };
                    }
                    ModelState::InProgress { .. } => {}
                }
            }
            self.records.insert(
                record,
                ModelRecord {
                    fingerprint: request.fingerprint,
                    state: ModelState::InProgress {
                        owner: request.owner,
                        lease_until: now + request.lease,
                    },
                    expires_at: now + request.retention,
                    written: self.writes,
                },
            );
            self.writes += 1;
            Observed::Claimed(request.to_claim())
        }

        fn held(&mut self, record: usize, owner: OwnerToken) -> Option<&mut ModelRecord> {
            let now = self.now;
            self.records
                .get_mut(&record)
                .filter(|r| r.is_held_by(owner, now))
        }

        fn renew(&mut self, record: usize, owner: OwnerToken, lease: Duration) -> Observed {
            let now = self.now;
            match self.held(record, owner) {
                Some(found) => {
                    found.state = ModelState::InProgress {
                        owner,
                        lease_until: now + lease,
                    };
                    Observed::Done
                }
                None => Observed::StaleOwner,
            }
        }

        fn complete(
            &mut self,
            record: usize,
            owner: OwnerToken,
            response: &StoredResponse,
            retention: Duration,
        ) -> Observed {
            let (now, written) = (self.now, self.writes);
            match self.held(record, owner) {
                Some(found) => {
                    found.state = ModelState::Completed {
                        response: response.clone(),
                    };
                    found.expires_at = now + retention;
                    found.written = written;
                    self.writes += 1;
                    Observed::Done
                }
                None => Observed::StaleOwner,
            }
        }

        fn release(&mut self, record: usize, owner: OwnerToken) -> Observed {
            if self.held(record, owner).is_none() {
                return Observed::StaleOwner;
            }
            self.records.remove(&record);
            Observed::Done
        }

        fn load(&mut self, record: usize) -> Observed {
            let now = self.now;
            let Some(found) = self.records.get(&record) else {
                return Observed::Loaded(None);
            };
            if found.is_expired(now) {
                // The store removes an expired record it comes across.
                self.records.remove(&record);
                return Observed::Loaded(None);
            }
            Observed::Loaded(Some(Loaded {
                fingerprint: found.fingerprint,
                state: found.state.clone(),
                expires_at: found.expires_at,
            }))
        }

        fn delete_expired(&mut self, batch: usize) -> Observed {
            let now = self.now;
            // Which expired records go first shows only in how many remain: a
            // single-shard store takes them by expiry, then by write.
            let mut expired: Vec<(Duration, u64, usize)> = self
                .records
                .iter()
                .filter(|(_, r)| r.is_expired(now))
                .map(|(&record, r)| (r.expires_at, r.written, record))
                .collect();
            expired.sort_unstable();
            expired.truncate(batch);
            for (_, _, record) in &expired {
                self.records.remove(record);
            }
            Observed::Deleted(expired.len() as u64)
        }
    }

    /// The store's answers, with its wall-clock times turned into offsets from
    /// `start` (the store's time when the sequence began).
    struct Observer {
        store: MemoryStore,
        start: SystemTime,
    }

    impl Observer {
        fn offset(&self, at: SystemTime) -> Duration {
            at.duration_since(self.start)
                .expect("the store's times are after the start")
        }

        fn step(&self, result: Result<(), StoreError>) -> Observed {
            match result {
                Ok(()) => Observed::Done,
                Err(StoreError::StaleOwner) => Observed::StaleOwner,
                Err(error) => panic!("unexpected store error: {error}"),
            }
        }

        fn claim_outcome(&self, outcome: ClaimOutcome) -> Observed {
            match outcome {
                ClaimOutcome::Claimed(claim) => Observed::Claimed(claim),
                ClaimOutcome::InProgress {
                    fingerprint,
                    lease_until,
                } => Observed::InProgress {
                    fingerprint,
                    lease_until: self.offset(lease_until),
                },
                ClaimOutcome::Completed {
                    fingerprint,
                    response,
                } => Observed::Completed {
                    fingerprint,
                    response,
                },
            }
        }

        fn loaded(&self, record: Option<Record>) -> Observed {
            Observed::Loaded(record.map(|record| Loaded {
                fingerprint: record.fingerprint,
                state: match record.state {
                    RecordState::InProgress { owner, lease_until } => ModelState::InProgress {
                        owner,
                        lease_until: self.offset(lease_until),
                    },
                    RecordState::Completed { response } => ModelState::Completed { response },
                },
                expires_at: self.offset(record.expires_at),
            }))
        }
    }

    fn scope(record: usize) -> Scope {
        Scope::new(SCOPES[record])
    }

    fn key() -> IdempotencyKey {
        IdempotencyKey::new("order-1").unwrap()
    }

    fn response(request: usize, status: u16) -> StoredResponse {
        StoredResponse::new(
            status,
            vec![
                Header::new("x-request", request.to_string()),
                Header::new("set-cookie", "a=1"),
                Header::new("set-cookie", "b=2"),
            ],
            format!("request {request} answered {status}"),
        )
    }

    fn retention() -> impl Strategy<Value = Duration> {
        prop_oneof![Just(SHORT_RETENTION), Just(LONG_RETENTION)]
    }

    fn op() -> impl Strategy<Value = Op> {
        let request = 0..REQUESTS;
        prop_oneof![
            4 => (0..SCOPES.len(), request.clone(), 1..=2u8, retention()).prop_map(
                |(record, request, fingerprint, retention)| Op::Claim {
                    record,
                    request,
                    fingerprint,
                    retention,
                }
            ),
            2 => request.clone().prop_map(|request| Op::Renew { request }),
            2 => (request.clone(), prop_oneof![Just(201u16), Just(409)], retention()).prop_map(
                |(request, status, retention)| Op::Complete {
                    request,
                    status,
                    retention,
                }
            ),
            1 => request.prop_map(|request| Op::Release { request }),
            2 => (0..SCOPES.len()).prop_map(|record| Op::Load { record }),
            1 => (1..=3usize).prop_map(|batch| Op::DeleteExpired { batch }),
            3 => prop_oneof![
                Just(Duration::from_secs(1)),
                Just(SHORT_RETENTION),
                Just(LEASE),
                Just(LONG_RETENTION),
            ]
            .prop_map(Op::Advance),
        ]
    }

    async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
        // One shard, so that a partial cleanup takes the records the model takes.
        let store = MemoryStore::builder().shards(1).build();
        // The store's wall-clock reading of "now", from a record's expiry.
        let reference = ClaimRequest {
            scope: Scope::new("reference"),
            key: key(),
            fingerprint: Fingerprint::from_bytes([0; 32]),
            owner: OwnerToken::random(),
            lease: LEASE,
            retention: LONG_RETENTION,
        };
        store.claim(&reference).await.unwrap();
        let record = store
            .load(&reference.scope, &reference.key)
            .await
            .unwrap()
            .expect("a claimed record loads");
        store.release(&reference.to_claim()).await.unwrap();
        let start = record.expires_at - LONG_RETENTION;
        let observer = Observer { store, start };
        let store = &observer.store;

        let mut model = Model::default();
        // Each request's latest claim and the record it is for, granted or not.
        let mut latest: [Option<(usize, Claim)>; REQUESTS] = Default::default();
        for (step, op) in ops.into_iter().enumerate() {
            let (expected, actual) = match op.clone() {
                Op::Claim {
                    record,
                    request,
                    fingerprint,
                    retention,
                } => {
                    let claim_request = ClaimRequest {
                        scope: scope(record),
                        key: key(),
                        fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
                        owner: OwnerToken::random(),
                        lease: LEASE,
                        retention,
                    };
                    latest[request] = Some((record, claim_request.to_claim()));
                    let actual = observer.claim_outcome(store.claim(&claim_request).await.unwrap());
                    (model.claim(record, &claim_request), actual)
                }
                Op::Renew { request } => match &latest[request] {
                    Some((record, claim)) => (
                        model.renew(*record, claim.owner, LEASE),
                        observer.step(store.renew(claim, LEASE).await),
                    ),
                    None => (Observed::Skipped, Observed::Skipped),
                },
                Op::Complete {
                    request,
                    status,
                    retention,
                } => match &latest[request] {
                    Some((record, claim)) => {
                        let response = response(request, status);
                        (
                            model.complete(*record, claim.owner, &response, retention),
                            observer.step(store.complete(claim, &response, retention).await),
                        )
                    }
                    None => (Observed::Skipped, Observed::Skipped),
                },
                Op::Release { request } => match &latest[request] {
                    Some((record, claim)) => (
                        model.release(*record, claim.owner),
                        observer.step(store.release(claim).await),
                    ),
                    None => (Observed::Skipped, Observed::Skipped),
                },
                Op::Load { record } => (
                    model.load(record),
                    observer.loaded(store.load(&scope(record), &key()).await.unwrap()),
                ),
                Op::DeleteExpired { batch } => (
                    model.delete_expired(batch),
                    Observed::Deleted(store.delete_expired(batch).await.unwrap()),
                ),
                Op::Advance(by) => {
                    model.now += by;
                    tokio::time::advance(by).await;
                    (Observed::Skipped, Observed::Skipped)
                }
            };
            prop_assert_eq!(
                actual,
                expected,
                "step {} ({:?}) at {:?}",
                step,
                op,
                model.now
            );
            prop_assert_eq!(
                store.len(),
                model.records.len(),
                "records held after step {} ({:?})",
                step,
                op
            );
        }
        if model.records.is_empty() {
            prop_assert_eq!(store.used_bytes(), 0, "an empty store counts no bytes");
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn memory_store_follows_the_model(ops in vec(op(), 1..80)) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(run(ops))?;
        }
    }
}
