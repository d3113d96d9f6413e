//! Why a store could not be set up.

use idem_core::store::BoxError;

/// Why a store could not be built, connected, migrated or checked.
///
/// Store steps fail with [`idem_core::StoreError`] instead; this error belongs to
/// application startup.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A table or schema name is not a plain SQL identifier.
    #[error(
        "the {kind} name {name:?} is not a plain identifier: use 1 to {max} ASCII letters, \
         digits and underscores, not starting with a digit"
    )]
    InvalidName {
        /// `"table"` or `"schema"`.
        kind: &'static str,
        /// The name given.
        name: String,
        /// The longest name accepted.
        max: usize,
    },
    /// The pool could not be built or its first connection failed.
    #[error("could not connect to the database")]
    Connect(#[source] BoxError),
    /// The store's table does not exist: nothing migrated this database yet.
    #[error(
        "the idempotency table {table} is missing: run store.migrate() at start-up \
         (or apply store.ddl() with your migration tool)"
    )]
    SchemaMissing {
        /// The table, as the database names it.
        table: String,
    },
    /// The store's table exists but lacks columns this version of idem-diesel
    /// uses: it was created by an older version and not migrated since.
    #[error(
        "the idempotency table {table} is older than this library (it lacks the \
         column(s) {}): run store.migrate() at start-up",
        .missing.join(", ")
    )]
    SchemaOutdated {
        /// The table, as the database names it.
        table: String,
        /// The columns this library needs that the table lacks.
        missing: Vec<String>,
    },
    /// A consumer inbox's tables are missing, or lack columns this version of
    /// idem-diesel uses: nothing migrated this database for the inbox yet, or
    /// an older version did.
    #[error(
        "the consumer inbox's tables are missing or older than this library (it lacks {}): \
         run inbox.migrate() at start-up",
        .missing.join(", ")
    )]
    InboxSchema {
        /// What the database lacks: a table (`idem_consumer_inbox`) or a
        /// table's column (`idem_consumer_failures.last_attempt_at`).
        missing: Vec<String>,
    },
    /// The outbox's table is missing, or lacks columns this version of
    /// idem-diesel uses: nothing migrated this database for the outbox yet,
    /// or an older version did.
    #[error(
        "the outbox's table is missing or older than this library (it lacks {}): \
         run outbox.migrate() at start-up",
        .missing.join(", ")
    )]
    OutboxSchema {
        /// What the database lacks: the table (`idem_outbox`) or one of its
        /// columns (`idem_outbox.parked_at`).
        missing: Vec<String>,
    },
    /// The table's columns could not be read.
    #[error("could not read the columns of the idempotency table {table}")]
    SchemaCheck {
        /// The table, as the database names it.
        table: String,
        /// What failed.
        #[source]
        source: BoxError,
    },
    /// Creating or upgrading the table failed.
    #[error("could not migrate the idempotency table {table}")]
    Migrate {
        /// The table, as the database names it.
        table: String,
        /// What failed.
        #[source]
        source: BoxError,
    },
}

impl SetupError {
    /// A failed first connection: the store's error, unwrapped to its cause.
    pub(crate) fn connect(error: idem_core::StoreError) -> Self {
        match error {
            idem_core::StoreError::Unavailable(source) => Self::Connect(source),
            other => Self::Connect(other.into()),
        }
    }
}
