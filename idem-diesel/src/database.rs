//! What every store, inbox and outbox of this crate holds and does alike on
//! either database: the pool (with the failed connection attempts it reports,
//! see `crate::pool`), how long a connection may take, and the schema gate;
//! opening a pool and checking that it connects, running embedded migrations,
//! reading a table's columns for `check_schema`. Each database says how in
//! its [`Dialect`] (`postgres/mod.rs`, `sqlite/mod.rs`); the stores, the
//! inboxes and the outbox keep only what is theirs.

use std::future::Future;
use std::time::Duration;

use bb8::{ManageConnection, PooledConnection};
use diesel_async::pooled_connection::PoolError;
use diesel_migrations::EmbeddedMigrations;
use idem_core::StoreError;
use idem_core::store::BoxError;

use crate::SetupError;
use crate::outbox::Backend;
use crate::pool::{self, ConnectFailures};
use crate::table::{ColumnRow, SchemaGate};

/// The settings of the pool a builder opens, and whether its schema check is
/// skipped: what [`pool_settings!`](crate::pool::pool_settings) and the
/// builders' `busy_timeout` set.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PoolSettings {
    pub(crate) max_connections: u32,
    pub(crate) connection_timeout: Duration,
    /// SQLite only: how long a write waits for the file's lock.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) busy_timeout: Duration,
    pub(crate) skip_schema_check: bool,
}

impl PoolSettings {
    /// The defaults, with `max_connections` the database's.
    pub(crate) fn new(max_connections: u32) -> Self {
        Self {
            max_connections,
            connection_timeout: Duration::from_secs(3),
            busy_timeout: Duration::from_secs(5),
            skip_schema_check: false,
        }
    }
}

/// A connection checked out of a [`Database`]'s pool.
pub(crate) type Pooled<'a, B> = PooledConnection<'a, <B as Dialect>::Manager>;

/// How a database does what every store, inbox and outbox does alike.
pub(crate) trait Dialect: Backend<Pool = bb8::Pool<<Self as Dialect>::Manager>> {
    /// diesel-async's manager of the database's connections.
    type Manager: ManageConnection<Error = PoolError>;

    /// The manager of `url`'s connections: how each is opened and checked
    /// on checkout.
    fn manager(url: &str, settings: &PoolSettings) -> Self::Manager;

    /// Runs `migrations`, taking turns with every other instance's.
    fn migrate(
        database: &Database<Self>,
        migrations: EmbeddedMigrations,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// The columns of `table`, named as the statements name it, as the
    /// database describes it (none: there is no such table).
    fn columns(
        database: &Database<Self>,
        table: String,
    ) -> impl Future<Output = Result<Vec<ColumnRow>, BoxError>> + Send;
}

/// A store's, an inbox's or the outbox's database: its pool and schema gate.
pub(crate) struct Database<B: Backend> {
    pub(crate) pool: B::Pool,
    /// Set when this crate built the pool (see `crate::pool`).
    pub(crate) failures: Option<ConnectFailures>,
    /// PostgreSQL: how long a dedicated connection may take to open.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) connection_timeout: Duration,
    /// Passed by `migrate`, `check_schema` or the builder's
    /// `skip_schema_check`: what readiness asks.
    pub(crate) schema_gate: SchemaGate,
}

impl<B: Dialect> Database<B> {
    /// Builds a pool for `url` and checks that it connects. Its failed
    /// connection attempts are reported to the waiting checkouts (see
    /// `crate::pool`), and not retried.
    pub(crate) async fn open(url: &str, settings: &PoolSettings) -> Result<Self, SetupError> {
        let failures = ConnectFailures::new();
        let pool = bb8::Pool::builder()
            .max_size(settings.max_connections)
            .connection_timeout(settings.connection_timeout)
            .retry_connection(false)
            .error_sink(failures.sink())
            .build(B::manager(url, settings))
            .await
            .map_err(|e| SetupError::Connect(e.into()))?;
        drop(
            pool::checkout(&pool, Some(&failures))
                .await
                .map_err(SetupError::connect)?,
        );
        Ok(Self::with(pool, Some(failures), settings))
    }

    /// Over a pool the application already has.
    pub(crate) fn over(pool: B::Pool, settings: &PoolSettings) -> Self {
        Self::with(pool, None, settings)
    }

    fn with(pool: B::Pool, failures: Option<ConnectFailures>, settings: &PoolSettings) -> Self {
        let schema_gate = SchemaGate::default();
        if settings.skip_schema_check {
            schema_gate.pass();
        }
        Self {
            pool,
            failures,
            connection_timeout: settings.connection_timeout,
            schema_gate,
        }
    }

    /// A pooled connection, failing fast while the database is down.
    pub(crate) async fn connection(&self) -> Result<Pooled<'_, B>, StoreError> {
        pool::checkout(&self.pool, self.failures.as_ref()).await
    }

    /// A pooled connection that is not tied to `self`'s lifetime.
    pub(crate) async fn connection_owned(&self) -> Result<Pooled<'static, B>, StoreError> {
        pool::checkout_owned(&self.pool, self.failures.as_ref()).await
    }

    /// Runs `migrations` (named after `table` in an error) and opens the
    /// schema gate.
    pub(crate) async fn migrate(
        &self,
        migrations: EmbeddedMigrations,
        table: &str,
    ) -> Result<(), SetupError> {
        B::migrate(self, migrations)
            .await
            .map_err(|source| SetupError::Migrate {
                table: table.to_owned(),
                source,
            })?;
        self.schema_gate.pass();
        Ok(())
    }

    /// Reads the columns of each of `tables` (as the statements name them),
    /// and opens the schema gate if `check` accepts them; a failure to read
    /// them is named after `named`.
    pub(crate) async fn check_schema(
        &self,
        named: &str,
        tables: impl IntoIterator<Item = String>,
        check: impl FnOnce(&[Vec<ColumnRow>]) -> Result<(), SetupError>,
    ) -> Result<(), SetupError> {
        let mut found = Vec::new();
        for table in tables {
            let columns =
                B::columns(self, table)
                    .await
                    .map_err(|source| SetupError::SchemaCheck {
                        table: named.to_owned(),
                        source,
                    })?;
            found.push(columns);
        }
        check(&found)?;
        self.schema_gate.pass();
        Ok(())
    }

    /// The pool's connections, for `Debug`.
    pub(crate) fn state(&self) -> bb8::State {
        self.pool.state()
    }
}
