//! [`PgOutbox`]: the transactional outbox on PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Binary, Integer, Nullable, Text, Uuid as SqlUuid};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};
use futures_util::StreamExt;
use idem_core::StoreError;
use idem_core::cleanup::{Cleanup, ExpiredRows, SweepGuard, SweepLock};
use idem_core::outbox::{Event, Publish};
use idem_core::store::{NotReady, StoreFuture};

use super::consumer_inbox::ended;
use super::statements::{
    self, Commit, OutboxSettle, OutboxStage, OutboxStageQuiet, OutboxTake, Statement,
};
use super::transactional::mark_begun;
use super::{PgPool, roll_back};
use crate::database::{Database, Pooled};
use crate::outbox::{
    Backlog, Batch, BoxFuture, OUTBOX_TABLE, Outbox, OutboxBuilder, ParkedEvent, Postgres, Relay,
    Settlement, Source, Taken,
};
use crate::prepared::PreparedExt;
use crate::row::{duration_micros, time_from_micros};
use crate::{SetupError, outbox};

/// The outbox on PostgreSQL: [`Outbox`] over a [`PgPool`].
pub type PgOutbox = Outbox<Postgres>;

impl outbox::Backend for Postgres {
    type Pool = PgPool;
}

/// The channel a committed stage notifies.
const CHANNEL: &str = "idem_outbox";

/// The migrations that create the outbox's table.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres_outbox");

/// Stages an event: `$1` id, `$2` destination, `$3` key, `$4` payload, `$5`
/// headers. Notifies the relays, which hear it when the transaction commits
/// (and not at all if it rolls back).
const STAGE: &str = "WITH staged AS (
        INSERT INTO idem_outbox (id, destination, key, payload, headers)
        VALUES ($1, $2, $3, $4, $5) RETURNING 1
    )
    SELECT pg_notify('idem_outbox', '') FROM staged";

/// [`STAGE`] without the notification.
const STAGE_QUIET: &str = "INSERT INTO idem_outbox (id, destination, key, payload, headers)
    VALUES ($1, $2, $3, $4, $5)";

/// A relay's batch, `$1` events at most: the events whose turn it is (the
/// earliest unsent event of their destination and key; due), locked for this
/// relay and skipped by the others (`SKIP LOCKED`), with the events behind
/// them in their key, which the others leave alone since an earlier one of
/// their key is unsent.
///
/// Written so that its one sensible plan is the indexes' whatever the
/// statistics say: a table filled by a burst since it was last analyzed
/// looks empty to the planner (its unsent rows estimated at one), and the
/// former `NOT EXISTS` anti-join then compared every candidate with every
/// unsent row (870 ms for a batch of 100 out of 20,000 unsent, against 2 ms
/// now). A head is found by one index probe of its key (the scalar
/// subquery: the first unsent event at or after its destination and key in
/// the key index's order, which is the earliest of its key since the
/// candidate itself is one; written as a row comparison in that order so
/// that no other index can serve it: asked for the key's events by position,
/// the planner walked the unsent events' position index and filtered each
/// one's key, 57 buffers a probe and 6 ms a take of 100 behind 20,000 sent
/// events, against 4 buffers and 2.6 ms now), the events behind it by one
/// bounded range each: when `$1` heads were found, the batch's `$1` earliest
/// events are all at or before the last head, so no key is read past it.
const TAKE: &str = "WITH heads AS (
        SELECT o.position, o.destination, o.key FROM idem_outbox AS o
        WHERE o.sent_at IS NULL AND o.parked_at IS NULL AND o.next_attempt_at <= now()
          AND o.position = (
              SELECT e.position FROM idem_outbox AS e
              WHERE (e.destination, e.key) >= (o.destination, o.key)
                AND e.sent_at IS NULL AND e.parked_at IS NULL
              ORDER BY e.destination, e.key, e.position LIMIT 1)
        ORDER BY o.position LIMIT $1
        FOR UPDATE OF o SKIP LOCKED
    ), bound AS (
        SELECT CASE WHEN count(*) < $1 THEN 9223372036854775807 ELSE max(position) END AS last
        FROM heads
    )
    SELECT f.position, f.id, f.destination, f.key, f.payload, f.headers, f.attempts
    FROM heads AS h CROSS JOIN bound AS b CROSS JOIN LATERAL (
        SELECT o.position, o.id, o.destination, o.key, o.payload, o.headers, o.attempts
        FROM idem_outbox AS o
        WHERE o.destination = h.destination AND o.key = h.key
          AND o.sent_at IS NULL AND o.parked_at IS NULL
          AND o.position >= h.position AND o.position <= b.last
        ORDER BY o.position LIMIT $1) AS f
    ORDER BY f.position LIMIT $1";

/// Opens a batch's transaction, sent with [`TAKE`] (one round trip), for
/// the plan [`TAKE`] is written for: the ordered scan of the unsent events'
/// index, which stops once it has found its heads. Left to the statistics,
/// the planner may read the whole table instead: it takes a head for one
/// unsent event in 200 (its default for the head test), when a backlog of
/// 20,000 over 1,000 keys has one in 20, and sorts what it read (70 ms a
/// batch, against 1 ms). Sequential scans and sorts are priced out for this
/// transaction alone, and JIT, which their price would otherwise start
/// (200 ms), is off.
async fn begin_take(connection: &AsyncPgConnection) -> diesel::QueryResult<()> {
    let mut connection = connection;
    SimpleAsyncConnection::batch_execute(
        &mut connection,
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_sort = off; SET LOCAL jit = off",
    )
    .await
}

/// What became of a batch: `$1` positions sent; `$2`, `$3` positions parked
/// and why; `$4`, `$5` positions to try again and after how long (µs).
const SETTLE: &str = "WITH sent AS (
        UPDATE idem_outbox SET sent_at = now() WHERE position = ANY($1) RETURNING 1
    ), parked AS (
        UPDATE idem_outbox AS o
        SET parked_at = now(), reason = p.reason, attempts = o.attempts + 1
        FROM unnest($2::bigint[], $3::text[]) AS p(position, reason)
        WHERE o.position = p.position RETURNING 1
    ), retried AS (
        UPDATE idem_outbox AS o
        SET attempts = o.attempts + 1,
            next_attempt_at = clock_timestamp() + r.delay * interval '1 microsecond'
        FROM unnest($4::bigint[], $5::bigint[]) AS r(position, delay)
        WHERE o.position = r.position RETURNING 1
    )
    SELECT (SELECT count(*) FROM sent) + (SELECT count(*) FROM parked)
         + (SELECT count(*) FROM retried) AS n";

#[derive(QueryableByName)]
struct EventRow {
    #[diesel(sql_type = BigInt)]
    position: i64,
    #[diesel(sql_type = SqlUuid)]
    id: uuid::Uuid,
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
const OLDEST_UNSENT: &str = "SELECT (
        SELECT (extract(epoch FROM clock_timestamp() - staged_at) * 1000000)::bigint
        FROM idem_outbox WHERE sent_at IS NULL AND parked_at IS NULL
        ORDER BY position LIMIT 1) AS oldest_us";

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
    #[diesel(sql_type = SqlUuid)]
    id: uuid::Uuid,
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

/// A staged event's headers could not be read back.
#[derive(Debug, thiserror::Error)]
#[error("an outbox event's headers are not in their encoding")]
struct CorruptHeaders;

type OwnedConnection =
    bb8::PooledConnection<'static, AsyncDieselConnectionManager<AsyncPgConnection>>;

/// The relay's statements, kept prepared on every connection.
struct PgSource {
    outbox: PgOutbox,
    take: Statement<OutboxTake>,
    settle: Arc<Statement<OutboxSettle>>,
    commit: Arc<Statement<Commit>>,
}

struct PgBatch {
    connection: OwnedConnection,
    events: Vec<Taken>,
    settle: Arc<Statement<OutboxSettle>>,
    commit: Arc<Statement<Commit>>,
}

impl Outbox<Postgres> {
    /// Connects to `url` with a pool of its own (4 connections) and the
    /// default retention of sent events (24 h). Call
    /// [`migrate`](Self::migrate) once before use.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        Self::builder().connect(url).await
    }

    /// An outbox over a pool the application already has (a `PgStore`'s,
    /// say).
    pub fn new(pool: PgPool) -> Self {
        Self::builder().build(pool)
    }

    /// Creates the outbox's table (`idem_outbox`) with its embedded diesel
    /// migration. Safe to call from every instance at start-up.
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

    /// Stages `event` in the transaction open on `connection`: one statement,
    /// which commits with the transaction or not at all. It takes the
    /// connection shared, so it can be pipelined with the caller's own
    /// statements (`tokio::join!` of both, sent without waiting in between).
    ///
    /// On a connection outside a transaction, the event is staged at once,
    /// on its own.
    pub async fn stage(
        &self,
        connection: &AsyncPgConnection,
        event: &Event,
    ) -> diesel::QueryResult<()> {
        let headers = event.encode_headers();
        let binds = statements::binds()
            .bind::<SqlUuid, _>(event.id())
            .bind::<Text, _>(event.destination())
            .bind::<Text, _>(event.key())
            .bind::<Binary, _>(&event.payload()[..])
            .bind::<Binary, _>(headers);
        if self.inner.notify {
            stage_statement().run(connection, binds).await?;
        } else {
            stage_quiet_statement().run(connection, binds).await?;
        }
        self.count_staged(event);
        Ok(())
    }

    /// A relay that publishes this outbox's events with `publisher`. Several
    /// may run at once, in one process or many: each event is taken by one
    /// of them at a time. Refused until [`migrate`](Self::migrate) or
    /// [`check_schema`](Self::check_schema) passed in this process (or the
    /// builder's `skip_schema_check`): the error names the fix.
    pub fn relay<P: Publish>(&self, publisher: P) -> Result<Relay<P>, NotReady> {
        self.readiness()?;
        Ok(Relay::new(
            Arc::new(PgSource {
                outbox: self.clone(),
                take: Statement::new(true, TAKE.to_owned()),
                settle: Arc::new(Statement::new(true, SETTLE.to_owned())),
                commit: Arc::new(Statement::new(true, "COMMIT".to_owned())),
            }),
            publisher,
        ))
    }

    /// What is waiting: unsent and parked events, and the age of the oldest
    /// unsent one.
    pub async fn backlog(&self) -> Result<Backlog, StoreError> {
        let mut connection = self.connection().await?;
        let row = diesel::sql_query(
            "SELECT (SELECT count(*) FROM idem_outbox
                     WHERE sent_at IS NULL AND parked_at IS NULL) AS unsent,
                    (SELECT count(*) FROM idem_outbox WHERE parked_at IS NOT NULL) AS parked,
                    (SELECT (extract(epoch FROM clock_timestamp() - staged_at) * 1000000)::bigint
                     FROM idem_outbox WHERE sent_at IS NULL AND parked_at IS NULL
                     ORDER BY position LIMIT 1) AS oldest_us",
        )
        .prepared()
        .get_result::<BacklogRow>(&mut *connection)
        .await
        .map_err(StoreError::unavailable)?;
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
        let mut connection = self.connection().await?;
        let rows = diesel::sql_query(
            "SELECT id, destination, key, reason, attempts,
                    (extract(epoch FROM parked_at) * 1000000)::bigint AS parked_at
             FROM idem_outbox WHERE parked_at IS NOT NULL ORDER BY position",
        )
        .prepared()
        .load::<ParkedRow>(&mut *connection)
        .await
        .map_err(StoreError::unavailable)?;
        rows.into_iter()
            .map(|row| {
                Ok(ParkedEvent {
                    id: row.id,
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
    /// unsent or parked ones), one runner at a time across instances. (To
    /// sweep them in a store's job instead: `store.cleanup().also(outbox)`.)
    pub fn cleanup(&self) -> Cleanup<PgOutbox> {
        Cleanup::new(self.clone()).lock(self.clone())
    }

    async fn connection(&self) -> Result<Pooled<'_, Postgres>, StoreError> {
        self.inner.db.connection().await
    }
}

impl OutboxBuilder<Postgres> {
    /// Whether staging notifies the relays when the transaction commits
    /// (default `true`). `NOTIFY` serializes the commits that use it across
    /// the database; without it relays find events by polling.
    pub fn notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// Builds a pool for `url` and checks that it connects.
    pub async fn connect(self, url: &str) -> Result<PgOutbox, SetupError> {
        let db = Database::open(url, &self.pool).await?;
        Ok(Outbox::with_database(db, &self))
    }

    /// An outbox over a pool the application already has.
    pub fn build(self, pool: PgPool) -> PgOutbox {
        Outbox::with_database(Database::over(pool, &self.pool), &self)
    }
}

/// The stage statements, shared by every outbox of the process (they name one
/// table), so that each connection prepares them once.
fn stage_statement() -> &'static Statement<OutboxStage> {
    static STATEMENT: std::sync::OnceLock<Statement<OutboxStage>> = std::sync::OnceLock::new();
    STATEMENT.get_or_init(|| Statement::new(true, STAGE.to_owned()))
}

fn stage_quiet_statement() -> &'static Statement<OutboxStageQuiet> {
    static STATEMENT: std::sync::OnceLock<Statement<OutboxStageQuiet>> = std::sync::OnceLock::new();
    STATEMENT.get_or_init(|| Statement::new(true, STAGE_QUIET.to_owned()))
}

impl Source for PgSource {
    fn take(&self, limit: usize) -> BoxFuture<'_, Result<Box<dyn Batch>, StoreError>> {
        Box::pin(async move {
            let inner = &self.outbox.inner;
            let mut connection = inner.db.connection_owned().await?;
            let rows = {
                let connection: &mut AsyncPgConnection = &mut connection;
                mark_begun(connection).map_err(StoreError::unavailable)?;
                let binds =
                    statements::binds().bind::<BigInt, _>(i64::try_from(limit).unwrap_or(i64::MAX));
                let take = self.take.rows::<_, EventRow>(connection, binds);
                let (begun, rows) = tokio::join!(biased; begin_take(connection), take);
                if let Err(error) = begun {
                    AnsiTransactionManager::transaction_manager_status_mut(connection)
                        .set_in_error();
                    return Err(StoreError::unavailable(error));
                }
                match rows {
                    Ok(rows) if rows.is_empty() => {
                        roll_back(connection).await;
                        rows
                    }
                    Ok(rows) => rows,
                    Err(error) => {
                        roll_back(connection).await;
                        return Err(StoreError::unavailable(error));
                    }
                }
            };
            let mut events = Vec::with_capacity(rows.len());
            for row in rows {
                let headers = Event::decode_headers(&row.headers)
                    .ok_or_else(|| StoreError::unavailable(CorruptHeaders))?;
                events.push(Taken {
                    position: row.position,
                    attempts: u32::try_from(row.attempts).unwrap_or(0),
                    event: Event::staged(row.id, row.destination, row.key, row.payload, headers),
                });
            }
            Ok(Box::new(PgBatch {
                connection,
                events,
                settle: Arc::clone(&self.settle),
                commit: Arc::clone(&self.commit),
            }) as Box<dyn Batch>)
        })
    }

    fn woken(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.outbox.inner.wake.notified())
    }

    fn wakes_early(&self) -> bool {
        false
    }

    fn batches_at_once(&self) -> usize {
        usize::MAX
    }

    #[cfg(feature = "metrics")]
    fn oldest_unsent(&self) -> BoxFuture<'_, Result<Option<Duration>, StoreError>> {
        Box::pin(async move {
            let mut connection = self.outbox.connection().await?;
            let row = diesel::sql_query(OLDEST_UNSENT)
                .prepared()
                .get_result::<OldestRow>(&mut *connection)
                .await
                .map_err(StoreError::unavailable)?;
            Ok(row
                .oldest_us
                .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))))
        })
    }

    fn listen(&self, poll_interval: Duration) -> Option<BoxFuture<'static, ()>> {
        if !self.outbox.inner.notify {
            return None;
        }
        let outbox = self.outbox.clone();
        Some(Box::pin(async move {
            loop {
                match listen(&outbox).await {
                    Ok(()) => {}
                    Err(error) => tracing::debug!(
                        target: "idem",
                        error = %idem_core::log::error_chain(&error),
                        "the outbox relay's LISTEN connection failed; polling meanwhile"
                    ),
                }
                tokio::time::sleep(poll_interval).await;
            }
        }))
    }
}

/// Listens for staged events on a connection of its own, waking the relay,
/// until the connection fails (checked every 30 s).
async fn listen(outbox: &PgOutbox) -> Result<(), StoreError> {
    let mut connection = outbox.inner.db.dedicated().await?;
    connection
        .batch_execute(&format!("LISTEN {CHANNEL}"))
        .await
        .map_err(StoreError::unavailable)?;
    // Events committed before the LISTEN took effect: look once.
    outbox.inner.wake.notify_one();
    loop {
        {
            let mut notifications = std::pin::pin!(connection.notifications_stream());
            let check = tokio::time::sleep(Duration::from_secs(30));
            let mut check = std::pin::pin!(check);
            loop {
                tokio::select! {
                    notification = notifications.next() => match notification {
                        Some(Ok(_)) => outbox.inner.wake.notify_one(),
                        Some(Err(error)) => return Err(StoreError::unavailable(error)),
                        None => return Ok(()),
                    },
                    () = &mut check => break,
                }
            }
        }
        connection
            .batch_execute("SELECT 1")
            .await
            .map_err(StoreError::unavailable)?;
    }
}

impl Batch for PgBatch {
    fn events(&self) -> &[Taken] {
        &self.events
    }

    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        Box::pin(async move {
            let PgBatch {
                mut connection,
                settle,
                commit,
                ..
            } = *self;
            let connection: &mut AsyncPgConnection = &mut connection;
            let (parked, reasons): (Vec<i64>, Vec<String>) = settlement.parked.into_iter().unzip();
            let (retried, delays): (Vec<i64>, Vec<i64>) = settlement.retried.into_iter().unzip();
            let binds = statements::binds()
                .bind::<Array<BigInt>, _>(settlement.sent)
                .bind::<Array<BigInt>, _>(parked)
                .bind::<Array<Text>, _>(reasons)
                .bind::<Array<BigInt>, _>(retried)
                .bind::<Array<BigInt>, _>(delays);
            // The `COMMIT` is sent right behind the settlement (one round
            // trip); when the settlement fails, it rolls back.
            let (settled, committed) = tokio::join!(
                biased;
                settle.run(connection, binds),
                commit.run(connection, statements::binds()),
            );
            ended(connection);
            settled.map_err(StoreError::unavailable)?;
            committed.map_err(StoreError::unavailable)?;
            Ok(())
        })
    }
}

impl ExpiredRows for PgOutbox {
    fn sweep_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let mut connection = self.connection().await?;
            let deleted = diesel::sql_query(
                "DELETE FROM idem_outbox WHERE ctid = ANY(ARRAY(
                     SELECT ctid FROM idem_outbox
                     WHERE sent_at <= now() - $2 * interval '1 microsecond' LIMIT $1))",
            )
            .bind::<BigInt, _>(i64::try_from(batch).unwrap_or(i64::MAX))
            .bind::<BigInt, _>(duration_micros(self.inner.retention))
            .prepared()
            .execute(&mut *connection)
            .await
            .map_err(StoreError::unavailable)?;
            Ok(u64::try_from(deleted).unwrap_or(u64::MAX))
        })
    }
}

/// One outbox sweep at a time, across instances: a session-scoped advisory
/// lock keyed by the outbox's table, on a connection of its own.
impl SweepLock for PgOutbox {
    fn try_lock(&self) -> StoreFuture<'_, Option<SweepGuard>> {
        Box::pin(self.inner.db.sweep_lock(OUTBOX_TABLE.to_owned()))
    }
}
