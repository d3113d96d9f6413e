//! What the consumer inboxes of both backends ([`PgInbox`](crate::PgInbox),
//! [`SqliteInbox`](crate::SqliteInbox)) share: the classification of
//! database errors that can never succeed on a retry, and time conversions.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use idem_core::StoreError;
use idem_core::consume::{Attempt, BatchEntry, Batched, Entered, HandlerError, InboxError};

use crate::SetupError;
use crate::row::{duration_micros, time_from_micros};
use crate::table::ColumnRow;

/// How long an inbox remembers a processed message by default: 7 days, longer
/// than any broker redelivers.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// The consumer inboxes' tables, with the columns both backends' statements
/// use: what `check_schema` verifies.
pub(crate) const INBOX_SCHEMA: [(&str, &[&str]); 3] = [
    (
        "idem_consumer_inbox",
        &["consumer", "message_id", "fingerprint", "processed_at"],
    ),
    (
        "idem_consumer_failures",
        &["consumer", "message_id", "attempted_at", "last_attempt_at"],
    ),
    (
        "idem_consumer_dead_letters",
        &[
            "consumer",
            "message_id",
            "reason",
            "attempted_at",
            "dead_at",
            "published",
        ],
    ),
];

/// The consumer inboxes' tables.
pub(crate) const INBOX_TABLES: [&str; 3] =
    [INBOX_SCHEMA[0].0, INBOX_SCHEMA[1].0, INBOX_SCHEMA[2].0];

/// Whether the columns the database described for each of the inbox's
/// tables (none: the table does not exist), in [`INBOX_SCHEMA`]'s order, are
/// what the inbox's statements need.
pub(crate) fn check_inbox_columns(found: &[Vec<ColumnRow>]) -> Result<(), SetupError> {
    let missing = crate::table::missing_columns(&INBOX_SCHEMA, found);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(SetupError::InboxSchema { missing })
    }
}

/// The handler broke the transaction's shape: it left savepoints open.
#[derive(Debug, thiserror::Error)]
#[error("the handler left {0} nested transaction(s) open; its writes were rolled back")]
pub(crate) struct NestedOpen(pub(crate) u32);

/// A batch's messages were not all one consumer's.
#[derive(Debug, thiserror::Error)]
#[error("a batch holds the messages of more than one consumer")]
pub(crate) struct MixedConsumers;

/// What an inbox's entry found for one message, on either backend.
pub(crate) enum Found {
    /// Entered now, after this many failed attempts: the transaction stays
    /// open for the handler.
    Entered { failures: i32 },
    /// Applied before, with this fingerprint.
    Applied(Vec<u8>),
    /// A dead letter.
    Dead { published: bool },
}

/// The consumer of a batch's messages (`None`: an empty batch), refused when
/// they are not all one consumer's.
pub(crate) fn consumer_of<'a>(batch: &[BatchEntry<'a>]) -> Result<Option<&'a str>, InboxError> {
    let Some(first) = batch.first() else {
        return Ok(None);
    };
    let consumer = first.entry.consumer;
    if batch.iter().any(|item| item.entry.consumer != consumer) {
        return Err(InboxError::unavailable(MixedConsumers));
    }
    Ok(Some(consumer))
}

/// What each message of `batch` came to as its entry `found` it (a new one
/// `Processed`, unless the handler or the commit fail), and the new ones:
/// their index and attempt.
pub(crate) fn entered(
    batch: &[BatchEntry<'_>],
    found: impl IntoIterator<Item = Found>,
) -> (Vec<Entered>, Vec<(usize, u32)>) {
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut new = Vec::new();
    for (i, (item, found)) in batch.iter().zip(found).enumerate() {
        outcomes.push(match found {
            Found::Dead { published } => Entered::Dead { published },
            Found::Applied(fingerprint)
                if fingerprint[..] == item.entry.fingerprint.as_bytes()[..] =>
            {
                Entered::Duplicate
            }
            Found::Applied(_) => Entered::Reused,
            Found::Entered { failures } => {
                let attempt = u32::try_from(failures).unwrap_or(0).saturating_add(1);
                new.push((i, attempt));
                Entered::Processed { attempt }
            }
        });
    }
    (outcomes, new)
}

/// The attempts of a batch's `new` messages, for its handler.
pub(crate) fn attempts<'a>(batch: &'a [BatchEntry<'a>], new: &[(usize, u32)]) -> Vec<Attempt<'a>> {
    new.iter()
        .map(|&(i, attempt)| Attempt::new(batch[i].message, batch[i].entry.message_id, attempt))
        .collect()
}

/// What a batch came to: `outcomes` as entered (the new ones `Processed`),
/// unless the handler or the commit `failed` on the `new` messages (their
/// index and attempt): then the one new message's own failure, or, with
/// more, the batch's.
pub(crate) fn batched(
    mut outcomes: Vec<Entered>,
    new: &[(usize, u32)],
    failed: Option<HandlerError>,
) -> Batched {
    match (failed, new) {
        (None, _) => Batched::Entered(outcomes),
        (Some(error), &[(i, attempt)]) => {
            outcomes[i] = Entered::Failed { attempt, error };
            Batched::Entered(outcomes)
        }
        (Some(error), _) => Batched::Failed(error),
    }
}

/// Whether `error`, or an error in its `source()` chain, is a diesel error that
/// can never succeed on a retry: see the crate's README ("Permanent errors").
/// The first diesel error found in the chain decides.
pub(crate) fn is_permanent(error: &(dyn StdError + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(diesel) = error.downcast_ref::<DieselError>() {
            return diesel_is_permanent(diesel);
        }
        next = error.source();
    }
    false
}

fn diesel_is_permanent(error: &DieselError) -> bool {
    match error {
        DieselError::DatabaseError(kind, info) => match kind {
            // The row breaks a constraint of the schema: it will again.
            DatabaseErrorKind::ForeignKeyViolation
            | DatabaseErrorKind::RestrictViolation
            | DatabaseErrorKind::NotNullViolation
            | DatabaseErrorKind::CheckViolation => true,
            // A unique or exclusion violation may be a race with a concurrent
            // writer of the application's own table (two messages inserting
            // the same row): the retry may find the row and succeed. A real
            // duplicate runs out of attempts and is dead-lettered all the same.
            DatabaseErrorKind::UniqueViolation
            | DatabaseErrorKind::ExclusionViolation
            | DatabaseErrorKind::SerializationFailure
            | DatabaseErrorKind::ReadOnlyTransaction
            | DatabaseErrorKind::ClosedConnection
            | DatabaseErrorKind::UnableToSendCommand => false,
            // diesel names no other SQLSTATE: the data errors are told by
            // their message.
            _ => is_data_error(info.message()),
        },
        // A bind value the column's type cannot hold.
        DieselError::SerializationError(_) => true,
        _ => false,
    }
}

/// The messages of the database errors about the data itself (PostgreSQL's
/// SQLSTATE class 22 and the index row limit, SQLite's equivalents), which
/// diesel reports as `DatabaseErrorKind::Unknown`. PostgreSQL's are matched as
/// the server writes them with its default `lc_messages` (English).
const DATA_ERRORS: &[&str] = &[
    // PostgreSQL 22003 ("bigint out of range", "value … is out of range for
    // type integer"), 22008 ("date/time field value out of range").
    "out of range",
    "numeric field overflow",
    "value overflows numeric format",
    // 22001: "value too long for type character varying(16)".
    "value too long for type",
    // 54000: "index row size 2720 exceeds btree version 4 maximum 2704 …",
    // "index row requires 9000 bytes, maximum size is 8191".
    "index row size",
    "index row requires",
    // 22P02, 22012, 22021, 22P05.
    "invalid input syntax",
    "invalid input value for enum",
    "division by zero",
    "invalid byte sequence for encoding",
    "has no equivalent in encoding",
    // SQLite.
    "integer overflow",
    "string or blob too big",
    "datatype mismatch",
    "cannot store",
];

fn is_data_error(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    DATA_ERRORS.iter().any(|pattern| message.contains(pattern))
}

/// An inbox step's failure from a store-level one, unwrapped to its cause.
pub(crate) fn unavailable(error: StoreError) -> InboxError {
    match error {
        StoreError::Unavailable(source) => InboxError::Unavailable(source),
        other => InboxError::unavailable(other),
    }
}

/// `time` as microseconds since the Unix epoch (0 before it).
pub(crate) fn micros(time: SystemTime) -> i64 {
    duration_micros(time.duration_since(UNIX_EPOCH).unwrap_or_default())
}

/// The instant `micros` microseconds after the Unix epoch, as an inbox reads it.
pub(crate) fn time(micros: i64) -> Result<SystemTime, InboxError> {
    time_from_micros(micros).map_err(|error| InboxError::Corrupt(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database(kind: DatabaseErrorKind, message: &str) -> DieselError {
        DieselError::DatabaseError(kind, Box::new(message.to_owned()))
    }

    #[test]
    fn constraint_and_data_errors_are_permanent_and_the_rest_is_not() {
        for (error, permanent) in [
            (database(DatabaseErrorKind::CheckViolation, "check"), true),
            (database(DatabaseErrorKind::ForeignKeyViolation, "fk"), true),
            (database(DatabaseErrorKind::NotNullViolation, "null"), true),
            (database(DatabaseErrorKind::UniqueViolation, "dup"), false),
            (
                database(DatabaseErrorKind::SerializationFailure, "40001"),
                false,
            ),
            (
                database(DatabaseErrorKind::ClosedConnection, "closed"),
                false,
            ),
            (
                database(DatabaseErrorKind::UnableToSendCommand, "broken pipe"),
                false,
            ),
            (
                database(DatabaseErrorKind::Unknown, "bigint out of range"),
                true,
            ),
            (
                database(
                    DatabaseErrorKind::Unknown,
                    "value too long for type character varying(4)",
                ),
                true,
            ),
            (
                database(
                    DatabaseErrorKind::Unknown,
                    "index row size 2720 exceeds btree version 4 maximum 2704 for index \"k\"",
                ),
                true,
            ),
            (
                database(
                    DatabaseErrorKind::Unknown,
                    "canceling statement due to lock timeout",
                ),
                false,
            ),
            (
                database(DatabaseErrorKind::Unknown, "deadlock detected"),
                false,
            ),
            (
                database(DatabaseErrorKind::Unknown, "database is locked"),
                false,
            ),
            (DieselError::NotFound, false),
        ] {
            assert_eq!(is_permanent(&error), permanent, "{error}");
        }
    }

    #[test]
    fn the_source_chain_is_walked() {
        #[derive(Debug, thiserror::Error)]
        #[error("the ledger write failed")]
        struct Wrapped(#[source] DieselError);

        let wrapped = Wrapped(database(DatabaseErrorKind::CheckViolation, "check"));
        assert!(is_permanent(&wrapped));
        let boxed: Box<dyn StdError + Send + Sync> = Box::new(wrapped);
        assert!(is_permanent(&*boxed));
        let io = std::io::Error::other("connection reset");
        assert!(!is_permanent(&io));
    }
}
