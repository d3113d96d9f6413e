//! The ledger in the SQLite store's file.
//!
//! A keyed request runs in transactional mode (`docs/contract.md` §7): its
//! operation and its event are written in the request's
//! [`SqliteTransaction`], and commit with the idempotency record's completion
//! or not at all, so a crash at any instant leaves one effect or none, with no
//! lookup of the key's earlier operation (only the Redis ledger, which has no
//! such transaction, needs one). An unkeyed deposit commits on its own.

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel::{OptionalExtension, QueryResult, RunQueryDsl, SqliteConnection};
use idem_diesel::{Event, SqliteOutbox, SqlitePool, SqliteTransaction};
use uuid::Uuid;

use super::{Applied, Attempt, BALANCE_IN_RANGE, LedgerError, Operation};

/// The tables, created if missing.
const MIGRATION: &str = include_str!("sqlite.sql");

const INSERT_OPERATION: &str = "INSERT INTO payment_operations
     (id, account_id, kind, amount, currency, balance_after, idempotency_scope, idempotency_key)
     VALUES (?, ?, ?, ?, ?, ?, ?, ?)";

const ACCOUNT: &str = "SELECT balance, operations FROM payment_accounts WHERE account_id = ?";

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
    /// With `--publish`: the event staged with the operation.
    staged: Option<(SqliteOutbox, Event)>,
}

pub(super) async fn migrate(pool: &SqlitePool) -> Result<(), LedgerError> {
    run(pool, |c| {
        c.immediate_transaction(|c| c.batch_execute(MIGRATION))
    })
    .await
}

/// Applies the operation in an immediate transaction of its own.
pub(super) async fn apply(
    pool: &SqlitePool,
    id: Uuid,
    operation: &Operation,
    attempt: &Attempt,
    staged: Option<(SqliteOutbox, Event)>,
) -> Result<Applied, LedgerError> {
    let row = Row::new(id, operation, attempt, staged);
    let outcome = run(pool, move |c| c.immediate_transaction(|c| insert(c, &row))).await?;
    applied(id, operation, outcome)
}

/// Applies the operation in the request's transaction: it commits with the
/// idempotency record, or not at all.
pub(super) async fn apply_in(
    transaction: &SqliteTransaction,
    id: Uuid,
    operation: &Operation,
    attempt: &Attempt,
    staged: Option<(SqliteOutbox, Event)>,
) -> Result<Applied, LedgerError> {
    let row = Row::new(id, operation, attempt, staged);
    let outcome = transaction
        .write(move |c| insert(c, &row).map_err(LedgerError::unavailable))
        .await?;
    applied(id, operation, outcome)
}

impl From<idem_diesel::SqliteTransactionError> for LedgerError {
    fn from(error: idem_diesel::SqliteTransactionError) -> Self {
        Self::unavailable(error)
    }
}

impl Row {
    fn new(
        id: Uuid,
        operation: &Operation,
        attempt: &Attempt,
        staged: Option<(SqliteOutbox, Event)>,
    ) -> Self {
        let (scope, key) = attempt.recorded_key();
        Self {
            id: id.to_string(),
            operation: operation.clone(),
            scope: scope.map(str::to_owned),
            key: key.map(str::to_owned),
            staged,
        }
    }
}

fn applied(id: Uuid, operation: &Operation, outcome: Outcome) -> Result<Applied, LedgerError> {
    match outcome {
        Outcome::Applied(balance) => Ok(Applied { id, balance }),
        Outcome::Overflow => Err(LedgerError::Overflow {
            account_id: operation.account_id.clone(),
        }),
    }
}

/// What one apply did.
enum Outcome {
    /// Applied; the balance after it.
    Applied(i64),
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

/// The balance update, then the operation's row and its event (nothing
/// staged on overflow).
fn insert(c: &mut SqliteConnection, row: &Row) -> QueryResult<Outcome> {
    let operation = &row.operation;
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
