//! Where each partition's position lives: a row per consumer, topic and
//! partition in the inbox's database, `idem_kafka_offsets`, written in the
//! same transaction as the effect and the inbox row.
//!
//! The row holds the partition's **next** offset (the offset after the last
//! record applied). Every write is fenced: it moves the row from the offset
//! the writer last saw to the next one, and writes nothing when the row holds
//! anything else, because then another member owns the partition now and has
//! moved it. A write that finds no row inserts it (the partition's first
//! record), unless another member inserted it first.
//!
//! A row already at the write's target counts as written: that is the row
//! after this writer's own COMMIT that landed but whose answer was lost (the
//! retry of a commit that succeeded), or after another member applied the
//! same record; either way the record is done and the partition goes on from
//! there. (Whoever moved it, the record's effect is the inbox's to keep once:
//! its row is in the same transaction.)

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;

use idem_core::consume::{Inbox, InboxError};
use idem_diesel::diesel::result::QueryResult;
use idem_diesel::diesel::sql_types::{BigInt, Integer, Text};
use idem_diesel::diesel::{self, QueryableByName};
use idem_diesel::diesel_async::{RunQueryDsl, SimpleAsyncConnection};

/// What an offsets step answers.
pub type OffsetsFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The table, created if missing (the same text on both databases).
macro_rules! schema {
    () => {
        "CREATE TABLE IF NOT EXISTS idem_kafka_offsets (
            consumer TEXT NOT NULL,
            topic TEXT NOT NULL,
            partition_id INTEGER NOT NULL,
            next_offset BIGINT NOT NULL,
            PRIMARY KEY (consumer, topic, partition_id)
        )"
    };
}

/// On PostgreSQL, under an advisory lock: two `CREATE TABLE IF NOT EXISTS`
/// at once (two consumers starting together) can both miss the table and
/// collide in the catalog.
#[cfg(feature = "postgres")]
const PG_SCHEMA: &str = concat!(
    "BEGIN; SELECT pg_advisory_xact_lock(hashtext('idem_kafka_offsets')); ",
    schema!(),
    "; COMMIT;"
);

/// On SQLite: writers take turns already.
#[cfg(feature = "sqlite")]
const SQLITE_SCHEMA: &str = schema!();

const POSITIONS: &str = "SELECT partition_id, next_offset FROM idem_kafka_offsets
    WHERE consumer = $1 AND topic = $2";

/// The fenced move (`$1` consumer, `$2` topic, `$3` partition, `$4` the next
/// offset, `$5` the offset the writer saw, `-1` for none): in this order,
/// because SQLite numbers parameters as they first appear. A row already at
/// `$4` is rewritten with the same value, so the move counts one row.
const ADVANCE: &str = "INSERT INTO idem_kafka_offsets (consumer, topic, partition_id, next_offset)
    VALUES ($1, $2, $3, $4)
    ON CONFLICT (consumer, topic, partition_id) DO UPDATE SET next_offset = excluded.next_offset
    WHERE idem_kafka_offsets.next_offset IN ($5, excluded.next_offset)";

/// One partition's move, from the offset its owner saw to the next one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advance<'a> {
    /// The consumer's name (the inbox's).
    pub consumer: &'a str,
    /// The topic.
    pub topic: &'a str,
    /// The partition.
    pub partition: i32,
    /// The next offset the row held when this owner last read or wrote it;
    /// `None` when it had no row.
    pub from: Option<i64>,
    /// The offset after the record applied.
    pub to: i64,
}

#[derive(QueryableByName)]
struct PositionRow {
    #[diesel(sql_type = Integer)]
    partition_id: i32,
    #[diesel(sql_type = BigInt)]
    next_offset: i64,
}

/// The offsets' statements on a connection: the handler's transaction, or a
/// pooled connection of its own. Implemented for idem-diesel's PostgreSQL and
/// SQLite connections.
pub trait OffsetsTx: Send {
    /// Moves the partition's row as `advance` says; `true` too when the row
    /// is already at `advance.to` (see the module's docs); `false` (nothing
    /// written) when it holds any other offset than `advance.from`: the
    /// partition has another owner.
    fn advance<'a>(&'a mut self, advance: &'a Advance<'a>) -> OffsetsFuture<'a, QueryResult<bool>>;
}

/// An inbox whose database also holds the positions: idem-diesel's
/// [`PgInbox`](idem_diesel::PgInbox) and
/// [`SqliteInbox`](idem_diesel::SqliteInbox).
pub trait Offsets: Inbox<Tx: OffsetsTx> {
    /// Creates `idem_kafka_offsets` if it is missing.
    fn migrate_offsets(&self) -> OffsetsFuture<'_, Result<(), InboxError>>;

    /// The stored next offset of each of the topic's partitions that has one.
    fn positions<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> OffsetsFuture<'a, Result<HashMap<i32, i64>, InboxError>>;

    /// Moves a partition's row in a transaction of its own (a record that
    /// ran no handler: a duplicate, a dead letter); `false` when fenced.
    fn advance_alone<'a>(
        &'a self,
        advance: &'a Advance<'a>,
    ) -> OffsetsFuture<'a, Result<bool, InboxError>>;
}

/// One implementation for both databases: the statements are the same text.
macro_rules! offsets_on {
    ($connection:ty, $inbox:ty, $schema:expr) => {
        impl OffsetsTx for $connection {
            fn advance<'a>(
                &'a mut self,
                advance: &'a Advance<'a>,
            ) -> OffsetsFuture<'a, QueryResult<bool>> {
                Box::pin(async move {
                    let written = diesel::sql_query(ADVANCE)
                        .bind::<Text, _>(advance.consumer)
                        .bind::<Text, _>(advance.topic)
                        .bind::<Integer, _>(advance.partition)
                        .bind::<BigInt, _>(advance.to)
                        .bind::<BigInt, _>(advance.from.unwrap_or(-1))
                        .execute(self)
                        .await?;
                    Ok(written == 1)
                })
            }
        }

        impl Offsets for $inbox {
            fn migrate_offsets(&self) -> OffsetsFuture<'_, Result<(), InboxError>> {
                Box::pin(async move {
                    let mut connection =
                        self.pool().get().await.map_err(InboxError::unavailable)?;
                    connection
                        .batch_execute($schema)
                        .await
                        .map_err(InboxError::unavailable)
                })
            }

            fn positions<'a>(
                &'a self,
                consumer: &'a str,
                topic: &'a str,
            ) -> OffsetsFuture<'a, Result<HashMap<i32, i64>, InboxError>> {
                Box::pin(async move {
                    let mut connection =
                        self.pool().get().await.map_err(InboxError::unavailable)?;
                    let rows = diesel::sql_query(POSITIONS)
                        .bind::<Text, _>(consumer)
                        .bind::<Text, _>(topic)
                        .get_results::<PositionRow>(&mut *connection)
                        .await
                        .map_err(InboxError::unavailable)?;
                    Ok(rows
                        .into_iter()
                        .map(|row| (row.partition_id, row.next_offset))
                        .collect())
                })
            }

            fn advance_alone<'a>(
                &'a self,
                advance: &'a Advance<'a>,
            ) -> OffsetsFuture<'a, Result<bool, InboxError>> {
                Box::pin(async move {
                    let mut connection =
                        self.pool().get().await.map_err(InboxError::unavailable)?;
                    connection
                        .advance(advance)
                        .await
                        .map_err(InboxError::unavailable)
                })
            }
        }
    };
}

#[cfg(feature = "postgres")]
offsets_on!(
    idem_diesel::diesel_async::AsyncPgConnection,
    idem_diesel::PgInbox,
    PG_SCHEMA
);
#[cfg(feature = "sqlite")]
offsets_on!(
    idem_diesel::AsyncSqliteConnection,
    idem_diesel::SqliteInbox,
    SQLITE_SCHEMA
);
