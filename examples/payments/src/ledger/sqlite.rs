//! The ledger in the SQLite store's file.
//!
//! A keyed request's operation is found again by its scope and key, within
//! the records' retention. SQLite has no transactional mode: the idempotency
//! record completes in a transaction of its own, after the ledger's. A
//! process that dies between the two leaves the key in progress; once its
//! lease lapses, the retry runs the handler again, and the ledger answers the
//! operation the key already applied instead of applying it a second time (and
//! stages no second event): one effect, and the same receipt. The Redis ledger
//! does the same with a marker key (`src/ledger/redis.rs`).

use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{OptionalExtension, QueryResult, RunQueryDsl, SqliteConnection};
use idem_diesel::{Event, SqliteOutbox, SqlitePool};
use uuid::Uuid;

use super::{Applied, Attempt, BALANCE_IN_RANGE, LedgerError, Operation};

/// The tables, created if missing.
const MIGRATION: &str = include_str!("sqlite.sql");

const INSERT_OPERATION: &str = "INSERT INTO payment_operations
     (id, account_id, kind, amount, currency, balance_after, idempotency_scope, idempotency_key)
     VALUES (?, ?, ?, ?, ?, ?, ?, ?)";

const ACCOUNT: &str = "SELECT balance, operations FROM payment_accounts WHERE account_id = ?";

/// The operation a key applied within the retention (`?` account, scope, key,
/// and the oldest time as a `strftime` modifier such as `-86400 seconds`).
const EARLIER: &str = "SELECT id, balance_after AS balance FROM payment_operations
     WHERE account_id = ? AND idempotency_scope = ? AND idempotency_key = ?
       AND created_at >= strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?)
     LIMIT 1";

/// The balance update (`?` account, `?` amount); an overflow updates nothing
/// and returns no row.
fn update_statement() -> String {
    format!(
        "INSERT INTO payment_accounts AS account (account_id, balance, operations)
         VALUES (?, ?, 1)
         ON CONFLICT (account_id) DO UPDATE
             SET balance = account.balance + excluded.balance,
                 operations = account.operations + 1
             WHERE {BALANCE_IN_RANGE}
         RETURNING balance"
    )
}

#[derive(diesel::QueryableByName)]
struct BalanceRow {
    #[diesel(sql_type = BigInt)]
    balance: i64,
}

#[derive(diesel::QueryableByName)]
struct EarlierRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = BigInt)]
    balance: i64,
}

#[derive(diesel::QueryableByName)]
struct AccountRow {
    #[diesel(sql_type = BigInt)]
    balance: i64,
    #[diesel(sql_type = BigInt)]
    operations: i64,
}

/// An operation as the blocking task owns it.
struct Row {
    id: String,
    operation: Operation,
    scope: Option<String>,
    key: Option<String>,
    /// How far back a key's operation is found again (the records' retention).
    retention: Duration,
    /// With `--publish`: the event staged with the operation.
    staged: Option<(SqliteOutbox, Event)>,
}

pub(super) async fn migrate(pool: &SqlitePool) -> Result<(), LedgerError> {
    run(pool, |c| {
        c.immediate_transaction(|c| c.batch_execute(MIGRATION))
    })
    .await
}

/// Applies the operation in an immediate transaction of its own, unless its
/// key applied one within `retention`: then answers that one.
pub(super) async fn apply(
    pool: &SqlitePool,
    retention: Duration,
    id: Uuid,
    operation: &Operation,
    attempt: &Attempt,
    staged: Option<(SqliteOutbox, Event)>,
) -> Result<Applied, LedgerError> {
    let (scope, key) = attempt.recorded_key();
    let row = Row {
        id: id.to_string(),
        operation: operation.clone(),
        scope: scope.map(str::to_owned),
        key: key.map(str::to_owned),
        retention,
        staged,
    };
    let outcome = run(pool, move |c| c.immediate_transaction(|c| insert(c, &row))).await?;
    match outcome {
        Outcome::Applied(balance) => Ok(Applied { id, balance }),
        Outcome::Earlier(EarlierRow { id, balance }) => Ok(Applied {
            id: Uuid::parse_str(&id).map_err(LedgerError::unavailable)?,
            balance,
        }),
        Outcome::Overflow => Err(LedgerError::Overflow {
            account_id: operation.account_id.clone(),
        }),
    }
}

/// What one apply did.
enum Outcome {
    /// Applied now; the balance after it.
    Applied(i64),
    /// The key's operation, applied before.
    Earlier(EarlierRow),
    /// Nothing: the balance would leave 64 bits.
    Overflow,
}

pub(super) async fn account(
    pool: &SqlitePool,
    account_id: &str,
) -> Result<(i64, u64), LedgerError> {
    let account_id = account_id.to_owned();
    let row = run(pool, move |c| {
        diesel::sql_query(ACCOUNT)
            .bind::<Text, _>(&account_id)
            .get_result::<AccountRow>(c)
            .optional()
    })
    .await?;
    Ok(row.map_or((0, 0), |row| {
        (row.balance, u64::try_from(row.operations).unwrap_or(0))
    }))
}

/// The key's earlier operation if there is one; else the balance update,
/// then the operation's row and its event (nothing staged on overflow).
fn insert(c: &mut SqliteConnection, row: &Row) -> QueryResult<Outcome> {
    let operation = &row.operation;
    if let (Some(scope), Some(key)) = (&row.scope, &row.key) {
        let earlier = diesel::sql_query(EARLIER)
            .bind::<Text, _>(&operation.account_id)
            .bind::<Text, _>(scope)
            .bind::<Text, _>(key)
            .bind::<Text, _>(format!("-{} seconds", row.retention.as_secs()))
            .get_result::<EarlierRow>(c)
            .optional()?;
        if let Some(earlier) = earlier {
            return Ok(Outcome::Earlier(earlier));
        }
    }
    let updated = diesel::sql_query(update_statement())
        .bind::<Text, _>(&operation.account_id)
        .bind::<BigInt, _>(operation.amount)
        .get_result::<BalanceRow>(c)
        .optional()?;
    let Some(BalanceRow { balance }) = updated else {
        return Ok(Outcome::Overflow);
    };
    diesel::sql_query(INSERT_OPERATION)
        .bind::<Text, _>(&row.id)
        .bind::<Text, _>(&operation.account_id)
        .bind::<Text, _>(operation.kind.as_str())
        .bind::<BigInt, _>(operation.amount)
        .bind::<Text, _>(&operation.currency)
        .bind::<BigInt, _>(balance)
        .bind::<Nullable<Text>, _>(row.scope.as_deref())
        .bind::<Nullable<Text>, _>(row.key.as_deref())
        .execute(c)?;
    if let Some((outbox, event)) = &row.staged {
        outbox.stage_blocking(c, event)?;
    }
    Ok(Outcome::Applied(balance))
}

/// Runs `task` on a pooled connection, on a blocking thread, as a Tokio task of
/// its own: dropping the future of a blocking step makes diesel-async wait for
/// it with `block_in_place`, which panics on a current-thread runtime (each
/// actix-web worker runs on one). A handler dropped mid-step detaches instead,
/// and the step finishes by itself.
async fn run<R: Send + 'static>(
    pool: &SqlitePool,
    task: impl FnOnce(&mut SqliteConnection) -> QueryResult<R> + Send + 'static,
) -> Result<R, LedgerError> {
    let pool = pool.clone();
    tokio::spawn(async move {
        let mut connection = pool.get_owned().await.map_err(LedgerError::unavailable)?;
        connection
            .spawn_blocking(task)
            .await
            .map_err(LedgerError::unavailable)
    })
    .await
    .map_err(LedgerError::unavailable)?
}
