//! The builders the stores and the inboxes of both databases share: one
//! type per kind, generic over the database ([`Postgres`](crate::Postgres),
//! [`Sqlite`](crate::Sqlite)) as the outbox's is, the settings both have
//! documented once, each database's own (a PostgreSQL schema, SQLite's busy
//! timeout) and its `connect`/`build` beside its store or inbox.

use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use crate::database::PoolSettings;
use crate::outbox::Backend;
use crate::pool::pool_settings;
use crate::table::DEFAULT_TABLE;

/// Configures a store ([`PgStoreBuilder`](crate::PgStoreBuilder),
/// [`SqliteStoreBuilder`](crate::SqliteStoreBuilder)): its table and the
/// pool it builds. The settings below are the same on both databases; the
/// defaults are each database's (PostgreSQL: 10 connections; SQLite: 4).
#[must_use]
pub struct StoreBuilder<B: Backend> {
    pub(crate) schema: Option<String>,
    pub(crate) table: String,
    pub(crate) pool: PoolSettings,
    backend: PhantomData<fn() -> B>,
}

impl<B: Backend> StoreBuilder<B> {
    /// The defaults, with `max_connections` the database's.
    pub(crate) fn new(max_connections: u32) -> Self {
        Self {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
            pool: PoolSettings::new(max_connections),
            backend: PhantomData,
        }
    }

    /// The table's name (default `idem_records`): ASCII letters, digits and
    /// underscores, at most 52 characters.
    pub fn table(mut self, name: impl Into<String>) -> Self {
        self.table = name.into();
        self
    }

    pool_settings! {
        connections: "default 10 on PostgreSQL, 4 on SQLite",
        ready: "a route's layer builds on the store (without it, a layer built on a store not checked refuses to build, naming the fix: [`Store::readiness`](idem_core::Store::readiness))",
    }
}

impl<B: Backend> Clone for StoreBuilder<B> {
    fn clone(&self) -> Self {
        Self {
            schema: self.schema.clone(),
            table: self.table.clone(),
            ..*self
        }
    }
}

impl<B: Backend> fmt::Debug for StoreBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("pool", &self.pool)
            .finish()
    }
}

/// Configures a consumer inbox ([`PgInboxBuilder`](crate::PgInboxBuilder),
/// [`SqliteInboxBuilder`](crate::SqliteInboxBuilder)): what it remembers,
/// and the pool it builds. The settings are the same on both databases; the
/// defaults are each database's (PostgreSQL: 10 connections; SQLite: 4).
#[must_use]
pub struct InboxBuilder<B: Backend> {
    pub(crate) retention: Duration,
    pub(crate) pool: PoolSettings,
    backend: PhantomData<fn() -> B>,
}

impl<B: Backend> InboxBuilder<B> {
    /// The defaults, with `max_connections` the database's.
    pub(crate) fn new(max_connections: u32) -> Self {
        Self {
            retention: crate::consume::DEFAULT_RETENTION,
            pool: PoolSettings::new(max_connections),
            backend: PhantomData,
        }
    }

    /// How long processed messages are remembered (default 7 days). Make it
    /// longer than the broker redelivers: a redelivery after it runs again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    pool_settings! {
        connections: "default 10 on PostgreSQL, 4 on SQLite; each message being processed holds one until its transaction ends",
        ready: "the inbox is ready",
    }
}

impl<B: Backend> Clone for InboxBuilder<B> {
    fn clone(&self) -> Self {
        Self { ..*self }
    }
}

impl<B: Backend> fmt::Debug for InboxBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboxBuilder")
            .field("retention", &self.retention)
            .field("pool", &self.pool)
            .finish()
    }
}
