//! `RedisStore` against real Redis: the core conformance suite on one node and
//! on a three-primary Redis Cluster (one of each per test binary, shared, a key
//! prefix per test), then what is particular to Redis: script reloading,
//! expiry, slots, outages, a failover. The inbox conformance suite runs on
//! both through `StoreInbox`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken, RecordState};
use idem_core::{Fingerprint, IdempotencyKey, Scope, Store, StoreError, StoredResponse};
use idem_redis::{RedisStore, SetupError};
use idem_testkit::TestRedis;

/// The suite on one node.
mod single {
    use super::*;

    async fn fresh_store() -> RedisStore {
        super::store_on(TestRedis::shared()).await
    }

    idem_core::conformance_tests!(fresh_store);
}

/// The suite on a Redis Cluster.
mod cluster {
    use super::*;

    async fn fresh_store() -> RedisStore {
        super::store_on(TestRedis::shared_cluster()).await
    }

    idem_core::conformance_tests!(fresh_store);
}

/// The inbox suite, through `StoreInbox`, on one node and on a cluster.
mod inbox {
    use idem_core::consume::StoreInbox;
    use idem_core::consume::conformance::Untransacted;
    use idem_testkit::TestRedis;

    /// A `StoreInbox` over Redis; effects counted here (the inbox has no
    /// transaction).
    pub(super) async fn over(redis: &TestRedis) -> Untransacted<StoreInbox> {
        Untransacted::new(StoreInbox::new(super::store_on(redis).await))
    }

    mod single {
        async fn fresh() -> super::Untransacted<super::StoreInbox> {
            super::over(idem_testkit::TestRedis::shared()).await
        }
        idem_core::inbox_conformance_tests!(fresh);
    }

    mod cluster {
        async fn fresh() -> super::Untransacted<super::StoreInbox> {
            super::over(idem_testkit::TestRedis::shared_cluster()).await
        }
        idem_core::inbox_conformance_tests!(fresh);
    }
}

/// A store on `redis` under a key prefix no other test has.
async fn store_on(redis: &TestRedis) -> RedisStore {
    RedisStore::builder()
        .prefix(redis.fresh_prefix())
        .connect(&redis.url())
        .await
        .unwrap()
}

fn request(key: &str, lease: Duration, retention: Duration) -> ClaimRequest {
    ClaimRequest {
        scope: Scope::new("s"),
        key: IdempotencyKey::new(key).unwrap(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        owner: OwnerToken::random(),
        lease,
        retention,
    }
}

/// The number `redis-cli` printed on the node that answered it.
fn number(printed: &[String]) -> i64 {
    printed
        .iter()
        .map(|line| line.parse::<i64>().unwrap())
        .sum()
}

#[tokio::test]
async fn scripts_are_loaded_again_after_noscript() {
    for redis in [TestRedis::shared(), TestRedis::shared_cluster()] {
        let store = store_on(redis).await;
        let first = request("flushed", Duration::from_secs(60), Duration::from_secs(60));
        assert!(matches!(
            store.claim(&first).await.unwrap(),
            ClaimOutcome::Claimed(_)
        ));
        redis.cli(&["SCRIPT", "FLUSH"]).unwrap();
        let retry = request("flushed", Duration::from_secs(60), Duration::from_secs(60));
        assert!(
            matches!(
                store.claim(&retry).await.unwrap(),
                ClaimOutcome::InProgress { .. }
            ),
            "after SCRIPT FLUSH the claim script is loaded again and finds the record"
        );
    }
}

#[tokio::test]
async fn redis_expires_records_but_never_a_live_lease() {
    for redis in [TestRedis::shared(), TestRedis::shared_cluster()] {
        let store = RedisStore::builder()
            .prefix(redis.fresh_prefix())
            .expiry_grace(Duration::from_millis(100))
            .connect(&redis.url())
            .await
            .unwrap();
        let scope = Scope::new("s");
        // Completed with a short retention: gone from Redis itself.
        let done = request("done", Duration::from_secs(60), Duration::from_secs(60));
        let ClaimOutcome::Claimed(claim) = store.claim(&done).await.unwrap() else {
            panic!("a new key is claimed");
        };
        store
            .complete(
                &claim,
                &StoredResponse::new(200, vec![], "x"),
                Duration::from_millis(200),
            )
            .await
            .unwrap();
        // In progress with a retention shorter than its lease.
        let running = request(
            "running",
            Duration::from_secs(60),
            Duration::from_millis(200),
        );
        let ClaimOutcome::Claimed(runner) = store.claim(&running).await.unwrap() else {
            panic!("a new key is claimed");
        };
        tokio::time::sleep(Duration::from_millis(800)).await;

        let done_key = store.record_key(&scope, &done.key);
        let running_key = store.record_key(&scope, &running.key);
        let exists = |key: &[u8]| {
            let key = String::from_utf8(key.to_vec()).unwrap();
            // EXISTS on every node: the record's own node answers 1 or 0, the
            // others refuse it (MOVED), which redis-cli prints as an error.
            redis
                .cli(&["-c", "EXISTS", &key])
                .map(|printed| number(&printed[..1]))
                .unwrap()
        };
        assert_eq!(exists(&done_key), 0, "Redis deleted the expired record");
        assert_eq!(
            exists(&running_key),
            1,
            "Redis keeps a record whose lease lives past its retention"
        );
        assert!(matches!(
            store.load(&scope, &running.key).await.unwrap().unwrap().state,
            RecordState::InProgress { owner, .. } if owner == runner.owner
        ));
        assert_eq!(
            store.delete_expired(10).await.unwrap(),
            0,
            "nothing is left for delete_expired"
        );
    }
}

#[tokio::test]
async fn records_spread_over_the_cluster_primaries() {
    let redis = TestRedis::shared_cluster();
    let store = store_on(redis).await;
    for n in 0..60 {
        let claim = request(
            &format!("spread-{n}"),
            Duration::from_secs(60),
            Duration::from_secs(60),
        );
        assert!(matches!(
            store.claim(&claim).await.unwrap(),
            ClaimOutcome::Claimed(_)
        ));
    }
    let counts: Vec<i64> = redis
        .cli(&["DBSIZE"])
        .unwrap()
        .iter()
        .map(|count| count.parse().unwrap())
        .collect();
    assert_eq!(counts.len(), 3);
    assert!(
        counts.iter().all(|&count| count > 0),
        "every primary holds records: {counts:?}"
    );
}

#[tokio::test]
async fn a_prefix_with_braces_is_refused() {
    let result = RedisStore::builder()
        .prefix("a{b}")
        .connect(&TestRedis::shared().url())
        .await;
    assert!(matches!(result, Err(SetupError::Prefix)));
}

#[tokio::test]
async fn a_cluster_url_without_nodes_is_refused() {
    assert!(matches!(
        RedisStore::connect("redis+cluster://").await,
        Err(SetupError::NoClusterNodes)
    ));
}

/// The node stops under the store: steps fail as `Unavailable` within the
/// timeouts, and succeed again once it is back, with the same store value.
#[tokio::test]
async fn a_stopped_node_is_unavailable_then_recovers() {
    let redis = tokio::task::spawn_blocking(TestRedis::start)
        .await
        .unwrap()
        .unwrap();
    let store = store_on(&redis).await;
    let first = request("outage", Duration::from_secs(60), Duration::from_secs(60));
    assert!(matches!(
        store.claim(&first).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    let redis = std::sync::Arc::new(redis);
    let stopping = std::sync::Arc::clone(&redis);
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .unwrap()
        .unwrap();
    let started = std::time::Instant::now();
    let retry = request("outage", Duration::from_secs(60), Duration::from_secs(60));
    assert!(matches!(
        store.claim(&retry).await,
        Err(StoreError::Unavailable(_))
    ));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a step fails within seconds while Redis is down: {:?}",
        started.elapsed()
    );
    // Let the store's reconnection attempts end (refused), as they do during
    // any outage longer than a moment: the first step after the server is back
    // must not fail on them.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let resuming = std::sync::Arc::clone(&redis);
    tokio::task::spawn_blocking(move || resuming.resume())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(
            store.claim(&retry).await.unwrap(),
            ClaimOutcome::InProgress { .. }
        ),
        "the store reconnects by itself, and the record saved at shutdown is back"
    );
}

/// A primary of a cluster with replicas crashes: its replica takes over, and
/// the same store value goes on, finding the record written before the crash
/// (replicated first, with `WAIT`: losing a write that was not is what the
/// crate docs warn about, not what this test is about).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_failing_over_is_survived() {
    let redis = std::sync::Arc::new(
        tokio::task::spawn_blocking(|| TestRedis::start_replicated_cluster(3, 1))
            .await
            .unwrap()
            .unwrap(),
    );
    let store = store_on(&redis).await;
    let scope = Scope::new("s");
    let first = request("failover", Duration::from_secs(60), Duration::from_secs(60));
    let ClaimOutcome::Claimed(claim) = store.claim(&first).await.unwrap() else {
        panic!("a new key is claimed");
    };
    let response = StoredResponse::new(201, vec![], "before the failover");
    store
        .complete(&claim, &response, Duration::from_secs(60))
        .await
        .unwrap();
    let record_key = String::from_utf8(store.record_key(&scope, &first.key)).unwrap();
    let primary = redis.primary_of(&record_key).unwrap();
    // The replica reports its link up and its offset at the primary's (the
    // readiness it reports, however slow the machine), and `WAIT` confirms
    // that a replica acknowledged the write.
    let syncing = std::sync::Arc::clone(&redis);
    tokio::task::spawn_blocking(move || syncing.await_replicas())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(redis.cli_on(primary, &["WAIT", "1", "30000"]).unwrap(), "1");
    redis.crash_node(primary).unwrap();

    let retry = request("failover", Duration::from_secs(60), Duration::from_secs(60));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        match store.claim(&retry).await {
            Ok(outcome) => break outcome,
            Err(StoreError::Unavailable(_)) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("the store did not survive the failover: {error:?}"),
        }
    };
    assert_eq!(
        outcome,
        ClaimOutcome::Completed {
            fingerprint: first.fingerprint,
            response
        },
        "the replica that took over holds the record"
    );
    assert_ne!(
        redis.primary_of(&record_key).unwrap(),
        primary,
        "a replica took over the slot"
    );
    let other = request(
        "after-failover",
        Duration::from_secs(60),
        Duration::from_secs(60),
    );
    assert!(matches!(
        store.claim(&other).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
}
