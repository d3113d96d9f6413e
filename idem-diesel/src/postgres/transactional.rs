//! Transactional mode: the claim, the handler's writes and the completion in
//! one PostgreSQL transaction (`docs/contract.md` §7).

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use diesel::QueryableByName;
use diesel::connection::TransactionDepthChange;
use diesel::sql_types::{BigInt, Binary, Bool, Integer, Text, Uuid as SqlUuid};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use idem_core::store::{
    Claim, ClaimOutcome, ClaimRequest, ExecutionContext, OwnerToken, Record, StoreFuture,
};
use idem_core::{IdempotencyKey, Scope, Store, StoreError, StoredResponse};
use tokio::sync::{MappedMutexGuard, MutexGuard};

use super::{CLAIM_ATTEMPTS, ClaimContended, PgStore, completion_binds, statements};
use crate::prepared::PreparedExt;
use crate::row::{ClaimRow, RecordRow, duration_micros};
use crate::wait;
use idem_core::cleanup::Cleanup;

/// The advisory lock class of the keys that transactional executions hold
/// (see [`super::MIGRATION_LOCK_CLASS`]).
const EXECUTION_LOCK_CLASS: i32 = 0x6964_6d03;

/// The default bound on a lock wait inside an execution's transaction.
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The default bound on an execution's transaction left idle with nobody to
/// renew it (see [`TransactionalPgStore::idle_timeout`]).
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How many unanswered TCP keepalive probes end a transaction's session.
const KEEPALIVE_PROBES: u32 = 4;

/// Whether a transactional execution holds the key (`$1` lock key, `$2` class):
/// outside a transaction block the lock, if free, is taken and given back by
/// the statement's own implicit transaction.
const EXECUTION_RUNNING: &str =
    "SELECT NOT pg_try_advisory_xact_lock($2, hashtext($1)) AS in_progress";

/// A [`PgStore`] in transactional mode: the claim, the handler's own writes and
/// the completion commit together, or not at all (`docs/contract.md` §7).
///
/// `claim` first reads the committed record: a live one (completed and
/// unexpired: a replay) is answered at once, without a transaction. Otherwise
/// it `BEGIN`s on a pooled connection, takes a
/// transaction-scoped advisory lock on the key and writes the in-progress record
/// inside the transaction. The open transaction is handed to the handler as a
/// [`PgTransaction`] (through
/// [`Store::execution_context`] and the adapters' `ExecutionInfo::context`);
/// `complete` writes the answer on the same connection and `COMMIT`s; `release`
/// (a released status, a failed or panicking handler, a dropped execution)
/// `ROLLBACK`s. A crash of the process, or of the connection, rolls everything
/// back by itself: a retry then finds the key new and runs the handler once.
/// `BEGIN` and the claim are pipelined (sent together), and so are the
/// completion and `COMMIT`: a first execution costs three round trips besides
/// the handler's own statements, a replay one.
///
/// A commit that fails is [`StoreError::Uncommitted`]: the engine's
/// [`Execution::settle`](idem_core::Execution::settle) then answers
/// `503 store-unavailable` instead of the handler's answer, since the answer's
/// effects were rolled back.
///
/// **Concurrent duplicates.** The in-progress record is uncommitted, so other
/// transactions cannot see it; the advisory lock is what they see. A duplicate
/// that arrives while the first request's transaction is open finds the lock
/// taken and is answered [`ClaimOutcome::InProgress`] at once (the route's
/// `409`, or in wait mode a wait, polling the lock, then the replay of the
/// committed answer). The uncommitted record's fingerprint is invisible too, so
/// a *different* request under the running key gets `409` (not `422`) until the
/// first commits. The lease is not what excludes others here (the lock is), so
/// `renew` only checks that the transaction is open.
///
/// **Lock waits.** Every lock wait in the transaction, the claim's and the
/// handler's own (an `UPDATE` behind another transaction's row lock), is bounded
/// by [`lock_timeout`](TransactionalPgStoreBuilder::lock_timeout) (default 5 s): past it the statement
/// fails, and the execution is released rather than held open.
///
/// **Slow handlers.** A handler slower than the lease keeps its transaction
/// while its process lives, and runs once: the advisory lock, not the lease,
/// keeps duplicates out, and each renewal of the lease (the engine renews every
/// third of it while the handler runs) sends a no-op statement on the
/// transaction's connection when the handler is not holding it, so the server
/// never sees the transaction idle for long. A remote call between two
/// statements (a payment provider) may take as long as it takes, as long as
/// the handler lets go of [`PgTransaction::connection`] meanwhile; holding the
/// connection without using it counts as idle, up to
/// [`idle_timeout`](TransactionalPgStoreBuilder::idle_timeout).
///
/// **Vanished executions.** A transaction ends, and the key is free again, when
/// its session does:
///
/// - the application process exits or crashes: at once (its machine closes the
///   connection);
/// - its machine vanishes, or the network to it fails: within the *keepalive
///   bound* `k + 4 × i`, where the server's TCP keepalives on the session probe
///   after `k` = half the lease (at least 1 s) of silence, every `i` = an eighth
///   of the lease (at least 1 s), and give up after 4 unanswered probes
///   (`tcp_keepalives_*`, and `tcp_user_timeout` set to the same bound). That is
///   about the lease for leases of 8 s or more (31 s for the default 30 s), and
///   5 s for a 1 s lease. It needs a TCP connection; over a Unix socket the process is on the
///   database's machine and its exit closes the socket;
/// - the execution stalls with nobody renewing it (its handler returned but the
///   request never settled), or the handler holds the connection without using
///   it: after [`idle_timeout`](TransactionalPgStoreBuilder::idle_timeout) (default 60 s, and at least
///   the lease) of idleness (`idle_in_transaction_session_timeout`). The client
///   then gets `503` and the handler's writes are rolled back.
///
/// All of these settings are local to the execution's transaction: the pooled
/// connection gets its own back when the transaction ends.
///
/// **Connections.** Each running execution holds one pooled connection until it
/// settles: size the pool for the concurrent transactional requests.
///
/// ```no_run
/// use idem_core::{Engine, Policy};
/// use idem_diesel::PgStore;
/// use std::time::Duration;
///
/// # async fn run() -> Result<(), idem_diesel::SetupError> {
/// let store = PgStore::connect("postgres://app@db.internal/app").await?;
/// store.migrate().await?;
/// let transactional = store
///     .transactional_builder()
///     .lock_timeout(Duration::from_secs(2))
///     .build();
/// let engine = Engine::new(transactional, Policy::required());
/// # let _ = engine;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct TransactionalPgStore {
    store: PgStore,
    open: Arc<Mutex<HashMap<OwnerToken, PgTransaction>>>,
    lock_timeout: Duration,
    idle_timeout: Duration,
}

/// The open transaction of one transactional execution, as its handler gets it.
///
/// A cheap clone. [`connection`](Self::connection) lends the transaction's
/// connection, for diesel-async queries that commit with the request's
/// completion, or roll back with its release:
///
/// ```no_run
/// use diesel::sql_types::{BigInt, Text};
/// use diesel_async::RunQueryDsl;
/// use idem_diesel::PgTransaction;
///
/// async fn charge(transaction: &PgTransaction, account: &str, amount: i64) -> Result<(), Box<dyn std::error::Error>> {
///     let mut connection = transaction.connection().await?;
///     diesel::sql_query("INSERT INTO ledger (account, amount) VALUES ($1, $2)")
///         .bind::<Text, _>(account)
///         .bind::<BigInt, _>(amount)
///         .execute(&mut *connection)
///         .await?;
///     Ok(())
/// }
/// ```
///
/// Do not `COMMIT` or `ROLLBACK` it yourself: the engine does, when the request
/// settles. Nested `conn.transaction(…)` calls work as savepoints. Let go of the
/// connection before the handler returns: the completion waits for it.
#[derive(Clone)]
pub struct PgTransaction {
    connection: Arc<tokio::sync::Mutex<Option<OwnedConnection>>>,
}

/// The request's [`PgTransaction`], as a handler's first argument: an axum or
/// actix-web handler states that it takes the transaction by taking a
/// `Transaction`, which derefs to the `PgTransaction`, and is mounted with the
/// adapter's `on` (`idem_axum::IdempotencyLayer::on`,
/// `idem_actix::Idempotency::on`), which checks when the route is built that
/// its store is a [`TransactionalPgStore`] with keys required and failing
/// closed: a route that would hand the handler no transaction fails the
/// start. Where a handler also serves routes over other stores, take
/// `Option<ExecutionInfo>` and ask it for `context::<PgTransaction>()`.
pub type Transaction = idem_core::StoreContext<PgTransaction>;

/// The connection of a [`PgTransaction`], lent until dropped. Dereferences to
/// [`AsyncPgConnection`].
pub struct PgTransactionConnection<'a> {
    guard: MappedMutexGuard<'a, AsyncPgConnection>,
}

/// The transaction has ended (the request settled): its connection is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the execution's transaction has already been committed or rolled back")]
pub struct TransactionEnded;

/// A pooled connection held across store steps.
type OwnedConnection =
    bb8::PooledConnection<'static, AsyncDieselConnectionManager<AsyncPgConnection>>;

/// The execution's transaction could not be committed as it stood.
#[derive(Debug, thiserror::Error)]
enum CommitRefused {
    #[error("the handler left {0} nested transaction(s) open inside the execution's transaction")]
    NestedOpen(u32),
    #[error("the in-progress record was not found in the execution's own transaction")]
    RecordMissing,
}

#[derive(QueryableByName)]
struct RunningRow {
    #[diesel(sql_type = Bool)]
    in_progress: bool,
}

impl PgStore {
    /// This store in transactional mode, over the same pool and table (see
    /// [`TransactionalPgStore`]), with the default settings. Routes whose
    /// handlers write to the same database use it; the others keep the plain
    /// store.
    pub fn transactional(&self) -> TransactionalPgStore {
        self.transactional_builder().build()
    }

    /// This store in transactional mode, its settings still to be chosen.
    pub fn transactional_builder(&self) -> TransactionalPgStoreBuilder {
        TransactionalPgStoreBuilder {
            store: self.clone(),
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// The settings of a [`TransactionalPgStore`] ([`PgStore::transactional_builder`]),
/// each with its default; building cannot fail (the pool and the table are
/// the plain store's).
#[derive(Clone, Debug)]
#[must_use]
pub struct TransactionalPgStoreBuilder {
    store: PgStore,
    lock_timeout: Duration,
    idle_timeout: Duration,
}

impl TransactionalPgStoreBuilder {
    /// Bounds every lock wait inside an execution's transaction (default 5 s;
    /// at least 1 ms): the claim's, and the handler's own statements'. Past it
    /// the waiting statement fails.
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Ends an execution's transaction that stays idle, with no statement and no
    /// renewal, for this long (default 60 s; at least the claim's lease): the
    /// bound on an execution that stalled while its process lives, and on a
    /// handler holding [`PgTransaction::connection`] without using it.
    /// Renewals keep a running handler's transaction from idling while the
    /// handler lets go of the connection.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// The store in transactional mode.
    pub fn build(self) -> TransactionalPgStore {
        TransactionalPgStore {
            store: self.store,
            open: Arc::default(),
            lock_timeout: self.lock_timeout,
            idle_timeout: self.idle_timeout,
        }
    }
}

impl TransactionalPgStore {
    /// How long a lock wait inside an execution's transaction may take
    /// ([`TransactionalPgStoreBuilder::lock_timeout`]).
    pub fn get_lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// How long an execution's transaction may sit idle
    /// ([`TransactionalPgStoreBuilder::idle_timeout`]).
    pub fn get_idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// The plain store over the same table (for `migrate`, the pool, or routes
    /// whose effects are outside the database).
    pub fn plain(&self) -> &PgStore {
        &self.store
    }

    /// The cleanup job of the table (the same as the plain store's).
    pub fn cleanup(&self) -> Cleanup<PgStore> {
        self.store.cleanup()
    }

    /// How many executions hold an open transaction right now.
    pub fn open_transactions(&self) -> usize {
        self.transactions().len()
    }

    fn transactions(&self) -> std::sync::MutexGuard<'_, HashMap<OwnerToken, PgTransaction>> {
        // The map is consistent between statements: a panic elsewhere leaves it usable.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The text whose hash is the key's advisory lock: the table, the scope and
    /// the key, newline-separated (a key has no newline, nor a table name, so
    /// the text names one record).
    fn lock_key(&self, scope: &Scope, key: &IdempotencyKey) -> String {
        format!(
            "{}\n{}\n{}",
            self.store.inner.table.display(),
            scope.as_str(),
            key.as_str()
        )
    }

    /// The transaction of `owner`, taken out of the open ones.
    fn take(&self, owner: OwnerToken) -> Option<PgTransaction> {
        self.transactions().remove(&owner)
    }

    /// Answers from the committed record when it is live (a replay, or a plain
    /// store's execution in progress), without a transaction: one read.
    /// Otherwise claims inside a fresh transaction; keeps it open when the
    /// claim is granted, ends it otherwise.
    async fn claim_in_transaction(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let inner = &self.store.inner;
        let mut connection = inner.db.connection_owned().await?;
        let binds = statements::binds()
            .bind::<Text, _>(request.scope.as_str())
            .bind::<Text, _>(request.key.as_str());
        let live = inner
            .statements
            .live
            .row::<_, RecordRow>(&connection, binds)
            .await
            .map_err(StoreError::unavailable)?;
        if let Some(record) = live {
            return record.into_found();
        }
        match self.claim_on(&mut connection, request).await {
            Ok(ClaimOutcome::Claimed(claim)) => {
                let transaction = PgTransaction::new(connection);
                self.transactions().insert(claim.owner, transaction);
                Ok(ClaimOutcome::Claimed(claim))
            }
            outcome => {
                // Nothing was written: end the transaction, give the connection back.
                if let Err(error) =
                    AnsiTransactionManager::rollback_transaction(&mut *connection).await
                {
                    tracing::debug!(%error, "rollback after a claim that was not granted failed; the connection is dropped");
                }
                outcome
            }
        }
    }

    /// `BEGIN`, and the claim statement in the transaction it opens, until the
    /// claim settles (see `Statements::transactional_claim`). The first claim
    /// goes out with the `BEGIN`, in one round trip. When another execution's transaction
    /// holds the key, its record is uncommitted, so neither its fingerprint nor
    /// its lease is visible: the answer is in progress with the request's own
    /// fingerprint (a duplicate, so 409) and the lease this claim would have had.
    async fn claim_on(
        &self,
        connection: &mut AsyncPgConnection,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let timeout = format!("{}ms", self.lock_timeout.as_millis());
        let idle = format!("{}ms", self.idle_timeout.max(request.lease).as_millis());
        let keepalive = Keepalive::for_lease(request.lease);
        let lock_key = self.lock_key(&request.scope, &request.key);
        mark_begun(connection).map_err(StoreError::unavailable)?;
        for attempt in 0..CLAIM_ATTEMPTS {
            let binds = statements::binds()
                .bind::<Text, _>(request.scope.as_str())
                .bind::<Text, _>(request.key.as_str())
                .bind::<Binary, _>(&request.fingerprint.as_bytes()[..])
                .bind::<SqlUuid, _>(request.owner.as_uuid())
                .bind::<BigInt, _>(duration_micros(request.lease))
                .bind::<BigInt, _>(duration_micros(request.retention))
                .bind::<Integer, _>(EXECUTION_LOCK_CLASS)
                .bind::<Text, _>(&lock_key)
                .bind::<Text, _>(&timeout)
                .bind::<Text, _>(&idle)
                .bind::<Text, _>(keepalive.idle_secs.to_string())
                .bind::<Text, _>(keepalive.interval_secs.to_string())
                .bind::<Text, _>(KEEPALIVE_PROBES.to_string())
                .bind::<Text, _>(keepalive.bound_millis().to_string());
            let claim = self
                .store
                .inner
                .statements
                .transactional_claim
                .row::<_, ClaimRow>(connection, binds);
            let row = if attempt == 0 {
                // `BEGIN` is polled first, so it is sent first.
                let (begun, row) = tokio::join!(biased; begin(connection), claim);
                if let Err(error) = begun {
                    // Whatever the server did, the pool must not reuse it.
                    AnsiTransactionManager::transaction_manager_status_mut(connection)
                        .set_in_error();
                    return Err(StoreError::unavailable(error));
                }
                row
            } else {
                claim.await
            }
            .map_err(StoreError::unavailable)?;
            if let Some(outcome) = ClaimRow::settled(row, request) {
                return outcome;
            }
        }
        Err(StoreError::unavailable(ClaimContended))
    }

    /// Writes the completion on the execution's transaction and commits.
    async fn commit(
        &self,
        transaction: PgTransaction,
        claim: &Claim,
        response: &StoredResponse,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let Some(mut connection) = transaction.end().await else {
            return Err(StoreError::StaleOwner);
        };
        let depth = transaction_depth(&mut connection);
        if depth != 1 {
            roll_back(&mut connection).await;
            return Err(StoreError::uncommitted(CommitRefused::NestedOpen(
                depth.saturating_sub(1),
            )));
        }
        let statements = &self.store.inner.statements;
        let binds = completion_binds(claim, response, retention);
        // The completion, then `COMMIT`, in one round trip. Both wait their
        // turn for the connection's statement cache, which the completion
        // takes first (it is polled first) and gives back only once it has
        // sent its statement: the `COMMIT` cannot overtake it, even when the
        // completion must be prepared first. A completion that fails (its
        // record missing, or the handler's failed statement aborted the
        // transaction) makes the `COMMIT` a rollback.
        let (completed, committed) = tokio::join!(
            biased;
            statements
                .transactional_complete
                .run(&connection, binds),
            statements
                .commit
                .run(&connection, statements::binds()),
        );
        // The transaction is over either way: a `COMMIT` that fails rolls back.
        if let Ok(status) = AnsiTransactionManager::transaction_manager_status_mut(&mut *connection)
            .transaction_state()
        {
            let _ = status.change_transaction_depth(TransactionDepthChange::DecreaseDepth);
        }
        match (completed, committed) {
            (Ok(_), Ok(_)) => Ok(()),
            (Err(error), _) if is_missing_record(&error) => {
                Err(StoreError::uncommitted(CommitRefused::RecordMissing))
            }
            (Err(error), _) | (Ok(_), Err(error)) => Err(StoreError::uncommitted(error)),
        }
    }
}

impl Store for TransactionalPgStore {
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(self.claim_in_transaction(request))
    }

    /// The advisory lock, not the lease, keeps others out: renewal checks that
    /// the transaction is still open and keeps the server from ending it as
    /// idle (a no-op statement on its connection, unless the handler holds it).
    fn renew<'a>(&'a self, claim: &'a Claim, _lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let transaction = self.transactions().get(&claim.owner).cloned();
            match transaction {
                Some(transaction) => transaction.keep_alive().await,
                None => Err(StoreError::StaleOwner),
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
            let Some(transaction) = self.take(claim.owner) else {
                return Err(StoreError::StaleOwner);
            };
            self.commit(transaction, claim, response, retention).await
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let Some(transaction) = self.take(claim.owner) else {
                return Err(StoreError::StaleOwner);
            };
            if let Some(mut connection) = transaction.end().await {
                roll_back(&mut connection).await;
            }
            Ok(())
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

    /// Polls the key's advisory lock, which the running execution holds until
    /// its transaction ends.
    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        let lock_key = self.lock_key(scope, key);
        Box::pin(wait::until_settled(poll, move || {
            let lock_key = lock_key.clone();
            async move {
                let mut connection = self.store.connection().await?;
                diesel::sql_query(EXECUTION_RUNNING)
                    .bind::<Text, _>(lock_key)
                    .bind::<Integer, _>(EXECUTION_LOCK_CLASS)
                    .prepared()
                    .get_result::<RunningRow>(&mut *connection)
                    .await
                    .map(|row| row.in_progress)
                    .map_err(StoreError::unavailable)
            }
        }))
    }

    fn execution_context(&self, claim: &Claim) -> Option<ExecutionContext> {
        let transaction = self.transactions().get(&claim.owner).cloned()?;
        Some(Arc::new(transaction))
    }

    fn execution_context_type(&self) -> Option<idem_core::store::ContextType> {
        Some(idem_core::store::ContextType::of::<PgTransaction>())
    }

    fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.store.readiness()
    }
}

impl fmt::Debug for TransactionalPgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalPgStore")
            .field("store", &self.store)
            .field("open_transactions", &self.open_transactions())
            .field("lock_timeout", &self.lock_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl PgTransaction {
    fn new(connection: OwnedConnection) -> Self {
        Self {
            connection: Arc::new(tokio::sync::Mutex::new(Some(connection))),
        }
    }

    /// The transaction's connection, lent until the returned guard drops; waits
    /// while another holder has it. Fails once the request has settled.
    pub async fn connection(&self) -> Result<PgTransactionConnection<'_>, TransactionEnded> {
        let guard = self.connection.lock().await;
        MutexGuard::try_map(guard, |connection| connection.as_deref_mut())
            .map(|guard| PgTransactionConnection { guard })
            .map_err(|_| TransactionEnded)
    }

    /// Sends a no-op statement on the transaction's connection, so that the
    /// server does not end the transaction as idle, unless the handler holds
    /// the connection (it is then the handler's to use, and never waited for:
    /// the engine renews between polls of the handler). A connection found
    /// closed means the transaction is gone with it.
    async fn keep_alive(&self) -> Result<(), StoreError> {
        let Ok(mut guard) = self.connection.try_lock() else {
            return Ok(());
        };
        let Some(connection) = guard.as_deref_mut() else {
            return Err(StoreError::StaleOwner);
        };
        match connection.batch_execute("SELECT 1").await {
            Ok(()) => Ok(()),
            Err(diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::ClosedConnection,
                _,
            )) => Err(StoreError::StaleOwner),
            // An aborted transaction (a handler's statement failed) still holds
            // the key until the handler's failure releases it.
            Err(error) => {
                tracing::debug!(%error, "the keepalive statement of a transactional execution failed");
                Ok(())
            }
        }
    }

    /// Takes the connection away from every holder, once they let go of it.
    async fn end(&self) -> Option<OwnedConnection> {
        self.connection.lock().await.take()
    }
}

impl fmt::Debug for PgTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransaction").finish_non_exhaustive()
    }
}

impl Deref for PgTransactionConnection<'_> {
    type Target = AsyncPgConnection;

    fn deref(&self) -> &AsyncPgConnection {
        &self.guard
    }
}

impl DerefMut for PgTransactionConnection<'_> {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        &mut self.guard
    }
}

impl fmt::Debug for PgTransactionConnection<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTransactionConnection")
            .finish_non_exhaustive()
    }
}

/// The server's TCP keepalives on an execution's session, from its lease (see
/// [`TransactionalPgStore`]).
struct Keepalive {
    idle_secs: u64,
    interval_secs: u64,
}

impl Keepalive {
    fn for_lease(lease: Duration) -> Self {
        let at_least_a_second = |duration: Duration| {
            u64::try_from(duration.as_millis().div_ceil(1000).max(1)).unwrap_or(u64::MAX)
        };
        Self {
            idle_secs: at_least_a_second(lease / 2),
            interval_secs: at_least_a_second(lease / 8),
        }
    }

    /// How long a vanished peer keeps the session: `k + 4 × i`.
    fn bound_millis(&self) -> u64 {
        let probes = u64::from(KEEPALIVE_PROBES).saturating_mul(self.interval_secs);
        self.idle_secs.saturating_add(probes).saturating_mul(1000)
    }
}

/// Counts the execution's transaction as open before its `BEGIN` is sent: a
/// claim dropped midway then leaves a connection the pool sees as still in a
/// transaction, and closes instead of reusing.
pub(super) fn mark_begun(connection: &mut AsyncPgConnection) -> diesel::QueryResult<()> {
    let status =
        AnsiTransactionManager::transaction_manager_status_mut(connection).transaction_state()?;
    if status.transaction_depth().is_some() {
        return Err(diesel::result::Error::AlreadyInTransaction);
    }
    status.change_transaction_depth(TransactionDepthChange::IncreaseDepth)
}

/// Sends `BEGIN` (see [`mark_begun`]). A `BEGIN` cannot fail on a live session
/// outside a transaction, which a pooled connection is: the claim pipelined
/// behind it runs in its transaction.
pub(super) async fn begin(connection: &AsyncPgConnection) -> diesel::QueryResult<()> {
    let mut connection = connection;
    SimpleAsyncConnection::batch_execute(&mut connection, "BEGIN").await
}

/// Whether `error` is the transactional completion's own failure: no
/// in-progress record to complete.
fn is_missing_record(error: &diesel::result::Error) -> bool {
    matches!(
        error,
        diesel::result::Error::DatabaseError(_, info)
            if info.message().contains("idem: the in-progress record is missing")
    )
}

/// How deep the connection's transactions are nested (1: the execution's own).
pub(crate) fn transaction_depth(connection: &mut AsyncPgConnection) -> u32 {
    match AnsiTransactionManager::transaction_manager_status_mut(connection).transaction_depth() {
        Ok(Some(depth)) => depth.get(),
        Ok(None) | Err(_) => 0,
    }
}

/// Rolls the execution's transaction back. A failure leaves the connection
/// marked broken, so the pool closes it instead of reusing it, and closing the
/// connection rolls the transaction back on the server.
pub(crate) async fn roll_back(connection: &mut AsyncPgConnection) {
    while transaction_depth(connection) > 0 {
        if let Err(error) = AnsiTransactionManager::rollback_transaction(connection).await {
            tracing::debug!(%error, "rollback failed; the connection will be closed instead");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keepalive_bound_follows_the_lease() {
        for (lease_ms, idle, interval, bound_ms) in [
            (300, 1, 1, 5_000),
            (1_000, 1, 1, 5_000),
            (8_000, 4, 1, 8_000),
            (30_000, 15, 4, 31_000),
            (120_000, 60, 15, 120_000),
        ] {
            let keepalive = Keepalive::for_lease(Duration::from_millis(lease_ms));
            assert_eq!(
                (
                    keepalive.idle_secs,
                    keepalive.interval_secs,
                    keepalive.bound_millis()
                ),
                (idle, interval, bound_ms),
                "lease {lease_ms} ms"
            );
        }
    }
}
