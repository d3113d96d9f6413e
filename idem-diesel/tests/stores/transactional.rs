//! Transactional mode on PostgreSQL (`docs/contract.md` §7): the engine drives a
//! `TransactionalPgStore`, and the handler writes to a `ledger` table through
//! the execution's transaction. Every test checks the outcome from another
//! connection: the record and the ledger rows together, or neither.

use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem_core::store::RecordState;
use idem_core::{
    Begin, Engine, Execution, Fingerprint, InProgress, Policy, ProblemKind, Scope, Settlement,
    Store, StoredResponse,
};
use idem_diesel::{PgStore, PgTransaction, TransactionEnded, TransactionalPgStore};

use crate::postgres::{Count, count, execute, fresh_store, key};
use crate::{Databases, TestFn, context_of, created, execute_new, fingerprint, until};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    (
        "transactional::a_stored_status_commits_the_record_and_the_writes_together",
        |d| {
            Box::pin(a_stored_status_commits_the_record_and_the_writes_together(
                d,
            ))
        },
    ),
    (
        "transactional::released_failed_and_dropped_executions_roll_everything_back",
        |d| {
            Box::pin(released_failed_and_dropped_executions_roll_everything_back(
                d,
            ))
        },
    ),
    (
        "transactional::a_duplicate_waits_for_the_commit_and_replays",
        |d| Box::pin(a_duplicate_waits_for_the_commit_and_replays(d)),
    ),
    (
        "transactional::a_duplicate_during_the_transaction_gets_409",
        |d| Box::pin(a_duplicate_during_the_transaction_gets_409(d)),
    ),
    (
        "transactional::a_replay_reads_the_record_outside_any_transaction",
        |d| Box::pin(a_replay_reads_the_record_outside_any_transaction(d)),
    ),
    (
        "transactional::a_lock_wait_past_lock_timeout_fails_and_rolls_back",
        |d| Box::pin(a_lock_wait_past_lock_timeout_fails_and_rolls_back(d)),
    ),
    (
        "transactional::a_killed_connection_leaves_nothing_and_the_retry_runs_once",
        |d| {
            Box::pin(a_killed_connection_leaves_nothing_and_the_retry_runs_once(
                d,
            ))
        },
    ),
    (
        "transactional::a_completion_that_finds_no_record_commits_nothing",
        |d| Box::pin(a_completion_that_finds_no_record_commits_nothing(d)),
    ),
    ("transactional::nested_transactions_are_savepoints", |d| {
        Box::pin(nested_transactions_are_savepoints(d))
    }),
    (
        "transactional::an_execution_stalled_past_its_idle_timeout_is_ended_by_the_server",
        |d| Box::pin(an_execution_stalled_past_its_idle_timeout_is_ended_by_the_server(d)),
    ),
    (
        "transactional::a_handler_slower_than_the_lease_runs_once_and_delivers",
        |d| Box::pin(a_handler_slower_than_the_lease_runs_once_and_delivers(d)),
    ),
    (
        "transactional::an_axum_handler_writes_in_the_requests_transaction",
        |d| Box::pin(an_axum_handler_writes_in_the_requests_transaction(d)),
    ),
];

pub(crate) const MEASUREMENTS: &[(&str, TestFn)] =
    &[("measure::postgres_transactional_against_plain", |d| {
        Box::pin(measure_transactional_against_plain(d))
    })];

/// The conformance cases that hold in transactional mode. The others observe
/// an in-progress record from outside its transaction (its fingerprint, its
/// lease lapsing, `load` seeing it), which transactional mode hides by design.
pub(crate) const CONFORMANCE: &[&str] = &[
    "claim_of_completed_returns_response",
    "release_makes_record_new",
    "completion_resets_retention",
    "replay_is_byte_exact",
    "non_replayable_response_round_trips",
    "scopes_are_isolated",
];

/// A fresh transactional store over a migrated table, and a `ledger` table for
/// the handlers' writes.
pub(crate) async fn fresh_transactional(databases: &Arc<Databases>) -> TransactionalPgStore {
    let store = fresh_store(databases).await;
    execute(
        &store,
        "CREATE TABLE ledger (key text NOT NULL, amount bigint NOT NULL)",
    )
    .await;
    store.transactional()
}

fn engine(store: &TransactionalPgStore, policy: Policy) -> Engine {
    Engine::new(store.clone(), policy)
}

/// The execution's transaction, as a handler gets it.
fn transaction_of(execution: &Execution) -> PgTransaction {
    context_of(execution)
}

/// The handler's effect: one ledger row, written in the execution's transaction.
async fn write_ledger(
    transaction: &PgTransaction,
    key: &str,
    amount: i64,
) -> diesel::QueryResult<()> {
    let mut connection = transaction
        .connection()
        .await
        .expect("the transaction is open");
    diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ($1, $2)")
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(amount)
        .execute(&mut *connection)
        .await
        .map(drop)
}

async fn ledger_rows(store: &PgStore, key: &str) -> i64 {
    count(
        store,
        &format!("SELECT count(*) AS n FROM ledger WHERE key = '{key}'"),
    )
    .await
}

async fn record_state(store: &PgStore, key_name: &str) -> Option<RecordState> {
    Store::load(store, &Scope::new("alice"), &key(key_name))
        .await
        .expect("load")
        .map(|record| record.state)
}

async fn a_replay_reads_the_record_outside_any_transaction(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "paid").await;
    let settlement = execution.settle(&created("paid")).await;
    assert!(matches!(settlement, Settlement::Deliver), "{settlement:?}");
    // Another session holds the key's execution lock (class 0x69646d03, the
    // hash of the table, the scope and the key, newline-separated: what an
    // execution's transaction takes). A replay that opened a transaction and
    // tried the lock would answer in progress; the replay reads the completed
    // record without either.
    let mut holder = plain.pool().get().await.expect("a connection");
    holder
        .batch_execute(
            "SELECT pg_advisory_lock(1768189187, hashtext('idem_records' || E'\\n' || 'alice' || E'\\n' || 'paid'))",
        )
        .await
        .expect("lock");
    let replay = store
        .claim(&idem_core::store::ClaimRequest {
            scope: Scope::new("alice"),
            key: key("paid"),
            fingerprint: fingerprint(),
            owner: idem_core::store::OwnerToken::random(),
            lease: Duration::from_secs(30),
            retention: Duration::from_secs(60),
        })
        .await
        .expect("claim");
    let idem_core::store::ClaimOutcome::Completed { response, .. } = replay else {
        panic!("a completed record answered {replay:?}");
    };
    assert_eq!(response.body, "paid");
    assert_eq!(store.open_transactions(), 0);
    holder
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .expect("unlock");
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

    // Until it commits, nothing of it is visible from outside.
    assert_eq!(ledger_rows(&plain, "charge-1").await, 0);
    assert_eq!(record_state(&plain, "charge-1").await, None);
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
        matches!(transaction.connection().await, Err(TransactionEnded)),
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

    // An execution dropped unsettled (its task was cancelled): released in the
    // background.
    let execution = execute_new(&engine, "dropped").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "dropped", 1))
        .await
        .unwrap();
    drop(execution);
    until(|| async { store.open_transactions() == 0 }).await;

    for name in ["released", "failed", "dropped"] {
        assert_eq!(
            ledger_rows(&plain, name).await,
            0,
            "{name}: the write is rolled back"
        );
        assert_eq!(record_state(&plain, name).await, None, "{name}: no record");
        // The retry runs the handler, and this time it commits.
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
    assert_eq!(
        count(&plain, "SELECT count(*) AS n FROM pg_stat_activity WHERE state = 'idle in transaction' AND datname = current_database()").await,
        0,
        "no transaction is left open"
    );
}

async fn a_duplicate_waits_for_the_commit_and_replays(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let policy = Policy::required().in_progress(InProgress::Wait {
        up_to: Duration::from_secs(60),
    });
    let engine = engine(&store, policy);
    let execution = execute_new(&engine, "slow").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "slow", 5))
        .await
        .unwrap();

    let duplicate = tokio::spawn({
        let engine = engine.clone();
        async move {
            engine
                .begin(Scope::new("alice"), key("slow"), fingerprint())
                .await
        }
    });
    // The duplicate is waiting once it has polled the key's lock.
    until(|| async {
        count(
            &plain,
            "SELECT count(*) AS n FROM pg_stat_activity
             WHERE datname = current_database()
               AND query LIKE '%NOT pg_try_advisory_xact_lock%'
               AND query NOT LIKE '%pg_stat_activity%'",
        )
        .await
            > 0
    })
    .await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate waits while the transaction is open"
    );

    assert!(matches!(
        execution.settle(&created("slow and steady")).await,
        Settlement::Deliver
    ));
    match duplicate.await.unwrap() {
        Begin::Replay(replay) => {
            assert_eq!(replay.status, 201);
            assert_eq!(replay.body, created("slow and steady").body);
            assert_eq!(
                replay.header_values("idempotent-replayed").next(),
                Some(&b"true"[..])
            );
        }
        other => panic!("the waiting duplicate answered {other:?}"),
    }
    assert_eq!(ledger_rows(&plain, "slow").await, 1);
}

async fn a_duplicate_during_the_transaction_gets_409(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let execution = execute_new(&engine(&store, Policy::required()), "busy").await;
    let transaction = transaction_of(&execution);
    execution
        .run(write_ledger(&transaction, "busy", 5))
        .await
        .unwrap();

    // Reject mode: 409 at once, with Retry-After.
    let rejecting = engine(&store, Policy::required());
    match rejecting
        .begin(Scope::new("alice"), key("busy"), fingerprint())
        .await
    {
        Begin::Reject(problem) => {
            assert_eq!(
                (problem.kind, problem.status, problem.retry_after),
                (
                    ProblemKind::RequestInProgress,
                    409,
                    Some(Duration::from_secs(1))
                )
            );
        }
        other => panic!("a duplicate during the transaction answered {other:?}"),
    }
    // Wait mode: 409 once the wait's bound has passed.
    let waiting = engine(
        &store,
        Policy::required().in_progress(InProgress::Wait {
            up_to: Duration::from_millis(300),
        }),
    );
    match waiting
        .begin(Scope::new("alice"), key("busy"), fingerprint())
        .await
    {
        Begin::Reject(problem) => assert_eq!(problem.status, 409),
        other => panic!("a duplicate past its wait answered {other:?}"),
    }
    // A different request under the running key: its fingerprint is hidden
    // in the uncommitted record, so 409 too (422 once it commits).
    match rejecting
        .begin(
            Scope::new("alice"),
            key("busy"),
            Fingerprint::from_bytes([2; 32]),
        )
        .await
    {
        Begin::Reject(problem) => assert_eq!(problem.status, 409),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        execution.settle(&created("done")).await,
        Settlement::Deliver
    ));
    match rejecting
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
    assert_eq!(ledger_rows(&plain, "busy").await, 1);
}

async fn a_lock_wait_past_lock_timeout_fails_and_rolls_back(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases)
        .await
        .plain()
        .transactional_builder()
        .lock_timeout(Duration::from_millis(200))
        .build();
    assert_eq!(store.get_lock_timeout(), Duration::from_millis(200));
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());

    // Another transaction of the application holds the ledger.
    let mut blocker = plain
        .pool()
        .dedicated_connection()
        .await
        .expect("a connection");
    blocker
        .batch_execute("BEGIN; LOCK TABLE ledger IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let execution = execute_new(&engine, "blocked").await;
    let transaction = transaction_of(&execution);
    let written = execution
        .run(write_ledger(&transaction, "blocked", 9))
        .await;
    let error = written.expect_err("the write waits past lock_timeout");
    assert!(error.to_string().contains("lock timeout"), "{error}");
    execution.release().await;
    blocker.batch_execute("ROLLBACK").await.unwrap();

    assert_eq!(record_state(&plain, "blocked").await, None);
    assert_eq!(ledger_rows(&plain, "blocked").await, 0);
    let retry = execute_new(&engine, "blocked").await;
    let transaction = transaction_of(&retry);
    retry
        .run(write_ledger(&transaction, "blocked", 9))
        .await
        .unwrap();
    assert!(matches!(
        retry.settle(&created("ok")).await,
        Settlement::Deliver
    ));
    assert_eq!(ledger_rows(&plain, "blocked").await, 1);
}

async fn a_killed_connection_leaves_nothing_and_the_retry_runs_once(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    // The retry waits, in case the killed backend still holds the key's lock
    // for a moment while it exits.
    let engine = engine(
        &store,
        Policy::required().in_progress(InProgress::Wait {
            up_to: Duration::from_secs(60),
        }),
    );
    let execution = execute_new(&engine, "doomed").await;
    let transaction = transaction_of(&execution);
    let pid = execution
        .run(async {
            write_ledger(&transaction, "doomed", 100).await.unwrap();
            let mut connection = transaction.connection().await.unwrap();
            diesel::sql_query("SELECT pg_backend_pid()::bigint AS n")
                .get_result::<Count>(&mut *connection)
                .await
                .unwrap()
                .n
        })
        .await;
    assert_eq!(
        count(
            &plain,
            &format!("SELECT pg_terminate_backend({pid})::int::bigint AS n")
        )
        .await,
        1
    );

    let Settlement::Retract(problem) = execution.settle(&created("charged")).await else {
        panic!("a completion on a killed connection must not deliver the handler's answer")
    };
    assert_eq!(
        (problem.kind, problem.status),
        (ProblemKind::StoreUnavailable, 503)
    );
    assert!(problem.retry_after.is_some());
    assert_eq!(record_state(&plain, "doomed").await, None, "no record");
    assert_eq!(ledger_rows(&plain, "doomed").await, 0, "no write");

    let retry = execute_new(&engine, "doomed").await;
    let transaction = transaction_of(&retry);
    retry
        .run(write_ledger(&transaction, "doomed", 100))
        .await
        .unwrap();
    assert!(matches!(
        retry.settle(&created("charged")).await,
        Settlement::Deliver
    ));
    assert!(matches!(
        engine
            .begin(Scope::new("alice"), key("doomed"), fingerprint())
            .await,
        Begin::Replay(_)
    ));
    assert_eq!(ledger_rows(&plain, "doomed").await, 1, "exactly one effect");
}

async fn an_execution_stalled_past_its_idle_timeout_is_ended_by_the_server(
    databases: Arc<Databases>,
) {
    let store = fresh_transactional(&databases)
        .await
        .plain()
        .transactional_builder()
        .idle_timeout(Duration::from_millis(300))
        .build();
    assert_eq!(store.get_idle_timeout(), Duration::from_millis(300));
    let plain = store.plain().clone();
    let engine = engine(
        &store,
        Policy::required()
            .lease(Duration::from_millis(300))
            .in_progress(InProgress::Wait {
                up_to: Duration::from_secs(60),
            }),
    );
    let execution = execute_new(&engine, "stalled").await;
    let transaction = transaction_of(&execution);
    let pid = execution
        .run(async {
            write_ledger(&transaction, "stalled", 5).await.unwrap();
            let mut connection = transaction.connection().await.unwrap();
            diesel::sql_query("SELECT pg_backend_pid()::bigint AS n")
                .get_result::<Count>(&mut *connection)
                .await
                .unwrap()
                .n
        })
        .await;
    // The execution stalls (its handler returned, the request never settles):
    // nobody renews it, and the server ends the session once it has been idle
    // in its transaction for the idle timeout.
    until(|| async {
        count(
            &plain,
            &format!("SELECT count(*) AS n FROM pg_stat_activity WHERE pid = {pid}"),
        )
        .await
            == 0
    })
    .await;
    assert_eq!(ledger_rows(&plain, "stalled").await, 0);
    assert_eq!(record_state(&plain, "stalled").await, None);
    // The key is free for the retry, which runs once.
    let retry = execute_new(&engine, "stalled").await;
    let retry_transaction = transaction_of(&retry);
    retry
        .run(write_ledger(&retry_transaction, "stalled", 5))
        .await
        .unwrap();
    assert!(matches!(
        retry.settle(&created("ok")).await,
        Settlement::Deliver
    ));
    // The stalled execution wakes up: its answer is not delivered.
    assert!(matches!(
        execution.settle(&created("late")).await,
        Settlement::Retract(_)
    ));
    assert_eq!(ledger_rows(&plain, "stalled").await, 1);
}

#[derive(diesel::QueryableByName)]
struct Settings {
    #[diesel(sql_type = Text)]
    idle: String,
    #[diesel(sql_type = Text)]
    keepalive: String,
}

/// A handler that waits three leases between two statements (a remote call),
/// with a duplicate in between: the duplicate is told to wait, the handler's
/// transaction survives, both its writes commit once, and its client gets its
/// answer. Once letting go of the connection while it waits, with the idle
/// timeout as short as the lease (renewals keep the transaction busy), and once
/// holding the connection (within the default idle timeout).
async fn a_handler_slower_than_the_lease_runs_once_and_delivers(databases: Arc<Databases>) {
    let lease = Duration::from_millis(300);
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    for (name, store, hold) in [
        (
            "lets-go",
            plain.transactional_builder().idle_timeout(lease).build(),
            false,
        ),
        ("holds", store.clone(), true),
    ] {
        let engine = engine(&store, Policy::required().lease(lease));
        let execution = execute_new(&engine, name).await;
        let transaction = transaction_of(&execution);
        let handler = async {
            if hold {
                let mut connection = transaction.connection().await.unwrap();
                let settings = diesel::sql_query(
                    "SELECT current_setting('idle_in_transaction_session_timeout') AS idle,
                            current_setting('tcp_keepalives_idle') || ' '
                            || current_setting('tcp_keepalives_interval') || ' '
                            || current_setting('tcp_keepalives_count') || ' '
                            || current_setting('tcp_user_timeout') AS keepalive",
                )
                .get_result::<Settings>(&mut *connection)
                .await?;
                assert_eq!(
                    (settings.idle.as_str(), settings.keepalive.as_str()),
                    ("1min", "1 1 4 5000"),
                    "the default idle timeout, and keepalives from the lease"
                );
                write_ledger_on(&mut connection, name, 1).await?;
                tokio::time::sleep(3 * lease).await;
                write_ledger_on(&mut connection, name, 2).await
            } else {
                write_ledger(&transaction, name, 1).await?;
                tokio::time::sleep(3 * lease).await;
                write_ledger(&transaction, name, 2).await
            }
        };
        let duplicate = async {
            tokio::time::sleep(lease + lease / 2).await;
            engine
                .begin(Scope::new("alice"), key(name), fingerprint())
                .await
        };
        let (written, duplicate) = tokio::join!(execution.run(handler), duplicate);
        written.unwrap_or_else(|error| panic!("{name}: the handler's writes failed: {error}"));
        match duplicate {
            Begin::Reject(problem) => {
                assert_eq!(problem.kind, ProblemKind::RequestInProgress, "{name}");
            }
            other => panic!("{name}: a duplicate during the handler answered {other:?}"),
        }
        assert!(
            matches!(
                execution.settle(&created("charged")).await,
                Settlement::Deliver
            ),
            "{name}: the first client gets its answer"
        );
        assert_eq!(ledger_rows(&plain, name).await, 2, "{name}: one execution");
        match engine
            .begin(Scope::new("alice"), key(name), fingerprint())
            .await
        {
            Begin::Replay(response) => assert_eq!(response.status, 201, "{name}"),
            other => panic!("{name}: a retry after the answer got {other:?}"),
        }
    }
}

/// The completion and `COMMIT` go out together: when the completion finds no
/// record (here the handler deleted it), the `COMMIT` must roll back, even on a
/// fresh connection where the completion is prepared first.
async fn a_completion_that_finds_no_record_commits_nothing(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "erased").await;
    let transaction = transaction_of(&execution);
    execution
        .run(async {
            write_ledger(&transaction, "erased", 5).await.unwrap();
            let mut connection = transaction.connection().await.unwrap();
            let deleted = diesel::sql_query("DELETE FROM idem_records WHERE key = 'erased'")
                .execute(&mut *connection)
                .await
                .unwrap();
            assert_eq!(deleted, 1, "the in-progress record, in the transaction");
        })
        .await;
    let Settlement::Retract(problem) = execution.settle(&created("charged")).await else {
        panic!("a completion without its record must not deliver the handler's answer")
    };
    assert_eq!(
        (problem.kind, problem.status),
        (ProblemKind::StoreUnavailable, 503)
    );
    assert_eq!(ledger_rows(&plain, "erased").await, 0, "no write");
    assert_eq!(record_state(&plain, "erased").await, None, "no record");
    assert_eq!(store.open_transactions(), 0);

    let retry = execute_new(&engine, "erased").await;
    let transaction = transaction_of(&retry);
    retry
        .run(write_ledger(&transaction, "erased", 5))
        .await
        .unwrap();
    assert!(matches!(
        retry.settle(&created("charged")).await,
        Settlement::Deliver
    ));
    assert_eq!(ledger_rows(&plain, "erased").await, 1, "exactly one effect");
    assert!(matches!(
        record_state(&plain, "erased").await,
        Some(RecordState::Completed { .. })
    ));
}

async fn nested_transactions_are_savepoints(databases: Arc<Databases>) {
    use diesel_async::AsyncConnection;

    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let engine = engine(&store, Policy::required());
    let execution = execute_new(&engine, "nested").await;
    let transaction = transaction_of(&execution);
    execution
        .run(async {
            write_ledger(&transaction, "nested", 1).await.unwrap();
            let mut connection = transaction.connection().await.unwrap();
            // A nested transaction that fails rolls back to its savepoint only.
            let nested: Result<(), diesel::result::Error> = connection
                .transaction(async |connection| {
                    diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ('nested', 2)")
                        .execute(connection)
                        .await?;
                    Err(diesel::result::Error::RollbackTransaction)
                })
                .await;
            assert!(nested.is_err());
        })
        .await;
    assert!(matches!(
        execution.settle(&created("ok")).await,
        Settlement::Deliver
    ));
    assert_eq!(ledger_rows(&plain, "nested").await, 1);
    assert_eq!(
        count(&plain, "SELECT sum(amount)::bigint AS n FROM ledger").await,
        1,
        "the savepoint's write is gone, the execution's stays"
    );
}

/// What the axum handler below shares with the test.
#[derive(Clone)]
struct Charges {
    /// The plain store, to kill the request's connection from outside.
    plain: PgStore,
    /// Kill the request's connection after its write, before the commit.
    kill_next: Arc<std::sync::atomic::AtomicBool>,
}

/// A charge, as an application's axum handler writes it: in the request's
/// transaction, which it states it takes (mounted with `on`).
async fn charge(
    transaction: idem_diesel::Transaction,
    axum::extract::State(charges): axum::extract::State<Charges>,
    execution: idem_axum::ExecutionInfo,
) -> (axum::http::StatusCode, String) {
    use axum::http::StatusCode;

    let key = execution.key().as_str().to_owned();
    let pid = {
        let Ok(mut connection) = transaction.connection().await else {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                "transaction ended".to_owned(),
            );
        };
        if write_ledger_on(&mut connection, &key, 25).await.is_err() {
            return (StatusCode::INTERNAL_SERVER_ERROR, "write failed".to_owned());
        }
        diesel::sql_query("SELECT pg_backend_pid()::bigint AS n")
            .get_result::<Count>(&mut *connection)
            .await
            .map(|row| row.n)
    };
    if charges
        .kill_next
        .swap(false, std::sync::atomic::Ordering::SeqCst)
    {
        let pid = pid.expect("the backend's pid");
        count(
            &charges.plain,
            &format!("SELECT pg_terminate_backend({pid})::int::bigint AS n"),
        )
        .await;
    }
    (StatusCode::CREATED, format!("charged once for {key}"))
}

async fn write_ledger_on(
    connection: &mut diesel_async::AsyncPgConnection,
    key: &str,
    amount: i64,
) -> diesel::QueryResult<()> {
    diesel::sql_query("INSERT INTO ledger (key, amount) VALUES ($1, $2)")
        .bind::<Text, _>(key)
        .bind::<BigInt, _>(amount)
        .execute(connection)
        .await
        .map(drop)
}

async fn an_axum_handler_writes_in_the_requests_transaction(databases: Arc<Databases>) {
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let charges = Charges {
        plain: plain.clone(),
        kill_next: Arc::default(),
    };
    let charged = idem_axum::IdempotencyLayer::new(store.clone(), Policy::required())
        .global_scope()
        .on(axum::http::Method::POST, charge)
        .expect("a transactional store hands the handler its transaction");
    let app = axum::Router::new()
        .route("/charges", charged)
        .with_state(charges.clone());
    let send = |key: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/charges")
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
        (StatusCode::CREATED, "charged once for order-1")
    );
    let (retry, body) = send("order-1").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(body, "charged once for order-1");
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(
        ledger_rows(&plain, "order-1").await,
        1,
        "one effect for two requests"
    );

    // The connection dies after the handler's write: the client is told 503,
    // not the handler's 201, and nothing of the request is left.
    charges
        .kill_next
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (lost, body) = send("order-2").await;
    assert_eq!(lost.status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(lost.headers.contains_key("retry-after"));
    assert!(body.contains("store-unavailable"), "{body}");
    assert_eq!(ledger_rows(&plain, "order-2").await, 0);
    assert_eq!(record_state(&plain, "order-2").await, None);
    // The retry (once the killed backend has let go of the key) runs once.
    let (retried, body) = loop {
        let (retried, body) = send("order-2").await;
        if retried.status != StatusCode::CONFLICT {
            break (retried, body);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(retried.status, StatusCode::CREATED, "{body}");
    assert_eq!(ledger_rows(&plain, "order-2").await, 1);
    assert_eq!(store.open_transactions(), 0);
}

/// One request after another, each with a one-row handler write: the plain
/// store (the write in its own autocommit statement) against transactional mode
/// (the write in the request's transaction).
async fn measure_transactional_against_plain(databases: Arc<Databases>) {
    let store = fresh_transactional(&databases).await;
    let plain = store.plain().clone();
    let n: u32 = 2_000;
    let plain_engine = Engine::new(plain.clone(), Policy::required());
    let started = std::time::Instant::now();
    for i in 0..n {
        let name = format!("plain-{i}");
        let execution = execute_new(&plain_engine, &name).await;
        let mut connection = plain.pool().get().await.unwrap();
        write_ledger_on(&mut connection, &name, 1).await.unwrap();
        drop(connection);
        assert!(matches!(
            execution.settle(&created("ok")).await,
            Settlement::Deliver
        ));
    }
    let plain_elapsed = started.elapsed();

    let engine = engine(&store, Policy::required());
    let started = std::time::Instant::now();
    for i in 0..n {
        let name = format!("transactional-{i}");
        let execution = execute_new(&engine, &name).await;
        let transaction = transaction_of(&execution);
        write_ledger(&transaction, &name, 1).await.unwrap();
        assert!(matches!(
            execution.settle(&created("ok")).await,
            Settlement::Deliver
        ));
    }
    let transactional_elapsed = started.elapsed();
    eprintln!(
        "postgres: {n} requests with a one-row write, one after another: plain {:?} per request, transactional {:?} per request",
        plain_elapsed / n,
        transactional_elapsed / n,
    );
}
