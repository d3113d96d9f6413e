//! SQLite beyond the conformance suite: restarts, URL forms, table names,
//! connections sharing a file, waiting.

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem_core::store::ClaimOutcome;
use idem_core::{Scope, Store, StoredResponse};
use idem_diesel::{SetupError, SqliteStore};

use crate::postgres::{assert_schema_missing, assert_schema_outdated, claimed, request};
use crate::{Databases, TestFn};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    ("sqlite::a_route_is_not_built_on_an_unverified_store", |d| {
        Box::pin(a_route_is_not_built_on_an_unverified_store(d))
    }),
    (
        "sqlite::check_schema_names_a_missing_or_older_table_and_the_fix",
        |d| Box::pin(check_schema_names_a_missing_or_older_table_and_the_fix(d)),
    ),
    ("sqlite::records_survive_reopening_the_file", |d| {
        Box::pin(records_survive_reopening_the_file(d))
    }),
    (
        "sqlite::migrate_and_claim_on_a_current_thread_runtime",
        |d| Box::pin(migrate_and_claim_on_a_current_thread_runtime(d)),
    ),
    (
        "sqlite::a_step_given_up_on_a_current_thread_runtime_finishes_by_itself",
        |d| Box::pin(a_step_given_up_on_a_current_thread_runtime_finishes_by_itself(d)),
    ),
    (
        "sqlite::an_unopenable_file_fails_to_connect_with_its_cause",
        |d| Box::pin(an_unopenable_file_fails_to_connect_with_its_cause(d)),
    ),
    ("sqlite::url_forms_open_the_same_file", |d| {
        Box::pin(url_forms_open_the_same_file(d))
    }),
    ("sqlite::custom_table_is_created_and_used", |d| {
        Box::pin(custom_table_is_created_and_used(d))
    }),
    ("sqlite::two_pools_on_one_file_race_for_one_claim", |d| {
        Box::pin(two_pools_on_one_file_race_for_one_claim(d))
    }),
    ("sqlite::changed_resolves_when_the_record_settles", |d| {
        Box::pin(changed_resolves_when_the_record_settles(d))
    }),
    (
        "sqlite::a_claim_that_waited_for_the_write_lock_gets_its_full_lease",
        |d| {
            Box::pin(a_claim_that_waited_for_the_write_lock_gets_its_full_lease(
                d,
            ))
        },
    ),
];

pub(crate) const MEASUREMENTS: &[(&str, TestFn)] = &[("measure::sqlite_claim_complete", |d| {
    Box::pin(measure_claim_complete(d))
})];

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// A migrated store on a new file.
pub(crate) async fn fresh_store(databases: &Arc<Databases>) -> SqliteStore {
    let store = SqliteStore::connect(&databases.fresh_sqlite_url())
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    store
}

/// Runs `sql` on the store's pool and answers its `n` column.
pub(crate) async fn count(store: &SqliteStore, sql: &str) -> i64 {
    let mut connection = store.pool().get().await.expect("a connection");
    diesel::sql_query(sql)
        .get_result::<Count>(&mut *connection)
        .await
        .expect(sql)
        .n
}

/// Runs `sql` on the store's pool.
pub(crate) async fn execute(store: &SqliteStore, sql: &str) {
    let mut connection = store.pool().get().await.expect("a connection");
    connection.batch_execute(sql).await.expect(sql);
}

async fn records_survive_reopening_the_file(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    let request = request("s", "kept", 1, Duration::from_secs(30));
    let response = StoredResponse::new(201, vec![], "created");
    {
        let store = SqliteStore::connect(&url).await.expect("connect");
        store.migrate().await.expect("migrate");
        let claim = claimed(&store, &request).await;
        store
            .complete(&claim, &response, Duration::from_secs(60))
            .await
            .expect("complete");
    }
    let reopened = SqliteStore::connect(&url).await.expect("connect");
    reopened.migrate().await.expect("migrate again is a no-op");
    let retry = crate::postgres::request("s", "kept", 1, Duration::from_secs(30));
    assert_eq!(
        reopened.claim(&retry).await.unwrap(),
        ClaimOutcome::Completed {
            fingerprint: request.fingerprint,
            response
        },
        "a reopened file replays what was completed before"
    );
}

/// actix-web runs each worker on a current-thread runtime.
async fn migrate_and_claim_on_a_current_thread_runtime(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = SqliteStore::connect(&url).await.expect("connect");
            store.migrate().await.expect("migrate");
            claimed(&store, &request("s", "k", 1, Duration::from_secs(30))).await;
        });
    })
    .await
    .unwrap();
}

/// actix-web runs each worker on a current-thread runtime, and drops a store
/// step's future when it gives up on it (the engine's wait between two looks at
/// a record, a client that disconnects): the step must let go without blocking
/// or panicking there, and finish by itself.
async fn a_step_given_up_on_a_current_thread_runtime_finishes_by_itself(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = SqliteStore::connect(&url).await.expect("connect");
            store.migrate().await.expect("migrate");
            // Another connection holds the write lock: the claim waits in its step.
            let mut writer = store.pool().get().await.expect("a connection");
            writer.batch_execute("BEGIN IMMEDIATE").await.expect("lock");
            let request = request("s", "given-up", 1, Duration::from_secs(30));
            let given_up =
                tokio::time::timeout(Duration::from_millis(100), store.claim(&request)).await;
            assert!(
                given_up.is_err(),
                "the claim waits for the lock: {given_up:?}"
            );
            writer.batch_execute("COMMIT").await.expect("unlock");
            drop(writer);

            // The claim given up on is made anyway, once the lock is free.
            let patience = Instant::now() + Duration::from_secs(30);
            while Store::load(&store, &request.scope, &request.key)
                .await
                .expect("load")
                .is_none()
            {
                assert!(
                    Instant::now() < patience,
                    "the step given up on never finished"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let again = store
                .claim(&self::request("s", "given-up", 1, Duration::from_secs(30)))
                .await
                .expect("claim");
            assert!(
                matches!(again, ClaimOutcome::InProgress { .. }),
                "{again:?}"
            );
        });
    })
    .await
    .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()));
}

async fn an_unopenable_file_fails_to_connect_with_its_cause(databases: Arc<Databases>) {
    let missing_directory = databases.fresh_sqlite_path().join("no-such-dir/idem.db");
    let error = SqliteStore::connect(missing_directory.to_str().unwrap())
        .await
        .expect_err("connect fails");
    assert!(matches!(error, SetupError::Connect(_)), "{error:?}");
    assert!(
        crate::error_chain(&error)
            .to_lowercase()
            .contains("unable to open the database file"),
        "the cause is kept: {}",
        crate::error_chain(&error)
    );
}

async fn url_forms_open_the_same_file(databases: Arc<Databases>) {
    let path = databases.fresh_sqlite_path();
    let plain = SqliteStore::connect(path.to_str().unwrap())
        .await
        .expect("a plain path");
    plain.migrate().await.expect("migrate");
    let claim = claimed(&plain, &request("s", "k", 1, Duration::from_secs(30))).await;
    plain
        .complete(
            &claim,
            &StoredResponse::new(200, vec![], ""),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    for url in [
        format!("sqlite://{}", path.display()),
        format!("sqlite:{}", path.display()),
    ] {
        let store = SqliteStore::connect(&url).await.expect(&url);
        let found = Store::load(&store, &Scope::new("s"), &claim.key)
            .await
            .unwrap();
        assert!(found.is_some(), "{url} opens the same file");
    }
}

/// What building a route's engine on `store` says: `Ok` or the panic's message.
fn build_route(store: impl Store) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        drop(idem_core::Engine::new(store, idem_core::Policy::required()));
    }))
    .map_err(|panic| panic.downcast_ref::<String>().cloned().unwrap_or_default())
}

async fn a_route_is_not_built_on_an_unverified_store(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    let store = SqliteStore::connect(&url).await.expect("connect");
    let refused = build_route(store.clone()).expect_err("no migrate, no check: refused");
    assert_eq!(
        refused,
        "idem: the idempotency table idem_records was not verified before a route was built \
         on its store: call `store.migrate().await` at start-up, or `store.check_schema().await` \
         when the application's own migrations create the table \
         (`SqliteStoreBuilder::skip_schema_check` opts out)"
    );
    // The same refusal as a `Result`, for an application that handles it.
    let not_ready = idem_core::Engine::try_new(store.clone(), idem_core::Policy::required())
        .map(drop)
        .expect_err("refused without a panic");
    assert_eq!(format!("idem: {not_ready}"), refused);
    // A failed check does not open the gate.
    assert!(store.check_schema().await.is_err());
    assert!(build_route(store.clone()).is_err());
    // Migrating opens it for every clone of the store.
    store.migrate().await.expect("migrate");
    assert_eq!(build_route(store.clone()), Ok(()));
    assert!(idem_core::Engine::try_new(store.clone(), idem_core::Policy::required()).is_ok());
    // A store that checked the table its migrations made passes too.
    let checked = SqliteStore::connect(&url).await.expect("connect");
    checked.check_schema().await.expect("the table is there");
    assert_eq!(build_route(checked), Ok(()));
    // The explicit opt-out.
    let skipped = SqliteStore::builder()
        .table("unmade")
        .skip_schema_check()
        .connect(&url)
        .await
        .expect("connect");
    assert_eq!(build_route(skipped), Ok(()));
}

async fn check_schema_names_a_missing_or_older_table_and_the_fix(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    let store = SqliteStore::connect(&url).await.expect("connect");
    assert_schema_missing(&store.check_schema().await.unwrap_err(), "idem_records");

    // The table an older idem-diesel would have made: without `replayable` and
    // `created_at`.
    execute(
        &store,
        "CREATE TABLE idem_records (
            scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
            state TEXT NOT NULL, owner BLOB, lease_until INTEGER, status INTEGER,
            headers BLOB, body BLOB, expires_at INTEGER NOT NULL,
            PRIMARY KEY (scope, key))",
    )
    .await;
    assert_schema_outdated(&store.check_schema().await.unwrap_err());

    execute(&store, "DROP TABLE idem_records").await;
    store.migrate().await.expect("migrate");
    store.check_schema().await.expect("a migrated table passes");

    let custom = SqliteStore::builder()
        .table("payment_keys")
        .connect(&url)
        .await
        .expect("connect");
    assert_schema_missing(&custom.check_schema().await.unwrap_err(), "payment_keys");
    custom.migrate().await.expect("migrate");
    custom
        .check_schema()
        .await
        .expect("a migrated custom table passes");
}

async fn custom_table_is_created_and_used(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    let custom = SqliteStore::builder()
        .table("payment_keys")
        .connect(&url)
        .await
        .expect("connect");
    custom.migrate().await.expect("migrate");
    custom.migrate().await.expect("a second migrate is a no-op");
    assert_eq!(
        count(
            &custom,
            "SELECT count(*) AS n FROM sqlite_master
             WHERE name IN ('idem_records', '__diesel_schema_migrations')"
        )
        .await,
        0,
        "a custom name runs the DDL, not the migrations"
    );
    let claim = claimed(&custom, &request("s", "k", 1, Duration::from_secs(30))).await;
    custom
        .complete(
            &claim,
            &StoredResponse::new(200, vec![], ""),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    assert_eq!(
        count(&custom, "SELECT count(*) AS n FROM payment_keys").await,
        1
    );

    let default = SqliteStore::connect(&url).await.expect("connect");
    default.migrate().await.expect("migrate");
    assert!(
        matches!(
            default
                .claim(&request("s", "k", 2, Duration::from_secs(30)))
                .await,
            Ok(ClaimOutcome::Claimed(_))
        ),
        "the default table does not see the custom table's record"
    );
}

async fn two_pools_on_one_file_race_for_one_claim(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    let first = SqliteStore::connect(&url).await.expect("connect");
    first.migrate().await.expect("migrate");
    let second = SqliteStore::connect(&url).await.expect("connect");
    let barrier = Arc::new(tokio::sync::Barrier::new(24));
    let racers: Vec<_> = (0..24u8)
        .map(|n| {
            let store = if n % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                let request = request("s", "contested", n, Duration::from_secs(30));
                barrier.wait().await;
                store.claim(&request).await
            })
        })
        .collect();
    let mut granted = 0;
    for racer in racers {
        match racer.await.unwrap() {
            Ok(ClaimOutcome::Claimed(_)) => granted += 1,
            Ok(ClaimOutcome::InProgress { .. }) => {}
            other => panic!("a racing claim answered {other:?}"),
        }
    }
    assert_eq!(granted, 1, "one claim across two pools on one file wins");
}

/// The lease is measured from when the claim runs, holding the lock, on SQLite's
/// clock: a claim that waited longer than its lease for another connection's
/// write still keeps a duplicate out afterwards.
async fn a_claim_that_waited_for_the_write_lock_gets_its_full_lease(databases: Arc<Databases>) {
    let url = databases.fresh_sqlite_url();
    let store = SqliteStore::connect(&url).await.expect("connect");
    store.migrate().await.expect("migrate");
    let other = SqliteStore::connect(&url).await.expect("connect");
    let mut writer = other.pool().get().await.expect("a connection");
    writer.batch_execute("BEGIN IMMEDIATE").await.expect("lock");

    let lease = Duration::from_secs(1);
    let first = request("s", "waited", 1, lease);
    let claiming = {
        let store = store.clone();
        let first = first.clone();
        tokio::spawn(async move { store.claim(&first).await })
    };
    tokio::time::sleep(lease + lease / 2).await;
    assert!(
        !claiming.is_finished(),
        "the claim waits for the write lock"
    );
    writer.batch_execute("COMMIT").await.expect("unlock");
    let started = Instant::now();
    assert!(matches!(
        claiming.await.unwrap(),
        Ok(ClaimOutcome::Claimed(_))
    ));

    let duplicate = request("s", "waited", 1, lease);
    match store.claim(&duplicate).await.unwrap() {
        ClaimOutcome::InProgress { lease_until, .. } => {
            let left = lease_until
                .duration_since(std::time::SystemTime::now())
                .expect("the lease is still live");
            assert!(
                left + started.elapsed() >= lease - Duration::from_millis(5),
                "a full lease from when the claim ran: {left:?} left"
            );
        }
        other => panic!("a duplicate right after the claim answered {other:?}"),
    }
}

async fn changed_resolves_when_the_record_settles(databases: Arc<Databases>) {
    let store = fresh_store(&databases).await;
    let request = request("s", "waited-on", 1, Duration::from_secs(30));
    let claim = claimed(&store, &request).await;
    store
        .changed(&request.scope, &request.key, Duration::from_millis(50))
        .await
        .expect("changed resolves at its poll bound");
    let waiter = {
        let store = store.clone();
        let (scope, key) = (request.scope.clone(), request.key.clone());
        tokio::spawn(async move { store.changed(&scope, &key, Duration::from_secs(3600)).await })
    };
    store.release(&claim).await.expect("release");
    waiter
        .await
        .unwrap()
        .expect("changed resolves once released");
}

async fn measure_claim_complete(databases: Arc<Databases>) {
    let store = fresh_store(&databases).await;
    let response = StoredResponse::new(201, vec![], r#"{"id":1}"#);
    let n = 2_000;
    let started = Instant::now();
    for i in 0..n {
        let claim = claimed(
            &store,
            &request("s", &format!("seq-{i}"), 1, Duration::from_secs(30)),
        )
        .await;
        store
            .complete(&claim, &response, Duration::from_secs(60))
            .await
            .unwrap();
    }
    let elapsed = started.elapsed();
    eprintln!(
        "sqlite: {n} sequential claim+complete in {elapsed:?}: {:.0}/s",
        f64::from(n) / elapsed.as_secs_f64()
    );
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let store = store.clone();
            let response = response.clone();
            tokio::spawn(async move {
                for i in 0..250 {
                    let claim = claimed(
                        &store,
                        &request("s", &format!("par-{t}-{i}"), 1, Duration::from_secs(30)),
                    )
                    .await;
                    store
                        .complete(&claim, &response, Duration::from_secs(60))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed();
    eprintln!(
        "sqlite: 2000 claim+complete from 8 tasks in {elapsed:?}: {:.0}/s",
        2000.0 / elapsed.as_secs_f64()
    );
}
