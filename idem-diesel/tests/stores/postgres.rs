//! PostgreSQL beyond the conformance suite: migrations, table names, instances
//! sharing a database, corrupt rows, waiting, outages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem_core::store::{ClaimOutcome, ClaimRequest, OwnerToken};
use idem_core::{Fingerprint, IdempotencyKey, Scope, Store, StoreError, StoredResponse};
use idem_diesel::{PgStore, SetupError};
use idem_testkit::TestPostgres;

use crate::{Databases, TestFn, error_chain};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    (
        "postgres::check_schema_names_a_missing_or_older_table_and_the_fix",
        |d| Box::pin(check_schema_names_a_missing_or_older_table_and_the_fix(d)),
    ),
    (
        "postgres::migrations_run_once_under_concurrent_instances",
        |d| Box::pin(migrations_run_once_under_concurrent_instances(d)),
    ),
    (
        "postgres::custom_schema_and_table_are_created_and_used",
        |d| Box::pin(custom_schema_and_table_are_created_and_used(d)),
    ),
    (
        "postgres::migrate_and_claim_on_a_current_thread_runtime",
        |d| Box::pin(migrate_and_claim_on_a_current_thread_runtime(d)),
    ),
    ("postgres::store_statements_stay_prepared", |d| {
        Box::pin(store_statements_stay_prepared(d))
    }),
    ("postgres::a_claim_of_a_live_record_writes_nothing", |d| {
        Box::pin(a_claim_of_a_live_record_writes_nothing(d))
    }),
    ("postgres::invalid_table_names_are_refused", |d| {
        Box::pin(invalid_table_names_are_refused(d))
    }),
    ("postgres::two_instances_race_for_one_claim", |d| {
        Box::pin(two_instances_race_for_one_claim(d))
    }),
    ("postgres::corrupt_rows_are_reported_as_corrupt", |d| {
        Box::pin(corrupt_rows_are_reported_as_corrupt(d))
    }),
    ("postgres::changed_resolves_when_the_record_settles", |d| {
        Box::pin(changed_resolves_when_the_record_settles(d))
    }),
    ("postgres::outage_answers_unavailable_then_recovers", |d| {
        Box::pin(outage_answers_unavailable_then_recovers(d))
    }),
    (
        "postgres::connecting_to_a_missing_database_fails_with_its_cause",
        |d| Box::pin(connecting_to_a_missing_database_fails_with_its_cause(d)),
    ),
];

pub(crate) const MEASUREMENTS: &[(&str, TestFn)] = &[("measure::postgres_claim_complete", |d| {
    Box::pin(measure_claim_complete(d))
})];

#[derive(QueryableByName)]
pub(crate) struct Count {
    #[diesel(sql_type = BigInt)]
    pub(crate) n: i64,
}

/// A migrated store on a fresh database.
pub(crate) async fn fresh_store(databases: &Arc<Databases>) -> PgStore {
    let store = PgStore::connect(&databases.fresh_postgres().await)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    store
}

/// Runs `sql` on the store's pool and answers its `n` column.
pub(crate) async fn count(store: &PgStore, sql: &str) -> i64 {
    let mut connection = store.pool().get().await.expect("a connection");
    diesel::sql_query(sql)
        .get_result::<Count>(&mut *connection)
        .await
        .expect(sql)
        .n
}

/// Runs `sql` on the store's pool.
pub(crate) async fn execute(store: &PgStore, sql: &str) {
    let mut connection = store.pool().get().await.expect("a connection");
    connection.batch_execute(sql).await.expect(sql);
}

pub(crate) fn key(name: &str) -> IdempotencyKey {
    IdempotencyKey::new(name).expect("a valid key")
}

pub(crate) fn request(
    scope: &str,
    key_name: &str,
    fingerprint: u8,
    lease: Duration,
) -> ClaimRequest {
    ClaimRequest {
        scope: Scope::new(scope),
        key: key(key_name),
        fingerprint: Fingerprint::from_bytes([fingerprint; 32]),
        owner: OwnerToken::random(),
        lease,
        retention: Duration::from_secs(3600),
    }
}

pub(crate) async fn claimed(store: &dyn Store, request: &ClaimRequest) -> idem_core::store::Claim {
    match store.claim(request).await {
        Ok(ClaimOutcome::Claimed(claim)) => claim,
        other => panic!("a claim of a new record answered {other:?}"),
    }
}

async fn migrations_run_once_under_concurrent_instances(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    let mut instances = Vec::new();
    for _ in 0..4 {
        instances.push(PgStore::connect(&url).await.expect("connect"));
    }
    let migrations = instances.iter().map(|store| {
        let store = store.clone();
        tokio::spawn(async move { store.migrate().await })
    });
    for migration in migrations.collect::<Vec<_>>() {
        migration
            .await
            .unwrap()
            .expect("every concurrent migrate succeeds");
    }
    let store = &instances[0];
    store.migrate().await.expect("a later migrate is a no-op");
    assert_eq!(
        count(
            store,
            "SELECT count(*) AS n FROM __diesel_schema_migrations"
        )
        .await,
        1,
        "the one migration is recorded once"
    );
    assert_eq!(
        count(
            store,
            "SELECT count(*) AS n FROM pg_indexes
             WHERE tablename = 'idem_records' AND indexname = 'idem_records_expires_at'"
        )
        .await,
        1,
        "the cleanup index exists"
    );
    let claim = claimed(store, &request("s", "k", 1, Duration::from_secs(30))).await;
    store
        .complete(
            &claim,
            &StoredResponse::new(201, vec![], "ok"),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
}

/// actix-web runs each worker on a current-thread runtime: diesel's synchronous
/// migration harness must not need a multi-threaded one.
async fn migrate_and_claim_on_a_current_thread_runtime(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = PgStore::connect(&url).await.expect("connect");
            store.migrate().await.expect("migrate");
            claimed(&store, &request("s", "k", 1, Duration::from_secs(30))).await;
        });
    })
    .await
    .unwrap();
}

async fn custom_schema_and_table_are_created_and_used(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    let custom = PgStore::builder()
        .schema("billing")
        .table("idem_keys")
        .connect(&url)
        .await
        .expect("connect");
    custom
        .migrate()
        .await
        .expect("migrate creates the schema and the table");
    custom.migrate().await.expect("a second migrate is a no-op");
    assert_eq!(
        count(
            &custom,
            "SELECT count(*) AS n FROM pg_tables WHERE schemaname = 'billing' AND tablename = 'idem_keys'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &custom,
            "SELECT count(*) AS n FROM pg_tables WHERE tablename = 'idem_records'"
        )
        .await,
        0,
        "a custom name creates no default table"
    );
    assert_eq!(
        count(
            &custom,
            "SELECT count(*) AS n FROM pg_tables WHERE tablename = '__diesel_schema_migrations'"
        )
        .await,
        0,
        "a custom name runs the DDL, not the migrations"
    );

    let request = request("s", "shared-key", 1, Duration::from_secs(30));
    let claim = claimed(&custom, &request).await;
    let response = StoredResponse::new(201, vec![], "custom");
    custom
        .complete(&claim, &response, Duration::from_secs(60))
        .await
        .expect("complete");
    assert_eq!(
        count(&custom, "SELECT count(*) AS n FROM billing.idem_keys").await,
        1,
        "the record is in the custom table"
    );

    // The default table in the same database is another set of records.
    let default = PgStore::connect(&url).await.expect("connect");
    default.migrate().await.expect("migrate");
    let again = self::request("s", "shared-key", 2, Duration::from_secs(30));
    assert!(
        matches!(default.claim(&again).await, Ok(ClaimOutcome::Claimed(_))),
        "the default table does not see the custom table's record"
    );
    assert_eq!(
        custom.claim(&again).await.unwrap(),
        ClaimOutcome::Completed {
            fingerprint: request.fingerprint,
            response
        }
    );
}

async fn store_statements_stay_prepared(databases: Arc<Databases>) {
    // One connection, so the statements land in the session this test inspects.
    let store = PgStore::builder()
        .max_connections(1)
        .connect(&databases.fresh_postgres().await)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    for n in 0..3 {
        let claim = claimed(
            &store,
            &request("s", &format!("k-{n}"), 1, Duration::from_secs(30)),
        )
        .await;
        store
            .complete(
                &claim,
                &StoredResponse::new(200, vec![], ""),
                Duration::from_secs(60),
            )
            .await
            .expect("complete");
    }
    let found = claimed_again(&store).await;
    assert!(matches!(found, ClaimOutcome::Completed { .. }), "{found:?}");
    assert_eq!(
        count(
            &store,
            "SELECT count(*) AS n FROM pg_prepared_statements
             WHERE statement NOT LIKE '%pg_prepared_statements%'
               AND (statement LIKE '%claimed AS%'
                    OR statement LIKE '%SET%state = ''completed''%')"
        )
        .await,
        2,
        "the claim and the completion are each prepared once and reused: one round trip per step"
    );
}

/// The row version of `key_name` in scope `s`: its physical address and the
/// transaction that last locked or updated it (0 when none did).
async fn row_version(store: &PgStore, key_name: &str) -> (String, String) {
    #[derive(QueryableByName)]
    struct Version {
        #[diesel(sql_type = Text)]
        ctid: String,
        #[diesel(sql_type = Text)]
        xmax: String,
    }
    let mut connection = store.pool().get().await.expect("a connection");
    let version = diesel::sql_query(
        "SELECT ctid::text AS ctid, xmax::text AS xmax FROM idem_records
         WHERE scope = 's' AND key = $1",
    )
    .bind::<Text, _>(key_name)
    .get_result::<Version>(&mut *connection)
    .await
    .expect("the record's row");
    (version.ctid, version.xmax)
}

async fn a_claim_of_a_live_record_writes_nothing(databases: Arc<Databases>) {
    let store = fresh_store(&databases).await;
    let lease = Duration::from_secs(30);
    let running = claimed(&store, &request("s", "running", 1, lease)).await;
    let done = claimed(&store, &request("s", "done", 1, lease)).await;
    store
        .complete(
            &done,
            &StoredResponse::new(201, vec![], "ok"),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    let before = (
        row_version(&store, "running").await,
        row_version(&store, "done").await,
    );
    assert_eq!((before.0.1.as_str(), before.1.1.as_str()), ("0", "0"));
    for _ in 0..3 {
        let found = store
            .claim(&request("s", "running", 1, lease))
            .await
            .expect("claim");
        assert!(
            matches!(found, ClaimOutcome::InProgress { .. }),
            "{found:?}"
        );
        let found = store
            .claim(&request("s", "done", 1, lease))
            .await
            .expect("claim");
        assert!(matches!(found, ClaimOutcome::Completed { .. }), "{found:?}");
    }
    let after = (
        row_version(&store, "running").await,
        row_version(&store, "done").await,
    );
    assert_eq!(
        after, before,
        "a claim that finds a live record neither locks nor updates its row"
    );
    store.release(&running).await.expect("release");
}

async fn claimed_again(store: &PgStore) -> ClaimOutcome {
    store
        .claim(&request("s", "k-0", 1, Duration::from_secs(30)))
        .await
        .expect("claim")
}

/// Asserts that `check_schema` found no table `name`, and says to migrate.
pub(crate) fn assert_schema_missing(error: &SetupError, name: &str) {
    assert!(
        matches!(error, SetupError::SchemaMissing { table } if table == name),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        format!(
            "the idempotency table {name} is missing: run store.migrate() at start-up \
             (or apply store.ddl() with your migration tool)"
        )
    );
}

/// Asserts that `check_schema` found an older `idem_records` (the one without
/// `replayable` and `created_at`), and says to migrate.
pub(crate) fn assert_schema_outdated(error: &SetupError) {
    assert!(
        matches!(error, SetupError::SchemaOutdated { table, missing }
            if table == "idem_records" && missing == &["replayable", "created_at"]),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .ends_with(": run store.migrate() at start-up")
    );
}

/// The table an older idem-diesel would have made: without `replayable` and
/// `created_at`.
const OLDER_TABLE: &str = "CREATE TABLE idem_records (
    scope text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,
    state text NOT NULL, owner uuid, lease_until timestamptz, status integer,
    headers bytea, body bytea, expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key))";

async fn check_schema_names_a_missing_or_older_table_and_the_fix(databases: Arc<Databases>) {
    let store = PgStore::connect(&databases.fresh_postgres().await)
        .await
        .expect("connect");
    assert_schema_missing(&store.check_schema().await.unwrap_err(), "idem_records");

    execute(&store, OLDER_TABLE).await;
    assert_schema_outdated(&store.check_schema().await.unwrap_err());

    execute(&store, "DROP TABLE idem_records").await;
    store.migrate().await.expect("migrate");
    store.check_schema().await.expect("a migrated table passes");

    // A configured schema and table are looked up as configured, not through
    // the search_path, which still finds the default table.
    let custom = PgStore::builder()
        .schema("idem")
        .table("payment_keys")
        .build(store.pool().clone())
        .expect("build");
    assert_schema_missing(
        &custom.check_schema().await.unwrap_err(),
        "idem.payment_keys",
    );
    custom.migrate().await.expect("migrate");
    custom
        .check_schema()
        .await
        .expect("a migrated custom table passes");
}

async fn invalid_table_names_are_refused(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    let refused = PgStore::builder()
        .table("idem; DROP TABLE accounts")
        .connect(&url)
        .await;
    assert!(
        matches!(refused, Err(SetupError::InvalidName { kind: "table", .. })),
        "{:?}",
        refused.err()
    );
    let refused = PgStore::builder().schema("a.b").connect(&url).await;
    assert!(matches!(
        refused,
        Err(SetupError::InvalidName { kind: "schema", .. })
    ));
}

async fn two_instances_race_for_one_claim(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    let first = PgStore::connect(&url).await.expect("connect");
    first.migrate().await.expect("migrate");
    let second = PgStore::connect(&url).await.expect("connect");
    let barrier = Arc::new(tokio::sync::Barrier::new(40));
    let racers: Vec<_> = (0..40u8)
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
    assert_eq!(granted, 1, "one claim in two instances wins");
}

async fn corrupt_rows_are_reported_as_corrupt(databases: Arc<Databases>) {
    let store = fresh_store(&databases).await;
    // Written by hand: the headers are not an encoding (a length with no bytes).
    execute(
        &store,
        "INSERT INTO idem_records
             (scope, key, fingerprint, state, status, headers, body, replayable, expires_at)
         VALUES ('s', 'damaged', decode(repeat('01', 32), 'hex'), 'completed',
                 200, '\\x00000009', '\\x', true, now() + interval '1 hour')",
    )
    .await;
    let claim = store
        .claim(&request("s", "damaged", 1, Duration::from_secs(30)))
        .await;
    assert!(
        matches!(claim, Err(StoreError::Corrupt(_))),
        "claim: {claim:?}"
    );
    let load = Store::load(&store, &Scope::new("s"), &key("damaged")).await;
    assert!(
        matches!(load, Err(StoreError::Corrupt(_))),
        "load: {load:?}"
    );
}

async fn changed_resolves_when_the_record_settles(databases: Arc<Databases>) {
    let store = fresh_store(&databases).await;
    let request = request("s", "waited-on", 1, Duration::from_secs(30));
    let claim = claimed(&store, &request).await;

    // With nothing happening, `changed` still resolves: at its poll bound.
    store
        .changed(&request.scope, &request.key, Duration::from_millis(50))
        .await
        .expect("changed");

    // With a bound far away, only the completion can end the wait.
    let waiter = {
        let store = store.clone();
        let (scope, key) = (request.scope.clone(), request.key.clone());
        tokio::spawn(async move { store.changed(&scope, &key, Duration::from_secs(3600)).await })
    };
    store
        .complete(
            &claim,
            &StoredResponse::new(200, vec![], ""),
            Duration::from_secs(60),
        )
        .await
        .expect("complete");
    waiter
        .await
        .unwrap()
        .expect("changed resolves once completed");
}

async fn outage_answers_unavailable_then_recovers(_: Arc<Databases>) {
    // A cluster of its own: stopping the shared one would fail other trials.
    let cluster = tokio::task::spawn_blocking(TestPostgres::start)
        .await
        .unwrap()
        .unwrap_or_else(|error| panic!("{}", error_chain(&error)));
    let store = PgStore::connect(&cluster.url("postgres"))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let before = claimed(&store, &request("s", "before", 1, Duration::from_secs(60))).await;

    let cluster = tokio::task::spawn_blocking(move || {
        cluster
            .stop()
            .unwrap_or_else(|error| panic!("{}", error_chain(&error)));
        cluster
    })
    .await
    .unwrap();
    let started = Instant::now();
    let down = store
        .claim(&request("s", "during", 1, Duration::from_secs(60)))
        .await;
    let answered_in = started.elapsed();
    match &down {
        Err(error @ StoreError::Unavailable(_)) => {
            eprintln!(
                "outage: claim answered in {answered_in:?}: {}",
                error_chain(error)
            );
        }
        other => panic!("a claim while the database is down answered {other:?}"),
    }
    let completion = store
        .complete(
            &before,
            &StoredResponse::new(201, vec![], "done"),
            Duration::from_secs(60),
        )
        .await;
    assert!(
        matches!(completion, Err(StoreError::Unavailable(_))),
        "a completion while the database is down is a failure, not a stale owner: {completion:?}"
    );

    let cluster = tokio::task::spawn_blocking(move || {
        cluster
            .resume()
            .unwrap_or_else(|error| panic!("{}", error_chain(&error)));
        cluster
    })
    .await
    .unwrap();
    store
        .complete(
            &before,
            &StoredResponse::new(201, vec![], "done"),
            Duration::from_secs(60),
        )
        .await
        .expect("the claim made before the outage completes after it");
    assert!(matches!(
        store
            .claim(&request("s", "after", 1, Duration::from_secs(60)))
            .await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    drop(store);
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

async fn connecting_to_a_missing_database_fails_with_its_cause(databases: Arc<Databases>) {
    let url = databases.cluster().url("no_such_database");
    let error = PgStore::connect(&url).await.expect_err("connect fails");
    assert!(matches!(error, SetupError::Connect(_)), "{error:?}");
    assert!(
        error_chain(&error).contains("no_such_database"),
        "the cause is kept: {}",
        error_chain(&error)
    );
}

async fn measure_claim_complete(databases: Arc<Databases>) {
    let store = fresh_store(&databases).await;
    let response = StoredResponse::new(201, vec![], r#"{"id":1}"#);
    // Sequential: the round trips of one request's claim and completion.
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
        "postgres: {n} sequential claim+complete in {elapsed:?}: {:.0}/s",
        f64::from(n) / elapsed.as_secs_f64()
    );
    // Concurrent: 16 tasks over the pool of 10.
    let started = Instant::now();
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let store = store.clone();
            let response = response.clone();
            tokio::spawn(async move {
                for i in 0..500 {
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
        "postgres: 8000 claim+complete from 16 tasks in {elapsed:?}: {:.0}/s",
        8000.0 / elapsed.as_secs_f64()
    );
    // One connection, no pool: the statement's own cost.
    let mut connection = AsyncPgConnection::establish(&databases.fresh_postgres().await)
        .await
        .unwrap();
    let started = Instant::now();
    for _ in 0..n {
        diesel::sql_query("SELECT 1::bigint AS n")
            .get_result::<Count>(&mut connection)
            .await
            .unwrap();
    }
    eprintln!(
        "postgres: one round trip (SELECT 1) takes {:?}",
        started.elapsed() / n
    );
}
