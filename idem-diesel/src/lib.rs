#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Without a backend feature only the cleanup job is left; the shared pieces idle.
#![cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(dead_code, unused_imports)
)]

#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod builder;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod consume;
mod database;
mod error;
mod metrics;
mod outbox;
mod pool;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod positions;
mod prepared;
mod row;
mod table;
mod wait;

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

/// The core this store implements, re-exported as the adapters re-export it, so
/// that an application needs no `idem-core` line of its own.
pub use idem_core;

/// diesel, re-exported so that handlers are written against the version the
/// inboxes and stores use (see the README: "Versions").
pub use diesel;
/// diesel-async, re-exported for the same reason: `AsyncPgConnection`, the
/// SQLite connection wrapper and `RunQueryDsl` are its.
pub use diesel_async;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use builder::{InboxBuilder, StoreBuilder};
pub use error::SetupError;
pub use idem_core::cleanup::{Cleanup, ExpiredRows, Sweep, SweepGuard, SweepLock, SweepReport};
pub use idem_core::outbox::{Event, Publish, PublishError};
pub use outbox::{
    Backend, Backlog, Outbox, OutboxBuilder, ParkedEvent, Postgres, Relay, Relayed, Sqlite,
};
pub use table::DEFAULT_TABLE;

#[cfg(feature = "postgres")]
pub use postgres::{
    PgInbox, PgInboxBuilder, PgOutbox, PgPool, PgStore, PgStoreBuilder, PgTransaction,
    PgTransactionConnection, Transaction, TransactionEnded, TransactionalPgStore,
    TransactionalPgStoreBuilder,
};
#[cfg(feature = "sqlite")]
pub use sqlite::{
    AsyncSqliteConnection, SqliteInbox, SqliteInboxBuilder, SqliteOutbox, SqlitePool, SqliteStore,
    SqliteStoreBuilder, SqliteTransaction, SqliteTransactionError, TransactionalSqliteStore,
};
