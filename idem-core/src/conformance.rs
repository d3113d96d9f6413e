//! The conformance suite every store passes (feature `test-util`).
//!
//! A store only makes each step of the state machine atomic, but every step must
//! mean the same in every store: exactly one winner of a claim race, fencing by
//! owner token, lapsed leases and expired records counting as new, byte-exact
//! replays, isolated scopes, exact cleanup counts. The suite checks each of these
//! as a [`Case`]; [`cases`] lists them.
//!
//! # Running it against a store
//!
//! In an integration test of the store's crate (with `idem-core`'s `test-util`
//! feature enabled for tests), write an async function that answers a **fresh,
//! empty** store (a new database or schema, a truncated table…) and hand it to
//! [`conformance_tests!`](crate::conformance_tests). The macro writes one test per
//! case, each on a multi-threaded Tokio runtime with 2 workers, so a failure names
//! the broken behaviour:
//!
//! ```
//! // tests/conformance.rs
//! use idem_core::MemoryStore;
//!
//! async fn fresh_store() -> MemoryStore {
//!     MemoryStore::new()
//! }
//!
//! idem_core::conformance_tests!(fresh_store);
//! # fn main() {}
//! ```
//!
//! The function may answer any [`Store`], including an `Arc<dyn Store>`.
//! Each case may also be run on its own, for instance from a custom test harness:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! # #[tokio::main]
//! # async fn main() {
//! for case in idem_core::conformance::cases() {
//!     println!("{}", case.name);
//!     (case.run)(Arc::new(idem_core::MemoryStore::new())).await;
//! }
//! # }
//! ```
//!
//! # Time
//!
//! The cases run on real time, because a database store keeps the database's
//! clock: leases and retentions are a few hundred milliseconds and the cases sleep
//! past them, so the whole suite takes a few seconds. A store's clock may differ
//! from the test's by well under a second.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::store::{Claim, ClaimOutcome, ClaimRequest, OwnerToken, Record, RecordState};
use crate::{Fingerprint, Header, IdempotencyKey, Scope, Store, StoreError, StoredResponse};

/// One case of the suite: it panics, naming the broken behaviour, when the store
/// fails it.
pub type CaseFn = fn(Arc<dyn Store>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// A named case of the suite.
#[derive(Clone, Copy)]
pub struct Case {
    /// The behaviour the case checks, as a test name.
    pub name: &'static str,
    /// Runs the case against a fresh, empty store.
    pub run: CaseFn,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Writes one test per conformance case, each running against a fresh, empty store
/// from `$make` (an async function answering a [`Store`](crate::Store)).
///
/// Each test runs on a multi-threaded Tokio runtime with 2 workers. See
/// [`conformance`](crate::conformance) for an example.
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!(@each [tests $make]);
    };
    // The one list of case names; `cases()` must list the same (a unit test checks).
    (@each [$($then:tt)*]) => {
        $crate::conformance_tests! { @$($then)* ;
            claim_race_has_one_winner,
            claim_of_completed_returns_response,
            claim_reports_in_progress_fingerprint,
            stale_owner_cannot_complete_release_or_renew,
            unknown_owner_is_stale,
            renew_extends_lease,
            lapsed_lease_is_reclaimed,
            release_makes_record_new,
            expired_record_is_new_and_absent,
            completion_resets_retention,
            replay_is_byte_exact,
            non_replayable_response_round_trips,
            scopes_are_isolated,
            delete_expired_counts_exactly,
            load_reports_state,
        }
    };
    (@tests $make:path ; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::run_case(::core::stringify!($case), || $make());
            }
        )*
    };
    (@names ; $($case:ident),* $(,)?) => {
        [$(::core::stringify!($case)),*]
    };
}

/// Every case of the suite.
pub fn cases() -> Vec<Case> {
    macro_rules! case {
        ($name:ident) => {
            Case {
                name: stringify!($name),
                run: |store| Box::pin($name(store)),
            }
        };
    }
    vec![
        case!(claim_race_has_one_winner),
        case!(claim_of_completed_returns_response),
        case!(claim_reports_in_progress_fingerprint),
        case!(stale_owner_cannot_complete_release_or_renew),
        case!(unknown_owner_is_stale),
        case!(renew_extends_lease),
        case!(lapsed_lease_is_reclaimed),
        case!(release_makes_record_new),
        case!(expired_record_is_new_and_absent),
        case!(completion_resets_retention),
        case!(replay_is_byte_exact),
        case!(non_replayable_response_round_trips),
        case!(scopes_are_isolated),
        case!(delete_expired_counts_exactly),
        case!(load_reports_state),
    ]
}

/// Runs the case named `name` against the store `make` answers, on a fresh
/// multi-threaded runtime; what [`conformance_tests!`](crate::conformance_tests)
/// expands to.
///
/// # Panics
///
/// When the store fails the case, when no case has that name, or when the case
/// does not finish within a minute (a hung store).
#[doc(hidden)]
pub fn run_case<M, F, S>(name: &str, make: M)
where
    M: FnOnce() -> F,
    F: Future<Output = S>,
    S: Store,
{
    let Some(case) = cases().into_iter().find(|case| case.name == name) else {
        panic!("no conformance case is named {name}");
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => panic!("could not start a Tokio runtime for the conformance suite: {error}"),
    };
    runtime.block_on(async {
        let store: Arc<dyn Store> = Arc::new(make().await);
        if tokio::time::timeout(HANG, (case.run)(store)).await.is_err() {
            panic!("conformance case {name} did not finish within {HANG:?}: the store hangs");
        }
    });
}

/// How long a case may run before the store counts as hung.
const HANG: Duration = Duration::from_secs(60);
/// A lease or retention that lapses during a case.
const SHORT: Duration = Duration::from_millis(300);
/// Sleeping this long lets a `SHORT` lease or retention lapse.
const PAST_SHORT: Duration = Duration::from_millis(600);
/// A lease or retention that outlives every case.
const LONG: Duration = Duration::from_secs(3600);
/// How far the store's clock may be from the test's.
const SKEW: Duration = Duration::from_secs(1);

async fn claim_race_has_one_winner(store: Arc<dyn Store>) {
    const RACERS: u8 = 64;
    let key = key("race");
    let barrier = Arc::new(tokio::sync::Barrier::new(usize::from(RACERS)));
    let racers: Vec<_> = (0..RACERS)
        .map(|racer| {
            // Each racer has its own fingerprint, so the losers can name the winner.
            let request = request(&Scope::new("s"), &key, fingerprint(racer), LONG, LONG);
            let store = Arc::clone(&store);
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                let outcome = store.claim(&request).await;
                (request, outcome)
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut losers = Vec::new();
    for racer in racers {
        let (request, outcome) = match racer.await {
            Ok(finished) => finished,
            Err(error) => panic!("a racing claim panicked: {error}"),
        };
        match outcome {
            Ok(ClaimOutcome::Claimed(claim)) => {
                assert_eq!(
                    claim,
                    request.to_claim(),
                    "a granted claim is the request's claim"
                );
                winners.push(claim);
            }
            Ok(ClaimOutcome::InProgress { fingerprint, .. }) => losers.push(fingerprint),
            other => panic!("a racing claim of a new key answered {other:?}"),
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one of {RACERS} concurrent claims wins"
    );
    assert_eq!(
        losers.len(),
        usize::from(RACERS) - 1,
        "every other claim finds the key in progress"
    );
    let winner = winners[0].fingerprint;
    assert!(
        losers.iter().all(|&fingerprint| fingerprint == winner),
        "the losers of a claim race see the winner's fingerprint"
    );
}

async fn claim_of_completed_returns_response(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("completed");
    let first = request(&scope, &key, fingerprint(1), LONG, LONG);
    let claim = claimed(&store, &first).await;
    let response = StoredResponse::new(
        201,
        vec![Header::new("content-type", "application/json")],
        r#"{"id":1}"#,
    );
    ok(
        store.complete(&claim, &response, LONG).await,
        "complete by the owner",
    );

    for fp in [1, 2] {
        let retry = request(&scope, &key, fingerprint(fp), LONG, LONG);
        assert_eq!(
            claim_outcome(&store, &retry).await,
            ClaimOutcome::Completed {
                fingerprint: fingerprint(1),
                response: response.clone()
            },
            "a claim of a completed record answers its fingerprint and response, whatever the claimer's fingerprint"
        );
    }
}

async fn claim_reports_in_progress_fingerprint(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("in-progress");
    let before = SystemTime::now();
    claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
    let after = SystemTime::now();

    let other = request(&scope, &key, fingerprint(2), LONG, LONG);
    match claim_outcome(&store, &other).await {
        ClaimOutcome::InProgress {
            fingerprint: found,
            lease_until,
        } => {
            assert_eq!(
                found,
                fingerprint(1),
                "a claim of a record in progress answers the holder's fingerprint (the store does not judge a different one)"
            );
            assert!(
                lease_until + SKEW >= before + LONG && lease_until <= after + LONG + SKEW,
                "the lease of a claim runs `lease` from the claim: {lease_until:?}"
            );
        }
        other => panic!("a claim of a key in progress answered {other:?}"),
    }
}

async fn stale_owner_cannot_complete_release_or_renew(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("stale");
    let first = claimed(&store, &request(&scope, &key, fingerprint(1), SHORT, LONG)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = claimed(&store, &request(&scope, &key, fingerprint(2), LONG, LONG)).await;

    let stale_response = StoredResponse::new(200, vec![], "stale");
    stale(
        store.complete(&first, &stale_response, LONG).await,
        "complete by an owner whose record was claimed again",
    );
    stale(
        store.release(&first).await,
        "release by an owner whose record was claimed again",
    );
    stale(
        store.renew(&first, LONG).await,
        "renew by an owner whose record was claimed again",
    );
    let record = loaded(&store, &scope, &key).await;
    assert_eq!(
        (record.fingerprint, holder(&record)),
        (fingerprint(2), Some(second.owner)),
        "refused steps leave the second owner's claim in place"
    );

    let response = StoredResponse::new(201, vec![], "second");
    ok(
        store.complete(&second, &response, LONG).await,
        "complete by the current owner",
    );
    stale(
        store.complete(&first, &stale_response, LONG).await,
        "complete by a stale owner after completion",
    );
    stale(
        store.release(&first).await,
        "release by a stale owner after completion",
    );
    stale(
        store.renew(&first, LONG).await,
        "renew by a stale owner after completion",
    );
    stale(
        store.complete(&second, &stale_response, LONG).await,
        "a second completion by the owner",
    );
    stale(
        store.release(&second).await,
        "release of a completed record",
    );
    stale(
        store.renew(&second, LONG).await,
        "renew of a completed record",
    );

    let retry = request(&scope, &key, fingerprint(2), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Completed {
            fingerprint: fingerprint(2),
            response
        },
        "the record keeps the second owner's outcome"
    );
}

async fn unknown_owner_is_stale(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("unknown");
    let never_granted = request(&scope, &key, fingerprint(1), LONG, LONG).to_claim();
    let response = StoredResponse::new(200, vec![], "");
    stale(
        store.complete(&never_granted, &response, LONG).await,
        "complete of an absent record",
    );
    stale(
        store.release(&never_granted).await,
        "release of an absent record",
    );
    stale(
        store.renew(&never_granted, LONG).await,
        "renew of an absent record",
    );
    assert_eq!(
        store.load(&scope, &key).await.ok(),
        Some(None),
        "refused steps create no record"
    );

    let first = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
    stale(
        store.complete(&never_granted, &response, LONG).await,
        "complete by a token that never held the record",
    );
    stale(
        store.release(&never_granted).await,
        "release by a token that never held the record",
    );
    stale(
        store.renew(&never_granted, LONG).await,
        "renew by a token that never held the record",
    );
    let record = loaded(&store, &scope, &key).await;
    assert_eq!(
        holder(&record),
        Some(first.owner),
        "the holder keeps a record others tried to complete"
    );
}

async fn renew_extends_lease(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("renew");
    let claim = claimed(&store, &request(&scope, &key, fingerprint(1), SHORT, LONG)).await;
    let renewed_at = SystemTime::now();
    ok(store.renew(&claim, LONG).await, "renew by the owner");
    match loaded(&store, &scope, &key).await.state {
        RecordState::InProgress { lease_until, .. } => assert!(
            lease_until + SKEW >= renewed_at + LONG,
            "renew moves the lease to `lease` from now: {lease_until:?}"
        ),
        other => panic!("a renewed record is {other:?}"),
    }
    tokio::time::sleep(PAST_SHORT).await;

    let retry = request(&scope, &key, fingerprint(1), LONG, LONG);
    assert!(
        matches!(claim_outcome(&store, &retry).await, ClaimOutcome::InProgress { fingerprint: found, .. } if found == fingerprint(1)),
        "a renewed claim outlives its first lease"
    );
    ok(
        store.renew(&claim, LONG).await,
        "a second renew by the owner",
    );
    let response = StoredResponse::new(200, vec![], "done");
    ok(
        store.complete(&claim, &response, LONG).await,
        "complete after renewing",
    );
}

async fn lapsed_lease_is_reclaimed(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("lapsed");
    claimed(&store, &request(&scope, &key, fingerprint(1), SHORT, LONG)).await;
    tokio::time::sleep(PAST_SHORT).await;

    let retry = request(&scope, &key, fingerprint(2), LONG, LONG);
    let claim = claimed(&store, &retry).await;
    assert_eq!(
        claim,
        retry.to_claim(),
        "a lapsed lease is claimed by the next request"
    );
    let record = loaded(&store, &scope, &key).await;
    assert_eq!(
        (record.fingerprint, holder(&record)),
        (fingerprint(2), Some(retry.owner)),
        "the reclaimed record holds the new request's fingerprint and owner"
    );
    let third = request(&scope, &key, fingerprint(3), LONG, LONG);
    assert!(
        matches!(claim_outcome(&store, &third).await, ClaimOutcome::InProgress { fingerprint: found, .. } if found == fingerprint(2)),
        "the reclaimed record is in progress for others"
    );
}

async fn release_makes_record_new(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("release");
    let first = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
    ok(store.release(&first).await, "release by the owner");
    assert_eq!(
        store.load(&scope, &key).await.ok(),
        Some(None),
        "a released record is absent"
    );
    stale(store.release(&first).await, "a second release");
    stale(
        store
            .complete(&first, &StoredResponse::new(200, vec![], ""), LONG)
            .await,
        "complete after release",
    );

    let retry = request(&scope, &key, fingerprint(2), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Claimed(retry.to_claim()),
        "a released record is claimed anew"
    );
}

async fn expired_record_is_new_and_absent(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("expired");
    let claim = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
    ok(
        store
            .complete(&claim, &StoredResponse::new(201, vec![], "old"), SHORT)
            .await,
        "complete with a short retention",
    );
    tokio::time::sleep(PAST_SHORT).await;

    assert_eq!(
        store.load(&scope, &key).await.ok(),
        Some(None),
        "a completed record past its retention loads as absent"
    );
    let retry = request(&scope, &key, fingerprint(2), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Claimed(retry.to_claim()),
        "a completed record past its retention is claimed anew"
    );

    // In progress, past its retention and its lease.
    let other_key = self::key("expired-in-progress");
    claimed(
        &store,
        &request(&scope, &other_key, fingerprint(1), SHORT, SHORT),
    )
    .await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(
        store.load(&scope, &other_key).await.ok(),
        Some(None),
        "a record in progress past its retention and lease loads as absent"
    );
    let retry = request(&scope, &other_key, fingerprint(2), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Claimed(retry.to_claim()),
        "a record in progress past its retention and lease is claimed anew"
    );
}

async fn completion_resets_retention(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("retention");
    // Claimed with a short retention, completed with a long one.
    let claim = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, SHORT)).await;
    let completed_at = SystemTime::now();
    let response = StoredResponse::new(200, vec![], "kept");
    ok(
        store.complete(&claim, &response, LONG).await,
        "complete by the owner",
    );
    let record = loaded(&store, &scope, &key).await;
    assert!(
        record.expires_at + SKEW >= completed_at + LONG,
        "a completed record is kept `retention` from its completion: {:?}",
        record.expires_at
    );
    tokio::time::sleep(PAST_SHORT).await;
    let retry = request(&scope, &key, fingerprint(1), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Completed {
            fingerprint: fingerprint(1),
            response
        },
        "completion's retention replaces the claim's"
    );
}

async fn replay_is_byte_exact(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let every_byte: Vec<u8> = (0..=255).collect();
    let rich = StoredResponse::new(
        201,
        vec![
            Header::new("set-cookie", "a=1; Path=/"),
            Header::new("content-type", "application/octet-stream"),
            Header::new("set-cookie", "b=2; HttpOnly"),
            Header::new(
                "x-binary",
                Bytes::from_static(&[0x00, 0x7f, 0x80, 0xc3, 0x28, 0xff, b'\t']),
            ),
            Header::new("x-empty", ""),
            Header::new("set-cookie", "c=3"),
        ],
        every_byte,
    );
    let empty = StoredResponse::new(204, vec![], Bytes::new());
    for (name, response) in [("rich", rich), ("empty", empty)] {
        let key = key(name);
        let claim = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
        ok(
            store.complete(&claim, &response, LONG).await,
            "complete by the owner",
        );
        let retry = request(&scope, &key, fingerprint(1), LONG, LONG);
        assert_eq!(
            claim_outcome(&store, &retry).await,
            ClaimOutcome::Completed {
                fingerprint: fingerprint(1),
                response: response.clone()
            },
            "a claim replays the {name} response byte for byte (status, headers in order with repeats, body)"
        );
        assert_eq!(
            loaded(&store, &scope, &key).await.state,
            RecordState::Completed { response },
            "load answers the {name} response byte for byte"
        );
    }
}

async fn non_replayable_response_round_trips(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("too-large");
    let claim = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
    let response = StoredResponse::without_body(201, vec![Header::new("location", "/charges/1")]);
    ok(
        store.complete(&claim, &response, LONG).await,
        "complete by the owner",
    );
    let retry = request(&scope, &key, fingerprint(1), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Completed {
            fingerprint: fingerprint(1),
            response
        },
        "a response kept without its body stays not replayable"
    );
}

async fn scopes_are_isolated(store: Arc<dyn Store>) {
    let key = key("shared-key");
    let alice = Scope::new("alice");
    let bob = Scope::new("bob");
    let alice_claim = claimed(&store, &request(&alice, &key, fingerprint(1), LONG, LONG)).await;
    let bob_request = request(&bob, &key, fingerprint(2), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &bob_request).await,
        ClaimOutcome::Claimed(bob_request.to_claim()),
        "the same key under another scope is another record"
    );
    let bob_claim = bob_request.to_claim();

    let alice_response = StoredResponse::new(201, vec![], "alice");
    ok(
        store.complete(&alice_claim, &alice_response, LONG).await,
        "complete in one scope",
    );
    let bob_retry = request(&bob, &key, fingerprint(2), LONG, LONG);
    assert!(
        matches!(claim_outcome(&store, &bob_retry).await, ClaimOutcome::InProgress { fingerprint: found, .. } if found == fingerprint(2)),
        "completing a key in one scope leaves the other scope's record in progress"
    );
    stale(
        store
            .release(&Claim {
                scope: bob.clone(),
                ..alice_claim.clone()
            })
            .await,
        "an owner of one scope acting on another scope",
    );

    ok(
        store.release(&bob_claim).await,
        "release in the other scope",
    );
    assert_eq!(
        store.load(&bob, &key).await.ok(),
        Some(None),
        "the released scope's record is absent"
    );
    let alice_retry = request(&alice, &key, fingerprint(1), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &alice_retry).await,
        ClaimOutcome::Completed {
            fingerprint: fingerprint(1),
            response: alice_response
        },
        "releasing a key in one scope leaves the other scope's record"
    );
}

async fn delete_expired_counts_exactly(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let response = StoredResponse::new(200, vec![], "r");
    // Expired: 6 completed past their retention, 1 in progress past retention and lease.
    let mut expired = Vec::new();
    for n in 0..6 {
        let key = key(&format!("expired-{n}"));
        let claim = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
        ok(
            store.complete(&claim, &response, SHORT).await,
            "complete by the owner",
        );
        expired.push(key);
    }
    let abandoned = key("abandoned");
    claimed(
        &store,
        &request(&scope, &abandoned, fingerprint(1), SHORT, SHORT),
    )
    .await;
    expired.push(abandoned);
    // Live: 3 completed within their retention, 1 in progress past its retention
    // with a live lease, 1 in progress within its retention with a lapsed lease.
    let mut kept = Vec::new();
    for n in 0..3 {
        let key = key(&format!("kept-{n}"));
        let claim = claimed(&store, &request(&scope, &key, fingerprint(1), LONG, LONG)).await;
        ok(
            store.complete(&claim, &response, LONG).await,
            "complete by the owner",
        );
        kept.push(key);
    }
    let long_running = key("long-running");
    let runner = claimed(
        &store,
        &request(&scope, &long_running, fingerprint(1), LONG, SHORT),
    )
    .await;
    let lapsed = key("lapsed");
    claimed(
        &store,
        &request(&scope, &lapsed, fingerprint(1), SHORT, LONG),
    )
    .await;
    tokio::time::sleep(PAST_SHORT).await;

    let mut counts = Vec::new();
    for _ in 0..4 {
        match store.delete_expired(3).await {
            Ok(deleted) => counts.push(deleted),
            Err(error) => panic!("delete_expired failed: {error}"),
        }
    }
    assert_eq!(
        counts,
        [3, 3, 1, 0],
        "delete_expired(3) deletes the 7 expired records in batches of at most 3"
    );

    for key in &expired {
        assert_eq!(
            store.load(&scope, key).await.ok(),
            Some(None),
            "a deleted record is absent"
        );
    }
    for key in &kept {
        assert_eq!(
            loaded(&store, &scope, key).await.state,
            RecordState::Completed {
                response: response.clone()
            },
            "delete_expired keeps completed records within their retention"
        );
    }
    let record = loaded(&store, &scope, &long_running).await;
    assert_eq!(
        holder(&record),
        Some(runner.owner),
        "delete_expired keeps a record in progress with a live lease, past its retention"
    );
    ok(
        store.complete(&runner, &response, LONG).await,
        "complete by a long-running owner after cleanup",
    );
    let retry = request(&scope, &lapsed, fingerprint(2), LONG, LONG);
    assert_eq!(
        claim_outcome(&store, &retry).await,
        ClaimOutcome::Claimed(retry.to_claim()),
        "a record in progress with a lapsed lease is claimed anew after cleanup"
    );
}

async fn load_reports_state(store: Arc<dyn Store>) {
    let scope = Scope::new("s");
    let key = key("load");
    assert_eq!(
        store.load(&scope, &key).await.ok(),
        Some(None),
        "an unknown key loads as absent"
    );

    let request = request(&scope, &key, fingerprint(9), LONG, LONG);
    let claim = claimed(&store, &request).await;
    let now = SystemTime::now();
    let record = loaded(&store, &scope, &key).await;
    assert_eq!(
        (&record.scope, &record.key, record.fingerprint),
        (&scope, &key, fingerprint(9)),
        "load answers the record's scope, key and fingerprint"
    );
    match record.state {
        RecordState::InProgress { owner, lease_until } => {
            assert_eq!(
                owner, claim.owner,
                "load answers the owner of a record in progress"
            );
            assert!(
                lease_until > now,
                "load answers a live lease in the future: {lease_until:?}"
            );
        }
        other => panic!("a claimed record loads as {other:?}"),
    }
    assert!(
        record.expires_at > now,
        "a claimed record expires in the future"
    );

    let response = StoredResponse::new(202, vec![Header::new("x-a", "1")], "accepted");
    ok(
        store.complete(&claim, &response, LONG).await,
        "complete by the owner",
    );
    let record = loaded(&store, &scope, &key).await;
    assert_eq!(
        (record.fingerprint, record.state),
        (fingerprint(9), RecordState::Completed { response }),
        "load answers a completed record's response"
    );
    assert!(
        record.expires_at > SystemTime::now(),
        "a completed record expires in the future"
    );
}

fn key(name: &str) -> IdempotencyKey {
    match IdempotencyKey::new(name) {
        Ok(key) => key,
        Err(error) => panic!("the suite's key {name:?} is invalid: {error}"),
    }
}

fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

/// A request with a fresh owner.
fn request(
    scope: &Scope,
    key: &IdempotencyKey,
    fingerprint: Fingerprint,
    lease: Duration,
    retention: Duration,
) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        key: key.clone(),
        fingerprint,
        owner: OwnerToken::random(),
        lease,
        retention,
    }
}

async fn claim_outcome(store: &Arc<dyn Store>, request: &ClaimRequest) -> ClaimOutcome {
    match store.claim(request).await {
        Ok(outcome) => outcome,
        Err(error) => panic!("claim failed: {error}"),
    }
}

/// Claims `request`, which must be granted.
async fn claimed(store: &Arc<dyn Store>, request: &ClaimRequest) -> Claim {
    match claim_outcome(store, request).await {
        ClaimOutcome::Claimed(claim) => {
            assert_eq!(
                &claim,
                &request.to_claim(),
                "a granted claim is the request's claim"
            );
            claim
        }
        other => panic!("a claim of a new record answered {other:?}"),
    }
}

async fn loaded(store: &Arc<dyn Store>, scope: &Scope, key: &IdempotencyKey) -> Record {
    match store.load(scope, key).await {
        Ok(Some(record)) => record,
        Ok(None) => panic!("a record that must be present loads as absent"),
        Err(error) => panic!("load failed: {error}"),
    }
}

/// The owner holding `record` in progress; `None` when it is completed.
fn holder(record: &Record) -> Option<OwnerToken> {
    match record.state {
        RecordState::InProgress { owner, .. } => Some(owner),
        RecordState::Completed { .. } => None,
    }
}

fn ok(result: Result<(), StoreError>, step: &str) {
    if let Err(error) = result {
        panic!("{step} must succeed, but failed: {error}");
    }
}

fn stale(result: Result<(), StoreError>, step: &str) {
    assert!(
        matches!(result, Err(StoreError::StaleOwner)),
        "{step} must be refused with StaleOwner, but answered {result:?}"
    );
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_macro_lists_every_case() {
        let listed: &[&str] = &crate::conformance_tests!(@each [names]);
        let cases: Vec<&str> = super::cases().iter().map(|case| case.name).collect();
        assert_eq!(listed, cases.as_slice());
    }
}
