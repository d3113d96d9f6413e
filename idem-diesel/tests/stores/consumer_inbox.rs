//! The consumer inboxes of `idem_core::consume` (`PgInbox`, `SqliteInbox`):
//! the inbox conformance suite on each (a fresh database or file per case),
//! the positions' conformance suite (`idem_kafka_offsets`),
//! the classification of permanent errors against real database errors,
//! cleanup, and the tables living beside the older inbox's.

use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem_core::consume::conformance::{Subject, SubjectFuture};
use idem_core::consume::{
    Acked, Advance, Attempt, ConsumerPolicy, Decision, Handler, HandlerError, HandlerFuture, Inbox,
    Message, Positions, Protocol,
};
use idem_core::retry::Backoff;
use idem_diesel::{
    AsyncSqliteConnection, PgInbox, PgPool, SqliteInbox, SqlitePool, SqliteStore, Sweep,
    SweepReport,
};

use crate::postgres::Count;
use crate::{Databases, TestFn};

pub(crate) const TESTS: &[(&str, TestFn)] = &[
    (
        "consumer_inbox::postgres_permanent_errors_are_told_from_transient_ones",
        |d| Box::pin(postgres_permanent_errors_are_told_from_transient_ones(d)),
    ),
    (
        "consumer_inbox::postgres_a_permanent_error_is_dead_lettered_at_once",
        |d| Box::pin(postgres_a_permanent_error_is_dead_lettered_at_once(d)),
    ),
    (
        "consumer_inbox::postgres_cleanup_deletes_expired_rows_and_keeps_dead_letters",
        |d| Box::pin(postgres_cleanup_deletes_expired_rows_and_keeps_dead_letters(d)),
    ),
    (
        "consumer_inbox::postgres_a_processed_message_takes_four_statements",
        |d| Box::pin(postgres_a_processed_message_takes_four_statements(d)),
    ),
    (
        "consumer_inbox::postgres_a_handler_that_went_on_past_a_failed_statement_is_not_acknowledged",
        |d| {
            Box::pin(postgres_a_handler_that_went_on_past_a_failed_statement_is_not_acknowledged(d))
        },
    ),
    (
        "consumer_inbox::sqlite_permanent_errors_are_told_from_transient_ones",
        |d| Box::pin(sqlite_permanent_errors_are_told_from_transient_ones(d)),
    ),
    (
        "consumer_inbox::sqlite_a_permanent_error_is_dead_lettered_at_once",
        |d| Box::pin(sqlite_a_permanent_error_is_dead_lettered_at_once(d)),
    ),
    (
        "consumer_inbox::sqlite_cleanup_deletes_expired_rows_and_keeps_dead_letters",
        |d| {
            Box::pin(sqlite_cleanup_deletes_expired_rows_and_keeps_dead_letters(
                d,
            ))
        },
    ),
    (
        "consumer_inbox::sqlite_inbox_shares_the_file_with_the_store",
        |d| Box::pin(sqlite_inbox_shares_the_file_with_the_store(d)),
    ),
    (
        "consumer_inbox::postgres_an_inbox_is_ready_once_its_tables_are_verified",
        |d| Box::pin(postgres_an_inbox_is_ready_once_its_tables_are_verified(d)),
    ),
    (
        "consumer_inbox::sqlite_an_inbox_is_ready_once_its_tables_are_verified",
        |d| Box::pin(sqlite_an_inbox_is_ready_once_its_tables_are_verified(d)),
    ),
];

/// What an inbox not verified yet answers [`Inbox::readiness`] with.
fn not_verified(builder: &str) -> String {
    format!(
        "the consumer inbox's tables (idem_consumer_inbox, idem_consumer_failures, idem_consumer_dead_letters) were not verified before a consumer started on it: call `inbox.migrate().await` at start-up, or `inbox.check_schema().await` when the application's own migrations create them (`{builder}::skip_schema_check` opts out)"
    )
}

/// What `check_schema` answers on a database without the inbox's tables.
const ALL_MISSING: &str = "the consumer inbox's tables are missing or older than this library (it lacks idem_consumer_inbox, idem_consumer_failures, idem_consumer_dead_letters): run inbox.migrate() at start-up";

async fn postgres_an_inbox_is_ready_once_its_tables_are_verified(databases: Arc<Databases>) {
    let url = databases.fresh_postgres().await;
    let inbox = PgInbox::connect(&url).await.expect("connect");
    assert_eq!(
        inbox.readiness().unwrap_err().0,
        not_verified("PgInboxBuilder")
    );
    assert_eq!(
        inbox.check_schema().await.unwrap_err().to_string(),
        ALL_MISSING
    );
    assert!(
        inbox.readiness().is_err(),
        "a failed check verifies nothing"
    );
    // A table older than this library: the column it lacks is named.
    inbox.migrate().await.expect("migrate");
    assert_eq!(inbox.readiness(), Ok(()));
    let other = PgInbox::new(inbox.pool().clone());
    assert!(other.readiness().is_err(), "each handle verifies");
    pg_execute(
        inbox.pool(),
        "ALTER TABLE idem_consumer_failures DROP COLUMN last_attempt_at",
    )
    .await;
    assert_eq!(
        other.check_schema().await.unwrap_err().to_string(),
        "the consumer inbox's tables are missing or older than this library (it lacks idem_consumer_failures.last_attempt_at): run inbox.migrate() at start-up"
    );
    pg_execute(
        inbox.pool(),
        "ALTER TABLE idem_consumer_failures ADD COLUMN last_attempt_at timestamptz NOT NULL DEFAULT now()",
    )
    .await;
    other.check_schema().await.expect("the tables are there");
    assert_eq!(other.readiness(), Ok(()));
    let skipped = PgInbox::builder()
        .skip_schema_check()
        .build(inbox.pool().clone());
    assert_eq!(skipped.readiness(), Ok(()));
}

async fn sqlite_an_inbox_is_ready_once_its_tables_are_verified(databases: Arc<Databases>) {
    let inbox = SqliteInbox::connect(&databases.fresh_sqlite_url())
        .await
        .expect("connect");
    assert_eq!(
        inbox.readiness().unwrap_err().0,
        not_verified("SqliteInboxBuilder")
    );
    assert_eq!(
        inbox.check_schema().await.unwrap_err().to_string(),
        ALL_MISSING
    );
    inbox.migrate().await.expect("migrate");
    assert_eq!(inbox.readiness(), Ok(()));
    let other = SqliteInbox::new(inbox.pool().clone());
    assert!(other.readiness().is_err(), "each handle verifies");
    other.check_schema().await.expect("the tables are there");
    assert_eq!(other.readiness(), Ok(()));
    let skipped = SqliteInbox::builder()
        .skip_schema_check()
        .build(inbox.pool().clone());
    assert_eq!(skipped.readiness(), Ok(()));
}

/// Makes a fresh subject of one inbox and runs a conformance case on it.
pub(crate) type RunCase =
    fn(Arc<Databases>, &'static str) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Every inbox the conformance suite runs against.
pub(crate) const INBOXES: &[(&str, RunCase)] = &[
    ("postgres_inbox", |databases, case| {
        Box::pin(async move {
            let subject = fresh_postgres(&databases).await;
            idem_core::consume::conformance::run_case(case, subject).await;
        })
    }),
    ("sqlite_inbox", |databases, case| {
        Box::pin(async move {
            let subject = fresh_sqlite(&databases).await;
            idem_core::consume::conformance::run_case(case, subject).await;
        })
    }),
];

/// Every inbox the positions' conformance suite runs against (a fresh,
/// migrated inbox per case; the case creates the positions' table).
pub(crate) const POSITIONS: &[(&str, RunCase)] = &[
    ("postgres_inbox", |databases, case| {
        Box::pin(async move {
            let inbox = fresh_pg_inbox(&databases, Duration::from_secs(3600)).await;
            idem_core::consume::conformance::positions::run_case(case, inbox).await;
        })
    }),
    ("sqlite_inbox", |databases, case| {
        Box::pin(async move {
            let inbox = fresh_sqlite_inbox(&databases, Duration::from_secs(3600)).await;
            idem_core::consume::conformance::positions::run_case(case, inbox).await;
        })
    }),
];

/// A handler whose statement failed but which went on (it swallowed the
/// error) leaves its transaction aborted, and PostgreSQL answers the `COMMIT`
/// of such a transaction with a rollback, not an error: the message is then
/// not acknowledged but counted failed, its writes rolled back, and once a
/// later attempt is processed its failures are gone.
async fn postgres_a_handler_that_went_on_past_a_failed_statement_is_not_acknowledged(
    databases: Arc<Databases>,
) {
    let subject = fresh_postgres(&databases).await;
    let pool = subject.inbox.pool().clone();
    let protocol = Protocol::new("ledger", subject.inbox, ConsumerPolicy::new());
    let went_on = idem_core::consume::handler(
        |_attempt: Attempt<'_>, tx: &mut AsyncPgConnection| -> HandlerFuture<'_> {
            Box::pin(async move {
                write_effect(tx, "went on").await?;
                let failed = diesel::sql_query("INSERT INTO no_such_table VALUES (1)")
                    .execute(&mut *tx)
                    .await;
                assert!(failed.is_err(), "the statement fails");
                Ok(())
            })
        },
    );
    let message = Message::new("{}").id("m-1");
    let first = protocol.decide(&message, &went_on).await;
    assert!(
        matches!(first, Decision::Retry(_)),
        "an aborted transaction is a failed attempt, retried: {first:?}"
    );
    let counts = || async {
        (
            pg_count(&pool, "SELECT count(*) AS n FROM effects").await,
            pg_count(&pool, "SELECT count(*) AS n FROM idem_consumer_inbox").await,
            pg_count(&pool, "SELECT count(*) AS n FROM idem_consumer_failures").await,
        )
    };
    assert_eq!(
        counts().await,
        (0, 0, 1),
        "(effects, inbox rows, failure rows) after the aborted attempt"
    );
    let applied = idem_core::consume::handler(
        |_attempt: Attempt<'_>, tx: &mut AsyncPgConnection| -> HandlerFuture<'_> {
            Box::pin(async move {
                write_effect(tx, "applied").await?;
                Ok(())
            })
        },
    );
    let second = protocol.decide(&message, &applied).await;
    assert!(
        matches!(second, Decision::Ack(Acked::Processed { attempt: 2 })),
        "the next attempt, number 2, is processed: {second:?}"
    );
    assert_eq!(
        counts().await,
        (1, 1, 0),
        "(effects, inbox rows, failure rows) once processed"
    );
}

/// Records the effect `name` in the `effects` table, on `tx`.
async fn write_effect(tx: &mut AsyncPgConnection, name: &str) -> diesel::QueryResult<usize> {
    diesel::sql_query("INSERT INTO effects (name) VALUES ($1)")
        .bind::<Text, _>(name)
        .execute(tx)
        .await
}

/// A `PgInbox` on a fresh database, and an `effects` table its handlers write.
pub(crate) struct PgSubject {
    inbox: PgInbox,
}

impl Subject for PgSubject {
    type Inbox = PgInbox;

    fn inbox(&self) -> &PgInbox {
        &self.inbox
    }

    fn write<'a>(&'a self, tx: &'a mut AsyncPgConnection, name: &'a str) -> SubjectFuture<'a, ()> {
        Box::pin(async move {
            write_effect(tx, name).await?;
            Ok(())
        })
    }

    fn count<'a>(&'a self, name: &'a str) -> SubjectFuture<'a, u64> {
        Box::pin(async move {
            let mut connection = self.inbox.pool().get().await?;
            let counted = diesel::sql_query("SELECT count(*) AS n FROM effects WHERE name = $1")
                .bind::<Text, _>(name)
                .get_result::<Count>(&mut *connection)
                .await?;
            Ok(u64::try_from(counted.n)?)
        })
    }
}

/// A migrated `PgInbox` (its own pool) on a fresh database.
async fn fresh_pg_inbox(databases: &Arc<Databases>, retention: Duration) -> PgInbox {
    let url = databases.fresh_postgres().await;
    let inbox = PgInbox::builder()
        .retention(retention)
        .connect(&url)
        .await
        .expect("connect");
    inbox.migrate().await.expect("migrate");
    inbox.migrate().await.expect("a second migrate is a no-op");
    inbox
}

async fn fresh_postgres(databases: &Arc<Databases>) -> PgSubject {
    let inbox = fresh_pg_inbox(databases, Duration::from_secs(3600)).await;
    pg_execute(inbox.pool(), "CREATE TABLE effects (name text NOT NULL)").await;
    PgSubject { inbox }
}

async fn pg_execute(pool: &PgPool, sql: &str) {
    let mut connection = pool.get().await.expect("a connection");
    connection.batch_execute(sql).await.expect(sql);
}

async fn pg_count(pool: &PgPool, sql: &str) -> i64 {
    let mut connection = pool.get().await.expect("a connection");
    diesel::sql_query(sql)
        .get_result::<Count>(&mut *connection)
        .await
        .expect(sql)
        .n
}

/// The accounts of the classification tests: an over-long id breaks the
/// primary key's index row limit, a negative balance the CHECK.
const ACCOUNTS: &str = "CREATE TABLE accounts (
    id text PRIMARY KEY,
    balance bigint NOT NULL CHECK (balance >= 0)
)";

/// An account id far over the btree index row limit (2704 bytes), and not
/// compressible below it.
const HUGE_ID: &str = "(SELECT string_agg(md5(n::text), '') FROM generate_series(1, 300) AS n)";

async fn postgres_permanent_errors_are_told_from_transient_ones(databases: Arc<Databases>) {
    let inbox = fresh_pg_inbox(&databases, Duration::from_secs(3600)).await;
    pg_execute(inbox.pool(), ACCOUNTS).await;
    let mut connection = inbox.pool().get().await.expect("a connection");

    let overflow = diesel::sql_query("SELECT $1 + 1 AS n")
        .bind::<BigInt, _>(i64::MAX)
        .get_result::<Count>(&mut *connection)
        .await
        .err()
        .expect("bigint overflow");
    assert!(
        inbox.is_permanent(&overflow),
        "a bigint overflow: {overflow}"
    );

    let check = diesel::sql_query("INSERT INTO accounts VALUES ('acc_1', -5)")
        .execute(&mut *connection)
        .await
        .expect_err("a CHECK violation");
    assert!(inbox.is_permanent(&check), "a CHECK violation: {check}");
    // As the protocol asks: the handler's error, through its source chain.
    let handler_error = HandlerError::from(check);
    assert!(inbox.is_permanent(handler_error.source_error()));

    let too_long = diesel::sql_query(format!("INSERT INTO accounts VALUES ({HUGE_ID}, 0)"))
        .execute(&mut *connection)
        .await
        .expect_err("an index row too large");
    assert!(inbox.is_permanent(&too_long), "an over-long id: {too_long}");

    let not_null = diesel::sql_query("INSERT INTO accounts VALUES ('acc_2', NULL)")
        .execute(&mut *connection)
        .await
        .expect_err("a NOT NULL violation");
    assert!(inbox.is_permanent(&not_null), "{not_null}");

    // A unique violation may be a race with another writer: retried.
    pg_execute(inbox.pool(), "INSERT INTO accounts VALUES ('acc_3', 0)").await;
    let unique = diesel::sql_query("INSERT INTO accounts VALUES ('acc_3', 0)")
        .execute(&mut *connection)
        .await
        .expect_err("a unique violation");
    assert!(!inbox.is_permanent(&unique), "{unique}");

    // A serialization failure (SQLSTATE 40001) as diesel reports it.
    let serialization = diesel::result::Error::DatabaseError(
        diesel::result::DatabaseErrorKind::SerializationFailure,
        Box::new("could not serialize access due to concurrent update".to_owned()),
    );
    assert!(!inbox.is_permanent(&serialization));

    // A lock timeout, for real.
    let mut holder = inbox.pool().get().await.expect("a connection");
    holder
        .batch_execute("BEGIN; LOCK TABLE accounts IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock");
    let timed_out = connection
        .batch_execute("SET lock_timeout = '50ms'; SELECT * FROM accounts")
        .await
        .expect_err("a lock timeout");
    assert!(!inbox.is_permanent(&timed_out), "{timed_out}");
    holder.batch_execute("ROLLBACK").await.expect("rollback");

    // A connection the server ended.
    let mut victim = inbox
        .pool()
        .dedicated_connection()
        .await
        .expect("a connection");
    let pid = diesel::sql_query("SELECT pg_backend_pid()::bigint AS n")
        .get_result::<Count>(&mut victim)
        .await
        .expect("pid")
        .n;
    diesel::sql_query("SELECT pg_terminate_backend($1::integer)")
        .bind::<BigInt, _>(pid)
        .execute(&mut *connection)
        .await
        .expect("terminate");
    let closed = diesel::sql_query("SELECT 1::bigint AS n")
        .get_result::<Count>(&mut victim)
        .await
        .err()
        .expect("a closed connection");
    assert!(!inbox.is_permanent(&closed), "{closed}");
}

/// A handler that moves `amount` into account `id` (SQL expressions).
fn deposit(id: &'static str, amount: &'static str) -> impl Handler<AsyncPgConnection> {
    idem_core::consume::handler(
        move |_attempt: Attempt<'_>, tx: &mut AsyncPgConnection| -> HandlerFuture<'_> {
            Box::pin(async move {
                diesel::sql_query(format!(
                    "INSERT INTO accounts VALUES ({id}, {amount})
                 ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + excluded.balance"
                ))
                .execute(tx)
                .await?;
                Ok(())
            })
        },
    )
}

async fn postgres_a_permanent_error_is_dead_lettered_at_once(databases: Arc<Databases>) {
    let inbox = fresh_pg_inbox(&databases, Duration::from_secs(3600)).await;
    pg_execute(
        inbox.pool(),
        &format!("{ACCOUNTS}; INSERT INTO accounts VALUES ('full', 9223372036854775807)"),
    )
    .await;
    let policy = ConsumerPolicy::new().max_attempts(3).backoff(Backoff::new(
        Duration::from_millis(10),
        Duration::from_millis(100),
    ));
    let protocol = Protocol::new("ledger", inbox.clone(), policy);
    for (id, handler) in [
        ("overflow", deposit("'full'", "1")),
        ("negative", deposit("'acc_1'", "-5")),
        ("huge-id", deposit(HUGE_ID, "5")),
    ] {
        let message = Message::new(id).id(id);
        match protocol.decide(&message, &handler).await {
            Decision::DeadLetter(letter) => assert_eq!(
                letter.attempted_at.len(),
                1,
                "{id}: dead-lettered on its first attempt"
            ),
            other => panic!("{id}: a permanent error is dead-lettered, got {other:?}"),
        }
    }
    // A transient error is retried, and the next attempt is numbered 2.
    let flaky = idem_core::consume::handler(
        |attempt: Attempt<'_>, tx: &mut AsyncPgConnection| -> HandlerFuture<'_> {
            Box::pin(async move {
                if attempt.number() == 1 {
                    return Err(HandlerError::from(diesel::result::Error::DatabaseError(
                        diesel::result::DatabaseErrorKind::SerializationFailure,
                        Box::new("could not serialize access".to_owned()),
                    )));
                }
                diesel::sql_query("INSERT INTO accounts VALUES ('acc_2', 7)")
                    .execute(tx)
                    .await?;
                Ok(())
            })
        },
    );
    let message = Message::new("7").id("flaky");
    assert!(matches!(
        protocol.decide(&message, &flaky).await,
        Decision::Retry(ref retry) if retry.attempts == 1
    ));
    assert!(matches!(
        protocol.decide(&message, &flaky).await,
        Decision::Ack(idem_core::consume::Acked::Processed { attempt: 2 })
    ));
    assert_eq!(
        pg_count(
            inbox.pool(),
            "SELECT count(*) AS n FROM accounts WHERE id <> 'full'"
        )
        .await,
        1,
        "only the retried message's write committed"
    );
    assert_eq!(
        pg_count(
            inbox.pool(),
            "SELECT count(*) AS n FROM idem_consumer_failures"
        )
        .await,
        3,
        "the dead letters' failure rows stay (until retention); the processed one's went"
    );
    let letters = protocol.dead_letters().await.expect("dead letters");
    assert_eq!(letters.len(), 3);
}

async fn postgres_cleanup_deletes_expired_rows_and_keeps_dead_letters(databases: Arc<Databases>) {
    let inbox = fresh_pg_inbox(&databases, Duration::from_secs(3600)).await;
    // 250 processed two hours ago, 5 now; 3 failure rows abandoned three hours
    // ago, 1 recent; 1 dead letter from a day ago (never swept).
    pg_execute(
        inbox.pool(),
        "INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint, processed_at)
         SELECT 'ledger', 'old-' || n, '\\x00', now() - interval '2 hours'
         FROM generate_series(1, 250) AS n;
         INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint)
         SELECT 'ledger', 'new-' || n, '\\x00' FROM generate_series(1, 5) AS n;
         INSERT INTO idem_consumer_failures (consumer, message_id, attempted_at, last_attempt_at)
         SELECT 'ledger', 'gave-up-' || n, ARRAY[now() - interval '3 hours'],
                now() - interval '3 hours'
         FROM generate_series(1, 3) AS n;
         INSERT INTO idem_consumer_failures (consumer, message_id, attempted_at, last_attempt_at)
         VALUES ('ledger', 'retrying', ARRAY[now()], now());
         INSERT INTO idem_consumer_dead_letters
             (consumer, message_id, reason, attempted_at, dead_at)
         VALUES ('ledger', 'dead', 'refused', ARRAY[now() - interval '1 day'],
                 now() - interval '1 day');",
    )
    .await;
    match inbox.cleanup().batch_size(100).sweep().await {
        SweepReport::Swept(sweep) => assert_eq!(
            sweep,
            Sweep {
                deleted: 253,
                batches: 3
            }
        ),
        other => panic!("{other:?}"),
    }
    let pool = inbox.pool();
    assert_eq!(
        pg_count(pool, "SELECT count(*) AS n FROM idem_consumer_inbox").await,
        5
    );
    assert_eq!(
        pg_count(pool, "SELECT count(*) AS n FROM idem_consumer_failures").await,
        1
    );
    let letters = inbox.dead_letters("ledger").await.expect("dead letters");
    assert_eq!(letters.len(), 1, "dead letters are never swept");
}

/// What a processed message and a duplicate cost on PostgreSQL: the statements
/// the inbox sends (the handler's own aside), as diesel's instrumentation sees
/// them. `BEGIN` goes out with the entry, the failures' cleanup with `COMMIT`:
/// two round trips. A partition's record (`Protocol::decide_advancing`) sends
/// its position's move with the entry, before the entry's answer is known: a
/// duplicate's transaction has it too, and rolls it back.
async fn postgres_a_processed_message_takes_four_statements(databases: Arc<Databases>) {
    use diesel::connection::InstrumentationEvent;
    use diesel_async::AsyncConnection;
    use diesel_async::pooled_connection::{
        AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
    };
    use std::sync::Mutex;

    let url = databases.fresh_postgres().await;
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    config.recycling_method = RecyclingMethod::Fast;
    let seen = Arc::clone(&sent);
    config.custom_setup = Box::new(move |url| {
        let seen = Arc::clone(&seen);
        Box::pin(async move {
            let mut connection = AsyncPgConnection::establish(url).await?;
            connection.set_instrumentation(move |event: InstrumentationEvent<'_>| {
                if let InstrumentationEvent::StartQuery { query, .. } = event {
                    // The statement's first words, never its binds.
                    let text = query.to_string();
                    let words: Vec<&str> = text
                        .split_whitespace()
                        .take_while(|word| *word != "--")
                        .take(2)
                        .collect();
                    seen.lock().unwrap().push(words.join(" "));
                }
            });
            Ok(connection)
        })
    });
    let pool: PgPool = bb8::Pool::builder()
        .max_size(1)
        .build(AsyncDieselConnectionManager::new_with_config(url, config))
        .await
        .expect("a pool");
    let inbox = PgInbox::new(pool);
    inbox.migrate().await.expect("migrate");

    let protocol = Protocol::new("ledger", inbox, ConsumerPolicy::new());
    let nothing = idem_core::consume::handler(
        |_attempt: Attempt<'_>, _tx: &mut AsyncPgConnection| -> HandlerFuture<'_> {
            Box::pin(async { Ok(()) })
        },
    );
    let message = Message::new("{}").id("m-1");
    sent.lock().unwrap().clear();
    assert!(matches!(
        protocol.decide(&message, &nothing).await,
        Decision::Ack(_)
    ));
    let processed = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        processed,
        vec!["BEGIN", "WITH dead", "DELETE FROM", "COMMIT"],
        "a processed message: BEGIN with the entry, the cleanup with COMMIT"
    );
    assert!(matches!(
        protocol.decide(&message, &nothing).await,
        Decision::Ack(_)
    ));
    let duplicate = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(duplicate, vec!["BEGIN", "WITH dead", "ROLLBACK"]);

    protocol
        .inbox()
        .migrate_positions()
        .await
        .expect("positions");
    let record = Message::new("{}").id("m-2");
    let advance = Advance {
        consumer: "ledger",
        topic: "payments",
        partition: 0,
        from: None,
        to: 1,
    };
    sent.lock().unwrap().clear();
    assert!(matches!(
        protocol.decide_advancing(&record, &advance, &nothing).await,
        Decision::Ack(_)
    ));
    let processed = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        processed,
        vec!["BEGIN", "WITH dead", "INSERT INTO", "DELETE FROM", "COMMIT"],
        "a partition's record: its move sent with BEGIN and the entry"
    );
    assert!(matches!(
        protocol.decide_advancing(&record, &advance, &nothing).await,
        Decision::Ack(_)
    ));
    let duplicate = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        duplicate,
        vec!["BEGIN", "WITH dead", "INSERT INTO", "ROLLBACK"],
        "the move went out before the entry answered"
    );
    let positions = protocol
        .inbox()
        .positions("ledger", "payments")
        .await
        .expect("positions");
    assert_eq!(
        positions,
        std::collections::HashMap::from([(0, 1)]),
        "the record's move committed once"
    );

    // A batch of 32, one applied before: the same four statements, once.
    let batch: Vec<Message> = (0..32)
        .map(|i| Message::new("{}").id(format!("b-{i}")))
        .chain([message.clone()])
        .collect();
    let each = idem_core::consume::each(&nothing);
    sent.lock().unwrap().clear();
    let decisions = protocol.decide_batch(&batch, &each).await;
    assert_eq!(
        decisions
            .iter()
            .filter(|d| **d == Decision::Ack(idem_core::consume::Acked::Processed { attempt: 1 }))
            .count(),
        32
    );
    assert_eq!(
        decisions[32],
        Decision::Ack(idem_core::consume::Acked::Duplicate)
    );
    let processed = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        processed,
        vec!["BEGIN", "WITH input", "DELETE FROM", "COMMIT"],
        "a batch: BEGIN with the batch's entry, the cleanup with COMMIT"
    );
    let decisions = protocol.decide_batch(&batch, &each).await;
    assert!(
        decisions
            .iter()
            .all(|d| *d == Decision::Ack(idem_core::consume::Acked::Duplicate))
    );
    let duplicate = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(duplicate, vec!["BEGIN", "WITH input", "ROLLBACK"]);

    // A partition's 8 records in one batch: its move in the batch's
    // transaction, once.
    let records: Vec<Message> = (0..8)
        .map(|i| Message::new("{}").id(format!("k-{i}")))
        .collect();
    let offsets: Vec<i64> = (1..9).collect();
    let partition = idem_core::consume::PartitionBatch {
        consumer: "ledger",
        topic: "payments",
        partition: 0,
        from: Some(1),
        offsets: &offsets,
    };
    let batch = idem_core::consume::Batch::new(each, 8);
    let advanced = protocol
        .decide_batch_advancing(&records, &partition, batch.handler())
        .await;
    assert_eq!(advanced, idem_core::consume::Advanced::Applied(8));
    let moved = std::mem::take(&mut *sent.lock().unwrap());
    assert_eq!(
        moved,
        vec![
            "BEGIN",
            "WITH input",
            "INSERT INTO",
            "DELETE FROM",
            "COMMIT"
        ],
        "a batch of records: one entry, one move, one commit"
    );
    let positions = protocol
        .inbox()
        .positions("ledger", "payments")
        .await
        .expect("positions");
    assert_eq!(positions, std::collections::HashMap::from([(0, 9)]));
}

/// A `SqliteInbox` on a fresh file, and an `effects` table its handlers write.
pub(crate) struct SqliteSubject {
    inbox: SqliteInbox,
}

impl Subject for SqliteSubject {
    type Inbox = SqliteInbox;

    fn inbox(&self) -> &SqliteInbox {
        &self.inbox
    }

    fn write<'a>(
        &'a self,
        tx: &'a mut AsyncSqliteConnection,
        name: &'a str,
    ) -> SubjectFuture<'a, ()> {
        Box::pin(async move {
            diesel::sql_query("INSERT INTO effects (name) VALUES (?1)")
                .bind::<Text, _>(name)
                .execute(tx)
                .await?;
            Ok(())
        })
    }

    fn count<'a>(&'a self, name: &'a str) -> SubjectFuture<'a, u64> {
        Box::pin(async move {
            let mut connection = self.inbox.pool().get().await?;
            let counted = diesel::sql_query("SELECT count(*) AS n FROM effects WHERE name = ?1")
                .bind::<Text, _>(name.to_owned())
                .get_result::<Count>(&mut *connection)
                .await?;
            Ok(u64::try_from(counted.n)?)
        })
    }
}

/// A migrated `SqliteInbox` (its own pool) on a fresh file.
async fn fresh_sqlite_inbox(databases: &Arc<Databases>, retention: Duration) -> SqliteInbox {
    let inbox = SqliteInbox::builder()
        .retention(retention)
        .connect(&databases.fresh_sqlite_url())
        .await
        .expect("connect");
    inbox.migrate().await.expect("migrate");
    inbox.migrate().await.expect("a second migrate is a no-op");
    inbox
}

async fn fresh_sqlite(databases: &Arc<Databases>) -> SqliteSubject {
    let inbox = fresh_sqlite_inbox(databases, Duration::from_secs(3600)).await;
    sqlite_execute(inbox.pool(), "CREATE TABLE effects (name TEXT NOT NULL)").await;
    SqliteSubject { inbox }
}

async fn sqlite_execute(pool: &SqlitePool, sql: &str) {
    let mut connection = pool.get().await.expect("a connection");
    connection.batch_execute(sql).await.expect(sql);
}

async fn sqlite_count(pool: &SqlitePool, sql: &str) -> i64 {
    let mut connection = pool.get().await.expect("a connection");
    diesel::sql_query(sql.to_owned())
        .get_result::<Count>(&mut *connection)
        .await
        .expect(sql)
        .n
}

/// The accounts of the SQLite classification tests.
const SQLITE_ACCOUNTS: &str = "CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    balance INTEGER NOT NULL CHECK (balance >= 0)
) STRICT";

async fn sqlite_permanent_errors_are_told_from_transient_ones(databases: Arc<Databases>) {
    let inbox = fresh_sqlite_inbox(&databases, Duration::from_secs(3600)).await;
    sqlite_execute(inbox.pool(), SQLITE_ACCOUNTS).await;
    let mut connection = inbox.pool().get().await.expect("a connection");

    // SQLite's integers overflow into an error in sum() (arithmetic goes to REAL).
    let overflow = diesel::sql_query(
        "SELECT sum(v) AS n FROM (SELECT 9223372036854775807 AS v UNION ALL SELECT 1)",
    )
    .get_result::<Count>(&mut *connection)
    .await
    .err()
    .expect("an integer overflow");
    assert!(inbox.is_permanent(&overflow), "{overflow}");

    let check = diesel::sql_query("INSERT INTO accounts VALUES ('acc_1', -5)")
        .execute(&mut *connection)
        .await
        .expect_err("a CHECK violation");
    assert!(inbox.is_permanent(&check), "{check}");

    let mismatch = diesel::sql_query("INSERT INTO accounts VALUES ('acc_2', 'lots')")
        .execute(&mut *connection)
        .await
        .expect_err("a STRICT table's type mismatch");
    assert!(inbox.is_permanent(&mismatch), "{mismatch}");

    sqlite_execute(inbox.pool(), "INSERT INTO accounts VALUES ('acc_3', 0)").await;
    let unique = diesel::sql_query("INSERT INTO accounts VALUES ('acc_3', 0)")
        .execute(&mut *connection)
        .await
        .expect_err("a unique violation");
    assert!(!inbox.is_permanent(&unique), "{unique}");

    // Another connection's write transaction, past a short busy timeout.
    let mut holder = inbox.pool().get().await.expect("a connection");
    holder
        .batch_execute("BEGIN IMMEDIATE")
        .await
        .expect("the write lock");
    let busy = connection
        .batch_execute("PRAGMA busy_timeout = 20; INSERT INTO accounts VALUES ('acc_4', 0)")
        .await
        .expect_err("database is locked");
    assert!(!inbox.is_permanent(&busy), "{busy}");
    holder.batch_execute("ROLLBACK").await.expect("rollback");
}

async fn sqlite_a_permanent_error_is_dead_lettered_at_once(databases: Arc<Databases>) {
    let inbox = fresh_sqlite_inbox(&databases, Duration::from_secs(3600)).await;
    sqlite_execute(inbox.pool(), SQLITE_ACCOUNTS).await;
    let protocol = Protocol::new("ledger", inbox.clone(), ConsumerPolicy::new());
    let negative = idem_core::consume::handler(
        |_attempt: Attempt<'_>, tx: &mut AsyncSqliteConnection| -> HandlerFuture<'_> {
            Box::pin(async move {
                diesel::sql_query("INSERT INTO accounts VALUES ('acc_1', -5)")
                    .execute(tx)
                    .await?;
                Ok(())
            })
        },
    );
    match protocol
        .decide(&Message::new("-5").id("negative"), &negative)
        .await
    {
        Decision::DeadLetter(letter) => assert_eq!(letter.attempted_at.len(), 1),
        other => panic!("a CHECK violation is dead-lettered at once, got {other:?}"),
    }
    let letters = protocol.dead_letters().await.expect("dead letters");
    assert_eq!(letters.len(), 1);
    assert!(letters[0].reason.contains("CHECK"), "{}", letters[0].reason);
}

async fn sqlite_cleanup_deletes_expired_rows_and_keeps_dead_letters(databases: Arc<Databases>) {
    let inbox = fresh_sqlite_inbox(&databases, Duration::from_secs(3600)).await;
    let hours_ago = |hours: i64| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64;
        now - hours * 3_600_000_000
    };
    let (two, three, day, now) = (hours_ago(2), hours_ago(3), hours_ago(24), hours_ago(0));
    sqlite_execute(
        inbox.pool(),
        &format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 250)
             INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint, processed_at)
             SELECT 'ledger', 'old-' || i, x'00', {two} FROM n;
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5)
             INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint, processed_at)
             SELECT 'ledger', 'new-' || i, x'00', {now} FROM n;
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3)
             INSERT INTO idem_consumer_failures
                 (consumer, message_id, attempts, attempted_at, last_attempt_at)
             SELECT 'ledger', 'gave-up-' || i, 1, '{three}', {three} FROM n;
             INSERT INTO idem_consumer_failures
                 (consumer, message_id, attempts, attempted_at, last_attempt_at)
             VALUES ('ledger', 'retrying', 1, '{now}', {now});
             INSERT INTO idem_consumer_dead_letters
                 (consumer, message_id, reason, attempts, attempted_at, dead_at)
             VALUES ('ledger', 'dead', 'refused', 1, '{day}', {day});"
        ),
    )
    .await;
    match inbox.cleanup().batch_size(100).sweep().await {
        SweepReport::Swept(sweep) => assert_eq!(
            sweep,
            Sweep {
                deleted: 253,
                batches: 3
            }
        ),
        other => panic!("{other:?}"),
    }
    let pool = inbox.pool();
    assert_eq!(
        sqlite_count(pool, "SELECT count(*) AS n FROM idem_consumer_inbox").await,
        5
    );
    assert_eq!(
        sqlite_count(pool, "SELECT count(*) AS n FROM idem_consumer_failures").await,
        1
    );
    let letters = inbox.dead_letters("ledger").await.expect("dead letters");
    assert_eq!(letters.len(), 1, "dead letters are never swept");
    assert_eq!(letters[0].attempted_at.len(), 1);
}

async fn sqlite_inbox_shares_the_file_with_the_store(databases: Arc<Databases>) {
    let store = SqliteStore::connect(&databases.fresh_sqlite_url())
        .await
        .expect("connect");
    store.migrate().await.expect("migrate the store");
    let inbox = SqliteInbox::new(store.pool().clone());
    inbox.migrate().await.expect("migrate the inbox");
    store.migrate().await.expect("the store's migration again");
    assert_eq!(inbox.readiness(), Ok(()));
    assert_eq!(
        sqlite_count(
            store.pool(),
            "SELECT count(*) AS n FROM sqlite_master WHERE type = 'table' AND name IN (
                 'idem_records', 'idem_consumer_inbox', 'idem_consumer_failures',
                 'idem_consumer_dead_letters')"
        )
        .await,
        4
    );
}
