//! The effect: account balances in PostgreSQL, changed on the inbox's
//! transaction.

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem_diesel::PgPool;
use serde::Serialize;

use crate::ConsumerError;
use crate::message::Payment;

/// An account as `balance` prints it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, QueryableByName)]
pub struct Account {
    /// The account.
    #[diesel(sql_type = Text)]
    pub account_id: String,
    /// The sum of the amounts applied to it.
    #[diesel(sql_type = BigInt)]
    pub balance: i64,
    /// How many payments were applied to it.
    #[diesel(sql_type = BigInt)]
    pub operations: i64,
}

/// Why applying a payment failed; its writes are rolled back and it is
/// retried.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// `--fail-account` names the account: the deliberate bug.
    #[error("payments to account {0} fail on purpose (--fail-account)")]
    FailingAccount(String),
    /// The balance update failed (an overflow, a lost connection).
    #[error("the balance update failed")]
    Database(#[from] diesel::result::Error),
}

/// Creates the accounts table if it is missing.
pub async fn migrate(pool: &PgPool) -> Result<(), ConsumerError> {
    let mut connection = pool.get().await.map_err(ConsumerError::pool)?;
    connection
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS payments_consumer_accounts (
                 account_id text   PRIMARY KEY,
                 balance    bigint NOT NULL,
                 operations bigint NOT NULL
             )",
        )
        .await?;
    Ok(())
}

/// Adds the payment to its account and counts one operation, on the caller's
/// transaction; fails for the account `failing`.
pub async fn apply(
    connection: &mut AsyncPgConnection,
    payment: &Payment,
    failing: Option<&str>,
) -> Result<(), ApplyError> {
    if failing == Some(payment.account_id.as_str()) {
        return Err(ApplyError::FailingAccount(payment.account_id.clone()));
    }
    diesel::sql_query(
        "INSERT INTO payments_consumer_accounts (account_id, balance, operations)
         VALUES ($1, $2, 1)
         ON CONFLICT (account_id) DO UPDATE SET
             balance = payments_consumer_accounts.balance + excluded.balance,
             operations = payments_consumer_accounts.operations + 1",
    )
    .bind::<Text, _>(&payment.account_id)
    .bind::<BigInt, _>(payment.amount)
    .execute(connection)
    .await?;
    Ok(())
}

/// The account's balance and operations (zero for an account never paid).
pub async fn account(pool: &PgPool, account_id: &str) -> Result<Account, ConsumerError> {
    let mut connection = pool.get().await.map_err(ConsumerError::pool)?;
    let found = diesel::sql_query(
        "SELECT account_id, balance, operations FROM payments_consumer_accounts
         WHERE account_id = $1",
    )
    .bind::<Text, _>(account_id)
    .get_results::<Account>(&mut *connection)
    .await?;
    Ok(found.into_iter().next().unwrap_or_else(|| Account {
        account_id: account_id.to_owned(),
        balance: 0,
        operations: 0,
    }))
}
