//! The effect: each account's balance and operations, written on the inbox's
//! transaction, in PostgreSQL or SQLite (one schema per backend, applied at
//! start: `src/ledger/postgres.sql`, `src/ledger/sqlite.sql`).

use std::future::Future;
use std::pin::Pin;

use idem_diesel::AsyncSqliteConnection;
use idem_diesel::diesel::result::QueryResult;
use idem_diesel::diesel::sql_types::{BigInt, Text};
use idem_diesel::diesel::{self, QueryableByName};
use idem_diesel::diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde::Serialize;

use crate::payment::Payment;

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

/// What a ledger operation answers.
pub type LedgerFuture<'a, T> = Pin<Box<dyn Future<Output = QueryResult<T>> + Send + 'a>>;

/// The ledger's statements on a connection of either database: the handler's
/// transaction (`AsyncPgConnection`, `AsyncSqliteConnection`) or a pooled
/// connection of its own.
pub trait Ledger: Send {
    /// Creates the accounts table if it is missing.
    fn create_schema(&mut self) -> LedgerFuture<'_, ()>;
    /// Adds the payment to its account and counts one operation; answers
    /// `false`, and writes nothing, when the balance would pass `i64::MAX`.
    fn add<'a>(&'a mut self, payment: &'a Payment) -> LedgerFuture<'a, bool>;
    /// The account's balance and operations (zero for an account never
    /// paid).
    fn account<'a>(&'a mut self, account_id: &'a str) -> LedgerFuture<'a, Account>;
    /// Every account, by id.
    fn accounts(&mut self) -> LedgerFuture<'_, Vec<Account>>;
}

/// Adds `$2` to the account `$1` (`$1`, `$2` in this order: SQLite numbers
/// named parameters as they first appear). The sum is checked: the update's
/// `WHERE` leaves a balance that would overflow as it is, and no row is
/// written (the amount is positive, so `MAX - amount` cannot overflow).
const ADD: &str = "INSERT INTO payments_consumer_accounts (account_id, balance, operations)
    VALUES ($1, $2, 1)
    ON CONFLICT (account_id) DO UPDATE SET
        balance = payments_consumer_accounts.balance + excluded.balance,
        operations = payments_consumer_accounts.operations + 1
    WHERE payments_consumer_accounts.balance <= 9223372036854775807 - excluded.balance";

const ACCOUNT: &str = "SELECT account_id, balance, operations FROM payments_consumer_accounts
    WHERE account_id = $1";

const ACCOUNTS: &str =
    "SELECT account_id, balance, operations FROM payments_consumer_accounts ORDER BY account_id";

/// One implementation for both connections: the statements are the same
/// text, only the schema differs.
macro_rules! ledger_on {
    ($connection:ty, $schema:expr) => {
        impl Ledger for $connection {
            fn create_schema(&mut self) -> LedgerFuture<'_, ()> {
                Box::pin(self.batch_execute($schema))
            }

            fn add<'a>(&'a mut self, payment: &'a Payment) -> LedgerFuture<'a, bool> {
                Box::pin(async move {
                    let written = diesel::sql_query(ADD)
                        .bind::<Text, _>(payment.account_id.as_str())
                        .bind::<BigInt, _>(payment.amount)
                        .execute(self)
                        .await?;
                    Ok(written == 1)
                })
            }

            fn account<'a>(&'a mut self, account_id: &'a str) -> LedgerFuture<'a, Account> {
                Box::pin(async move {
                    let found = diesel::sql_query(ACCOUNT)
                        .bind::<Text, _>(account_id)
                        .get_results::<Account>(self)
                        .await?;
                    Ok(found.into_iter().next().unwrap_or_else(|| Account {
                        account_id: account_id.to_owned(),
                        balance: 0,
                        operations: 0,
                    }))
                })
            }

            fn accounts(&mut self) -> LedgerFuture<'_, Vec<Account>> {
                Box::pin(diesel::sql_query(ACCOUNTS).get_results::<Account>(self))
            }
        }
    };
}

ledger_on!(AsyncPgConnection, include_str!("postgres.sql"));
ledger_on!(AsyncSqliteConnection, include_str!("sqlite.sql"));
