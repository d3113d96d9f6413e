//! The SQLite store.

mod consumer_inbox;
mod outbox;
mod statements;
mod transactional;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Binary, Bool, Integer, Text};
use diesel::{
    ConnectionError, ConnectionResult, OptionalExtension, QueryResult, RunQueryDsl,
    SqliteConnection,
};
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod,
};
use diesel_async::sync_connection_wrapper::SyncConnectionWrapper;
use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};
use idem_core::store::BoxError;
use idem_core::store::{Claim, ClaimOutcome, ClaimRequest, Record, StoreFuture};
use idem_core::{IdempotencyKey, Scope, Store, StoreError, StoredResponse};

use crate::builder::StoreBuilder;
use crate::database::{Database, Dialect, PoolSettings};
use crate::outbox::Sqlite;
use crate::pool;
use crate::prepared::PreparedExt;
use crate::row::{InProgressRow, RecordRow, duration_micros, fenced};
use crate::table::{ColumnRow, Table};
use crate::{SetupError, wait};
use idem_core::cleanup::Cleanup;
use statements::Statements;

/// A diesel-async connection to SQLite: diesel's synchronous connection, run on
/// Tokio's blocking threads. What [`SqliteStore`]'s pool holds, and what a
/// [`SqliteInbox`] handler writes on.
pub type AsyncSqliteConnection = SyncConnectionWrapper<SqliteConnection>;

type Connection = AsyncSqliteConnection;

pub use consumer_inbox::{SqliteInbox, SqliteInboxBuilder};
pub use outbox::SqliteOutbox;
pub use transactional::{SqliteTransaction, SqliteTransactionError, TransactionalSqliteStore};

/// A bb8 pool of SQLite connections, as [`SqliteStore`] uses.
pub type SqlitePool = bb8::Pool<AsyncDieselConnectionManager<Connection>>;

/// The migrations that create the default table, `idem_records`.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite");

/// Records in a SQLite file: embedded, and kept across restarts.
///
/// Each store step runs as one task on a blocking thread, inside one
/// `BEGIN IMMEDIATE` transaction where it takes more than one statement: SQLite
/// cannot put an upsert inside a CTE, so a claim that finds a live record reads
/// it with a second statement in the same transaction. A claim first reads the
/// record without a transaction, and answers a live one (a replay, a duplicate
/// of a running execution) from that read alone. The file is opened in WAL
/// mode, so reads do not wait for writes; writes take turns, waiting up to the
/// busy timeout.
///
/// Lease and retention times are SQLite's clock, read inside each statement
/// once it holds the file's write lock: a step that waited for a pooled
/// connection or for the busy timeout still gets its full lease, and a lease is
/// never measured from an instant read before the wait.
///
/// ```no_run
/// use idem_diesel::SqliteStore;
///
/// # async fn run() -> Result<(), idem_diesel::SetupError> {
/// let store = SqliteStore::connect("sqlite://payments.db").await?;
/// store.migrate().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database<Sqlite>,
    table: Table,
    statements: Arc<Statements>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("table", &self.inner.table.display())
            .field("pool", &self.inner.db.state())
            .finish_non_exhaustive()
    }
}

/// Configures a [`SqliteStore`]: its table and the pool it builds.
pub type SqliteStoreBuilder = StoreBuilder<Sqlite>;

/// What a claim found, read inside its transaction.
enum ClaimStep {
    Claimed,
    Found(RecordRow),
}

/// A claim wrote nothing and found no live record: impossible inside one
/// immediate transaction, unless the table was changed by hand.
#[derive(Debug, thiserror::Error)]
#[error("the claim neither wrote nor found a record")]
struct ClaimVanished;

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` with the default table
    /// (`idem_records`) and pool.
    ///
    /// `url` is `sqlite://PATH` (`sqlite://payments.db` is relative,
    /// `sqlite:///var/lib/app/idem.db` absolute), `sqlite:PATH`, a `file:` URI,
    /// or a plain path. Call [`migrate`](Self::migrate) once before use.
    ///
    /// `:memory:` is not a store: every pooled connection would open a database
    /// of its own. Use `idem_core::MemoryStore` instead.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// A store over a pool the application already has, with the default table.
    ///
    /// Open its connections with a busy timeout (`PRAGMA busy_timeout`), or
    /// concurrent writes fail at once with "database is locked".
    pub fn from_pool(pool: SqlitePool) -> Self {
        Self::with_table(
            Database::over(pool, &PoolSettings::new(4)),
            Table::default(),
        )
    }

    /// Configures the table and the pool.
    pub fn builder() -> SqliteStoreBuilder {
        StoreBuilder::new(4)
    }

    fn with_table(db: Database<Sqlite>, table: Table) -> Self {
        Self {
            inner: Arc::new(Inner {
                statements: Arc::new(Statements::new(&table)),
                db,
                table,
            }),
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.inner.db.pool
    }

    /// The SQL that creates this store's table and cleanup index, for
    /// applications that run their own migration tool. Every statement is
    /// `IF NOT EXISTS`.
    pub fn ddl(&self) -> String {
        self.inner.table.sqlite_ddl()
    }

    /// Creates or upgrades the table, in one immediate transaction (so that
    /// processes sharing the file take turns).
    ///
    /// For the default table (`idem_records`) this runs the embedded diesel
    /// migrations, recorded in `__diesel_schema_migrations`. A migration cannot be
    /// templated, so for any other name it runs [`ddl`](Self::ddl) instead; every
    /// statement there is `IF NOT EXISTS`.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let table = &self.inner.table;
        if table.is_default() {
            return self.inner.db.migrate(MIGRATIONS, &table.display()).await;
        }
        let ddl = self.ddl();
        self.inner
            .db
            .run(move |c| c.immediate_transaction(|c| c.batch_execute(&ddl)))
            .await
            .map_err(|e| SetupError::Migrate {
                table: table.display(),
                source: e.into(),
            })?;
        self.inner.db.schema_gate.pass();
        Ok(())
    }

    /// Checks that this store's table exists with every column this version
    /// uses, so that a forgotten migration fails at start-up, naming the fix,
    /// instead of answering every keyed request `503 store-unavailable`.
    ///
    /// [`migrate`](Self::migrate) makes it pass; call it at start-up when your
    /// own migration tool creates the table ([`ddl`](Self::ddl)). It fails with
    /// [`SetupError::SchemaMissing`] or [`SetupError::SchemaOutdated`], whose
    /// messages say to run `store.migrate()`.
    pub async fn check_schema(&self) -> Result<(), SetupError> {
        let table = &self.inner.table;
        self.inner
            .db
            .check_schema(&table.display(), [table.name().to_owned()], |found| {
                table.check_columns(&found[0])
            })
            .await
    }

    /// A cleanup job for this store's table. SQLite writers take turns anyway,
    /// so it takes no lock.
    pub fn cleanup(&self) -> Cleanup<SqliteStore> {
        Cleanup::new(self.clone())
    }

    /// Runs `task` on a pooled connection, on a blocking thread, as a task
    /// of its own (see [`Database::run`]).
    async fn run<R: Send + 'static>(
        &self,
        task: impl FnOnce(&mut SqliteConnection, &Statements) -> QueryResult<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let statements = Arc::clone(&self.inner.statements);
        self.inner.db.run(move |c| task(c, &statements)).await
    }

    async fn in_progress(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let (scope, key) = (scope.clone(), key.clone());
        self.run(move |c, sql| {
            diesel::sql_query(&sql.in_progress)
                .bind::<Text, _>(scope.as_str())
                .bind::<Text, _>(key.as_str())
                .prepared()
                .get_result::<InProgressRow>(c)
                .map(|row| row.in_progress)
        })
        .await
    }
}

impl StoreBuilder<Sqlite> {
    /// How long a write waits for another connection's write to finish before it
    /// fails with "database is locked" (default 5 s). Ignored by
    /// [`build`](Self::build).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.pool.busy_timeout = timeout;
        self
    }

    /// Opens the database at `url` (see [`SqliteStore::connect`]), creating the
    /// file if missing, and checks that it opens.
    pub async fn connect(self, url: &str) -> Result<SqliteStore, SetupError> {
        let table = Table::new(None, &self.table)?;
        Ok(SqliteStore::with_table(
            Database::open(url, &self.pool).await?,
            table,
        ))
    }

    /// A store over a pool the application already has.
    pub fn build(self, pool: SqlitePool) -> Result<SqliteStore, SetupError> {
        let table = Table::new(None, &self.table)?;
        Ok(SqliteStore::with_table(
            Database::over(pool, &self.pool),
            table,
        ))
    }
}

impl Dialect for Sqlite {
    type Manager = AsyncDieselConnectionManager<Connection>;

    /// Connections opened with the busy timeout and WAL (see [`establish`]),
    /// not pinged on checkout: the file is local, so a connection does not
    /// go stale.
    fn manager(url: &str, settings: &PoolSettings) -> Self::Manager {
        let busy_ms = settings.busy_timeout.as_millis();
        let mut config = ManagerConfig::<Connection>::default();
        config.custom_setup = Box::new(move |url| establish(url, busy_ms));
        config.recycling_method = RecyclingMethod::Fast;
        AsyncDieselConnectionManager::new_with_config(database_path(url), config)
    }

    /// In one immediate transaction, so that processes sharing the file
    /// take turns.
    async fn migrate(
        database: &Database<Self>,
        migrations: EmbeddedMigrations,
    ) -> Result<(), BoxError> {
        database
            .run(move |c| {
                Ok(c.immediate_transaction(|c| c.run_pending_migrations(migrations).map(drop)))
            })
            .await?
    }

    async fn columns(database: &Database<Self>, table: String) -> Result<Vec<ColumnRow>, BoxError> {
        Ok(database
            .run(move |c| {
                diesel::sql_query("SELECT name FROM pragma_table_info(?)")
                    .bind::<Text, _>(table)
                    .load::<ColumnRow>(c)
            })
            .await?)
    }
}

impl Database<Sqlite> {
    /// Runs `task` on a pooled connection, on a blocking thread.
    ///
    /// As a task of its own: when the future of a blocking step is dropped,
    /// diesel-async waits for the step with `block_in_place`, which panics on a
    /// current-thread runtime (actix-web runs each worker on one). A caller that
    /// gives up on a step (the engine between two looks at a record, a client
    /// that disconnects, a consumer that stops) detaches from the task instead,
    /// and the step finishes by itself, as it would on any runtime.
    pub(crate) async fn run<R: Send + 'static>(
        &self,
        task: impl FnOnce(&mut SqliteConnection) -> QueryResult<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let (pool, failures) = (self.pool.clone(), self.failures.clone());
        tokio::spawn(async move {
            let mut connection = pool::checkout(&pool, failures.as_ref()).await?;
            connection
                .spawn_blocking(task)
                .await
                .map_err(StoreError::unavailable)
        })
        .await
        .map_err(StoreError::unavailable)?
    }
}

/// The path diesel opens for `url`: the `sqlite:` scheme removed, so that the
/// rest is a plain path (diesel would read `sqlite://` as a `file:` URI, where
/// `?` and `#` in a file name mean something else).
fn database_path(url: &str) -> &str {
    url.strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url)
}

/// Opens a connection: waits on locks instead of failing at once, and uses WAL
/// so that readers do not wait for writers.
fn establish(
    url: &str,
    busy_ms: u128,
) -> Pin<Box<dyn Future<Output = ConnectionResult<Connection>> + Send + '_>> {
    Box::pin(async move {
        let mut connection = Connection::establish(url).await?;
        connection
            .batch_execute(&format!(
                "PRAGMA busy_timeout = {busy_ms};
                 PRAGMA journal_mode = WAL;
                 PRAGMA synchronous = NORMAL;"
            ))
            .await
            .map_err(ConnectionError::CouldntSetupConfiguration)?;
        Ok(connection)
    })
}

/// The completion of `claim` with `response`, as a step on a connection: the
/// rows it updated (0: the claim is no longer held). The plain store runs it on
/// its own; transactional mode in the execution's transaction.
fn completion(
    claim: &Claim,
    response: &StoredResponse,
    retention: Duration,
) -> impl FnOnce(&mut SqliteConnection, &Statements) -> QueryResult<usize> + Send + 'static {
    let (scope, key) = (claim.scope.clone(), claim.key.clone());
    let owner = claim.owner.as_uuid();
    let status = i32::from(response.status);
    let headers = response.encode_headers();
    let body = response.body.clone();
    let replayable = response.replayable;
    let retention = duration_micros(retention);
    move |c, sql| {
        diesel::sql_query(&sql.complete)
            .bind::<Text, _>(scope.as_str())
            .bind::<Text, _>(key.as_str())
            .bind::<Binary, _>(&owner.as_bytes()[..])
            .bind::<Integer, _>(status)
            .bind::<Binary, _>(&headers[..])
            .bind::<Binary, _>(&body[..])
            .bind::<Bool, _>(replayable)
            .bind::<BigInt, _>(retention)
            .prepared()
            .execute(c)
    }
}

impl Store for SqliteStore {
    fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.inner
            .db
            .schema_gate
            .readiness(&self.inner.table, "SqliteStoreBuilder")
    }

    /// Reads the record first, without the write lock: a live one (a replay,
    /// or an execution in progress within its lease) is answered from that
    /// read, so replays and duplicates do not queue for the file's one
    /// writer (nor wait behind a transactional execution's open
    /// transaction). Otherwise claims in one immediate transaction. Both in
    /// one blocking step, on one pooled connection.
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            let (scope, key) = (request.scope.clone(), request.key.clone());
            let fingerprint = *request.fingerprint.as_bytes();
            let owner = request.owner.as_uuid();
            let lease = duration_micros(request.lease);
            let retention = duration_micros(request.retention);
            let step = self
                .run(move |c, sql| {
                    let read = |c: &mut SqliteConnection, statement: &str| {
                        diesel::sql_query(statement)
                            .bind::<Text, _>(scope.as_str())
                            .bind::<Text, _>(key.as_str())
                            .prepared()
                            .get_result::<RecordRow>(c)
                            .optional()
                    };
                    if let Some(live) = read(c, &sql.live)? {
                        return Ok(Some(ClaimStep::Found(live)));
                    }
                    c.immediate_transaction(|c| {
                        let written = diesel::sql_query(&sql.claim)
                            .bind::<Text, _>(scope.as_str())
                            .bind::<Text, _>(key.as_str())
                            .bind::<Binary, _>(&fingerprint[..])
                            .bind::<Binary, _>(&owner.as_bytes()[..])
                            .bind::<BigInt, _>(lease)
                            .bind::<BigInt, _>(retention)
                            .prepared()
                            .execute(c)?;
                        if written > 0 {
                            return Ok(Some(ClaimStep::Claimed));
                        }
                        read(c, &sql.found).map(|row| row.map(ClaimStep::Found))
                    })
                })
                .await?;
            match step {
                Some(ClaimStep::Claimed) => Ok(ClaimOutcome::Claimed(request.to_claim())),
                Some(ClaimStep::Found(row)) => row.into_found(),
                None => Err(StoreError::unavailable(ClaimVanished)),
            }
        })
    }

    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let (scope, key) = (claim.scope.clone(), claim.key.clone());
            let owner = claim.owner.as_uuid();
            let lease = duration_micros(lease);
            let rows = self
                .run(move |c, sql| {
                    diesel::sql_query(&sql.renew)
                        .bind::<Text, _>(scope.as_str())
                        .bind::<Text, _>(key.as_str())
                        .bind::<Binary, _>(&owner.as_bytes()[..])
                        .bind::<BigInt, _>(lease)
                        .prepared()
                        .execute(c)
                })
                .await?;
            fenced(Ok(rows))
        })
    }

    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let rows = self.run(completion(claim, response, retention)).await?;
            fenced(Ok(rows))
        })
    }

    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let (scope, key) = (claim.scope.clone(), claim.key.clone());
            let owner = claim.owner.as_uuid();
            let rows = self
                .run(move |c, sql| {
                    diesel::sql_query(&sql.release)
                        .bind::<Text, _>(scope.as_str())
                        .bind::<Text, _>(key.as_str())
                        .bind::<Binary, _>(&owner.as_bytes()[..])
                        .prepared()
                        .execute(c)
                })
                .await?;
            fenced(Ok(rows))
        })
    }

    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        Box::pin(async move {
            let (owned_scope, owned_key) = (scope.clone(), key.clone());
            let row = self
                .run(move |c, sql| {
                    diesel::sql_query(&sql.load)
                        .bind::<Text, _>(owned_scope.as_str())
                        .bind::<Text, _>(owned_key.as_str())
                        .prepared()
                        .get_result::<RecordRow>(c)
                        .optional()
                })
                .await?;
            row.map(|row| row.into_record(scope, key)).transpose()
        })
    }

    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let batch = i64::try_from(batch).unwrap_or(i64::MAX);
            let deleted = self
                .run(move |c, sql| {
                    diesel::sql_query(&sql.delete_expired)
                        .bind::<BigInt, _>(batch)
                        .prepared()
                        .execute(c)
                })
                .await?;
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

#[cfg(test)]
mod tests {
    use super::database_path;

    #[test]
    fn urls_become_paths() {
        assert_eq!(database_path("sqlite://payments.db"), "payments.db");
        assert_eq!(
            database_path("sqlite:///var/lib/idem.db"),
            "/var/lib/idem.db"
        );
        assert_eq!(database_path("sqlite:payments.db"), "payments.db");
        assert_eq!(database_path("/tmp/a.db"), "/tmp/a.db");
        assert_eq!(database_path("file:a.db?mode=rwc"), "file:a.db?mode=rwc");
    }
}
