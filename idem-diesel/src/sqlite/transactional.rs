//! Transactional mode on SQLite: the handler's writes and the record's
//! completion in one transaction (`docs/contract.md` §7).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use diesel::SqliteConnection;
use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use idem_core::cleanup::Cleanup;
use idem_core::store::{
    BoxError, Claim, ClaimOutcome, ClaimRequest, ContextType, ExecutionContext, NotReady,
    OwnerToken, Record, StoreFuture,
};
use idem_core::{IdempotencyKey, Scope, Store, StoreError, StoredResponse};
use tokio::sync::OwnedMutexGuard;

use super::{AsyncSqliteConnection, SqliteStore, completion};

/// A pooled connection held across the steps of one execution.
type OwnedConnection =
    bb8::PooledConnection<'static, AsyncDieselConnectionManager<AsyncSqliteConnection>>;

/// A [`SqliteStore`] in transactional mode: the handler's own writes and the
/// record's completion commit in one SQLite transaction, or not at all
/// (`docs/contract.md` §7). A crash at any instant leaves one effect or none:
/// the retry replays the committed answer, or, once the claim's lease has
/// lapsed, runs the handler once.
///
/// SQLite has one writer at a time, so the file's write lock is not held for
/// the whole request:
///
/// 1. `claim` is the plain store's. It first reads the record without the
///    write lock (WAL readers do not wait for writers): a live one (a replay,
///    or an execution in progress within its lease) is answered at once, even
///    while another execution's transaction holds the lock. Otherwise it
///    claims in its own short transaction: the in-progress record is committed, so a
///    concurrent duplicate sees it as on the plain store (`409` while it runs,
///    `422` for another body under the key, a wait then the replay in wait
///    mode).
/// 2. The handler gets a [`SqliteTransaction`] (through
///    [`Store::execution_context`], the adapters' `on` and
///    [`StoreContext<SqliteTransaction>`](idem_core::StoreContext)). Nothing is
///    opened yet: a payment provider's call before the first write holds no
///    lock, and no connection.
/// 3. Its first [`write`](SqliteTransaction::write) takes a pooled connection
///    and opens `BEGIN IMMEDIATE`, the file's write lock, waiting up to the
///    pool's busy timeout for another writer (another request's commit,
///    another process). Every later `write` runs in the same transaction.
/// 4. `complete` writes the answer in that transaction, fenced on the claim
///    (the record still in progress under this execution's owner), and
///    commits. A handler whose lease lapsed and whose key another request
///    claimed meanwhile finds the fence closed: everything rolls back, and the
///    client gets `503` (the answer's effects are gone), never a second effect.
///    A handler that never wrote completes as on the plain store.
/// 5. `release` (a released status, a failed or panicking handler, a dropped
///    execution) rolls the transaction back, then deletes the in-progress
///    record.
///
/// While the transaction is open no other connection can write, so no other
/// request can claim the key: renewals are then not needed, and skipped.
///
/// **Another writer holds the lock** (a long transaction of another process,
/// a backup): the first `write` waits up to the busy timeout
/// ([`SqliteStoreBuilder::busy_timeout`](crate::SqliteStoreBuilder::busy_timeout),
/// 5 s by default), then fails with [`SqliteTransactionError::Unavailable`],
/// which the handler answers `503` (with `Retry-After`); the engine releases
/// the key, nothing was written, and the retry runs the handler once. Keep
/// slow work (remote calls) before the first `write`, and keep the writes
/// short: every other writer of the file waits for the commit.
///
/// **Connections.** An execution holds a pooled connection from its first
/// `write` until it settles. Do not write through another connection of the
/// same file inside the handler: it would wait for the handler's own lock.
///
/// ```no_run
/// use idem_core::{Engine, Policy};
/// use idem_diesel::SqliteStore;
///
/// # async fn run() -> Result<(), idem_diesel::SetupError> {
/// let store = SqliteStore::connect("sqlite://orders.db").await?;
/// store.migrate().await?;
/// let engine = Engine::new(store.transactional(), Policy::required());
/// # let _ = engine;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct TransactionalSqliteStore {
    store: SqliteStore,
    open: Arc<Mutex<HashMap<OwnerToken, SqliteTransaction>>>,
}

/// The transaction of one transactional execution on SQLite, as its handler
/// gets it: opened by the first [`write`](Self::write), committed with the
/// record's completion, rolled back with its release. A cheap clone.
///
/// ```no_run
/// use diesel::sql_types::{BigInt, Text};
/// use diesel::RunQueryDsl;
/// use idem_diesel::{SqliteTransaction, SqliteTransactionError};
///
/// async fn order(
///     transaction: &SqliteTransaction,
///     item: String,
///     quantity: i64,
/// ) -> Result<usize, SqliteTransactionError> {
///     transaction
///         .write(move |connection| {
///             let rows = diesel::sql_query("INSERT INTO orders (item, quantity) VALUES (?, ?)")
///                 .bind::<Text, _>(item)
///                 .bind::<BigInt, _>(quantity)
///                 .execute(connection)?;
///             Ok(rows)
///         })
///         .await
/// }
/// ```
#[derive(Clone)]
pub struct SqliteTransaction {
    state: Arc<tokio::sync::Mutex<State>>,
    store: SqliteStore,
}

/// Where an execution's transaction stands.
enum State {
    /// Nothing written yet: no connection, no lock.
    Idle,
    /// `BEGIN IMMEDIATE` done on this connection: the file's write lock held.
    Open(OwnedConnection),
    /// Committed or rolled back: the request has settled.
    Ended,
}

/// Why a [`SqliteTransaction::write`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteTransactionError {
    /// The request has settled: its transaction was committed or rolled back.
    #[error("the execution's transaction has already been committed or rolled back")]
    Ended,
    /// The transaction could not be opened: no pooled connection was free in
    /// time, or another writer held the file's write lock past the busy
    /// timeout. Nothing was written; answer `503` and let the client retry.
    #[error("the database could not open the execution's transaction")]
    Unavailable(#[source] BoxError),
    /// A statement of the handler failed; the transaction stays open (SQLite
    /// rolls back only the failed statement), and the handler decides.
    #[error(transparent)]
    Query(#[from] diesel::result::Error),
}

/// The transaction could not be committed as it stood.
#[derive(Debug, thiserror::Error)]
enum CommitRefused {
    #[error("the handler left {0} nested transaction(s) open inside the execution's transaction")]
    NestedOpen(u32),
    #[error(
        "the claim was lost (its lease lapsed and another request claimed the key) before the commit"
    )]
    ClaimLost,
    #[error("the handler's step panicked; its transaction is gone")]
    Panicked,
}

impl SqliteStore {
    /// This store in transactional mode, over the same pool and table (see
    /// [`TransactionalSqliteStore`]). Routes whose handlers write to the same
    /// file use it; the others keep the plain store.
    pub fn transactional(&self) -> TransactionalSqliteStore {
        TransactionalSqliteStore {
            store: self.clone(),
            open: Arc::default(),
        }
    }
}

impl TransactionalSqliteStore {
    /// The plain store over the same table (for `migrate`, the pool, or routes
    /// whose effects are outside the database).
    pub fn plain(&self) -> &SqliteStore {
        &self.store
    }

    /// The cleanup job of the table (the same as the plain store's).
    pub fn cleanup(&self) -> Cleanup<SqliteStore> {
        self.store.cleanup()
    }

    /// How many executions are running (claimed, not settled), whether or not
    /// they have written yet.
    pub fn open_transactions(&self) -> usize {
        self.transactions().len()
    }

    fn transactions(&self) -> std::sync::MutexGuard<'_, HashMap<OwnerToken, SqliteTransaction>> {
        // The map is consistent between statements: a panic elsewhere leaves it usable.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self, owner: OwnerToken) -> Option<SqliteTransaction> {
        self.transactions().remove(&owner)
    }

    /// Writes the completion in the execution's transaction and commits; or,
    /// when the handler never wrote, completes as the plain store does.
    async fn commit(
        &self,
        transaction: SqliteTransaction,
        claim: &Claim,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let connection = match transaction.end().await {
            State::Open(connection) => connection,
            State::Idle => return self.store.complete(claim, response, retention).await,
            State::Ended => return Err(StoreError::StaleOwner),
        };
        let complete = completion(claim, response, retention);
        let statements = Arc::clone(&self.store.inner.statements);
        on_blocking_thread(connection, move |c| {
            let depth = depth(c);
            if depth != 1 {
                roll_back(c);
                return Err(CommitRefused::NestedOpen(depth.saturating_sub(1)).into());
            }
            match complete(c, &statements) {
                Ok(0) => {
                    roll_back(c);
                    return Err(CommitRefused::ClaimLost.into());
                }
                Ok(_) => {}
                Err(error) => {
                    roll_back(c);
                    return Err(error.into());
                }
            }
            // A COMMIT that fails leaves the transaction open: roll it back,
            // so the pooled connection is clean again.
            AnsiTransactionManager::commit_transaction(c).map_err(|error| {
                roll_back(c);
                BoxError::from(error)
            })
        })
        .await
        .map_err(StoreError::uncommitted)
    }
}

impl Store for TransactionalSqliteStore {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            let outcome = self.store.claim(request).await?;
            if let ClaimOutcome::Claimed(claim) = &outcome {
                let transaction = SqliteTransaction {
                    state: Arc::new(tokio::sync::Mutex::new(State::Idle)),
                    store: self.store.clone(),
                };
                self.transactions().insert(claim.owner, transaction);
            }
            Ok(outcome)
        })
    }

    /// Renews on the plain store until the handler first writes; from then on
    /// the open transaction's write lock keeps every other claim out, and the
    /// renewal is skipped.
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let transaction = self.transactions().get(&claim.owner).cloned();
            let Some(transaction) = transaction else {
                return self.store.renew(claim, lease).await;
            };
            // The handler is writing (and so opening the transaction): the
            // lock will keep others out, or the write fails and the handler
            // with it.
            let Ok(state) = transaction.state.try_lock() else {
                return Ok(());
            };
            match *state {
                // Held across the renewal, so that a first write waits for it.
                State::Idle => self.store.renew(claim, lease).await,
                State::Open(_) => Ok(()),
                State::Ended => Err(StoreError::StaleOwner),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            match self.take(claim.owner) {
                Some(transaction) => self.commit(transaction, claim, response, retention).await,
                // Settled before, with nothing written (the engine retries a
                // completion the store failed): the plain store's, fenced.
                None => self.store.complete(claim, response, retention).await,
            }
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            if let Some(transaction) = self.take(claim.owner)
                && let State::Open(connection) = transaction.end().await
            {
                // A rollback that fails drops the connection, which rolls back.
                let _ = on_blocking_thread(connection, |c| {
                    roll_back(c);
                    Ok(())
                })
                .await;
            }
            self.store.release(claim).await
        })
    }

    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        Store::load(&self.store, scope, key)
    }

    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        self.store.delete_expired(batch)
    }

    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        self.store.changed(scope, key, poll)
    }

    fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
        let transaction = self.transactions().get(&claim.owner).cloned()?;
        Some(Arc::new(transaction))
    }

    fn execution_context_type(&self) -> Option<ContextType> {
        Some(ContextType::of::<SqliteTransaction>())
    }

    fn readiness(&self) -> Result<(), NotReady> {
        self.store.readiness()
    }
}

impl fmt::Debug for TransactionalSqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalSqliteStore")
            .field("store", &self.store)
            .field("open_transactions", &self.open_transactions())
            .finish()
    }
}

impl SqliteTransaction {
    /// Runs `work` in the execution's transaction, on diesel's synchronous
    /// [`SqliteConnection`], on a blocking thread, and answers what it
    /// answered. The first call opens the transaction (`BEGIN IMMEDIATE`:
    /// see [`TransactionalSqliteStore`] for what it waits for); every later
    /// call runs in the same one. What `work` writes commits with the
    /// record's completion, or rolls back with its release.
    ///
    /// `work` is a plain closure: no boxing, no `async`. Move what it needs
    /// into it. Nested `connection.transaction(…)` calls are savepoints;
    /// do not `COMMIT` or `ROLLBACK` the execution's transaction yourself.
    /// Calls are taken one at a time.
    pub async fn write<R, E, F>(&self, work: F) -> Result<R, E>
    where
        F: FnOnce(&mut SqliteConnection) -> Result<R, E> + Send + 'static,
        R: Send + 'static,
        E: From<SqliteTransactionError> + Send + 'static,
    {
        let mut state = Arc::clone(&self.state).lock_owned().await;
        // The state changes only once the step is spawned: a write given up
        // on while it waits for a connection leaves the transaction as it was.
        let (connection, begun) = match &*state {
            State::Ended => return Err(SqliteTransactionError::Ended.into()),
            State::Open(_) => match std::mem::replace(&mut *state, State::Ended) {
                State::Open(connection) => (connection, true),
                State::Idle | State::Ended => return Err(SqliteTransactionError::Ended.into()),
            },
            State::Idle => {
                let db = &self.store.inner.db;
                let connection = db
                    .connection_owned()
                    .await
                    .map_err(|error| SqliteTransactionError::Unavailable(error.into()))?;
                (connection, false)
            }
        };
        // A task of its own, holding the state: the step finishes, and its
        // connection goes back into the state, even if this future is dropped
        // (see `Database::run`).
        let step = tokio::spawn(step(state, connection, begun, work));
        match step.await {
            Ok(outcome) => outcome,
            // The state is left ended: the handler's transaction is gone.
            Err(error) => Err(SqliteTransactionError::Unavailable(error.into()).into()),
        }
    }

    /// Ends the transaction for every holder, once they let go of it: what it
    /// was.
    async fn end(&self) -> State {
        std::mem::replace(&mut *self.state.lock().await, State::Ended)
    }
}

/// One [`SqliteTransaction::write`]: opens the transaction unless `begun`,
/// runs `work`, and puts the connection back in `state` (or the state back to
/// idle when the transaction could not be opened).
async fn step<R, E, F>(
    mut state: OwnedMutexGuard<State>,
    mut connection: OwnedConnection,
    begun: bool,
    work: F,
) -> Result<R, E>
where
    F: FnOnce(&mut SqliteConnection) -> Result<R, E> + Send + 'static,
    R: Send + 'static,
    E: From<SqliteTransactionError> + Send + 'static,
{
    let ran = connection
        .spawn_blocking(move |c| {
            if !begun
                && let Err(error) =
                    AnsiTransactionManager::begin_transaction_sql(c, "BEGIN IMMEDIATE")
            {
                return Ok(Err(error));
            }
            Ok(Ok(work(c)))
        })
        .await;
    match ran {
        Ok(Ok(outcome)) => {
            *state = State::Open(connection);
            outcome
        }
        Ok(Err(error)) => {
            *state = State::Idle;
            Err(SqliteTransactionError::Unavailable(error.into()).into())
        }
        // The blocking step itself failed (`work` panicked), maybe inside the
        // transaction: roll it back, so that the connection goes back to the
        // pool outside any transaction (a later step on it would otherwise
        // run inside this one). The request's handler fails with it.
        Err(error) => {
            *state = State::Ended;
            let _ = connection
                .spawn_blocking(|c| {
                    roll_back(c);
                    Ok(())
                })
                .await;
            Err(SqliteTransactionError::Unavailable(error.into()).into())
        }
    }
}

/// Runs `task` on `connection`'s blocking thread, in a task of its own (see
/// `Database::run`).
async fn on_blocking_thread(
    mut connection: OwnedConnection,
    task: impl FnOnce(&mut SqliteConnection) -> Result<(), BoxError> + Send + 'static,
) -> Result<(), BoxError> {
    let ran = tokio::spawn(async move { connection.spawn_blocking(|c| Ok(task(c))).await }).await;
    match ran {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(error)) => Err(error.into()),
        Err(_) => Err(CommitRefused::Panicked.into()),
    }
}

/// How deep the connection's transactions are nested (1: the execution's own).
fn depth(connection: &mut SqliteConnection) -> u32 {
    match AnsiTransactionManager::transaction_manager_status_mut(connection).transaction_depth() {
        Ok(Some(depth)) => depth.get(),
        Ok(None) | Err(_) => 0,
    }
}

/// Rolls every open level back. A rollback that fails leaves the connection
/// broken for the pool, which then closes it, and closing rolls back.
fn roll_back(connection: &mut SqliteConnection) {
    while depth(connection) > 0 {
        if let Err(error) = AnsiTransactionManager::rollback_transaction(connection) {
            tracing::debug!(%error, "rollback failed; the connection will be closed instead");
            return;
        }
    }
}

impl fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTransaction").finish_non_exhaustive()
    }
}
