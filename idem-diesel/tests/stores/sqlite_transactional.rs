//! Transactional mode on SQLite (`docs/contract.md` §7): the engine drives a
//! `TransactionalSqliteStore`, the handler writes to a `ledger` table through
//! `SqliteTransaction::write`. Every test checks the outcome from another
//! connection: the record's completion and the ledger rows together, or
//! neither.

use std::sync::Arc;
use std::time::Duration;

use diesel::RunQueryDsl;
use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use idem_core::store::RecordState;
use idem_core::{
    Begin, Engine, Execution, Fingerprint, Policy, ProblemKind, Scope, Settlement, Store,
    StoredResponse,
};
use idem_diesel::{
    Event, SqliteOutbox, SqliteStore, SqliteTransaction, SqliteTransactionError,
    TransactionalSqliteStore,
};

use crate::postgres::key;
use crate::sqlite::{count, execute};
use crate::{Databases, TestFn, context_of, created, execute_new, fingerprint, until};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    (
        "sqlite_transactional::a_stored_status_commits_the_record_and_the_writes_together",
        |d| {
            Box::pin(a_stored_status_commits_the_record_and_the_writes_together(
                d,
            ))
        },
    ),
    (
        "sqlite_transactional::released_failed_and_dropped_executions_roll_everything_back",
        |d| {
            Box::pin(released_failed_and_dropped_executions_roll_everything_back(
                d,
            ))
        },
    ),
    (
        "sqlite_transactional::duplicates_see_the_committed_claim",
        |d| Box::pin(duplicates_see_the_committed_claim(d)),
    ),
    (
        "sqlite_transactional::the_write_lock_is_taken_at_the_first_write",
        |d| Box::pin(the_write_lock_is_taken_at_the_first_write(d)),
    ),
    (
        "sqlite_transactional::a_handler_that_lost_its_lease_rolls_back",
        |d| Box::pin(a_handler_that_lost_its_lease_rolls_back(d)),
    ),
    (
        "sqlite_transactional::another_writer_past_the_busy_timeout_is_a_503_and_no_effect",
        |d| {
            Box::pin(another_writer_past_the_busy_timeout_is_a_503_and_no_effect(
                d,
            ))
        },
    ),
    (
        "sqlite_transactional::a_panicking_write_leaves_no_transaction_open",
        |d| Box::pin(a_panicking_write_leaves_no_transaction_open(d)),
    ),
    (
        "sqlite_transactional::nested_transactions_are_savepoints",
        |d| Box::pin(nested_transactions_are_savepoints(d)),
    ),
    (
        "sqlite_transactional::events_are_staged_in_the_requests_transaction",
        |d| Box::pin(events_are_staged_in_the_requests_transaction(d)),
    ),
    (
        "sqlite_transactional::an_axum_handler_writes_in_the_requests_transaction",
        |d| Box::pin(an_axum_handler_writes_in_the_requests_transaction(d)),
    ),
];

pub(crate) const MEASUREMENTS: &[(&str, TestFn)] =
    &[("measure::sqlite_transactional_against_plain", |d| {
        Box::pin(measure_transactional_against_plain(d))
    })];

/// A fresh transactional store over a migrated file, with a `ledger` table for
/// the handlers' writes; the busy timeout is `busy`.
async fn fresh(databases: &Arc<Databases>, busy: Duration) -> TransactionalSqliteStore {
    let store = SqliteStore::builder()
        .busy_timeout(busy)
        .connect(&databases.fresh_sqlite_url())
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    execute(
        &store,
        "CREATE TABLE ledger (key TEXT NOT NULL, amount BIGINT NOT NULL)",
    )
    .await;
    store.transactional()
}

/// The conformance suite's store: transactional mode keeps every case of the
/// plain store, since its claims are committed on their own.
pub(crate) async fn fresh_transactional(databases: &Arc<Databases>) -> TransactionalSqliteStore {
    fresh(databases, Duration::from_secs(5)).await
}

fn engine(store: &TransactionalSqliteStore, policy: Policy) -> Engine {
    Engine::new(store.clone(), policy)
}

/// The execution's transaction, as a handler gets it.
fn transaction_of(execution: &Execution) -> SqliteTransaction {
    context_of(execution)
}

/// The handler's effect: one ledger row, written in the execution's transaction.
async fn write_ledger(
    transaction: &SqliteTransaction,
    key: &str,
    amount: i64,
) -> Result<(), SqliteTransactionError> {
    let key = key.to_owned();
    transaction
        .write(move |c| {
            diesel::sql_query("INSERT INTO ledger (key, amount) VALUES (?, ?)")
                .bind::<Text, _>(key)
                .bind::<BigInt, _>(amount)
                .execute(c)?;
            Ok(())
        })
        .await
}

async fn ledger_rows(store: &SqliteStore, key: &str) -> i64 {
    count(
        store,
        &format!("SELECT count(*) AS n FROM ledger WHERE key = '{key}'"),
    )
    .await
}

async fn record_state(store: &SqliteStore, key_name: &str) -> Option<RecordState> {
    Store::load(store, &Scope::new("alice"), &key(key_name))
        .await
        .expect("load")
        .map(|record| record.state)
}

async fn a_stored_status_commits_the_record_and_the_writes_together(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "charge-1").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "charge-1", 42))
        .await
        .expect("the handler's write");

    // Until it commits, nothing of it is visible from outside; the claim is.
    assert_eq!(ledger_rows(&plain, "charge-1").await, 0);
    assert!(matches!(
        record_state(&plain, "charge-1").await,
        Some(RecordState::InProgress { .. })
    ));
    assert_eq!(store.open_transactions(), 1);

    let settlement = execution.settle(&created("charged")).await;
    assert!(matches!(settlement, Settlement::Deliver), "{settlement:?}");
    assert_eq!(ledger_rows(&plain, "charge-1").await, 1);
    assert!(matches!(
        record_state(&plain, "charge-1").await,
        Some(RecordState::Completed { response }) if response == created("charged")
    ));
    assert_eq!(store.open_transactions(), 0);
    assert!(
        matches!(
            write_ledger(&transaction, "charge-1", 1).await,
            Err(SqliteTransactionError::Ended)
        ),
        "the handler's handle is spent once the request settled"
    );

    match engine
        .begin(Scope::new("alice"), key("charge-1"), fingerprint())
        .await
    {
        Begin::Replay(replay) => assert_eq!(replay.body, created("charged").body),
        other => panic!("the retry answered {other:?}"),
    }
    assert_eq!(ledger_rows(&plain, "charge-1").await, 1, "one effect");

    // A handler that writes nothing completes as on the plain store.
    let execution = execute_new(&engine, "read-only").await;
    assert!(matches!(
        execution.settle(&created("nothing to write")).await,
        Settlement::Deliver
    ));
    assert!(matches!(
        record_state(&plain, "read-only").await,
        Some(RecordState::Completed { .. })
    ));
}

async fn released_failed_and_dropped_executions_roll_everything_back(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());

    // A status that is not stored: released, so rolled back.
    let execution = execute_new(&engine, "released").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "released", 1))
        .await
        .unwrap();
    let settlement = execution
        .settle(&StoredResponse::new(503, vec![], "provider down"))
        .await;
    assert!(matches!(settlement, Settlement::Deliver), "{settlement:?}");

    // A handler that failed (an error, a panic).
    let execution = execute_new(&engine, "failed").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "failed", 1))
        .await
        .unwrap();
    execution.release().await;

    // An execution dropped unsettled: released in the background.
    let execution = execute_new(&engine, "dropped").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "dropped", 1))
        .await
        .unwrap();
    drop(execution);
    until(|| async { store.open_transactions() == 0 }).await;
    // The background release also deletes the claim.
    until(|| async { record_state(&plain, "dropped").await.is_none() }).await;

    for name in ["released", "failed", "dropped"] {
        assert_eq!(
            ledger_rows(&plain, name).await,
            0,
            "{name}: the write is rolled back"
        );
        assert_eq!(record_state(&plain, name).await, None, "{name}: no record");
        let retry = execute_new(&engine, name).await;
        let transaction = transaction_of(&retry);
        retry
            .run(write_ledger(&transaction, name, 7))
            .await
            .unwrap();
        assert!(matches!(
            retry.settle(&created("ok")).await,
            Settlement::Deliver
        ));
        assert_eq!(
            ledger_rows(&plain, name).await,
            1,
            "{name}: the retry's one effect"
        );
    }
}

async fn duplicates_see_the_committed_claim(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "busy").await;
    let transaction = transaction_of(&execution);

    let expect_409 = |begin: Begin| match begin {
        Begin::Reject(problem) => assert_eq!(
            (problem.kind, problem.status),
            (ProblemKind::RequestInProgress, 409)
        ),
        other => panic!("a duplicate during the execution answered {other:?}"),
    };
    // Before the first write.
    expect_409(
        engine
            .begin(Scope::new("alice"), key("busy"), fingerprint())
            .await,
    );
    execution
        .run(write_ledger(&transaction, "busy", 5))
        .await
        .unwrap();
    // While the transaction holds the write lock, the duplicate is answered
    // from the committed claim without waiting for the lock.
    expect_409(
        engine
            .begin(Scope::new("alice"), key("busy"), fingerprint())
            .await,
    );
    // Another body under the running key: 422 at once, the claim is committed.
    match engine
        .begin(
            Scope::new("alice"),
            key("busy"),
            Fingerprint::from_bytes([2; 32]),
        )
        .await
    {
        Begin::Reject(problem) => assert_eq!(problem.kind, ProblemKind::KeyReused),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        execution.settle(&created("done")).await,
        Settlement::Deliver
    ));
    assert_eq!(ledger_rows(&plain, "busy").await, 1);
}

async fn the_write_lock_is_taken_at_the_first_write(databases: Arc<Databases>) {
    let store = fresh(&databases, Duration::from_millis(200)).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "slow-call").await;
    let transaction = transaction_of(&execution);

    // A slow call before the first write holds no lock: other requests claim
    // and complete meanwhile.
    let other = execute_new(&engine, "meanwhile").await;
    assert!(matches!(
        other.settle(&created("fine")).await,
        Settlement::Deliver
    ));

    // From the first write on, other writers wait: with a 200 ms busy
    // timeout, a write from another connection fails.
    execution
        .run(write_ledger(&transaction, "slow-call", 1))
        .await
        .unwrap();
    let mut connection = plain.pool().get().await.unwrap();
    let refused = diesel_async::RunQueryDsl::execute(
        diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('outside', 1)"),
        &mut *connection,
    )
    .await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|error| error.to_string().contains("locked")),
        "{refused:?}"
    );
    assert!(matches!(
        execution.settle(&created("written")).await,
        Settlement::Deliver
    ));
    // Committed: the lock is free again.
    diesel_async::RunQueryDsl::execute(
        diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('outside', 1)"),
        &mut *connection,
    )
    .await
    .expect("the write lock is free after the commit");
    assert_eq!(ledger_rows(&plain, "slow-call").await, 1);
}

async fn a_handler_that_lost_its_lease_rolls_back(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let short = Policy::required().lease(Duration::from_millis(300));
    let engine = engine(&store, short);
    let late = execute_new(&engine, "contested").await;
    let late_transaction = transaction_of(&late);

    // The first execution stalls past its lease without renewing (its task
    // is not polled), and the retry claims the key, runs and commits.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let retry = execute_new(&engine, "contested").await;
    let transaction = transaction_of(&retry);
    retry
        .run(write_ledger(&transaction, "contested", 2))
        .await
        .unwrap();
    assert!(matches!(
        retry.settle(&created("the retry's")).await,
        Settlement::Deliver
    ));

    // The stalled one wakes up and writes: its commit finds the claim lost,
    // rolls back, and its client is told 503, not its 201.
    late.run(write_ledger(&late_transaction, "contested", 1))
        .await
        .unwrap();
    match late.settle(&created("the late one's")).await {
        Settlement::Retract(problem) => {
            assert_eq!(
                (problem.kind, problem.status),
                (ProblemKind::StoreUnavailable, 503)
            );
        }
        other => panic!("the late execution settled {other:?}"),
    }
    assert_eq!(
        count(
            &plain,
            "SELECT coalesce(sum(amount), 0) AS n FROM ledger WHERE key = 'contested'"
        )
        .await,
        2,
        "only the retry's effect"
    );
    assert!(matches!(
        record_state(&plain, "contested").await,
        Some(RecordState::Completed { response }) if response == created("the retry's")
    ));
}

async fn another_writer_past_the_busy_timeout_is_a_503_and_no_effect(databases: Arc<Databases>) {
    let store = fresh(&databases, Duration::from_millis(200)).await;
    let plain = store.plain().clone();
    let lease = Duration::from_millis(600);
    let engine = engine(&store, Policy::required().lease(lease));
    let execution = execute_new(&engine, "blocked").await;
    let transaction = transaction_of(&execution);

    // Another process's long transaction holds the file's write lock.
    let path = plain_path(&plain).await;
    let (hold, held) = std::sync::mpsc::channel::<()>();
    let (locked, is_locked) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        use diesel::Connection;
        let mut connection = diesel::SqliteConnection::establish(&path).unwrap();
        connection.batch_execute("BEGIN IMMEDIATE").unwrap();
        locked.send(()).unwrap();
        held.recv().unwrap();
        connection.batch_execute("ROLLBACK").unwrap();
    });
    is_locked.recv().unwrap();

    let refused = execution
        .run(write_ledger(&transaction, "blocked", 1))
        .await;
    assert!(
        matches!(refused, Err(SqliteTransactionError::Unavailable(_))),
        "{refused:?}"
    );
    // The handler answers 503 (not stored). The release cannot delete the
    // claim while the other writer holds the lock either: the key stays in
    // progress until its lease lapses, and nothing was written.
    assert!(matches!(
        execution
            .settle(&StoredResponse::new(503, vec![], "busy"))
            .await,
        Settlement::Deliver
    ));
    let released_at = std::time::Instant::now();
    hold.send(()).unwrap();
    holder.join().unwrap();
    match engine
        .begin(Scope::new("alice"), key("blocked"), fingerprint())
        .await
    {
        Begin::Reject(problem) => assert_eq!(problem.status, 409),
        Begin::Execute(_) => panic!("the key ran again within its lease"),
        other => panic!("{other:?}"),
    }
    assert_eq!(ledger_rows(&plain, "blocked").await, 0);

    // Once the lease has lapsed, the retry runs once.
    tokio::time::sleep(lease.saturating_sub(released_at.elapsed()) + Duration::from_millis(100))
        .await;
    let retry = execute_new(&engine, "blocked").await;
    let transaction = transaction_of(&retry);
    retry
        .run(write_ledger(&transaction, "blocked", 1))
        .await
        .unwrap();
    assert!(matches!(
        retry.settle(&created("ok")).await,
        Settlement::Deliver
    ));
    assert_eq!(ledger_rows(&plain, "blocked").await, 1);
}

/// The file of `store`, read from SQLite itself.
async fn plain_path(store: &SqliteStore) -> String {
    #[derive(diesel::QueryableByName)]
    struct File {
        #[diesel(sql_type = Text)]
        file: String,
    }
    let mut connection = store.pool().get().await.unwrap();
    diesel_async::RunQueryDsl::get_result::<File>(
        diesel::sql_query("SELECT file FROM pragma_database_list WHERE name = 'main'"),
        &mut *connection,
    )
    .await
    .unwrap()
    .file
}

async fn a_panicking_write_leaves_no_transaction_open(databases: Arc<Databases>) {
    // One connection: the one the panic happened on is the next step's.
    let url = databases.fresh_sqlite_url();
    let store = SqliteStore::builder()
        .max_connections(1)
        .connect(&url)
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    execute(
        &store,
        "CREATE TABLE ledger (key TEXT NOT NULL, amount BIGINT NOT NULL)",
    )
    .await;
    let transactional = store.transactional();
    let engine = engine(&transactional, Policy::required());
    let execution = execute_new(&engine, "panics").await;
    let transaction = transaction_of(&execution);
    let panicked = transaction
        .write(|c| -> Result<(), SqliteTransactionError> {
            diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('panics', 1)")
                .execute(c)?;
            panic!("the handler's step panics mid-transaction")
        })
        .await;
    assert!(
        matches!(panicked, Err(SqliteTransactionError::Unavailable(_))),
        "{panicked:?}"
    );
    execution.release().await;

    // The next execution runs on the same connection, and commits: seen from
    // another pool on the file.
    let next = execute_new(&engine, "after").await;
    let transaction = transaction_of(&next);
    write_ledger(&transaction, "after", 2).await.unwrap();
    assert!(matches!(
        next.settle(&created("after")).await,
        Settlement::Deliver
    ));
    let other = SqliteStore::connect(&url).await.expect("another pool");
    other.check_schema().await.expect("the table");
    assert_eq!(ledger_rows(&other, "after").await, 1, "committed");
    assert_eq!(ledger_rows(&other, "panics").await, 0, "rolled back");
    assert!(matches!(
        record_state(&other, "after").await,
        Some(RecordState::Completed { .. })
    ));
    assert_eq!(record_state(&other, "panics").await, None);
}

async fn nested_transactions_are_savepoints(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "nested").await;
    let transaction = transaction_of(&execution);
    transaction
        .write(|c| {
            use diesel::Connection;
            diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('nested', 1)")
                .execute(c)?;
            // A savepoint that fails rolls back alone.
            let inner: Result<(), diesel::result::Error> = c.transaction(|c| {
                diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('nested', 100)")
                    .execute(c)?;
                Err(diesel::result::Error::RollbackTransaction)
            });
            assert!(inner.is_err());
            Ok::<_, SqliteTransactionError>(())
        })
        .await
        .unwrap();
    assert!(matches!(
        execution.settle(&created("nested")).await,
        Settlement::Deliver
    ));
    assert_eq!(
        count(
            &plain,
            "SELECT sum(amount) AS n FROM ledger WHERE key = 'nested'"
        )
        .await,
        1
    );
}

async fn events_are_staged_in_the_requests_transaction(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let outbox = SqliteOutbox::new(plain.pool().clone());
    outbox.migrate().await.unwrap();
    let engine = engine(&store, Policy::required());
    let event = |n: u32| Event::new("orders", "alice", format!("{{\"order\":{n}}}"));

    // Committed with the request: the write and the event, in one step or two.
    let execution = execute_new(&engine, "committed").await;
    let transaction = transaction_of(&execution);
    let staging = outbox.clone();
    let first = event(1);
    transaction
        .write(move |c| {
            diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('committed', 1)")
                .execute(c)?;
            staging.stage_blocking(c, &first)?;
            Ok::<_, SqliteTransactionError>(())
        })
        .await
        .unwrap();
    outbox.stage_in(&transaction, &event(2)).await.unwrap();
    assert_eq!(
        count(&plain, "SELECT count(*) AS n FROM idem_outbox").await,
        0
    );
    assert!(matches!(
        execution.settle(&created("ordered")).await,
        Settlement::Deliver
    ));
    assert_eq!(
        count(&plain, "SELECT count(*) AS n FROM idem_outbox").await,
        2
    );

    // Released: neither the write nor the event.
    let execution = execute_new(&engine, "released").await;
    let transaction = transaction_of(&execution);
    outbox.stage_in(&transaction, &event(3)).await.unwrap();
    execution.release().await;
    assert_eq!(
        count(&plain, "SELECT count(*) AS n FROM idem_outbox").await,
        2
    );
    assert_eq!(record_state(&plain, "released").await, None);
}

#[derive(Clone)]
struct Ledger;

async fn order(
    idem_core::StoreContext(transaction): idem_core::StoreContext<SqliteTransaction>,
    execution: idem_axum::ExecutionInfo,
) -> (axum::http::StatusCode, String) {
    use axum::http::StatusCode;
    let key = execution.key().as_str().to_owned();
    match write_ledger(&transaction, &key, 25).await {
        Ok(()) => (StatusCode::CREATED, format!("ordered once for {key}")),
        Err(SqliteTransactionError::Unavailable(_)) => {
            (StatusCode::SERVICE_UNAVAILABLE, "busy".to_owned())
        }
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "failed".to_owned()),
    }
}

async fn an_axum_handler_writes_in_the_requests_transaction(databases: Arc<Databases>) {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let ordered = idem_axum::IdempotencyLayer::new(store.clone(), Policy::required())
        .global_scope()
        .on(axum::http::Method::POST, order)
        .expect("a transactional store hands the handler its transaction");
    let app = axum::Router::new()
        .route("/orders", ordered)
        .with_state(Ledger);
    let send = |key: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/orders")
                .header("idempotency-key", key)
                .body(Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (parts, String::from_utf8(body.to_vec()).unwrap())
        }
    };
    let (first, body) = send("order-1").await;
    assert_eq!(
        (first.status, body.as_str()),
        (StatusCode::CREATED, "ordered once for order-1")
    );
    let (retry, body) = send("order-1").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(body, "ordered once for order-1");
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(ledger_rows(&plain, "order-1").await, 1);
    assert_eq!(store.open_transactions(), 0);
}

/// One request after another, each with a one-row handler write: the plain
/// store (the write on its own) against transactional mode (the write in the
/// request's transaction).
async fn measure_transactional_against_plain(databases: Arc<Databases>) {
    const REQUESTS: u32 = 500;
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    for (name, engine) in [
        ("plain", Engine::new(plain.clone(), Policy::required())),
        ("transactional", engine(&store, Policy::required())),
    ] {
        let started = std::time::Instant::now();
        for n in 0..REQUESTS {
            let key_name = format!("{name}-{n}");
            let execution = execute_new(&engine, &key_name).await;
            match execution.context() {
                Some(_) => {
                    let transaction = transaction_of(&execution);
                    write_ledger(&transaction, &key_name, 1).await.unwrap();
                }
                None => {
                    execute(
                        &plain,
                        &format!("INSERT INTO ledger (key, amount) VALUES ('{key_name}', 1)"),
                    )
                    .await
                }
            }
            assert!(matches!(
                execution.settle(&created("ok")).await,
                Settlement::Deliver
            ));
        }
        let per_request = started.elapsed() / REQUESTS;
        eprintln!("sqlite {name}: {per_request:?} per first execution");
    }
}
