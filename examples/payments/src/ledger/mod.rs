//! The ledger: accounts, their balances, and the operations applied to them; in
//! memory, or in the idempotency store's own database.

mod memory;
mod postgres;
mod redis;
mod sqlite;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::store::BoxError;
use idem_core::{ExecutionInfo, IdempotencyKey, Scope};
use idem_diesel::{PgPool, PgTransaction, SqlitePool, SqliteTransaction};
use serde::Serialize;
use uuid::Uuid;

use crate::publish::{Publishing, PublishingOutbox};
use idem_redis::RedisConnection;
use memory::MemoryLedger;
use redis::RedisLedger;

/// The accounts and every operation applied to them. Cheap to clone; clones
/// share the accounts.
///
/// - [`Ledger::memory`]: in this process, lost on exit (`--store memory`).
/// - [`Ledger::sqlite`]: tables in the SQLite store's file, through its pool;
///   an operation whose [`Attempt`] carries the request's
///   [`SqliteTransaction`] is written in that transaction, so it commits with
///   the idempotency record or not at all (transactional mode,
///   `docs/contract.md` §7).
/// - [`Ledger::postgres`]: the same in the PostgreSQL store's database, with
///   the request's [`PgTransaction`].
/// - [`Ledger::redis`]: keys in the Redis store's Redis, through its
///   connection; each account in one cluster slot, each operation one script
///   that also remembers which operation a keyed request applied
///   (`src/ledger/redis.rs` says why and what that leaves open).
///
/// The database ledgers create their tables with [`migrate`](Self::migrate)
/// (`src/ledger/postgres.sql`, `src/ledger/sqlite.sql`): `payment_accounts`
/// (the balance and the operation count of each account) and
/// `payment_operations` (one row per operation, with the request's principal
/// and key when it had one). Both change in one transaction, so they always
/// agree.
///
/// Applying an operation is not idempotent by nature: every call adds its amount
/// again. That is what the idempotency middleware protects.
///
/// ```
/// use payments::{Attempt, Ledger, Operation, OperationKind};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let ledger = Ledger::memory();
/// let deposit = Operation::new(OperationKind::Deposit, "acct-1", 100, "EUR");
/// ledger.apply(&deposit, &Attempt::unkeyed()).await?;
/// let charge = Operation::new(OperationKind::Charge, "acct-1", 25, "EUR");
/// ledger.apply(&charge, &Attempt::unkeyed()).await?;
/// let account = ledger.account("acct-1").await?;
/// assert_eq!((account.balance, account.operations), (125, 2));
/// # Ok::<(), payments::LedgerError>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Ledger {
    backend: Backend,
    /// `--publish`: each operation applied stages its event in its own
    /// transaction.
    publishing: Option<Publishing>,
    /// A crash test's `PAYMENTS_CRASH_AT=write`: die once an operation is
    /// written, before the request's record completes.
    crash_after_write: bool,
}

#[derive(Clone)]
enum Backend {
    Memory(MemoryLedger),
    Sqlite(SqlitePool),
    Postgres(PgPool),
    Redis(RedisLedger),
}

/// Charges and deposits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OperationKind {
    /// A charge through the payment provider.
    Charge,
    /// A deposit.
    Deposit,
}

/// An operation for the ledger to apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation {
    /// A charge or a deposit.
    pub kind: OperationKind,
    /// The account.
    pub account_id: String,
    /// The amount added to the balance.
    pub amount: i64,
    /// Its currency (recorded with the operation; balances ignore it).
    pub currency: String,
}

/// One delivery of a request, as the idempotency middleware let it through:
/// the key it carried, if any, and the transaction its writes join, if any.
///
/// ```
/// use idem_core::{IdempotencyKey, Scope};
/// use payments::Attempt;
///
/// let unkeyed = Attempt::unkeyed();
/// assert!(unkeyed.key().is_none());
/// let keyed = Attempt::keyed(Scope::new("alice"), IdempotencyKey::new("order-1")?);
/// assert_eq!(keyed.key().map(|(_, key)| key.as_str()), Some("order-1"));
/// assert!(!keyed.is_transactional());
/// # Ok::<(), idem_core::KeyError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Attempt {
    key: Option<(Scope, IdempotencyKey)>,
    transaction: Option<Joined>,
}

/// The request's transaction, which an attempt's writes join.
#[derive(Clone, Debug)]
enum Joined {
    Postgres(Arc<PgTransaction>),
    Sqlite(Arc<SqliteTransaction>),
}

/// An operation the ledger applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The operation's id.
    pub id: Uuid,
    /// The balance after it.
    pub balance: i64,
}

/// An account as `GET /accounts/{account_id}` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AccountView {
    /// The account.
    pub account_id: String,
    /// The sum of every amount applied.
    pub balance: i64,
    /// How many charges and deposits were applied.
    pub operations: u64,
}

/// Why an operation was not applied, or an account not read.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The balance would leave the range of a 64-bit integer.
    #[error("the balance of {account_id} would overflow")]
    Overflow {
        /// The account.
        account_id: String,
    },
    /// The ledger's database failed, or the request's transaction had ended;
    /// nothing was applied (in transactional mode the request's transaction
    /// is rolled back with it).
    #[error("the ledger is unavailable")]
    Unavailable(#[source] BoxError),
}

/// An operation carried the request's transaction to a ledger that
/// is not in that database: its writes could not commit with the record.
#[derive(Debug, thiserror::Error)]
#[error("the request runs in a transaction of another database than the ledger's")]
struct ForeignTransaction;

impl Ledger {
    /// An empty ledger in memory.
    pub fn memory() -> Self {
        Self {
            backend: Backend::Memory(MemoryLedger::default()),
            publishing: None,
            crash_after_write: false,
        }
    }

    /// The ledger in the SQLite file of `pool` (the SQLite store's:
    /// `SqliteStore::pool`). Call [`migrate`](Self::migrate) before use.
    pub fn sqlite(pool: SqlitePool) -> Self {
        Self {
            backend: Backend::Sqlite(pool),
            publishing: None,
            crash_after_write: false,
        }
    }

    /// The ledger in the PostgreSQL database of `pool` (the store's:
    /// `PgStore::pool`). Call [`migrate`](Self::migrate) before use.
    pub fn postgres(pool: PgPool) -> Self {
        Self {
            backend: Backend::Postgres(pool),
            publishing: None,
            crash_after_write: false,
        }
    }

    /// The ledger in the Redis of `connection` (the Redis store's:
    /// `RedisStore::connection`), on one node or a cluster. A keyed request's
    /// operation is remembered for `retention` (the records'), so that a retry
    /// that runs the handler again within it does not apply it twice.
    pub fn redis(connection: RedisConnection, retention: Duration) -> Self {
        Self {
            backend: Backend::Redis(RedisLedger::new(connection, retention)),
            publishing: None,
            crash_after_write: false,
        }
    }

    /// The outbox in this ledger's database (SQLite and PostgreSQL only).
    pub(crate) fn outbox(&self) -> Option<PublishingOutbox> {
        match &self.backend {
            Backend::Sqlite(pool) => Some(PublishingOutbox::sqlite(pool.clone())),
            Backend::Postgres(pool) => Some(PublishingOutbox::postgres(pool.clone())),
            Backend::Memory(_) | Backend::Redis(_) => None,
        }
    }

    /// The same ledger, staging an event with every operation it applies.
    /// Arms the crash point a crash test asks for in the environment:
    /// `PAYMENTS_CRASH_AT=write` makes the process die (as `SIGKILL` would)
    /// right after an operation is written, before the request's record
    /// completes: inside the request's transaction in transactional mode,
    /// after the ledger's own commit otherwise. Not part of what the example
    /// shows; an unknown value is an error.
    pub(crate) fn crash_point_from_env(self) -> Result<Self, String> {
        let crash_after_write = match std::env::var("PAYMENTS_CRASH_AT").as_deref() {
            Err(_) => false,
            Ok("write") => true,
            Ok(other) => {
                return Err(format!(
                    "PAYMENTS_CRASH_AT is {other:?}: expected \"write\""
                ));
            }
        };
        Ok(Self {
            crash_after_write,
            ..self
        })
    }

    pub(crate) fn publishing(self, publishing: Publishing) -> Self {
        Self {
            publishing: Some(publishing),
            ..self
        }
    }

    /// Creates the ledger's tables if they are missing (nothing to do in memory).
    pub async fn migrate(&self) -> Result<(), LedgerError> {
        match &self.backend {
            Backend::Memory(_) | Backend::Redis(_) => Ok(()),
            Backend::Sqlite(pool) => sqlite::migrate(pool).await,
            Backend::Postgres(pool) => postgres::migrate(pool).await,
        }
    }

    /// Adds the operation's amount to the account's balance and records the
    /// operation, with the attempt's key. When the attempt carries the request's
    /// transaction, the writes are made in it (PostgreSQL only).
    pub async fn apply(
        &self,
        operation: &Operation,
        attempt: &Attempt,
    ) -> Result<Applied, LedgerError> {
        let id = Uuid::new_v4();
        let applied = self.apply_to_backend(id, operation, attempt).await;
        if self.crash_after_write && applied.is_ok() {
            std::process::abort();
        }
        applied
    }

    async fn apply_to_backend(
        &self,
        id: Uuid,
        operation: &Operation,
        attempt: &Attempt,
    ) -> Result<Applied, LedgerError> {
        let staged = self
            .publishing
            .as_ref()
            .map(|publishing| (publishing.outbox.clone(), publishing.event(operation)));
        let (pg_event, sqlite_event) = match staged {
            Some((PublishingOutbox::Postgres(outbox), event)) => (Some((outbox, event)), None),
            Some((PublishingOutbox::Sqlite(outbox), event)) => (None, Some((outbox, event))),
            None => (None, None),
        };
        match (&self.backend, &attempt.transaction) {
            (Backend::Postgres(pool), None) => {
                postgres::apply(pool, id, operation, attempt, pg_event).await
            }
            (Backend::Postgres(_), Some(Joined::Postgres(transaction))) => {
                postgres::apply_in(transaction, id, operation, attempt, pg_event).await
            }
            (Backend::Sqlite(pool), None) => {
                sqlite::apply(pool, id, operation, attempt, sqlite_event).await
            }
            (Backend::Sqlite(_), Some(Joined::Sqlite(transaction))) => {
                sqlite::apply_in(transaction, id, operation, attempt, sqlite_event).await
            }
            (_, Some(_)) => Err(LedgerError::Unavailable(ForeignTransaction.into())),
            (Backend::Memory(memory), None) => memory.apply(id, operation),
            (Backend::Redis(redis), None) => redis.apply(id, operation, attempt).await,
        }
    }

    /// The account; an unknown one reads as balance 0 and no operations.
    pub async fn account(&self, account_id: &str) -> Result<AccountView, LedgerError> {
        let (balance, operations) = match &self.backend {
            Backend::Memory(memory) => memory.account(account_id),
            Backend::Sqlite(pool) => sqlite::account(pool, account_id).await?,
            Backend::Postgres(pool) => postgres::account(pool, account_id).await?,
            Backend::Redis(redis) => redis.account(account_id).await?,
        };
        Ok(AccountView {
            account_id: account_id.to_owned(),
            balance,
            operations,
        })
    }

    /// Where the accounts live: `memory`, `SQLite`, `PostgreSQL` or `Redis`.
    pub fn kind(&self) -> &'static str {
        match self.backend {
            Backend::Memory(_) => "memory",
            Backend::Sqlite(_) => "SQLite",
            Backend::Postgres(_) => "PostgreSQL",
            Backend::Redis(_) => "Redis",
        }
    }
}

impl Default for Ledger {
    /// [`Ledger::memory`].
    fn default() -> Self {
        Self::memory()
    }
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("kind", &self.kind())
            .finish_non_exhaustive()
    }
}

impl OperationKind {
    /// `charge` or `deposit`, as the ledger's tables spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Charge => "charge",
            Self::Deposit => "deposit",
        }
    }
}

impl Operation {
    /// An operation of `kind` adding `amount` (in `currency`) to `account_id`.
    pub fn new(
        kind: OperationKind,
        account_id: impl Into<String>,
        amount: i64,
        currency: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            account_id: account_id.into(),
            amount,
            currency: currency.into(),
        }
    }
}

impl Attempt {
    /// A request without a key: its writes commit on their own, and every
    /// delivery takes effect.
    pub fn unkeyed() -> Self {
        Self::default()
    }

    /// A request under `key`, which belongs to `scope` (the principal).
    pub fn keyed(scope: Scope, key: IdempotencyKey) -> Self {
        Self {
            key: Some((scope, key)),
            transaction: None,
        }
    }

    /// The delivery the idempotency middleware let through with `execution`
    /// (`None`: the request had no key): keyed by its scope and key, its
    /// writes joining the request's transaction in transactional mode (what
    /// its store handed it), so that they commit with its idempotency record,
    /// or not at all.
    pub fn of(execution: Option<&ExecutionInfo>) -> Self {
        match execution {
            Some(execution) => {
                let keyed = Self::keyed(execution.scope().clone(), execution.key().clone());
                match execution.context::<SqliteTransaction>() {
                    Some(transaction) => keyed.within_sqlite(transaction),
                    None => keyed.within(execution.context::<PgTransaction>()),
                }
            }
            None => Self::unkeyed(),
        }
    }

    /// The same attempt, whose writes join `transaction` when there is one: the
    /// request's transaction in transactional mode, so that they commit with its
    /// idempotency record, or not at all.
    #[must_use]
    pub fn within(self, transaction: Option<Arc<PgTransaction>>) -> Self {
        Self {
            transaction: transaction.map(Joined::Postgres),
            ..self
        }
    }

    /// [`within`](Self::within), on SQLite.
    #[must_use]
    pub fn within_sqlite(self, transaction: Arc<SqliteTransaction>) -> Self {
        Self {
            transaction: Some(Joined::Sqlite(transaction)),
            ..self
        }
    }

    /// The scope and key, if the request had a key.
    pub fn key(&self) -> Option<(&Scope, &IdempotencyKey)> {
        self.key.as_ref().map(|(scope, key)| (scope, key))
    }

    /// Whether the attempt's writes join the request's transaction
    /// (transactional mode).
    pub fn is_transactional(&self) -> bool {
        self.transaction.is_some()
    }

    /// The scope and key as the ledger's rows store them.
    fn recorded_key(&self) -> (Option<&str>, Option<&str>) {
        match &self.key {
            Some((scope, key)) => (Some(scope.as_str()), Some(key.as_str())),
            None => (None, None),
        }
    }
}

impl LedgerError {
    fn unavailable(error: impl Into<BoxError>) -> Self {
        Self::Unavailable(error.into())
    }
}

/// The guard of the balance update, in both SQL dialects: the new balance stays
/// within a 64-bit integer (`excluded.balance` is the amount). A `CASE`, since
/// neither database promises to evaluate `OR`'s operands in order, and the
/// branch not taken would overflow.
const BALANCE_IN_RANGE: &str = "CASE WHEN excluded.balance >= 0 \
     THEN account.balance <= 9223372036854775807 - excluded.balance \
     ELSE account.balance >= -9223372036854775807 - 1 - excluded.balance END";
