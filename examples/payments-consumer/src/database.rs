//! The consumer's database: PostgreSQL or SQLite, chosen by the URL's
//! scheme, holding the inbox's tables and the ledger's.

use idem_diesel::{PgInbox, SqliteInbox};

use crate::ConsumerError;
use crate::ledger::{Account, Ledger};

/// `--database`'s default: a file beside the working directory, so that
/// `run --amqp URL` needs no database server.
pub const DEFAULT_DATABASE: &str = "sqlite://payments-consumer.db";

/// Runs `$body` with `$connection`, a pooled connection of the
/// [`Database`]'s pool (either type: the body is compiled for each), in a
/// function that answers `Result<_, ConsumerError>`.
#[macro_export]
macro_rules! with_connection {
    ($database:expr, $connection:ident => $body:expr) => {
        match $database {
            $crate::database::Database::Postgres(inbox) => {
                $crate::with_connection!(@pooled inbox, $connection => $body)
            }
            $crate::database::Database::Sqlite(inbox) => {
                $crate::with_connection!(@pooled inbox, $connection => $body)
            }
        }
    };
    (@pooled $inbox:ident, $connection:ident => $body:expr) => {{
        let mut pooled = $inbox
            .pool()
            .get()
            .await
            .map_err($crate::ConsumerError::pool)?;
        let $connection = &mut *pooled;
        $body
    }};
}

/// Runs `$body` with `$inbox`, the database's inbox (either type: the body
/// is compiled for each).
macro_rules! with_inbox {
    ($database:expr, $inbox:ident => $body:expr) => {
        match $database {
            $crate::database::Database::Postgres($inbox) => $body,
            $crate::database::Database::Sqlite($inbox) => $body,
        }
    };
}
pub(crate) use with_inbox;

/// The inbox, on the database `--database` names; the ledger lives beside it.
#[derive(Clone)]
pub enum Database {
    /// `postgres://…` (or `postgresql://…`).
    Postgres(PgInbox),
    /// `sqlite://PATH`.
    Sqlite(SqliteInbox),
}

impl Database {
    /// Connects to `url` with a pool of up to `connections`, and applies the
    /// inbox's migration and the ledger's schema.
    pub async fn open(url: &str, connections: u32) -> Result<Self, ConsumerError> {
        let database = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Self::Postgres(
                PgInbox::builder()
                    .max_connections(connections)
                    .connect(url)
                    .await?,
            )
        } else if url.starts_with("sqlite:") {
            Self::Sqlite(
                SqliteInbox::builder()
                    .max_connections(connections)
                    .connect(url)
                    .await?,
            )
        } else {
            // The URL itself is not repeated: it may hold a password.
            return Err(ConsumerError::UnknownDatabase);
        };
        match &database {
            Self::Postgres(inbox) => inbox.migrate().await?,
            Self::Sqlite(inbox) => inbox.migrate().await?,
        }
        with_connection!(&database, connection => connection.create_schema().await?);
        Ok(database)
    }

    /// The account's balance and operations (zero for an account never
    /// paid).
    pub async fn account(&self, account_id: &str) -> Result<Account, ConsumerError> {
        Ok(with_connection!(self, connection => connection.account(account_id).await?))
    }

    /// Every account, by id.
    pub async fn accounts(&self) -> Result<Vec<Account>, ConsumerError> {
        Ok(with_connection!(self, connection => connection.accounts().await?))
    }
}
