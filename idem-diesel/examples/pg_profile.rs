//! Store steps on PostgreSQL, for profiling the application tier: `N` first
//! executions (claim + complete) or `N` replays through one pooled connection,
//! on a current-thread runtime, so that every instruction the client spends is
//! on this thread. Prints the statements the server counted per request
//! (`pg_stat_statements`).
//!
//! ```text
//! cargo run --release -p idem-diesel --features test-util --example pg_profile -- first 2000
//! valgrind --tool=callgrind --toggle-collect='*pg_profile*measured*' target/release/examples/pg_profile first 2000
//! ```
//!
//! Modes: `first`, `replay`, `tx-first`, `tx-replay`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken};
use idem_core::{Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_diesel::PgStore;
use idem_testkit::TestPostgres;

#[derive(QueryableByName)]
struct Calls {
    #[diesel(sql_type = BigInt)]
    calls: i64,
}

fn request(n: usize) -> ClaimRequest {
    ClaimRequest {
        scope: Scope::new("profile"),
        key: IdempotencyKey::new(&format!("key-{n:08}")).unwrap(),
        fingerprint: Fingerprint::from_bytes([7; 32]),
        owner: OwnerToken::random(),
        lease: Duration::from_secs(30),
        retention: Duration::from_secs(3600),
    }
}

async fn first<S: Store>(store: &S, from: usize, n: usize, response: &StoredResponse) {
    for i in from..from + n {
        let request = request(i);
        let ClaimOutcome::Claimed(claim) = store.claim(&request).await.unwrap() else {
            panic!("key {i} was not new");
        };
        store
            .complete(&claim, response, request.retention)
            .await
            .unwrap();
    }
}

async fn replay<S: Store>(store: &S, n: usize) {
    for i in 0..n {
        let outcome = store.claim(&request(i)).await.unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Completed { .. }),
            "{outcome:?}"
        );
    }
}

#[inline(never)]
fn measured<F: std::future::Future>(runtime: &tokio::runtime::Runtime, work: F) -> F::Output {
    runtime.block_on(work)
}

async fn calls(store: &PgStore) -> i64 {
    let mut connection = store.pool().get().await.unwrap();
    diesel::sql_query(
        "SELECT coalesce(sum(calls), 0)::bigint AS calls FROM pg_stat_statements \
         WHERE query NOT LIKE '%pg_stat_statements%'",
    )
    .get_result::<Calls>(&mut *connection)
    .await
    .unwrap()
    .calls
}

async fn reset(store: &PgStore) {
    let mut connection = store.pool().get().await.unwrap();
    diesel::sql_query("SELECT pg_stat_statements_reset()")
        .execute(&mut *connection)
        .await
        .unwrap();
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "first".to_owned());
    let n: usize = args.next().map_or(1000, |n| n.parse().unwrap());
    let cluster = TestPostgres::start().unwrap();
    cluster
        .psql(
            "postgres",
            "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'",
        )
        .unwrap();
    cluster.stop().unwrap();
    cluster.resume().unwrap();
    cluster.create_database("profile").unwrap();
    cluster
        .psql("profile", "CREATE EXTENSION pg_stat_statements")
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let response = StoredResponse::new(201, Vec::new(), vec![b'x'; 200]);
    let store = runtime.block_on(async {
        let store = PgStore::builder()
            .max_connections(1)
            .connect(&cluster.url("profile"))
            .await
            .unwrap();
        store.migrate().await.unwrap();
        store
    });
    let transactional = store.transactional();
    // Warm up: the connection prepares its statements; replays find records.
    runtime.block_on(async {
        match mode.as_str() {
            "first" | "replay" => first(&store, 0, n, &response).await,
            _ => first(&transactional, 0, n, &response).await,
        }
        reset(&store).await;
    });
    match mode.as_str() {
        "first" => measured(&runtime, first(&store, n, n, &response)),
        "replay" => measured(&runtime, replay(&store, n)),
        "tx-first" => measured(&runtime, first(&transactional, n, n, &response)),
        "tx-replay" => measured(&runtime, replay(&transactional, n)),
        other => panic!("unknown mode {other}"),
    }
    let calls = runtime.block_on(calls(&store));
    println!(
        "{mode}: {n} requests, {:.2} statements per request",
        calls as f64 / n as f64
    );
}
