//! Why a store could not be set up.

use idem_core::store::BoxError;

/// Why a store could not be built, connected or migrated.
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
