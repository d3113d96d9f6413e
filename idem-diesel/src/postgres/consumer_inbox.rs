//! [`PgInbox`]: the consumer inbox of `idem_core::consume` on PostgreSQL.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use diesel::QueryableByName;
use diesel::connection::TransactionDepthChange;
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::sql_types::{Array, BigInt, Binary, Bool, Integer, Nullable, Text};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};
use idem_core::cleanup::{Cleanup, ExpiredRows, SweepGuard, SweepLock};
use idem_core::consume::{
    Advance, Attempt, BatchEntry, BatchHandler, Batched, Buried, Counted, DeadLetter, Entered,
    Entry, Failure, Handler, HandlerError, Inbox, InboxError, InboxFuture, Message, PartitionLost,
};
use idem_core::store::{BoxError, StoreFuture};
use idem_core::{Redacted, StoreError};

use super::statements::{
    self, Commit, InboxAdvance, InboxBury, InboxCount, InboxEnter, InboxEnterBatch, InboxFinish,
    InboxFinishBatch, Statement,
};
use super::transactional::{begin, mark_begun};
use super::{BURY_LOCK_CLASS, PgPool, roll_back, transaction_depth};
use crate::SetupError;
use crate::builder::InboxBuilder;
use crate::consume::{self, Found, INBOX_TABLES, NestedOpen, check_inbox_columns, micros, time};
use crate::database::{Database, Pooled};
use crate::outbox::Postgres;
use crate::prepared::PreparedExt;

/// The migrations that create the inbox's tables.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres_consumer_inbox");

/// The table the inbox's migration and sweep lock are named after.
const INBOX_TABLE: &str = "idem_consumer_inbox";

/// How often the entry statement runs when it met a concurrent entry that
/// committed after its snapshot (see [`ENTER`]).
const ENTER_ATTEMPTS: usize = 5;

/// Enters a message: `$1` consumer, `$2` message id, `$3` fingerprint.
///
/// Records the entry unless the message is a dead letter or the consumer has
/// it already, and answers what it found: whether it entered, the dead
/// letter's `published` (NULL: not dead), the fingerprint of the message
/// applied before, and the failures so far. A concurrent entry of the same
/// message makes the insert wait for its transaction: if that rolls back, this
/// one enters; if it commits, its row is newer than this statement's snapshot,
/// so no column says why nothing was entered, and the statement runs again.
/// The fingerprint is looked up only when nothing was entered: a subquery in
/// a `CASE` branch not taken is not run.
const ENTER: &str = "WITH dead AS (
        SELECT published FROM idem_consumer_dead_letters
        WHERE consumer = $1 AND message_id = $2
    ), entered AS (
        INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint, processed_at)
        SELECT $1, $2, $3, now() WHERE NOT EXISTS (SELECT 1 FROM dead)
        ON CONFLICT (consumer, message_id) DO NOTHING
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM entered) AS entered,
           (SELECT published FROM dead) AS dead,
           CASE WHEN EXISTS (SELECT 1 FROM entered) THEN NULL
                ELSE (SELECT i.fingerprint FROM idem_consumer_inbox AS i
                      WHERE i.consumer = $1 AND i.message_id = $2) END AS fingerprint,
           COALESCE((SELECT cardinality(f.attempted_at) FROM idem_consumer_failures AS f
                     WHERE f.consumer = $1 AND f.message_id = $2), 0) AS failures";

/// Enters a batch of messages: `$1` consumer, `$2` their ids (distinct),
/// `$3` their fingerprints, in the batch's order.
///
/// [`ENTER`] for many rows at once: answers, per message and in its order
/// (`n`, from 1), the same columns. The rows are inserted in the order of
/// their ids, so two batches that share messages wait on each other in one
/// order and never deadlock; a message whose concurrent entry committed
/// after this statement's snapshot answers nothing decisive, and is entered
/// again.
const ENTER_BATCH: &str = "WITH input AS (
        SELECT i.message_id, i.fingerprint, i.n
        FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS i(message_id, fingerprint, n)
    ), dead AS (
        SELECT d.message_id, d.published FROM idem_consumer_dead_letters AS d
        WHERE d.consumer = $1 AND d.message_id = ANY($2)
    ), entered AS (
        INSERT INTO idem_consumer_inbox (consumer, message_id, fingerprint, processed_at)
        SELECT $1, i.message_id, i.fingerprint, now() FROM input AS i
        WHERE NOT EXISTS (SELECT 1 FROM dead WHERE dead.message_id = i.message_id)
        ORDER BY i.message_id
        ON CONFLICT (consumer, message_id) DO NOTHING
        RETURNING message_id
    )
    SELECT i.n, e.message_id IS NOT NULL AS entered, d.published AS dead,
           CASE WHEN e.message_id IS NOT NULL THEN NULL
                ELSE (SELECT x.fingerprint FROM idem_consumer_inbox AS x
                      WHERE x.consumer = $1 AND x.message_id = i.message_id) END AS fingerprint,
           COALESCE((SELECT cardinality(f.attempted_at) FROM idem_consumer_failures AS f
                     WHERE f.consumer = $1 AND f.message_id = i.message_id), 0) AS failures
    FROM input AS i
    LEFT JOIN entered AS e ON e.message_id = i.message_id
    LEFT JOIN dead AS d ON d.message_id = i.message_id
    ORDER BY i.n";

/// A batch's processed messages' failures are history: `$1` consumer, `$2`
/// their ids. Sent with the `COMMIT`, as [`FINISH`] is.
const FINISH_BATCH: &str =
    "DELETE FROM idem_consumer_failures WHERE consumer = $1 AND message_id = ANY($2)";

/// A processed message's failures are history: `$1` consumer, `$2` message
/// id. Sent with the `COMMIT`; it also fails, and so rolls the transaction
/// back, when a statement of the handler's failed and the handler went on.
const FINISH: &str = "DELETE FROM idem_consumer_failures WHERE consumer = $1 AND message_id = $2";

/// Counts a failed attempt: `$1` consumer, `$2` message id, `$3` its start (µs
/// since the epoch), `$4` the count that buries, `$5` the bury lock's class.
///
/// A dead letter is not counted: `dead` is its `published` and the times are
/// its own. Otherwise the attempt's time is appended, and the count that
/// reaches `$4` takes the consumer's bury lock (held to the end of the
/// transaction), so that the statement after it sees every earlier bury.
const COUNT: &str = "WITH dead AS (
        SELECT published, attempted_at FROM idem_consumer_dead_letters
        WHERE consumer = $1 AND message_id = $2
    ), counted AS (
        INSERT INTO idem_consumer_failures AS f
            (consumer, message_id, attempted_at, last_attempt_at)
        SELECT $1, $2, ARRAY[timestamptz 'epoch' + $3 * interval '1 microsecond'], now()
        WHERE NOT EXISTS (SELECT 1 FROM dead)
        ON CONFLICT (consumer, message_id) DO UPDATE SET
            attempted_at = f.attempted_at || excluded.attempted_at,
            last_attempt_at = excluded.last_attempt_at
        RETURNING f.attempted_at
    ), locked AS MATERIALIZED (
        SELECT pg_advisory_xact_lock($5, hashtext($1)) FROM counted
        WHERE cardinality(counted.attempted_at) >= $4
    )
    SELECT (SELECT published FROM dead) AS dead,
           ARRAY(SELECT (extract(epoch FROM u.t) * 1000000)::bigint
                 FROM (SELECT attempted_at FROM dead
                       UNION ALL SELECT attempted_at FROM counted) AS a,
                      unnest(a.attempted_at) WITH ORDINALITY AS u(t, i)
                 ORDER BY u.i) AS attempted_at,
           EXISTS (SELECT 1 FROM locked) AS bury";

/// Makes the message a dead letter with its counted attempts: `$1` consumer,
/// `$2` message id, `$3` the reason. Run under the consumer's bury lock, in a
/// snapshot taken after it, so the count includes every earlier bury and
/// concurrent buries each see their own. Answers whether it buried, the
/// consumer's dead letters, and (when it was dead already) `published`.
const BURY: &str = "WITH buried AS (
        INSERT INTO idem_consumer_dead_letters
            (consumer, message_id, reason, attempted_at, dead_at)
        SELECT f.consumer, f.message_id, $3, f.attempted_at, clock_timestamp()
        FROM idem_consumer_failures AS f WHERE f.consumer = $1 AND f.message_id = $2
        ON CONFLICT (consumer, message_id) DO NOTHING
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM buried) AS buried,
           (SELECT count(*) FROM idem_consumer_dead_letters WHERE consumer = $1)
               + (SELECT count(*) FROM buried) AS dead_letters,
           (SELECT published FROM idem_consumer_dead_letters
            WHERE consumer = $1 AND message_id = $2) AS published";

/// The columns of a `DeadLetterRow`.
const DEAD_LETTER_COLUMNS: &str = "consumer, message_id, reason, \
    ARRAY(SELECT (extract(epoch FROM u.t) * 1000000)::bigint \
          FROM unnest(attempted_at) WITH ORDINALITY AS u(t, i) ORDER BY u.i) AS attempted_at, \
    (extract(epoch FROM dead_at) * 1000000)::bigint AS dead_at, published";

/// Deletes up to `$1` processed messages, and up to `$1` failure rows, whose
/// last change is older than the retention (`$2` µs): by physical address,
/// found through the time indexes. Dead letters stay.
const DELETE_EXPIRED: &str = "WITH processed AS (
        DELETE FROM idem_consumer_inbox WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM idem_consumer_inbox
            WHERE processed_at <= now() - $2 * interval '1 microsecond' LIMIT $1))
        RETURNING 1
    ), abandoned AS (
        DELETE FROM idem_consumer_failures WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM idem_consumer_failures
            WHERE last_attempt_at <= now() - $2 * interval '1 microsecond' LIMIT $1))
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM processed) + (SELECT count(*) FROM abandoned) AS n";

/// The consumer inbox on PostgreSQL: each message applied once per consumer,
/// the handler's writes and the inbox row committed in one transaction.
///
/// It implements [`idem_core::consume::Inbox`]: hand it to a
/// [`Protocol`](idem_core::consume::Protocol) (or a broker crate built on
/// one), which decides what to do with each delivery. The handler gets the
/// inbox's open transaction as its [`AsyncPgConnection`]:
///
/// ```no_run
/// use idem_diesel::PgInbox;
/// use idem_diesel::diesel::sql_types::{BigInt, Text};
/// use idem_diesel::diesel_async::{AsyncPgConnection, RunQueryDsl};
/// use idem_diesel::idem_core::consume::{
///     Attempt, ConsumerPolicy, Decision, HandlerError, HandlerFuture, Message, Protocol, handler,
/// };
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = PgInbox::connect("postgres://app@db.internal/app").await?;
/// inbox.migrate().await?;
/// let protocol = Protocol::new("balances", inbox, ConsumerPolicy::new());
///
/// // Runs in the inbox's transaction: its writes commit with the inbox row.
/// let apply = handler(|attempt: Attempt<'_>, tx: &mut AsyncPgConnection| -> HandlerFuture<'_> {
///     Box::pin(async move {
///         let body = std::str::from_utf8(attempt.body()).map_err(HandlerError::permanent)?;
///         let amount: i64 = body.parse().map_err(HandlerError::permanent)?;
///         idem_diesel::diesel::sql_query("UPDATE accounts SET balance = balance + $2 WHERE id = $1")
///             .bind::<Text, _>("acc_1")
///             .bind::<BigInt, _>(amount)
///             .execute(tx)
///             .await?; // a CHECK violation here is permanent: dead-lettered at once
///         Ok(())
///     })
/// });
///
/// let message = Message::new("500").id("m-1");
/// match protocol.decide(&message, &apply).await {
///     Decision::Ack(_) => { /* acknowledge the delivery */ }
///     other => { /* retry, dead-letter or requeue it on the broker */ let _ = other; }
/// }
/// # Ok(())
/// # }
/// ```
///
/// Cheap to clone: clones share the pool. See the crate's README ("The
/// consumer inboxes") for what commits together, the tables, the errors it
/// classifies as permanent, and retention.
#[derive(Clone)]
pub struct PgInbox {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database<Postgres>,
    retention: Duration,
    statements: Statements,
}

/// The inbox's hot statements, kept prepared on every connection.
struct Statements {
    enter: Statement<InboxEnter>,
    finish: Statement<InboxFinish>,
    count: Statement<InboxCount>,
    bury: Statement<InboxBury>,
    advance: Statement<InboxAdvance>,
    enter_batch: Statement<InboxEnterBatch>,
    finish_batch: Statement<InboxFinishBatch>,
    commit: Statement<Commit>,
}

/// Configures a [`PgInbox`]: its retention and the pool it builds
/// ([`InboxBuilder`](crate::InboxBuilder), the same settings as SQLite's).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_diesel::PgInbox;
///
/// # async fn run() -> Result<(), idem_diesel::SetupError> {
/// let inbox = PgInbox::builder()
///     .retention(Duration::from_secs(3 * 24 * 3600))
///     .max_connections(16)
///     .connect("postgres://app@db.internal/app")
///     .await?;
/// inbox.migrate().await?;
/// # Ok(())
/// # }
/// ```
pub type PgInboxBuilder = InboxBuilder<Postgres>;

#[derive(QueryableByName)]
struct EnterRow {
    #[diesel(sql_type = Bool)]
    entered: bool,
    #[diesel(sql_type = Nullable<Bool>)]
    dead: Option<bool>,
    #[diesel(sql_type = Nullable<Binary>)]
    fingerprint: Option<Vec<u8>>,
    #[diesel(sql_type = Integer)]
    failures: i32,
}

#[derive(QueryableByName)]
struct EnterBatchRow {
    #[diesel(sql_type = BigInt)]
    n: i64,
    #[diesel(embed)]
    row: EnterRow,
}

#[derive(QueryableByName)]
struct CountRow {
    #[diesel(sql_type = Nullable<Bool>)]
    dead: Option<bool>,
    #[diesel(sql_type = Array<BigInt>)]
    attempted_at: Vec<i64>,
    #[diesel(sql_type = Bool)]
    bury: bool,
}

#[derive(QueryableByName)]
struct BuryRow {
    #[diesel(sql_type = Bool)]
    buried: bool,
    #[diesel(sql_type = BigInt)]
    dead_letters: i64,
    #[diesel(sql_type = Nullable<Bool>)]
    published: Option<bool>,
}

#[derive(QueryableByName)]
struct DeadLetterRow {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Text)]
    message_id: String,
    #[diesel(sql_type = Text)]
    reason: String,
    #[diesel(sql_type = Array<BigInt>)]
    attempted_at: Vec<i64>,
    #[diesel(sql_type = BigInt)]
    dead_at: i64,
    #[diesel(sql_type = Bool)]
    published: bool,
}

#[derive(QueryableByName)]
struct CountedRows {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

impl EnterRow {
    /// What the entry found.
    fn found(self) -> Found {
        match self.dead {
            Some(published) => Found::Dead { published },
            None if self.entered => Found::Entered {
                failures: self.failures,
            },
            None => Found::Applied(self.fingerprint.unwrap_or_default()),
        }
    }
}

/// The entry statement kept meeting concurrent entries of the message.
#[derive(Debug, thiserror::Error)]
#[error("the inbox entry kept meeting concurrent changes ({ENTER_ATTEMPTS} attempts)")]
struct EnterContended;

/// A statement that always answers one row answered none.
#[derive(Debug, thiserror::Error)]
#[error("an inbox statement answered no row")]
struct NoRow;

impl PgInbox {
    /// Connects to `url` with a pool of its own (10 connections) and the
    /// default retention (7 days). Fails if the database cannot be reached.
    /// Call [`migrate`](Self::migrate) once before use.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// An inbox over a pool the application already has (a `PgStore`'s, say),
    /// with the default retention.
    pub fn new(pool: PgPool) -> Self {
        Self::builder().build(pool)
    }

    /// Configures the retention and the pool.
    pub fn builder() -> PgInboxBuilder {
        InboxBuilder::new(10)
    }

    fn with_database(db: Database<Postgres>, builder: &PgInboxBuilder) -> Self {
        Self {
            inner: Arc::new(Inner {
                db,
                retention: builder.retention,
                statements: Statements {
                    enter: Statement::new(true, ENTER.to_owned()),
                    finish: Statement::new(true, FINISH.to_owned()),
                    count: Statement::new(true, COUNT.to_owned()),
                    bury: Statement::new(true, BURY.to_owned()),
                    advance: Statement::new(true, crate::positions::ADVANCE.to_owned()),
                    enter_batch: Statement::new(true, ENTER_BATCH.to_owned()),
                    finish_batch: Statement::new(true, FINISH_BATCH.to_owned()),
                    commit: Statement::new(true, "COMMIT".to_owned()),
                },
            }),
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.inner.db.pool
    }

    /// How long processed messages are remembered.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// Creates the inbox's tables (`idem_consumer_inbox`,
    /// `idem_consumer_failures`, `idem_consumer_dead_letters`) with its
    /// embedded diesel migrations. Safe to call from every instance at
    /// start-up: concurrent calls wait on an advisory lock.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        self.inner.db.migrate(MIGRATIONS, INBOX_TABLE).await
    }

    /// Checks that the inbox's tables exist with every column this version
    /// uses, so that a forgotten migration stops the consumer's start,
    /// naming the fix, instead of failing every message. [`migrate`](Self::migrate)
    /// makes it pass; call it at start-up when your own migration tool
    /// creates the tables. It fails with [`SetupError::InboxSchema`].
    pub async fn check_schema(&self) -> Result<(), SetupError> {
        let tables = INBOX_TABLES.map(str::to_owned);
        let db = &self.inner.db;
        db.check_schema(INBOX_TABLE, tables, check_inbox_columns)
            .await
    }

    /// A cleanup job that deletes processed messages and abandoned failure
    /// counts past the retention (never dead letters), one runner at a time
    /// across instances. (To sweep them in a store's job instead:
    /// `store.cleanup().also(inbox)`.)
    pub fn cleanup(&self) -> Cleanup<PgInbox> {
        Cleanup::new(self.clone()).lock(self.clone())
    }

    async fn connection(&self) -> Result<Pooled<'_, Postgres>, InboxError> {
        self.inner
            .db
            .connection()
            .await
            .map_err(consume::unavailable)
    }

    /// [`Inbox::process`]: enters the message, runs the handler and commits,
    /// on one pooled connection.
    ///
    /// With `advance` (a partition's record, [`Positions::process_advancing`](idem_core::consume::Positions::process_advancing)),
    /// the position's move is sent with the entry and the handler runs only
    /// if it moved.
    pub(crate) async fn process_on(
        &self,
        entry: &Entry<'_>,
        message: &Message,
        advance: Option<&Advance<'_>>,
        handler: &(dyn Handler<AsyncPgConnection> + '_),
    ) -> Result<Entered, InboxError> {
        let mut pooled = self.connection().await?;
        let connection: &mut AsyncPgConnection = &mut pooled;
        let (row, moved) = match self.enter(connection, entry, advance).await {
            Ok(entered) => entered,
            Err(error) => {
                roll_back(connection).await;
                return Err(InboxError::Unavailable(error));
            }
        };
        if let Some(published) = row.dead {
            roll_back(connection).await;
            return Ok(Entered::Dead { published });
        }
        if !row.entered {
            roll_back(connection).await;
            let same = row.fingerprint.as_deref() == Some(&entry.fingerprint.as_bytes()[..]);
            return Ok(if same {
                Entered::Duplicate
            } else {
                Entered::Reused
            });
        }
        let attempt = u32::try_from(row.failures).unwrap_or(0).saturating_add(1);
        if !moved {
            // Fenced: the partition has another owner; nothing is kept.
            roll_back(connection).await;
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
        let depth = transaction_depth(connection);
        if depth != 1 {
            roll_back(connection).await;
            let error = HandlerError::from(NestedOpen(depth.saturating_sub(1)));
            return Ok(Entered::Failed { attempt, error });
        }
        match self.finish(connection, entry).await {
            Ok(()) => Ok(Entered::Processed { attempt }),
            // Whether the commit landed is unknown: nothing is counted, the
            // redelivery finds out (a duplicate, or it runs).
            Err(error) if is_connection_error(&error) => Err(InboxError::unavailable(error)),
            // The transaction could not commit as the handler left it (one of
            // its statements failed and it went on; a deferred constraint):
            // its writes are rolled back, as for a handler error.
            Err(error) => Ok(Entered::Failed {
                attempt,
                error: HandlerError::from(error),
            }),
        }
    }

    /// [`Inbox::process_batch`]: enters the batch with one statement, runs
    /// the handler once on the new messages, and commits, on one pooled
    /// connection: two round trips (`BEGIN` with the entry, the cleanup
    /// with `COMMIT`) and the handler's, whatever the batch's size.
    async fn process_batch_on(
        &self,
        batch: &[BatchEntry<'_>],
        handler: &(dyn BatchHandler<AsyncPgConnection> + '_),
    ) -> Result<Batched, InboxError> {
        let Some(consumer) = consume::consumer_of(batch)? else {
            return Ok(Batched::Entered(Vec::new()));
        };
        let mut pooled = self.connection().await?;
        let connection: &mut AsyncPgConnection = &mut pooled;
        let rows = match self.enter_batch(connection, batch).await {
            Ok(rows) => rows,
            Err(error) => {
                roll_back(connection).await;
                return Err(InboxError::Unavailable(error));
            }
        };
        let (outcomes, new) = consume::entered(batch, rows.into_iter().map(EnterRow::found));
        if new.is_empty() {
            roll_back(connection).await;
            return Ok(Batched::Entered(outcomes));
        }
        let attempts = consume::attempts(batch, &new);
        let failed = match handler.handle(&attempts, connection).await {
            Err(error) => Some(error),
            Ok(()) => match transaction_depth(connection) {
                1 => None,
                depth => Some(HandlerError::from(NestedOpen(depth.saturating_sub(1)))),
            },
        };
        let failed = match failed {
            Some(error) => {
                roll_back(connection).await;
                Some(error)
            }
            None => {
                let ids: Vec<&str> = new
                    .iter()
                    .map(|&(i, _)| batch[i].entry.message_id)
                    .collect();
                match self.finish_batch(connection, consumer, &ids).await {
                    Ok(()) => None,
                    // Whether the commit landed is unknown: nothing is
                    // counted, the redeliveries find out.
                    Err(error) if is_connection_error(&error) => {
                        return Err(InboxError::unavailable(error));
                    }
                    Err(error) => Some(HandlerError::from(error)),
                }
            }
        };
        Ok(consume::batched(outcomes, &new, failed))
    }

    /// `BEGIN` and the batch's entry statement, sent together (one round
    /// trip), then the entry again for the messages a concurrent entry kept
    /// from settling. Leaves the transaction open. Answers a row per
    /// message, in the batch's order.
    async fn enter_batch(
        &self,
        connection: &mut AsyncPgConnection,
        batch: &[BatchEntry<'_>],
    ) -> Result<Vec<EnterRow>, BoxError> {
        mark_begun(connection)?;
        let statement = &self.inner.statements.enter_batch;
        let consumer = batch.first().map_or("", |item| item.entry.consumer);
        let mut rows: Vec<Option<EnterRow>> = batch.iter().map(|_| None).collect();
        let mut pending: Vec<usize> = (0..batch.len()).collect();
        for attempt in 0..ENTER_ATTEMPTS {
            let ids: Vec<&str> = pending.iter().map(|&i| batch[i].entry.message_id).collect();
            let fingerprints: Vec<&[u8]> = pending
                .iter()
                .map(|&i| &batch[i].entry.fingerprint.as_bytes()[..])
                .collect();
            let binds = statements::binds()
                .bind::<Text, _>(consumer)
                .bind::<Array<Text>, _>(&ids)
                .bind::<Array<Binary>, _>(&fingerprints);
            let enter = statement.rows::<_, EnterBatchRow>(connection, binds);
            let answered = if attempt == 0 {
                let (begun, answered) = tokio::join!(biased; begin(connection), enter);
                if let Err(error) = begun {
                    AnsiTransactionManager::transaction_manager_status_mut(connection)
                        .set_in_error();
                    return Err(error.into());
                }
                answered?
            } else {
                enter.await?
            };
            let mut unsettled = Vec::new();
            for answer in answered {
                let Some(&i) = usize::try_from(answer.n - 1)
                    .ok()
                    .and_then(|k| pending.get(k))
                else {
                    return Err(Box::new(NoRow));
                };
                let row = answer.row;
                if row.entered || row.dead.is_some() || row.fingerprint.is_some() {
                    rows[i] = Some(row);
                } else {
                    unsettled.push(i);
                }
            }
            if !unsettled.is_empty() {
                tracing::debug!(target: "idem", unsettled = unsettled.len(), "concurrent entries of a batch's messages committed; entering them again");
            }
            pending = unsettled;
            if pending.is_empty() {
                break;
            }
        }
        if !pending.is_empty() {
            return Err(Box::new(EnterContended));
        }
        rows.into_iter()
            .map(|row| row.ok_or_else(|| Box::new(NoRow) as BoxError))
            .collect()
    }

    /// Clears the batch's processed messages' failures and commits, sent
    /// together (one round trip). The transaction is over either way.
    async fn finish_batch(
        &self,
        connection: &mut AsyncPgConnection,
        consumer: &str,
        ids: &[&str],
    ) -> Result<(), DieselError> {
        let statements = &self.inner.statements;
        let binds = statements::binds()
            .bind::<Text, _>(consumer)
            .bind::<Array<Text>, _>(ids);
        let (finished, committed) = tokio::join!(
            biased;
            statements.finish_batch.run(connection, binds),
            statements.commit.run(connection, statements::binds()),
        );
        ended(connection);
        finished?;
        committed?;
        Ok(())
    }

    /// `BEGIN` and the entry statement, sent together (one round trip) with
    /// the position's move if there is one, the entry again while a
    /// concurrent entry keeps it from settling. Leaves the transaction open.
    /// Answers the entry and whether the position moved (`true` without a
    /// move).
    async fn enter(
        &self,
        connection: &mut AsyncPgConnection,
        entry: &Entry<'_>,
        advance: Option<&Advance<'_>>,
    ) -> Result<(EnterRow, bool), BoxError> {
        mark_begun(connection)?;
        let statements = &self.inner.statements;
        let statement = &statements.enter;
        let mut moved = true;
        for attempt in 0..ENTER_ATTEMPTS {
            let binds = statements::binds()
                .bind::<Text, _>(entry.consumer)
                .bind::<Text, _>(entry.message_id)
                .bind::<Binary, _>(&entry.fingerprint.as_bytes()[..]);
            let enter = statement.row::<_, EnterRow>(connection, binds);
            let row = if attempt == 0 {
                let advanced = async {
                    match advance {
                        Some(advance) => {
                            let binds = statements::binds()
                                .bind::<Text, _>(advance.consumer)
                                .bind::<Text, _>(advance.topic)
                                .bind::<Integer, _>(advance.partition)
                                .bind::<BigInt, _>(advance.to)
                                .bind::<BigInt, _>(advance.from.unwrap_or(-1));
                            Some(statements.advance.run(connection, binds).await)
                        }
                        None => None,
                    }
                };
                // `BEGIN` is polled first, so it is sent first; the move
                // last, so that it waits for the position's lock (a member
                // that lost the partition waits for the new owner's commit)
                // after the entry.
                let (begun, row, advanced) =
                    tokio::join!(biased; begin(connection), enter, advanced);
                if let Err(error) = begun {
                    // Whatever the server did, the pool must not reuse it.
                    AnsiTransactionManager::transaction_manager_status_mut(connection)
                        .set_in_error();
                    return Err(error.into());
                }
                // The entry's own error first: a move behind a failed entry
                // only reports the aborted transaction.
                let row = row?;
                if let Some(advanced) = advanced {
                    moved = advanced? == 1;
                }
                row
            } else {
                enter.await?
            };
            match row {
                Some(row) if row.entered || row.dead.is_some() || row.fingerprint.is_some() => {
                    return Ok((row, moved));
                }
                _ => tracing::debug!(
                    target: "idem",
                    message_id = %Redacted::of(entry.message_id),
                    "a concurrent entry of the message committed; entering again"
                ),
            }
        }
        Err(Box::new(EnterContended))
    }

    /// Clears the message's failures and commits, sent together (one round
    /// trip). The transaction is over either way.
    async fn finish(
        &self,
        connection: &mut AsyncPgConnection,
        entry: &Entry<'_>,
    ) -> Result<(), DieselError> {
        let statements = &self.inner.statements;
        let binds = statements::binds()
            .bind::<Text, _>(entry.consumer)
            .bind::<Text, _>(entry.message_id);
        // Both wait their turn for the connection's statement cache, which the
        // first takes first: the `COMMIT` cannot overtake it. When it fails,
        // the `COMMIT` behind it rolls back.
        let (finished, committed) = tokio::join!(
            biased;
            statements.finish.run(connection, binds),
            statements.commit.run(connection, statements::binds()),
        );
        ended(connection);
        finished?;
        committed?;
        Ok(())
    }

    /// [`Inbox::fail`], on one pooled connection.
    async fn fail_on(
        &self,
        entry: &Entry<'_>,
        failure: &Failure<'_>,
    ) -> Result<Counted, InboxError> {
        let mut pooled = self.connection().await?;
        let connection: &mut AsyncPgConnection = &mut pooled;
        let counted = self.count(connection, entry, failure).await;
        if counted.is_err() {
            roll_back(connection).await;
        }
        counted
    }

    async fn count(
        &self,
        connection: &mut AsyncPgConnection,
        entry: &Entry<'_>,
        failure: &Failure<'_>,
    ) -> Result<Counted, InboxError> {
        let statements = &self.inner.statements;
        mark_begun(connection).map_err(InboxError::unavailable)?;
        let binds = statements::binds()
            .bind::<Text, _>(entry.consumer)
            .bind::<Text, _>(entry.message_id)
            .bind::<BigInt, _>(micros(entry.at))
            .bind::<Integer, _>(i32::try_from(failure.bury_at.max(1)).unwrap_or(i32::MAX))
            .bind::<Integer, _>(BURY_LOCK_CLASS);
        let count = statements.count.row::<_, CountRow>(connection, binds);
        let (begun, row) = tokio::join!(biased; begin(connection), count);
        if let Err(error) = begun {
            AnsiTransactionManager::transaction_manager_status_mut(connection).set_in_error();
            return Err(InboxError::unavailable(error));
        }
        let row = row
            .map_err(InboxError::unavailable)?
            .ok_or_else(|| InboxError::unavailable(NoRow))?;
        let attempted_at = row
            .attempted_at
            .into_iter()
            .map(time)
            .collect::<Result<Vec<SystemTime>, _>>()?;
        let attempts = u32::try_from(attempted_at.len()).unwrap_or(u32::MAX);
        let counted = |buried| Counted {
            attempts,
            attempted_at: attempted_at.clone(),
            buried,
        };
        if let Some(published) = row.dead {
            roll_back(connection).await;
            return Ok(counted(Some(Buried::Already { published })));
        }
        if !row.bury {
            AnsiTransactionManager::commit_transaction(connection)
                .await
                .map_err(InboxError::unavailable)?;
            return Ok(counted(None));
        }
        // The consumer's bury lock is held: bury and commit, in one round trip.
        let binds = statements::binds()
            .bind::<Text, _>(entry.consumer)
            .bind::<Text, _>(entry.message_id)
            .bind::<Text, _>(failure.reason);
        let (buried, committed) = tokio::join!(
            biased;
            statements.bury.row::<_, BuryRow>(connection, binds),
            statements.commit.run(connection, statements::binds()),
        );
        ended(connection);
        let buried = buried
            .map_err(InboxError::unavailable)?
            .ok_or_else(|| InboxError::unavailable(NoRow))?;
        committed.map_err(InboxError::unavailable)?;
        Ok(counted(Some(if buried.buried {
            Buried::New {
                dead_letters: u64::try_from(buried.dead_letters).unwrap_or(0),
            }
        } else {
            Buried::Already {
                published: buried.published.unwrap_or(false),
            }
        })))
    }

    async fn letters(
        &self,
        sql: String,
        consumer: &str,
        message_id: Option<&str>,
    ) -> Result<Vec<DeadLetter>, InboxError> {
        let mut connection = self.connection().await?;
        let query = diesel::sql_query(sql).bind::<Text, _>(consumer);
        let rows = match message_id {
            Some(message_id) => {
                query
                    .bind::<Text, _>(message_id)
                    .prepared()
                    .load::<DeadLetterRow>(&mut *connection)
                    .await
            }
            None => {
                query
                    .prepared()
                    .load::<DeadLetterRow>(&mut *connection)
                    .await
            }
        }
        .map_err(InboxError::unavailable)?;
        rows.into_iter().map(DeadLetterRow::into_letter).collect()
    }
}

impl InboxBuilder<Postgres> {
    /// Builds a pool for `url` and checks that it connects.
    pub async fn connect(self, url: &str) -> Result<PgInbox, SetupError> {
        let db = Database::open(url, &self.pool).await?;
        Ok(PgInbox::with_database(db, &self))
    }

    /// An inbox over a pool the application already has.
    pub fn build(self, pool: PgPool) -> PgInbox {
        PgInbox::with_database(Database::over(pool, &self.pool), &self)
    }
}

impl Inbox for PgInbox {
    type Tx = AsyncPgConnection;
    const TRANSACTIONAL: bool = true;
    const BATCHES: bool = true;

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<AsyncPgConnection> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(self.process_on(entry, message, None, handler))
    }

    fn process_batch<'a>(
        &'a self,
        batch: &'a [BatchEntry<'a>],
        handler: &'a (dyn BatchHandler<AsyncPgConnection> + 'a),
    ) -> InboxFuture<'a, Batched> {
        Box::pin(self.process_batch_on(batch, handler))
    }

    fn fail<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        failure: &'a Failure<'a>,
    ) -> InboxFuture<'a, Counted> {
        Box::pin(self.fail_on(entry, failure))
    }

    fn published<'a>(&'a self, consumer: &'a str, message_id: &'a str) -> InboxFuture<'a, ()> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            diesel::sql_query(
                "UPDATE idem_consumer_dead_letters SET published = true \
                 WHERE consumer = $1 AND message_id = $2",
            )
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(message_id)
            .prepared()
            .execute(&mut *connection)
            .await
            .map(drop)
            .map_err(InboxError::unavailable)
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
                 WHERE consumer = $1 AND message_id = $2"
            );
            let letters = self.letters(sql, consumer, Some(message_id)).await?;
            Ok(letters.into_iter().next())
        })
    }

    fn dead_letters<'a>(&'a self, consumer: &'a str) -> InboxFuture<'a, Vec<DeadLetter>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT {DEAD_LETTER_COLUMNS} FROM idem_consumer_dead_letters \
                 WHERE consumer = $1 ORDER BY dead_at, message_id"
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
            // The failures go only with the dead letter: a message that is
            // not dead keeps its count.
            let sql = format!(
                "WITH gone AS (
                    DELETE FROM idem_consumer_dead_letters
                    WHERE consumer = $1 AND message_id = $2 RETURNING *
                 ), cleared AS (
                    DELETE FROM idem_consumer_failures AS f
                    WHERE f.consumer = $1 AND f.message_id = $2
                      AND EXISTS (SELECT 1 FROM gone)
                 )
                 SELECT {DEAD_LETTER_COLUMNS} FROM gone"
            );
            let letters = self.letters(sql, consumer, Some(message_id)).await?;
            Ok(letters.into_iter().next())
        })
    }

    fn is_permanent(&self, error: &(dyn std::error::Error + 'static)) -> bool {
        consume::is_permanent(error)
    }

    fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.inner.db.schema_gate.inbox_readiness("PgInboxBuilder")
    }
}

impl ExpiredRows for PgInbox {
    fn sweep_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let mut connection = self.inner.db.connection().await?;
            let deleted = diesel::sql_query(DELETE_EXPIRED)
                .bind::<BigInt, _>(i64::try_from(batch).unwrap_or(i64::MAX))
                .bind::<BigInt, _>(crate::row::duration_micros(self.inner.retention))
                .prepared()
                .get_result::<CountedRows>(&mut *connection)
                .await
                .map_err(StoreError::unavailable)?;
            Ok(u64::try_from(deleted.n).unwrap_or(0))
        })
    }
}

/// One inbox sweep at a time, across instances: a session-scoped advisory lock
/// keyed by the inbox's table, on a connection of its own.
impl SweepLock for PgInbox {
    fn try_lock(&self) -> StoreFuture<'_, Option<SweepGuard>> {
        Box::pin(self.inner.db.sweep_lock(INBOX_TABLE.to_owned()))
    }
}

impl fmt::Debug for PgInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgInbox")
            .field("retention", &self.inner.retention)
            .field("pool", &self.inner.db.state())
            .finish_non_exhaustive()
    }
}

impl DeadLetterRow {
    fn into_letter(self) -> Result<DeadLetter, InboxError> {
        let attempted_at = self
            .attempted_at
            .into_iter()
            .map(time)
            .collect::<Result<Vec<_>, _>>()?;
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

/// Counts the transaction as ended after a `COMMIT` sent as a statement: a
/// `COMMIT` that fails rolls back, so it is over either way.
pub(super) fn ended(connection: &mut AsyncPgConnection) {
    if let Ok(status) =
        AnsiTransactionManager::transaction_manager_status_mut(connection).transaction_state()
    {
        let _ = status.change_transaction_depth(TransactionDepthChange::DecreaseDepth);
    }
}

/// Whether `error` says the connection failed (so the commit's outcome is
/// unknown), rather than that the database refused the transaction.
fn is_connection_error(error: &DieselError) -> bool {
    !matches!(
        error,
        DieselError::DatabaseError(kind, _)
            if !matches!(
                kind,
                DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand
            )
    )
}
