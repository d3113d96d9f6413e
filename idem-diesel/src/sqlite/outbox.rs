//! [`SqliteOutbox`]: the transactional outbox on SQLite.

use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{BigInt, Binary, Integer, Nullable, Text};
use diesel::{QueryResult, QueryableByName, RunQueryDsl, SqliteConnection};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};
use idem_core::StoreError;
use idem_core::cleanup::{Cleanup, ExpiredRows};
use idem_core::outbox::{Event, Publish};
use idem_core::store::{NotReady, StoreFuture};

use super::statements::NOW;
use super::{AsyncSqliteConnection, SqlitePool, SqliteTransaction, SqliteTransactionError};
use crate::SetupError;
use crate::database::Database;
use crate::outbox::{
    self, Backlog, Batch, BoxFuture, OUTBOX_TABLE, Outbox, OutboxBuilder, ParkedEvent, Relay,
    Settlement, Source, Sqlite, Taken,
};
use crate::prepared::PreparedExt;
use crate::row::{duration_micros, time_from_micros};

/// The outbox on SQLite: [`Outbox`] over a [`SqlitePool`].
pub type SqliteOutbox = Outbox<Sqlite>;

impl outbox::Backend for Sqlite {
    type Pool = SqlitePool;
}

/// The migrations that create the outbox's table.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite_outbox");

/// A relay's batch, `?1` events at most: the events whose turn it is (no
/// earlier unsent event of their destination and key; due), with the events
/// behind them in their key. SQLite has one relay per file, so nothing is
/// locked.
const TAKE: &str = "WITH heads AS (
        SELECT o.position, o.destination, o.key FROM idem_outbox AS o
        WHERE o.sent_at IS NULL AND o.parked_at IS NULL AND o.next_attempt_at <= ?2
          AND NOT EXISTS (
              SELECT 1 FROM idem_outbox AS e
              WHERE e.destination = o.destination AND e.key = o.key
                AND e.position < o.position
                AND e.sent_at IS NULL AND e.parked_at IS NULL)
        ORDER BY o.position LIMIT ?1
    )
    SELECT o.position, o.id, o.destination, o.key, o.payload, o.headers, o.attempts
    FROM idem_outbox AS o JOIN heads AS h ON o.destination = h.destination AND o.key = h.key
    WHERE o.sent_at IS NULL AND o.parked_at IS NULL AND o.position >= h.position
    ORDER BY o.position LIMIT ?1";

#[derive(QueryableByName)]
struct EventRow {
    #[diesel(sql_type = BigInt)]
    position: i64,
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    destination: String,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Binary)]
    payload: Vec<u8>,
    #[diesel(sql_type = Binary)]
    headers: Vec<u8>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

/// The age of the oldest unsent, unparked event (µs), for the relay's gauge:
/// the first row of the `idem_outbox_unsent` index.
#[cfg(feature = "metrics")]
#[derive(QueryableByName)]
struct OldestRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    oldest_us: Option<i64>,
}

#[derive(QueryableByName)]
struct BacklogRow {
    #[diesel(sql_type = BigInt)]
    unsent: i64,
    #[diesel(sql_type = BigInt)]
    parked: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    oldest_us: Option<i64>,
}

#[derive(QueryableByName)]
struct ParkedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    destination: String,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Text)]
    reason: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = BigInt)]
    parked_at: i64,
}

/// A staged event's row could not be read back.
#[derive(Debug, thiserror::Error)]
#[error("an outbox event's {0} is not in its encoding")]
struct Corrupt(&'static str);

struct SqliteSource {
    outbox: SqliteOutbox,
}

struct SqliteBatch {
    outbox: SqliteOutbox,
    events: Vec<Taken>,
}

impl Outbox<Sqlite> {
    /// Opens (creating if missing) the database at `url` (`sqlite://PATH`)
    /// with a pool of its own and the default retention of sent events
    /// (24 h). Call [`migrate`](Self::migrate) once before use.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// An outbox over a pool the application already has (a `SqliteStore`'s
    /// or a `SqliteInbox`'s, say).
    pub fn new(pool: SqlitePool) -> Self {
        Self::builder().build(pool)
    }

    /// Creates the outbox's table (`idem_outbox`) with its embedded diesel
    /// migration, in one immediate transaction.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        self.inner.db.migrate(MIGRATIONS, OUTBOX_TABLE).await
    }

    /// Checks that the outbox's table exists with every column this version
    /// uses, so that a forgotten migration stops the relay's start, naming
    /// the fix, instead of leaving every event unsent. [`migrate`](Self::migrate)
    /// makes it pass; call it at start-up when your own migration tool
    /// creates the table. It fails with [`SetupError::OutboxSchema`].
    pub async fn check_schema(&self) -> Result<(), SetupError> {
        let tables = [OUTBOX_TABLE.to_owned()];
        let db = &self.inner.db;
        db.check_schema(OUTBOX_TABLE, tables, outbox::check_outbox_columns)
            .await
    }

    /// Stages `event` in the transaction open on `connection` (an inbox
    /// handler's, or the application's own): one statement, which commits
    /// with the transaction or not at all, and wakes this outbox's relay.
    ///
    /// On a connection outside a transaction, the event is staged at once,
    /// on its own.
    pub async fn stage(
        &self,
        connection: &mut AsyncSqliteConnection,
        event: &Event,
    ) -> diesel::QueryResult<()> {
        let staged = event.clone();
        connection
            .spawn_blocking(move |c| insert(c, &staged))
            .await?;
        self.staged_now(event);
        Ok(())
    }

    /// [`stage`](Self::stage) on diesel's synchronous connection, for code
    /// that already runs on a blocking thread (inside
    /// `SqliteConnection::immediate_transaction`, say).
    pub fn stage_blocking(
        &self,
        connection: &mut SqliteConnection,
        event: &Event,
    ) -> diesel::QueryResult<()> {
        insert(connection, event)?;
        self.staged_now(event);
        Ok(())
    }

    /// Stages `event` in a transactional execution's transaction (see
    /// [`TransactionalSqliteStore`](crate::TransactionalSqliteStore)): it
    /// commits with the request's effects and its record, or not at all. The
    /// first write of the execution opens the transaction, so this may wait
    /// for the file's write lock as any write does.
    ///
    /// To stage in the same step as the handler's own writes, call
    /// [`stage_blocking`](Self::stage_blocking) inside
    /// [`SqliteTransaction::write`](crate::SqliteTransaction::write).
    pub async fn stage_in(
        &self,
        transaction: &SqliteTransaction,
        event: &Event,
    ) -> Result<(), SqliteTransactionError> {
        let staged = event.clone();
        transaction
            .write(move |c| insert(c, &staged).map_err(SqliteTransactionError::from))
            .await?;
        self.staged_now(event);
        Ok(())
    }

    fn staged_now(&self, event: &Event) {
        self.count_staged(event);
        // The relay looks a few times over the next moments: the commit is
        // the caller's, and comes after this.
        self.inner.wake.notify_one();
    }

    /// The relay that publishes this outbox's events with `publisher`. Run
    /// one per SQLite file: two would each publish every event. Refused
    /// until [`migrate`](Self::migrate) or
    /// [`check_schema`](Self::check_schema) passed in this process (or the
    /// builder's `skip_schema_check`): the error names the fix.
    pub fn relay<P: Publish>(&self, publisher: P) -> Result<Relay<P>, NotReady> {
        self.readiness()?;
        Ok(Relay::new(
            Arc::new(SqliteSource {
                outbox: self.clone(),
            }),
            publisher,
        ))
    }

    /// What is waiting: unsent and parked events, and the age of the oldest
    /// unsent one.
    pub async fn backlog(&self) -> Result<Backlog, StoreError> {
        let row = self
            .run(|c| {
                diesel::sql_query(format!(
                    "SELECT (SELECT count(*) FROM idem_outbox
                             WHERE sent_at IS NULL AND parked_at IS NULL) AS unsent,
                            (SELECT count(*) FROM idem_outbox
                             WHERE parked_at IS NOT NULL) AS parked,
                            (SELECT {NOW} - staged_at FROM idem_outbox
                             WHERE sent_at IS NULL AND parked_at IS NULL
                             ORDER BY position LIMIT 1) AS oldest_us"
                ))
                .prepared()
                .get_result::<BacklogRow>(c)
            })
            .await?;
        Ok(Backlog {
            unsent: u64::try_from(row.unsent).unwrap_or(0),
            parked: u64::try_from(row.parked).unwrap_or(0),
            oldest_unsent: row
                .oldest_us
                .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))),
        })
    }

    /// The parked events, oldest first.
    pub async fn parked(&self) -> Result<Vec<ParkedEvent>, StoreError> {
        let rows = self
            .run(|c| {
                diesel::sql_query(
                    "SELECT id, destination, key, reason, attempts, parked_at
                     FROM idem_outbox WHERE parked_at IS NOT NULL ORDER BY position",
                )
                .prepared()
                .load::<ParkedRow>(c)
            })
            .await?;
        rows.into_iter()
            .map(|row| {
                Ok(ParkedEvent {
                    id: uuid::Uuid::parse_str(&row.id)
                        .map_err(|_| StoreError::unavailable(Corrupt("id")))?,
                    destination: row.destination,
                    key: row.key,
                    reason: row.reason,
                    attempts: u32::try_from(row.attempts).unwrap_or(0),
                    parked_at: time_from_micros(row.parked_at)?,
                })
            })
            .collect()
    }

    /// A cleanup job that deletes sent events past the retention (never
    /// unsent or parked ones). SQLite writers take turns, so it takes no
    /// lock.
    pub fn cleanup(&self) -> Cleanup<SqliteOutbox> {
        Cleanup::new(self.clone())
    }

    /// Runs `task` on a pooled connection, on a blocking thread, as a task of
    /// its own (see `Database::run`: a caller that gives up detaches).
    async fn run<R: Send + 'static>(
        &self,
        task: impl FnOnce(&mut SqliteConnection) -> QueryResult<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        self.inner.db.run(task).await
    }
}

impl OutboxBuilder<Sqlite> {
    /// How long a write waits for the file's lock (default 5 s). Ignored by
    /// `build`.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.pool.busy_timeout = timeout;
        self
    }

    /// Opens the database at `url` (see [`Outbox::<Sqlite>::connect`]),
    /// creating the file if missing, and checks that it opens.
    pub async fn connect(self, url: &str) -> Result<SqliteOutbox, SetupError> {
        let db = Database::open(url, &self.pool).await?;
        Ok(Outbox::with_database(db, &self))
    }

    /// An outbox over a pool the application already has.
    pub fn build(self, pool: SqlitePool) -> SqliteOutbox {
        Outbox::with_database(Database::over(pool, &self.pool), &self)
    }
}

/// The stage's one statement.
fn insert(c: &mut SqliteConnection, event: &Event) -> QueryResult<()> {
    diesel::sql_query(format!(
        "INSERT INTO idem_outbox
             (id, destination, key, payload, headers, staged_at, next_attempt_at)
         VALUES (?1, ?2, ?3, ?4, ?5, {NOW}, {NOW})"
    ))
    .bind::<Text, _>(event.id().hyphenated().to_string())
    .bind::<Text, _>(event.destination())
    .bind::<Text, _>(event.key())
    .bind::<Binary, _>(&event.payload()[..])
    .bind::<Binary, _>(event.encode_headers())
    .prepared()
    .execute(c)
    .map(drop)
}

impl Source for SqliteSource {
    fn take(&self, limit: usize) -> BoxFuture<'_, Result<Box<dyn Batch>, StoreError>> {
        Box::pin(async move {
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let rows = self
                .outbox
                .run(move |c| {
                    diesel::sql_query(TAKE.replace("?2", NOW))
                        .bind::<BigInt, _>(limit)
                        .prepared()
                        .load::<EventRow>(c)
                })
                .await?;
            let mut events = Vec::with_capacity(rows.len());
            for row in rows {
                let id = uuid::Uuid::parse_str(&row.id)
                    .map_err(|_| StoreError::unavailable(Corrupt("id")))?;
                let headers = Event::decode_headers(&row.headers)
                    .ok_or_else(|| StoreError::unavailable(Corrupt("headers")))?;
                events.push(Taken {
                    position: row.position,
                    attempts: u32::try_from(row.attempts).unwrap_or(0),
                    event: Event::staged(id, row.destination, row.key, row.payload, headers),
                });
            }
            Ok(Box::new(SqliteBatch {
                outbox: self.outbox.clone(),
                events,
            }) as Box<dyn Batch>)
        })
    }

    fn woken(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.outbox.inner.wake.notified())
    }

    fn wakes_early(&self) -> bool {
        true
    }

    fn batches_at_once(&self) -> usize {
        1
    }

    #[cfg(feature = "metrics")]
    fn oldest_unsent(&self) -> BoxFuture<'_, Result<Option<Duration>, StoreError>> {
        Box::pin(async move {
            let row = self
                .outbox
                .run(|c| {
                    diesel::sql_query(format!(
                        "SELECT (SELECT {NOW} - staged_at FROM idem_outbox
                                 WHERE sent_at IS NULL AND parked_at IS NULL
                                 ORDER BY position LIMIT 1) AS oldest_us"
                    ))
                    .prepared()
                    .get_result::<OldestRow>(c)
                })
                .await?;
            Ok(row
                .oldest_us
                .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))))
        })
    }

    fn listen(&self, _poll_interval: Duration) -> Option<BoxFuture<'static, ()>> {
        None
    }
}

impl Batch for SqliteBatch {
    fn events(&self) -> &[Taken] {
        &self.events
    }

    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move {
            self.outbox
                .run(move |c| {
                    c.immediate_transaction(|c| {
                        for position in settlement.sent {
                            diesel::sql_query(format!(
                                "UPDATE idem_outbox SET sent_at = {NOW} WHERE position = ?1"
                            ))
                            .bind::<BigInt, _>(position)
                            .prepared()
                            .execute(c)?;
                        }
                        for (position, reason) in settlement.parked {
                            diesel::sql_query(format!(
                                "UPDATE idem_outbox
                                 SET parked_at = {NOW}, reason = ?2, attempts = attempts + 1
                                 WHERE position = ?1"
                            ))
                            .bind::<BigInt, _>(position)
                            .bind::<Text, _>(reason)
                            .prepared()
                            .execute(c)?;
                        }
                        for (position, delay) in settlement.retried {
                            diesel::sql_query(format!(
                                "UPDATE idem_outbox
                                 SET attempts = attempts + 1, next_attempt_at = {NOW} + ?2
                                 WHERE position = ?1"
                            ))
                            .bind::<BigInt, _>(position)
                            .bind::<BigInt, _>(delay)
                            .prepared()
                            .execute(c)?;
                        }
                        Ok(())
                    })
                })
                .await
        })
    }
}

impl ExpiredRows for SqliteOutbox {
    fn sweep_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let batch = i64::try_from(batch).unwrap_or(i64::MAX);
            let retention = duration_micros(self.inner.retention);
            let deleted = self
                .run(move |c| {
                    diesel::sql_query(format!(
                        "DELETE FROM idem_outbox WHERE rowid IN (
                             SELECT rowid FROM idem_outbox
                             WHERE sent_at <= {NOW} - ?2 LIMIT ?1)"
                    ))
                    .bind::<BigInt, _>(batch)
                    .bind::<BigInt, _>(retention)
                    .prepared()
                    .execute(c)
                })
                .await?;
            Ok(u64::try_from(deleted).unwrap_or(u64::MAX))
        })
    }
}
