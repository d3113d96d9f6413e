//! The positions of a partitioned broker's consumer
//! ([`Positions`](idem_core::consume::Positions)) in the inbox's database:
//! a row per consumer, topic and partition in `idem_kafka_offsets`, written
//! in the same transaction as the effect and the inbox row. The table keeps
//! its name (idem-kafka created it before the positions moved here: existing
//! databases hold it).
//!
//! The row holds the partition's **next** offset; every write is fenced (see
//! [`Positions`](idem_core::consume::Positions) and
//! [`Advance`](idem_core::consume::Advance)): one statement, [`ADVANCE`],
//! inserts a missing row, moves one at the offset the writer saw, and
//! rewrites one already at its target with the same value, so the move
//! counts one row; a row at any other offset is left, and the move counts
//! none.

use std::collections::HashMap;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idem_core::consume::{Advance, InboxError, InboxFuture, Positions};

use crate::prepared::PreparedExt;

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
pub(crate) const ADVANCE: &str =
    "INSERT INTO idem_kafka_offsets (consumer, topic, partition_id, next_offset)
    VALUES ($1, $2, $3, $4)
    ON CONFLICT (consumer, topic, partition_id) DO UPDATE SET next_offset = excluded.next_offset
    WHERE idem_kafka_offsets.next_offset IN ($5, excluded.next_offset)";

#[derive(QueryableByName)]
struct PositionRow {
    #[diesel(sql_type = Integer)]
    partition_id: i32,
    #[diesel(sql_type = BigInt)]
    next_offset: i64,
}

/// [`ADVANCE`] with `$advance`'s binds, for either database's
/// `RunQueryDsl` (its type cannot be named: diesel keeps `UncheckedBind`
/// private).
macro_rules! advance_statement {
    ($advance:expr) => {{
        let advance: &Advance<'_> = $advance;
        diesel::sql_query(ADVANCE)
            .bind::<Text, _>(advance.consumer)
            .bind::<Text, _>(advance.topic)
            .bind::<Integer, _>(advance.partition)
            .bind::<BigInt, _>(advance.to)
            .bind::<BigInt, _>(advance.from.unwrap_or(-1))
            .prepared()
    }};
}

/// The fenced move on a connection: `true` when the row counts as written.
/// Kept prepared: on PostgreSQL, one round trip a message instead of a
/// parse, a bind and a close.
macro_rules! advance_on {
    ($connection:expr, $advance:expr) => {
        async {
            let written = advance_statement!($advance).execute($connection).await;
            written.map(|written| written == 1)
        }
    };
}

/// The fenced move on a SQLite connection, on the blocking thread that
/// holds it: [`SqliteInbox`](crate::SqliteInbox) sends it in its entry's
/// step. `true` when the row counts as written.
#[cfg(feature = "sqlite")]
pub(crate) fn advance_blocking(
    connection: &mut diesel::SqliteConnection,
    advance: &Advance<'_>,
) -> diesel::QueryResult<bool> {
    let written = diesel::RunQueryDsl::execute(advance_statement!(advance), connection)?;
    Ok(written == 1)
}

/// One implementation for both databases: the statements are the same text.
macro_rules! positions_on {
    ($connection:ty, $inbox:ty, $schema:expr) => {
        impl Positions for $inbox {
            fn migrate_positions(&self) -> InboxFuture<'_, ()> {
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
            ) -> InboxFuture<'a, HashMap<i32, i64>> {
                Box::pin(async move {
                    let mut connection =
                        self.pool().get().await.map_err(InboxError::unavailable)?;
                    let rows = diesel::sql_query(POSITIONS)
                        .bind::<Text, _>(consumer)
                        .bind::<Text, _>(topic)
                        .prepared()
                        .get_results::<PositionRow>(&mut *connection)
                        .await
                        .map_err(InboxError::unavailable)?;
                    Ok(rows
                        .into_iter()
                        .map(|row| (row.partition_id, row.next_offset))
                        .collect())
                })
            }

            fn advance_in<'a>(
                &'a self,
                tx: &'a mut $connection,
                advance: &'a Advance<'a>,
            ) -> InboxFuture<'a, bool> {
                Box::pin(async move {
                    advance_on!(tx, advance)
                        .await
                        .map_err(InboxError::unavailable)
                })
            }

            fn advance_alone<'a>(&'a self, advance: &'a Advance<'a>) -> InboxFuture<'a, bool> {
                Box::pin(async move {
                    let mut connection =
                        self.pool().get().await.map_err(InboxError::unavailable)?;
                    advance_on!(&mut *connection, advance)
                        .await
                        .map_err(InboxError::unavailable)
                })
            }

            /// The move is made with the entry, not from the handler's
            /// transaction after it: on PostgreSQL sent with `BEGIN` and
            /// the entry (one round trip), on SQLite in the entry's step on
            /// the blocking thread (`BEGIN IMMEDIATE`, the entry, the move).
            fn process_advancing<'a>(
                &'a self,
                entry: &'a idem_core::consume::Entry<'a>,
                message: &'a idem_core::consume::Message,
                advance: &'a Advance<'a>,
                handler: &'a (dyn idem_core::consume::Handler<$connection> + 'a),
            ) -> InboxFuture<'a, idem_core::consume::Entered> {
                Box::pin(self.process_on(entry, message, Some(advance), handler))
            }
        }
    };
}

#[cfg(feature = "postgres")]
positions_on!(diesel_async::AsyncPgConnection, crate::PgInbox, PG_SCHEMA);
#[cfg(feature = "sqlite")]
positions_on!(
    crate::AsyncSqliteConnection,
    crate::SqliteInbox,
    SQLITE_SCHEMA
);
