//! [`SqliteInbox`]: the consumer inbox of `idem_core::consume` on SQLite.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use diesel::connection::{AnsiTransactionManager, TransactionManager};
use diesel::sql_types::{BigInt, Binary, Bool, Integer, Nullable, Text};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl, SqliteConnection};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};
use idem_core::Redacted;
use idem_core::cleanup::{Cleanup, ExpiredRows};
use idem_core::consume::{
    Advance, Attempt, BatchEntry, BatchHandler, Batched, Buried, Counted, DeadLetter, Entered,
    Entry, Failure, Handler, HandlerError, Inbox, InboxError, InboxFuture, Message, PartitionLost,
};
use idem_core::store::StoreFuture;

use super::statements::NOW;
use super::{AsyncSqliteConnection, SqlitePool};
use crate::SetupError;
use crate::builder::InboxBuilder;
use crate::consume::{self, Found, INBOX_TABLES, NestedOpen, check_inbox_columns, micros, time};
use crate::database::{Database, Pooled};
use crate::outbox::Sqlite;
use crate::prepared::PreparedExt;
use crate::row::duration_micros;

/// The migrations that create the inbox's tables.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/sqlite_consumer_inbox");

/// What the entry reads: `?1` consumer, `?2` message id → the dead letter's
/// `published` (NULL: not dead), the fingerprint of the message applied
/// before, and the failures so far.
const LOOK: &str = "SELECT
        (SELECT published FROM idem_consumer_dead_letters
         WHERE consumer = ?1 AND message_id = ?2) AS dead,
        (SELECT fingerprint FROM idem_consumer_inbox
         WHERE consumer = ?1 AND message_id = ?2) AS fingerprint,
        COALESCE((SELECT attempts FROM idem_consumer_failures
                  WHERE consumer = ?1 AND message_id = ?2), 0) AS failures";

/// Dead letters are not counted again: `?1` consumer, `?2` message id.
const DEAD: &str = "SELECT published, attempted_at FROM idem_consumer_dead_letters
    WHERE consumer = ?1 AND message_id = ?2";

/// The columns of a `DeadLetterRow`.
const DEAD_LETTER_COLUMNS: &str = "consumer, message_id, reason, attempted_at, dead_at, published";

/// The consumer inbox on SQLite: each message applied once per consumer, the
/// handler's writes and the inbox row committed in one transaction, in a file
/// and with no server at all.
///
/// It implements [`idem_core::consume::Inbox`] as [`PgInbox`](crate::PgInbox)
/// does, on the same tables' shapes (see the crate's README, "Consumer
/// inboxes"). The handler writes on the inbox's open transaction, an
/// [`AsyncSqliteConnection`](crate::AsyncSqliteConnection):
///
/// ```no_run
/// use idem_diesel::{AsyncSqliteConnection, SqliteInbox};
/// use idem_diesel::diesel::sql_types::BigInt;
/// use idem_diesel::diesel_async::RunQueryDsl;
/// use idem_diesel::idem_core::consume::{
///     Attempt, ConsumerPolicy, HandlerError, HandlerFuture, Message, Protocol, handler,
/// };
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = SqliteInbox::connect("sqlite://consumer.db").await?;
/// inbox.migrate().await?;
/// let protocol = Protocol::new("balances", inbox, ConsumerPolicy::new());
/// let apply = handler(|attempt: Attempt<'_>, tx: &mut AsyncSqliteConnection| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         let body = std::str::from_utf8(attempt.body()).map_err(HandlerError::permanent)?;
///         let amount: i64 = body.parse().map_err(HandlerError::permanent)?;
///         idem_diesel::diesel::sql_query("UPDATE accounts SET balance = balance + ?1")
///             .bind::<BigInt, _>(amount)
///             .execute(tx)
///             .await?;
///         Ok(())
///     })
/// });
/// let decision = protocol.decide(&Message::new("500").id("m-1"), &apply).await;
/// # let _ = decision;
/// # Ok(())
/// # }
/// ```
///
/// SQLite has one writer: each message is processed inside a
/// `BEGIN IMMEDIATE` transaction, which holds the file's write lock from the
/// entry to the commit, handler included. Concurrent deliveries (of the same
/// message, or of any other, or the application's other writers) take turns,
/// each waiting up to the busy timeout
/// ([`SqliteInboxBuilder::busy_timeout`], 5 s) before it fails as unavailable
/// (the protocol then requeues it, uncounted): keep handlers short.
///
/// The handler's statements run on Tokio's blocking threads (diesel-async's
/// `SyncConnectionWrapper`), which wait for a step in progress when its future
/// is dropped: on a current-thread runtime, a `process` future must not be
/// dropped midway (the other steps run as tasks of their own, and may be).
#[derive(Clone)]
pub struct SqliteInbox {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database<Sqlite>,
    retention: Duration,
}

/// Configures a [`SqliteInbox`]: its retention and the pool it builds
/// ([`InboxBuilder`](crate::InboxBuilder), the same settings as PostgreSQL's).
pub type SqliteInboxBuilder = InboxBuilder<Sqlite>;

#[derive(QueryableByName)]
struct LookRow {
    #[diesel(sql_type = Nullable<Bool>)]
    dead: Option<bool>,
    #[diesel(sql_type = Nullable<Binary>)]
    fingerprint: Option<Vec<u8>>,
    #[diesel(sql_type = Integer)]
    failures: i32,
}

#[derive(QueryableByName)]
struct DeadRow {
    #[diesel(sql_type = Bool)]
    published: bool,
    #[diesel(sql_type = Text)]
    attempted_at: String,
}

#[derive(QueryableByName)]
struct FailuresRow {
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Text)]
    attempted_at: String,
}

#[derive(QueryableByName)]
struct CountRow {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct DeadLetterRow {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Text)]
    message_id: String,
    #[diesel(sql_type = Text)]
    reason: String,
    #[diesel(sql_type = Text)]
    attempted_at: String,
    #[diesel(sql_type = BigInt)]
    dead_at: i64,
    #[diesel(sql_type = Bool)]
    published: bool,
}

/// What the count of a failed attempt did.
struct Count {
    attempted_at: String,
    buried: Option<Buried>,
}

/// How the processing transaction ended.
enum Finish {
    Committed,
    /// The handler left savepoints open: rolled back.
    NestedOpen(u32),
}

impl SqliteInbox {
    /// Opens (creating if missing) the database at `url` (`sqlite://PATH`, as
    /// [`SqliteStore::connect`](crate::SqliteStore::connect) reads it) with a
    /// pool of its own and the default retention (7 days). Call
    /// [`migrate`](Self::migrate) once before use.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// An inbox over a pool the application already has (a `SqliteStore`'s,
    /// say), with the default retention. Open its connections with a busy
    /// timeout and WAL, as the store's pools are.
    pub fn new(pool: SqlitePool) -> Self {
        Self::builder().build(pool)
    }

    /// Configures the retention and the pool.
    pub fn builder() -> SqliteInboxBuilder {
        InboxBuilder::new(4)
    }

    fn with_database(db: Database<Sqlite>, builder: &SqliteInboxBuilder) -> Self {
        Self {
            inner: Arc::new(Inner {
                db,
                retention: builder.retention,
            }),
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.inner.db.pool
    }

    /// How long processed messages are remembered.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// Creates the inbox's tables (`idem_consumer_inbox`,
    /// `idem_consumer_failures`, `idem_consumer_dead_letters`) with its
    /// embedded diesel migrations, in one immediate transaction.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        self.inner.db.migrate(MIGRATIONS, INBOX_TABLES[0]).await
    }

    /// Checks that the inbox's tables exist with every column this version
    /// uses, so that a forgotten migration stops the consumer's start,
    /// naming the fix, instead of failing every message. [`migrate`](Self::migrate)
    /// makes it pass; call it at start-up when your own migration tool
    /// creates the tables. It fails with [`SetupError::InboxSchema`].
    pub async fn check_schema(&self) -> Result<(), SetupError> {
        let tables = INBOX_TABLES.map(str::to_owned);
        let db = &self.inner.db;
        db.check_schema(INBOX_TABLES[0], tables, check_inbox_columns)
            .await
    }

    /// A cleanup job that deletes processed messages and abandoned failure
    /// counts past the retention (never dead letters). SQLite writers take
    /// turns anyway, so it takes no lock.
    pub fn cleanup(&self) -> Cleanup<SqliteInbox> {
        Cleanup::new(self.clone())
    }

    async fn connection(&self) -> Result<Pooled<'_, Sqlite>, InboxError> {
        self.inner
            .db
            .connection()
            .await
            .map_err(consume::unavailable)
    }

    /// Runs `task` on a pooled connection, on a blocking thread, as a task of
    /// its own (see `Database::run`: a caller that gives up detaches).
    async fn run<R: Send + 'static>(
        &self,
        task: impl FnOnce(&mut SqliteConnection) -> QueryResult<R> + Send + 'static,
    ) -> Result<R, InboxError> {
        self.inner.db.run(task).await.map_err(consume::unavailable)
    }

    /// [`Inbox::process`]: enters the message, runs the handler and commits,
    /// on one pooled connection. With `advance` (a partition's record,
    /// [`Positions::process_advancing`](idem_core::consume::Positions::process_advancing)),
    /// the position moves in the entry's blocking step, before the handler:
    /// one step on a blocking thread fewer than a move from the handler.
    pub(crate) async fn process_on(
        &self,
        entry: &Entry<'_>,
        message: &Message,
        advance: Option<&Advance<'_>>,
        handler: &(dyn Handler<AsyncSqliteConnection> + '_),
    ) -> Result<Entered, InboxError> {
        let mut pooled = self.connection().await?;
        let connection: &mut AsyncSqliteConnection = &mut pooled;
        let (consumer, message_id) = (entry.consumer.to_owned(), entry.message_id.to_owned());
        let fingerprint = *entry.fingerprint.as_bytes();
        let advance = advance.map(OwnedAdvance::of);
        let (entered, moved) = connection
            .spawn_blocking(move |c| {
                let found = enter(c, &consumer, &message_id, &fingerprint)?;
                match (&found, advance) {
                    (Found::Entered { .. }, Some(advance)) => {
                        let moved = advance_or_roll_back(c, &advance.borrowed())?;
                        Ok((found, moved))
                    }
                    _ => Ok((found, true)),
                }
            })
            .await
            .map_err(InboxError::unavailable)?;
        let failures = match entered {
            Found::Dead { published } => return Ok(Entered::Dead { published }),
            Found::Applied(found) if found[..] == entry.fingerprint.as_bytes()[..] => {
                return Ok(Entered::Duplicate);
            }
            Found::Applied(_) => return Ok(Entered::Reused),
            Found::Entered { failures } => failures,
        };
        let attempt = u32::try_from(failures).unwrap_or(0).saturating_add(1);
        if !moved {
            // Fenced: the partition has another owner; the entry was rolled
            // back with the move, nothing is kept.
            let error = HandlerError::transient(PartitionLost);
            return Ok(Entered::Failed { attempt, error });
        }
        let ran = handler
            .handle(Attempt::new(message, entry.message_id, attempt), connection)
            .await;
        if let Err(error) = ran {
            roll_back(connection).await;
            return Ok(Entered::Failed { attempt, error });
        }
        let (consumer, message_id) = (entry.consumer.to_owned(), entry.message_id.to_owned());
        let finished = connection
            .spawn_blocking(move |c| finish(c, &consumer, &[message_id]))
            .await;
        match finished {
            Ok(Finish::Committed) => Ok(Entered::Processed { attempt }),
            Ok(Finish::NestedOpen(depth)) => Ok(Entered::Failed {
                attempt,
                error: HandlerError::from(NestedOpen(depth)),
            }),
            // SQLite refused the commit (a deferred constraint, say) or the
            // file is busy or broken: rolled back, counted as the attempt's
            // failure.
            Err(error) => {
                tracing::debug!(target: "idem", message_id = %Redacted::of(entry.message_id), error = %idem_core::log::error_chain(&error), "the inbox transaction did not commit");
                Ok(Entered::Failed {
                    attempt,
                    error: HandlerError::from(error),
                })
            }
        }
    }

    /// [`Inbox::process_batch`]: enters the batch and runs the handler once
    /// on the new messages, in one `BEGIN IMMEDIATE` transaction, one commit.
    async fn process_batch_on(
        &self,
        batch: &[BatchEntry<'_>],
        handler: &(dyn BatchHandler<AsyncSqliteConnection> + '_),
    ) -> Result<Batched, InboxError> {
        let Some(consumer) = consume::consumer_of(batch)? else {
            return Ok(Batched::Entered(Vec::new()));
        };
        let consumer = consumer.to_owned();
        let mut pooled = self.connection().await?;
        let connection: &mut AsyncSqliteConnection = &mut pooled;
        let keys: Vec<(String, [u8; 32])> = batch
            .iter()
            .map(|item| {
                (
                    item.entry.message_id.to_owned(),
                    *item.entry.fingerprint.as_bytes(),
                )
            })
            .collect();
        let entering = consumer.clone();
        let entered = connection
            .spawn_blocking(move |c| {
                enter_all(c, &entering, keys.iter().map(|(id, fp)| (id.as_str(), fp)))
            })
            .await
            .map_err(InboxError::unavailable)?;
        let (outcomes, new) = consume::entered(batch, entered);
        if new.is_empty() {
            return Ok(Batched::Entered(outcomes));
        }
        let attempts = consume::attempts(batch, &new);
        let failed = match handler.handle(&attempts, connection).await {
            Err(error) => {
                roll_back(connection).await;
                Some(error)
            }
            Ok(()) => {
                let ids: Vec<String> = new
                    .iter()
                    .map(|&(i, _)| batch[i].entry.message_id.to_owned())
                    .collect();
                let finished = connection
                    .spawn_blocking(move |c| finish(c, &consumer, &ids))
                    .await;
                match finished {
                    Ok(Finish::Committed) => None,
                    Ok(Finish::NestedOpen(depth)) => Some(HandlerError::from(NestedOpen(depth))),
                    Err(error) => {
                        tracing::debug!(target: "idem", error = %idem_core::log::error_chain(&error), "the inbox's batch transaction did not commit");
                        Some(HandlerError::from(error))
                    }
                }
            }
        };
        Ok(consume::batched(outcomes, &new, failed))
    }

    async fn letters(
        &self,
        sql: String,
        consumer: &str,
        message_id: Option<&str>,
    ) -> Result<Vec<DeadLetter>, InboxError> {
        let consumer = consumer.to_owned();
        let message_id = message_id.map(str::to_owned);
        let rows = self
            .run(move |c| {
                let query = diesel::sql_query(sql).bind::<Text, _>(consumer);
                match message_id {
                    Some(message_id) => query
                        .bind::<Text, _>(message_id)
                        .prepared()
                        .load::<DeadLetterRow>(c),
                    None => query.prepared().load::<DeadLetterRow>(c),
                }
            })
            .await?;
        rows.into_iter().map(DeadLetterRow::into_letter).collect()
    }
}

impl InboxBuilder<Sqlite> {
    /// How long a step waits for another connection's write transaction (a
    /// message being processed, handler included) before it fails with
    /// "database is locked" (default 5 s). Ignored by [`build`](Self::build).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.pool.busy_timeout = timeout;
        self
    }

    /// Opens the database at `url` (see [`SqliteInbox::connect`]), creating
    /// the file if missing, and checks that it opens.
    pub async fn connect(self, url: &str) -> Result<SqliteInbox, SetupError> {
        let db = Database::open(url, &self.pool).await?;
        Ok(SqliteInbox::with_database(db, &self))
    }

    /// An inbox over a pool the application already has.
    pub fn build(self, pool: SqlitePool) -> SqliteInbox {
        SqliteInbox::with_database(Database::over(pool, &self.pool), &self)
    }
}

impl Inbox for SqliteInbox {
    type Tx = AsyncSqliteConnection;
    const TRANSACTIONAL: bool = true;
    const BATCHES: bool = true;

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<AsyncSqliteConnection> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(self.process_on(entry, message, None, handler))
    }

    fn process_batch<'a>(
        &'a self,
        batch: &'a [BatchEntry<'a>],
        handler: &'a (dyn BatchHandler<AsyncSqliteConnection> + 'a),
    ) -> InboxFuture<'a, Batched> {
        Box::pin(self.process_batch_on(batch, handler))
    }

    fn fail<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        failure: &'a Failure<'a>,
    ) -> InboxFuture<'a, Counted> {
        Box::pin(async move {
            let (consumer, message_id) = (entry.consumer.to_owned(), entry.message_id.to_owned());
            let reason = failure.reason.to_owned();
            let at = micros(entry.at);
            let bury_at = i64::from(failure.bury_at.max(1));
            let count = self
                .run(move |c| count(c, &consumer, &message_id, at, bury_at, &reason))
                .await?;
            let attempted_at = parse_times(&count.attempted_at)?;
            Ok(Counted {
                attempts: u32::try_from(attempted_at.len()).unwrap_or(u32::MAX),
                attempted_at,
                buried: count.buried,
            })
        })
    }

    fn published<'a>(&'a self, consumer: &'a str, message_id: &'a str) -> InboxFuture<'a, ()> {
        Box::pin(async move {
            let (consumer, message_id) = (consumer.to_owned(), message_id.to_owned());
            self.run(move |c| {
                diesel::sql_query(
                    "UPDATE idem_consumer_dead_letters SET published = 1 \
                     WHERE consumer = ?1 AND message_id = ?2",
                )
                .bind::<Text, _>(consumer)
                .bind::<Text, _>(message_id)
                .prepared()
                .execute(c)
                .map(drop)
            })
            .await
        })
    }

    fn dead_letter<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT {DEAD_LETTER_COLUMNS} FROM idem_consumer_dead_letters \
                 WHERE consumer = ?1 AND message_id = ?2"
            );
            let letters = self.letters(sql, consumer, Some(message_id)).await?;
            Ok(letters.into_iter().next())
        })
    }

    fn dead_letters<'a>(&'a self, consumer: &'a str) -> InboxFuture<'a, Vec<DeadLetter>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT {DEAD_LETTER_COLUMNS} FROM idem_consumer_dead_letters \
                 WHERE consumer = ?1 ORDER BY dead_at, message_id"
            );
            self.letters(sql, consumer, None).await
        })
    }

    fn redrive<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>> {
        Box::pin(async move {
            let (consumer, message_id) = (consumer.to_owned(), message_id.to_owned());
            let row = self
                .run(move |c| {
                    c.immediate_transaction(|c| {
                        let gone = diesel::sql_query(format!(
                            "DELETE FROM idem_consumer_dead_letters \
                             WHERE consumer = ?1 AND message_id = ?2 \
                             RETURNING {DEAD_LETTER_COLUMNS}"
                        ))
                        .bind::<Text, _>(&consumer)
                        .bind::<Text, _>(&message_id)
                        .prepared()
                        .get_result::<DeadLetterRow>(c)
                        .optional()?;
                        // The failures go only with the dead letter: a
                        // message that is not dead keeps its count.
                        if gone.is_some() {
                            diesel::sql_query(
                                "DELETE FROM idem_consumer_failures \
                                 WHERE consumer = ?1 AND message_id = ?2",
                            )
                            .bind::<Text, _>(&consumer)
                            .bind::<Text, _>(&message_id)
                            .prepared()
                            .execute(c)?;
                        }
                        Ok(gone)
                    })
                })
                .await?;
            row.map(DeadLetterRow::into_letter).transpose()
        })
    }

    fn is_permanent(&self, error: &(dyn std::error::Error + 'static)) -> bool {
        consume::is_permanent(error)
    }

    fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.inner
            .db
            .schema_gate
            .inbox_readiness("SqliteInboxBuilder")
    }
}

impl ExpiredRows for SqliteInbox {
    fn sweep_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let batch = i64::try_from(batch).unwrap_or(i64::MAX);
            let retention = duration_micros(self.inner.retention);
            let deleted = self
                .inner
                .db
                .run(move |c| {
                    c.immediate_transaction(|c| {
                        // Processed messages, then abandoned failure counts.
                        let mut deleted = 0usize;
                        for (table, changed) in [
                            ("idem_consumer_inbox", "processed_at"),
                            ("idem_consumer_failures", "last_attempt_at"),
                        ] {
                            let rows = diesel::sql_query(format!(
                                "DELETE FROM {table} WHERE rowid IN (
                                     SELECT rowid FROM {table}
                                     WHERE {changed} <= {NOW} - ?2 LIMIT ?1)"
                            ))
                            .bind::<BigInt, _>(batch)
                            .bind::<BigInt, _>(retention)
                            .prepared()
                            .execute(c)?;
                            deleted = deleted.saturating_add(rows);
                        }
                        Ok(deleted)
                    })
                })
                .await?;
            Ok(u64::try_from(deleted).unwrap_or(u64::MAX))
        })
    }
}

impl fmt::Debug for SqliteInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteInbox")
            .field("retention", &self.inner.retention)
            .field("pool", &self.inner.db.state())
            .finish_non_exhaustive()
    }
}

impl DeadLetterRow {
    fn into_letter(self) -> Result<DeadLetter, InboxError> {
        let attempted_at = parse_times(&self.attempted_at)?;
        Ok(DeadLetter {
            consumer: self.consumer,
            message_id: self.message_id,
            attempts: u32::try_from(attempted_at.len()).unwrap_or(u32::MAX),
            reason: self.reason,
            attempted_at,
            dead_at: time(self.dead_at)?,
            published: self.published,
        })
    }
}

/// `BEGIN IMMEDIATE` (waiting, up to the busy timeout, for the file's write
/// lock), then the entry: a dead letter or a message applied before ends the
/// transaction; otherwise the inbox row is written and the transaction stays
/// open for the handler.
fn enter(
    c: &mut SqliteConnection,
    consumer: &str,
    message_id: &str,
    fingerprint: &[u8; 32],
) -> QueryResult<Found> {
    let mut found = enter_all(c, consumer, [(message_id, fingerprint)])?;
    found
        .pop()
        .ok_or_else(|| diesel::result::Error::QueryBuilderError("no entry".into()))
}

/// A partition's move, owned, to cross to a blocking thread.
struct OwnedAdvance {
    consumer: String,
    topic: String,
    partition: i32,
    from: Option<i64>,
    to: i64,
}

impl OwnedAdvance {
    fn of(advance: &Advance<'_>) -> Self {
        Self {
            consumer: advance.consumer.to_owned(),
            topic: advance.topic.to_owned(),
            partition: advance.partition,
            from: advance.from,
            to: advance.to,
        }
    }

    fn borrowed(&self) -> Advance<'_> {
        Advance {
            consumer: &self.consumer,
            topic: &self.topic,
            partition: self.partition,
            from: self.from,
            to: self.to,
        }
    }
}

/// The fenced move on the entry's open transaction: `true` when it was
/// written; fenced (`false`) or failed, the transaction (the entry with it)
/// is rolled back.
fn advance_or_roll_back(c: &mut SqliteConnection, advance: &Advance<'_>) -> QueryResult<bool> {
    match crate::positions::advance_blocking(c, advance) {
        Ok(true) => Ok(true),
        Ok(false) => roll_back_all(c).map(|()| false),
        Err(error) => {
            let _ = roll_back_all(c);
            Err(error)
        }
    }
}

/// Enters messages (`(id, fingerprint)`) in one `BEGIN IMMEDIATE`
/// transaction, left open when one of them entered (rolled back
/// otherwise): what each came to, in order.
fn enter_all<'a>(
    c: &mut SqliteConnection,
    consumer: &str,
    messages: impl IntoIterator<Item = (&'a str, &'a [u8; 32])>,
) -> QueryResult<Vec<Found>> {
    AnsiTransactionManager::begin_transaction_sql(c, "BEGIN IMMEDIATE")?;
    let found = messages
        .into_iter()
        .map(|(message_id, fingerprint)| look_and_insert(c, consumer, message_id, fingerprint))
        .collect::<QueryResult<Vec<Found>>>();
    match found {
        Ok(found) if found.iter().any(|f| matches!(f, Found::Entered { .. })) => Ok(found),
        Ok(found) => {
            AnsiTransactionManager::rollback_transaction(c)?;
            Ok(found)
        }
        Err(error) => {
            let _ = AnsiTransactionManager::rollback_transaction(c);
            Err(error)
        }
    }
}

fn look_and_insert(
    c: &mut SqliteConnection,
    consumer: &str,
    message_id: &str,
    fingerprint: &[u8; 32],
) -> QueryResult<Found> {
    let look = diesel::sql_query(LOOK)
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(message_id)
        .prepared()
        .get_result::<LookRow>(c)?;
    if let Some(published) = look.dead {
        return Ok(Found::Dead { published });
    }
    if let Some(found) = look.fingerprint {
        return Ok(Found::Applied(found));
    }
    diesel::sql_query(format!(
        "INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint, processed_at)
         VALUES (?1, ?2, ?3, {NOW})"
    ))
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(message_id)
    .bind::<Binary, _>(&fingerprint[..])
    .prepared()
    .execute(c)?;
    Ok(Found::Entered {
        failures: look.failures,
    })
}

/// Clears the processed messages' failures and commits; rolls back instead
/// when the handler left savepoints open or a statement fails.
fn finish(c: &mut SqliteConnection, consumer: &str, message_ids: &[String]) -> QueryResult<Finish> {
    let depth = depth(c);
    if depth != 1 {
        roll_back_all(c)?;
        return Ok(Finish::NestedOpen(depth.saturating_sub(1)));
    }
    let cleared = message_ids
        .iter()
        .try_for_each(|message_id| {
            diesel::sql_query(
                "DELETE FROM idem_consumer_failures WHERE consumer = ?1 AND message_id = ?2",
            )
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(message_id)
            .prepared()
            .execute(c)
            .map(drop)
        })
        .and_then(|()| AnsiTransactionManager::commit_transaction(c));
    if let Err(error) = cleared {
        let _ = roll_back_all(c);
        return Err(error);
    }
    Ok(Finish::Committed)
}

/// Counts a failed attempt in one immediate transaction; the count that
/// reaches `bury_at` moves the message to the dead letters and counts the
/// consumer's (SQLite's one writer makes concurrent buries take turns, so each
/// sees its own count).
fn count(
    c: &mut SqliteConnection,
    consumer: &str,
    message_id: &str,
    at: i64,
    bury_at: i64,
    reason: &str,
) -> QueryResult<Count> {
    c.immediate_transaction(|c| {
        let dead = diesel::sql_query(DEAD)
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(message_id)
            .prepared()
            .get_result::<DeadRow>(c)
            .optional()?;
        if let Some(dead) = dead {
            return Ok(Count {
                attempted_at: dead.attempted_at,
                buried: Some(Buried::Already {
                    published: dead.published,
                }),
            });
        }
        let counted = diesel::sql_query(format!(
            "INSERT INTO idem_consumer_failures AS f
                 (consumer, message_id, attempts, attempted_at, last_attempt_at)
             VALUES (?1, ?2, 1, ?3, {NOW})
             ON CONFLICT (consumer, message_id) DO UPDATE SET
                 attempts = f.attempts + 1,
                 attempted_at = f.attempted_at || ',' || excluded.attempted_at,
                 last_attempt_at = excluded.last_attempt_at
             RETURNING attempts, attempted_at"
        ))
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(message_id)
        .bind::<Text, _>(at.to_string())
        .prepared()
        .get_result::<FailuresRow>(c)?;
        if i64::from(counted.attempts) < bury_at {
            return Ok(Count {
                attempted_at: counted.attempted_at,
                buried: None,
            });
        }
        diesel::sql_query(format!(
            "INSERT INTO idem_consumer_dead_letters
                 (consumer, message_id, reason, attempts, attempted_at, dead_at)
             VALUES (?1, ?2, ?3, ?4, ?5, {NOW})"
        ))
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(message_id)
        .bind::<Text, _>(reason)
        .bind::<Integer, _>(counted.attempts)
        .bind::<Text, _>(&counted.attempted_at)
        .prepared()
        .execute(c)?;
        let dead_letters = diesel::sql_query(
            "SELECT count(*) AS n FROM idem_consumer_dead_letters WHERE consumer = ?1",
        )
        .bind::<Text, _>(consumer)
        .prepared()
        .get_result::<CountRow>(c)?
        .n;
        Ok(Count {
            attempted_at: counted.attempted_at,
            buried: Some(Buried::New {
                dead_letters: u64::try_from(dead_letters).unwrap_or(0),
            }),
        })
    })
}

/// How deep the connection's transactions are nested (1: the inbox's own).
fn depth(c: &mut SqliteConnection) -> u32 {
    match AnsiTransactionManager::transaction_manager_status_mut(c).transaction_depth() {
        Ok(Some(depth)) => depth.get(),
        Ok(None) | Err(_) => 0,
    }
}

/// Rolls every open level back. A failure leaves the connection's transaction
/// state broken, so the pool closes it (which rolls back on the file).
fn roll_back_all(c: &mut SqliteConnection) -> QueryResult<()> {
    while depth(c) > 0 {
        AnsiTransactionManager::rollback_transaction(c)?;
    }
    Ok(())
}

/// Rolls the processing transaction back after the handler failed.
async fn roll_back(connection: &mut AsyncSqliteConnection) {
    if let Err(error) = connection.spawn_blocking(roll_back_all).await {
        tracing::debug!(target: "idem", error = %idem_core::log::error_chain(&error), "rollback failed; the connection will be closed instead");
    }
}

/// The comma-separated microsecond times of an `attempted_at` column.
fn parse_times(times: &str) -> Result<Vec<SystemTime>, InboxError> {
    times
        .split(',')
        .filter(|time| !time.is_empty())
        .map(|micros| {
            micros
                .trim()
                .parse::<i64>()
                .map_err(|_| {
                    InboxError::Corrupt(format!("an attempt time {micros:?} is not a number"))
                })
                .and_then(time)
        })
        .collect()
}
