//! The PostgreSQL store.

mod consumer_inbox;
mod outbox;
mod statements;
mod transactional;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{BigInt, Binary, Bool, Integer, Text, Uuid as SqlUuid};
use diesel::{QueryResult, QueryableByName};
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, PoolableConnection, RecyclingMethod,
};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};
use idem_core::store::BoxError;
use idem_core::store::{Claim, ClaimOutcome, ClaimRequest, Record, StoreFuture};
use idem_core::{IdempotencyKey, Scope, Store, StoreError, StoredResponse};

use crate::builder::StoreBuilder;
use crate::database::{Database, Dialect, PoolSettings, Pooled};
use crate::outbox::Postgres;
use crate::row::{ClaimRow, InProgressRow, RecordRow, duration_micros, fenced};
use crate::table::{ColumnRow, Table};
use crate::{SetupError, wait};
use idem_core::cleanup::{Cleanup, SweepGuard, SweepLock};
use statements::Statements;

pub use consumer_inbox::{PgInbox, PgInboxBuilder};
pub use outbox::PgOutbox;
pub use transactional::{
    PgTransaction, PgTransactionConnection, Transaction, TransactionEnded, TransactionalPgStore,
    TransactionalPgStoreBuilder,
};
pub(crate) use transactional::{roll_back, transaction_depth};

/// A bb8 pool of diesel-async PostgreSQL connections, as [`PgStore`] uses.
pub type PgPool = bb8::Pool<AsyncDieselConnectionManager<AsyncPgConnection>>;

/// The migrations that create the default table, `idem_records`.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres");

/// Advisory lock classes (the first key of `pg_advisory_lock(int, int)`), so that
/// idem's locks do not collide with the application's own.
const MIGRATION_LOCK_CLASS: i32 = 0x6964_6d01;
pub(crate) const SWEEP_LOCK_CLASS: i32 = 0x6964_6d02;
/// The class of the consumer inbox's per-consumer bury lock (`0x6964_6d03` is
/// transactional mode's).
const BURY_LOCK_CLASS: i32 = 0x6964_6d04;

/// How often a claim statement is run again when it met a concurrent change (see
/// `Statements::claim`). Each run takes a fresh snapshot, so a second run almost
/// always settles it.
const CLAIM_ATTEMPTS: usize = 5;

/// Records in a PostgreSQL table, shared by every application instance that
/// connects to the database.
///
/// Each store step is one statement and one round trip: the claim is a single
/// `INSERT … ON CONFLICT … DO UPDATE … WHERE …` inside a CTE that also returns
/// the record it found; `complete`, `renew` and `release` check the owner token in
/// their `WHERE` clause. Times are the database's (`now()`), so instances with
/// skewed clocks agree on when a lease lapsed.
///
/// Cheap to clone: clones share the pool.
///
/// ```no_run
/// use idem_diesel::PgStore;
///
/// # async fn run() -> Result<(), idem_diesel::SetupError> {
/// let store = PgStore::connect("postgres://app@db.internal/app").await?;
/// store.migrate().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database<Postgres>,
    table: Table,
    statements: Statements,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("table", &self.inner.table.display())
            .field("pool", &self.inner.db.state())
            .finish_non_exhaustive()
    }
}

/// Configures a [`PgStore`]: its table, its schema, and the pool it builds.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_diesel::PgStore;
///
/// # async fn run() -> Result<(), idem_diesel::SetupError> {
/// let store = PgStore::builder()
///     .schema("idem")
///     .table("payment_keys")
///     .max_connections(20)
///     .connection_timeout(Duration::from_secs(2))
///     .connect("postgres://app@db.internal/app")
///     .await?;
/// store.migrate().await?; // creates the schema and the table if missing
/// # Ok(())
/// # }
/// ```
pub type PgStoreBuilder = StoreBuilder<Postgres>;

/// The claim statement met concurrent changes on every attempt.
#[derive(Debug, thiserror::Error)]
#[error("the claim kept meeting concurrent changes to the record ({CLAIM_ATTEMPTS} attempts)")]
struct ClaimContended;

/// A dedicated connection could not be opened in time.
#[derive(Debug, thiserror::Error)]
#[error("no database connection within {0:?}")]
struct ConnectTimedOut(Duration);

#[derive(QueryableByName)]
struct LockRow {
    #[diesel(sql_type = Bool)]
    locked: bool,
}

impl PgStore {
    /// Connects to `url` with the default table (`idem_records`) and pool.
    ///
    /// Fails if the database cannot be reached. Call [`migrate`](Self::migrate)
    /// once before use.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// A store over a pool the application already has, with the default table.
    ///
    /// The pool's own settings apply. Give it a short `connection_timeout` (the
    /// store's builder uses 3 s), so that an outage is answered quickly rather than
    /// after bb8's default of 30 s. diesel-async's default checkout test
    /// (`RecyclingMethod::Verified`) costs a `SELECT 1` round trip per store
    /// step; the pools the store builds only check that the connection is open.
    pub fn from_pool(pool: PgPool) -> Self {
        Self::with_table(
            Database::over(pool, &PoolSettings::new(10)),
            Table::default(),
        )
    }

    /// Configures the table, the schema and the pool.
    pub fn builder() -> PgStoreBuilder {
        StoreBuilder::new(10)
    }

    fn with_table(db: Database<Postgres>, table: Table) -> Self {
        Self {
            inner: Arc::new(Inner {
                statements: Statements::new(&table),
                db,
                table,
            }),
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.inner.db.pool
    }

    /// The SQL that creates this store's schema (if configured), table and
    /// cleanup index, for applications that run their own migration tool.
    /// Every statement is `IF NOT EXISTS`.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_diesel::SetupError> {
    /// use idem_diesel::{PgPool, PgStore};
    /// use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    ///
    /// // Building a pool does not connect.
    /// let pool: PgPool = bb8::Pool::builder()
    ///     .build_unchecked(AsyncDieselConnectionManager::new("postgres://localhost/app"));
    /// let store = PgStore::builder().schema("idem").build(pool)?;
    /// let ddl = store.ddl();
    /// assert!(ddl.starts_with(r#"CREATE SCHEMA IF NOT EXISTS "idem";"#));
    /// assert!(ddl.contains(r#"CREATE TABLE IF NOT EXISTS "idem"."idem_records""#));
    /// # Ok(())
    /// # }
    /// ```
    pub fn ddl(&self) -> String {
        let table = &self.inner.table;
        match table.schema() {
            Some(schema) => format!(
                "CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n{}",
                table.postgres_ddl()
            ),
            None => table.postgres_ddl(),
        }
    }

    /// Creates or upgrades the table. Safe to call from every instance at startup:
    /// concurrent calls wait on an advisory lock.
    ///
    /// For the default table (`idem_records`, no schema) this runs the embedded
    /// diesel migrations, recorded in `__diesel_schema_migrations`. A migration
    /// cannot be templated, so for any other name it runs [`ddl`](Self::ddl)
    /// instead, in one transaction; every statement there is `IF NOT EXISTS`.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let table = &self.inner.table;
        if table.is_default() {
            return self.inner.db.migrate(MIGRATIONS, &table.display()).await;
        }
        // Several statements in one simple query run as one implicit
        // transaction, which the transaction-scoped lock serializes.
        let sql = format!(
            "SELECT pg_advisory_xact_lock({MIGRATION_LOCK_CLASS}, 0);\n{}",
            self.ddl()
        );
        let failed = |source: BoxError| SetupError::Migrate {
            table: table.display(),
            source,
        };
        let mut connection = self.connection().await.map_err(|e| failed(e.into()))?;
        connection
            .batch_execute(&sql)
            .await
            .map_err(|e| failed(e.into()))?;
        self.inner.db.schema_gate.pass();
        Ok(())
    }

    /// Checks that this store's table exists with every column this version
    /// uses, so that a forgotten migration fails at start-up, naming the fix,
    /// instead of answering every keyed request `503 store-unavailable`.
    ///
    /// The table is looked up as the store's statements name it (through the
    /// connection's `search_path` unless a schema is configured).
    /// [`migrate`](Self::migrate) makes it pass; call it at start-up when your
    /// own migration tool creates the table ([`ddl`](Self::ddl)). It fails with
    /// [`SetupError::SchemaMissing`] or [`SetupError::SchemaOutdated`], whose
    /// messages say to run `store.migrate()`.
    pub async fn check_schema(&self) -> Result<(), SetupError> {
        let table = &self.inner.table;
        self.inner
            .db
            .check_schema(&table.display(), [table.sql()], |found| {
                table.check_columns(&found[0])
            })
            .await
    }

    /// A cleanup job for this store's table, of which one runner at a time
    /// sweeps across every instance (see [`SweepLock`]).
    pub fn cleanup(&self) -> Cleanup<PgStore> {
        Cleanup::new(self.clone()).lock(self.clone())
    }

    async fn connection(&self) -> Result<Pooled<'_, Postgres>, StoreError> {
        self.inner.db.connection().await
    }

    async fn in_progress(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let connection = self.connection().await?;
        let binds = statements::binds()
            .bind::<Text, _>(scope.as_str())
            .bind::<Text, _>(key.as_str());
        self.inner
            .statements
            .in_progress
            .row::<_, InProgressRow>(&connection, binds)
            .await
            .map(|row| row.is_some_and(|row| row.in_progress))
            .map_err(StoreError::unavailable)
    }
}

impl StoreBuilder<Postgres> {
    /// The table's schema (default: the connection's `search_path`, usually
    /// `public`). [`PgStore::migrate`] creates it if missing.
    pub fn schema(mut self, name: impl Into<String>) -> Self {
        self.schema = Some(name.into());
        self
    }

    /// Builds a pool for `url` and checks that it connects.
    pub async fn connect(self, url: &str) -> Result<PgStore, SetupError> {
        let table = self.validated_table()?;
        Ok(PgStore::with_table(
            Database::open(url, &self.pool).await?,
            table,
        ))
    }

    /// A store over a pool the application already has.
    pub fn build(self, pool: PgPool) -> Result<PgStore, SetupError> {
        let table = self.validated_table()?;
        Ok(PgStore::with_table(Database::over(pool, &self.pool), table))
    }

    fn validated_table(&self) -> Result<Table, SetupError> {
        Table::new(self.schema.as_deref(), &self.table)
    }
}

impl Dialect for Postgres {
    type Manager = AsyncDieselConnectionManager<AsyncPgConnection>;

    /// Connections checked on checkout only for a closed socket.
    fn manager(url: &str, _: &PoolSettings) -> Self::Manager {
        let mut config = ManagerConfig::default();
        config.recycling_method = RecyclingMethod::CustomFunction(Box::new(refuse_closed));
        AsyncDieselConnectionManager::new_with_config(url, config)
    }

    /// On a connection of its own, under a session-scoped advisory lock, so
    /// that concurrent calls wait for each other. diesel's migration harness
    /// is synchronous: it runs on a blocking thread, which works under both
    /// runtime flavours (a current-thread runtime keeps driving the
    /// connection while it awaits the task).
    async fn migrate(
        database: &Database<Self>,
        migrations: EmbeddedMigrations,
    ) -> Result<(), BoxError> {
        use diesel::connection::SimpleConnection;

        let connection = database.dedicated().await?;
        tokio::task::spawn_blocking(move || {
            let mut connection: AsyncConnectionWrapper<AsyncPgConnection> = connection.into();
            SimpleConnection::batch_execute(
                &mut connection,
                &format!("SELECT pg_advisory_lock({MIGRATION_LOCK_CLASS}, 0)"),
            )?;
            connection.run_pending_migrations(migrations)?;
            Ok(())
        })
        .await?
    }

    async fn columns(database: &Database<Self>, table: String) -> Result<Vec<ColumnRow>, BoxError> {
        let mut connection = database.connection().await?;
        Ok(diesel::sql_query(
            "SELECT attname::text AS name FROM pg_attribute \
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
        )
        .bind::<Text, _>(table)
        .load::<ColumnRow>(&mut *connection)
        .await?)
    }
}

impl Database<Postgres> {
    /// The sweep lock of the table `name`: a session-scoped advisory lock,
    /// on a connection of its own that the guard holds (see [`SweepLock`]).
    pub(crate) async fn sweep_lock(&self, name: String) -> Result<Option<SweepGuard>, StoreError> {
        let mut connection = self.dedicated().await?;
        let row = diesel::sql_query("SELECT pg_try_advisory_lock($1, hashtext($2)) AS locked")
            .bind::<Integer, _>(SWEEP_LOCK_CLASS)
            .bind::<Text, _>(name)
            .get_result::<LockRow>(&mut connection)
            .await
            .map_err(StoreError::unavailable)?;
        Ok(row.locked.then(|| SweepGuard::new(connection)))
    }

    /// A connection outside the pool: for migrations, `LISTEN`, and
    /// session-scoped advisory locks.
    pub(crate) async fn dedicated(&self) -> Result<AsyncPgConnection, StoreError> {
        let timeout = self.connection_timeout;
        match tokio::time::timeout(timeout, self.pool.dedicated_connection()).await {
            Ok(connection) => connection.map_err(StoreError::unavailable),
            Err(_) => Err(StoreError::unavailable(ConnectTimedOut(timeout))),
        }
    }
}

/// The pool's check on checkout: refuses a connection whose socket has closed
/// (after a database restart, say), without the round trip of a `SELECT 1`.
fn refuse_closed(
    connection: &mut AsyncPgConnection,
) -> Pin<Box<dyn Future<Output = QueryResult<()>> + Send + '_>> {
    let closed = PoolableConnection::is_broken(connection);
    Box::pin(async move {
        if closed {
            Err(DieselError::DatabaseError(
                DatabaseErrorKind::ClosedConnection,
                Box::new("the connection is closed".to_owned()),
            ))
        } else {
            Ok(())
        }
    })
}

impl PgStore {
    /// Runs the claim statement on `connection` until it settles (see
    /// `Statements::claim`).
    async fn claim_on(
        &self,
        connection: &mut AsyncPgConnection,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        for _ in 0..CLAIM_ATTEMPTS {
            let binds = statements::binds()
                .bind::<Text, _>(request.scope.as_str())
                .bind::<Text, _>(request.key.as_str())
                .bind::<Binary, _>(&request.fingerprint.as_bytes()[..])
                .bind::<SqlUuid, _>(request.owner.as_uuid())
                .bind::<BigInt, _>(duration_micros(request.lease))
                .bind::<BigInt, _>(duration_micros(request.retention));
            let row = self
                .inner
                .statements
                .claim
                .row::<_, ClaimRow>(connection, binds)
                .await
                .map_err(StoreError::unavailable)?;
            if let Some(outcome) = ClaimRow::settled(row, request) {
                return outcome;
            }
        }
        Err(StoreError::unavailable(ClaimContended))
    }
}

/// The binds of the completion statements (`complete`, and transactional
/// mode's own): `$1` scope, `$2` key, `$3` owner, `$4` status, `$5` headers,
/// `$6` body, `$7` replayable, `$8` retention µs.
fn completion_binds<'a>(
    claim: &'a Claim,
    response: &'a StoredResponse,
    retention: Duration,
) -> impl diesel::query_builder::QueryFragment<diesel::pg::Pg> + Send + 'a {
    statements::binds()
        .bind::<Text, _>(claim.scope.as_str())
        .bind::<Text, _>(claim.key.as_str())
        .bind::<SqlUuid, _>(claim.owner.as_uuid())
        .bind::<Integer, _>(i32::from(response.status))
        .bind::<Binary, _>(response.encode_headers())
        .bind::<Binary, _>(&response.body[..])
        .bind::<Bool, _>(response.replayable)
        .bind::<BigInt, _>(duration_micros(retention))
}

impl Store for PgStore {
    fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.inner
            .db
            .schema_gate
            .readiness(&self.inner.table, "PgStoreBuilder")
    }

    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            self.claim_on(&mut connection, request).await
        })
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let connection = self.connection().await?;
            let binds = statements::binds()
                .bind::<Text, _>(claim.scope.as_str())
                .bind::<Text, _>(claim.key.as_str())
                .bind::<SqlUuid, _>(claim.owner.as_uuid())
                .bind::<BigInt, _>(duration_micros(lease));
            let rows = self.inner.statements.renew.run(&connection, binds).await;
            fenced(rows)
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let connection = self.connection().await?;
            let binds = completion_binds(claim, response, retention);
            fenced(self.inner.statements.complete.run(&connection, binds).await)
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let connection = self.connection().await?;
            let binds = statements::binds()
                .bind::<Text, _>(claim.scope.as_str())
                .bind::<Text, _>(claim.key.as_str())
                .bind::<SqlUuid, _>(claim.owner.as_uuid());
            let rows = self.inner.statements.release.run(&connection, binds).await;
            fenced(rows)
        })
    }

    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        Box::pin(async move {
            let connection = self.connection().await?;
            let binds = statements::binds()
                .bind::<Text, _>(scope.as_str())
                .bind::<Text, _>(key.as_str());
            let row = self
                .inner
                .statements
                .load
                .row::<_, RecordRow>(&connection, binds)
                .await
                .map_err(StoreError::unavailable)?;
            row.map(|row| row.into_record(scope, key)).transpose()
        })
    }

    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let connection = self.connection().await?;
            let binds =
                statements::binds().bind::<BigInt, _>(i64::try_from(batch).unwrap_or(i64::MAX));
            let deleted = self
                .inner
                .statements
                .delete_expired
                .run(&connection, binds)
                .await
                .map_err(StoreError::unavailable)?;
            Ok(u64::try_from(deleted).unwrap_or(u64::MAX))
        })
    }

    fn changed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
        poll: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(wait::until_settled(poll, move || {
            self.in_progress(scope, key)
        }))
    }
}

/// One sweep at a time per table, across every instance: a session-scoped
/// `pg_try_advisory_lock` on a connection of its own, outside the pool, keyed by
/// the table's name. The lock is held for the whole sweep and released when the
/// sweep drops the guard and its connection closes, or when the process dies.
impl SweepLock for PgStore {
    fn try_lock(&self) -> StoreFuture<'_, Option<SweepGuard>> {
        Box::pin(self.inner.db.sweep_lock(self.inner.table.display()))
    }
}
