//! The ledger in the PostgreSQL store's database.

use diesel::OptionalExtension;
use diesel::sql_types::{BigInt, Nullable, Text, Uuid as SqlUuid};
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use idem_diesel::{Event, PgOutbox, PgPool, PgTransaction};
use uuid::Uuid;

use super::{Applied, Attempt, BALANCE_IN_RANGE, LedgerError, Operation};

/// The tables, created if missing.
const MIGRATION: &str = include_str!("postgres.sql");

/// One statement, so atomic even outside a transaction: the account's balance
/// and count move (`$1` account, `$2` amount), and the operation is recorded
/// (`$3` id, `$4` kind, `$5` currency, `$6` scope, `$7` key). An overflow updates
/// nothing, inserts nothing, and returns no row.
fn apply_statement() -> String {
    format!(
        "WITH updated AS (
             INSERT INTO payment_accounts AS account (account_id, balance, operations)
             VALUES ($1, $2, 1)
             ON CONFLICT (account_id) DO UPDATE
                 SET balance = account.balance + excluded.balance,
                     operations = account.operations + 1
                 WHERE {BALANCE_IN_RANGE}
             RETURNING balance
         )
         INSERT INTO payment_operations
             (id, account_id, kind, amount, currency, balance_after, idempotency_scope, idempotency_key)
         SELECT $3, $1, $4, $2, $5, updated.balance, $6, $7 FROM updated
         RETURNING balance_after"
    )
}

const ACCOUNT: &str = "SELECT balance, operations FROM payment_accounts WHERE account_id = $1";

#[derive(diesel::QueryableByName)]
struct AppliedRow {
    #[diesel(sql_type = BigInt)]
    balance_after: i64,
}

#[derive(diesel::QueryableByName)]
struct AccountRow {
    #[diesel(sql_type = BigInt)]
    balance: i64,
    #[diesel(sql_type = BigInt)]
    operations: i64,
}

pub(super) async fn migrate(pool: &PgPool) -> Result<(), LedgerError> {
    let mut connection = pool.get().await.map_err(LedgerError::unavailable)?;
    connection
        .batch_execute(MIGRATION)
        .await
        .map_err(LedgerError::unavailable)
}

/// The outbox and the event an operation stages, with `--publish`.
pub(super) type Staged = Option<(PgOutbox, Event)>;

/// Applies the operation on a connection of its own: it commits by itself
/// (with its event, in a transaction of its own, when it stages one).
pub(super) async fn apply(
    pool: &PgPool,
    id: Uuid,
    operation: &Operation,
    attempt: &Attempt,
    staged: Staged,
) -> Result<Applied, LedgerError> {
    let mut pooled = pool.get().await.map_err(LedgerError::unavailable)?;
    let connection: &mut AsyncPgConnection = &mut pooled;
    if staged.is_none() {
        return apply_on(connection, id, operation, attempt, None).await;
    }
    AnsiTransactionManager::begin_transaction(connection)
        .await
        .map_err(LedgerError::unavailable)?;
    match apply_on(connection, id, operation, attempt, staged).await {
        Ok(applied) => {
            AnsiTransactionManager::commit_transaction(connection)
                .await
                .map_err(LedgerError::unavailable)?;
            Ok(applied)
        }
        Err(error) => {
            // A failed rollback leaves the connection broken: the pool drops it.
            let _ = AnsiTransactionManager::rollback_transaction(connection).await;
            Err(error)
        }
    }
}

/// Applies the operation in the request's transaction: it commits with the
/// idempotency record, or not at all.
pub(super) async fn apply_in(
    transaction: &PgTransaction,
    id: Uuid,
    operation: &Operation,
    attempt: &Attempt,
    staged: Staged,
) -> Result<Applied, LedgerError> {
    let mut connection = transaction
        .connection()
        .await
        .map_err(LedgerError::unavailable)?;
    apply_on(&mut connection, id, operation, attempt, staged).await
}

/// The operation, then (only when it applied: an overflow stages nothing)
/// its event, on the same transaction.
async fn apply_on(
    connection: &mut AsyncPgConnection,
    id: Uuid,
    operation: &Operation,
    attempt: &Attempt,
    staged: Staged,
) -> Result<Applied, LedgerError> {
    let (scope, key) = attempt.recorded_key();
    let row = diesel::sql_query(apply_statement())
        .bind::<Text, _>(&operation.account_id)
        .bind::<BigInt, _>(operation.amount)
        .bind::<SqlUuid, _>(id)
        .bind::<Text, _>(operation.kind.as_str())
        .bind::<Text, _>(&operation.currency)
        .bind::<Nullable<Text>, _>(scope)
        .bind::<Nullable<Text>, _>(key)
        .get_result::<AppliedRow>(connection)
        .await
        .optional()
        .map_err(LedgerError::unavailable)?;
    match row {
        Some(row) => {
            if let Some((outbox, event)) = staged {
                outbox
                    .stage(connection, &event)
                    .await
                    .map_err(LedgerError::unavailable)?;
            }
            Ok(Applied {
                id,
                balance: row.balance_after,
            })
        }
        None => Err(LedgerError::Overflow {
            account_id: operation.account_id.clone(),
        }),
    }
}

pub(super) async fn account(pool: &PgPool, account_id: &str) -> Result<(i64, u64), LedgerError> {
    let mut connection = pool.get().await.map_err(LedgerError::unavailable)?;
    let row = diesel::sql_query(ACCOUNT)
        .bind::<Text, _>(account_id)
        .get_result::<AccountRow>(&mut *connection)
        .await
        .optional()
        .map_err(LedgerError::unavailable)?;
    Ok(row.map_or((0, 0), |row| {
        (row.balance, u64::try_from(row.operations).unwrap_or(0))
    }))
}
