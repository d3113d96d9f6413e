//! The test's own connections to the database under a server: to look at what
//! the server's backends are doing, to hold an account's row, and to read the
//! ledger's rows.

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

/// How many times [`Database::wait_for`] looks at most.
const LOOKS: usize = 2_000;

/// The pause between two looks of [`Database::wait_for`].
const LOOK_PAUSE: Duration = Duration::from_millis(5);

/// A connection of the test's own.
pub(crate) struct Database {
    connection: AsyncPgConnection,
}

/// What [`Database::wait_for`] waits for, among the server's backends (every
/// other connection to the database).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Sight {
    /// A backend waits for a lock: a request is caught inside its transaction
    /// behind a row the test holds.
    LockWait,
    /// A backend's latest statement is the transactional store's poll of a
    /// running key's lock (idem-diesel's `SELECT NOT pg_try_advisory_xact_lock…`):
    /// a duplicate found its key running and waits for the commit. Only a
    /// route configured to wait polls.
    DuplicateWaiting,
}

/// A charge or deposit row of `payment_operations`.
#[derive(Clone, Debug, PartialEq, Eq, QueryableByName)]
pub(crate) struct OperationRow {
    #[diesel(sql_type = Text)]
    pub(crate) id: String,
    #[diesel(sql_type = Text)]
    pub(crate) kind: String,
    #[diesel(sql_type = BigInt)]
    pub(crate) amount: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) idempotency_scope: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) idempotency_key: Option<String>,
}

/// The idempotency records, by state.
#[derive(Clone, Debug, PartialEq, Eq, QueryableByName)]
pub(crate) struct RecordCounts {
    #[diesel(sql_type = BigInt)]
    pub(crate) completed: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) in_progress: i64,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl Database {
    /// Connects to `url`. Every statement of the connection is bounded, a
    /// guard against a hang (a lock that is never released).
    pub(crate) async fn connect(url: &str) -> Self {
        let connection = AsyncPgConnection::establish(url)
            .await
            .unwrap_or_else(|error| panic!("connect to {url}: {error}"));
        let mut database = Self { connection };
        database.batch("SET statement_timeout = '60s'").await;
        database
    }

    /// Runs `sql` (one or more statements, no results).
    pub(crate) async fn batch(&mut self, sql: &str) {
        self.connection
            .batch_execute(sql)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    /// Opens a transaction that holds `account`'s row of `payment_accounts`
    /// (creating the row at balance 0 if it is missing): every charge of the
    /// account then waits inside its own transaction, at its balance update,
    /// until [`release`](Self::release).
    pub(crate) async fn hold(&mut self, account: &str) {
        assert!(
            account
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-'),
            "a plain account id"
        );
        // Two messages: statements before a `BEGIN` in one message would join
        // the transaction, and the row would go with its rollback.
        self.batch(&format!(
            "INSERT INTO payment_accounts (account_id, balance, operations) \
             VALUES ('{account}', 0, 0) ON CONFLICT (account_id) DO NOTHING"
        ))
        .await;
        self.batch(&format!(
            "BEGIN; SELECT 1 FROM payment_accounts WHERE account_id = '{account}' FOR UPDATE"
        ))
        .await;
    }

    /// Ends the transaction of [`hold`](Self::hold).
    pub(crate) async fn release(&mut self) {
        self.batch("ROLLBACK").await;
    }

    /// Looks at the server's backends every few milliseconds until `sight`
    /// shows; panics if it never does.
    pub(crate) async fn wait_for(&mut self, sight: Sight) {
        let condition = match sight {
            Sight::LockWait => "wait_event_type = 'Lock'",
            Sight::DuplicateWaiting => "query LIKE 'SELECT NOT pg_try_advisory_xact_lock%'",
        };
        let sql = format!(
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND {condition}"
        );
        for _ in 0..LOOKS {
            let seen = diesel::sql_query(&sql)
                .get_result::<Count>(&mut self.connection)
                .await
                .unwrap_or_else(|error| panic!("{sql}: {error}"));
            if seen.n > 0 {
                return;
            }
            tokio::time::sleep(LOOK_PAUSE).await;
        }
        panic!("{sight:?} never showed in pg_stat_activity");
    }

    /// The operations of `account`, oldest first.
    pub(crate) async fn operations(&mut self, account: &str) -> Vec<OperationRow> {
        diesel::sql_query(
            "SELECT id::text AS id, kind, amount, idempotency_scope, idempotency_key \
             FROM payment_operations WHERE account_id = $1 ORDER BY created_at, id",
        )
        .bind::<Text, _>(account)
        .load(&mut self.connection)
        .await
        .expect("the ledger's operations")
    }

    /// The idempotency records, by state.
    pub(crate) async fn records(&mut self) -> RecordCounts {
        diesel::sql_query(
            "SELECT count(*) FILTER (WHERE state = 'completed') AS completed, \
                    count(*) FILTER (WHERE state = 'in_progress') AS in_progress \
             FROM idem_records",
        )
        .get_result(&mut self.connection)
        .await
        .expect("the idempotency records")
    }
}
