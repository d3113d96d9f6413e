//! Checking connections out of the pool, failing fast when the database is down.
//!
//! bb8 opens connections in the background and hands their errors to an error
//! sink, never to the request waiting for the connection: that request waits out
//! the whole connection timeout and learns only "timed out". Pools the stores
//! build instead report failed connection attempts here, and a waiting checkout
//! fails at once with the attempt's error, so that an outage is answered in the
//! time a refused connection takes, with its cause.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use bb8::{ErrorSink, ManageConnection, PooledConnection, RunError};
use diesel_async::pooled_connection::PoolError;
use idem_core::StoreError;
use tokio::sync::broadcast;

/// Failed connection attempts of one pool, as they happen.
#[derive(Clone, Debug)]
pub(crate) struct ConnectFailures {
    sender: broadcast::Sender<Arc<PoolError>>,
}

/// A connection attempt failed while a store step waited for a connection.
#[derive(Debug, thiserror::Error)]
#[error("could not open a database connection")]
struct ConnectFailed(#[source] SharedError);

/// No connection became free within the pool's connection timeout.
#[derive(Debug, thiserror::Error)]
#[error("no database connection became free within the pool's connection timeout")]
struct NoConnection;

/// A pool error shared by every checkout that saw it.
#[derive(Debug)]
struct SharedError(Arc<PoolError>);

impl ConnectFailures {
    pub(crate) fn new() -> Self {
        // Waiters only need to learn that some attempt failed: a few slots do.
        let (sender, _) = broadcast::channel(4);
        Self { sender }
    }

    /// The sink to give the pool's builder.
    pub(crate) fn sink(&self) -> Box<dyn ErrorSink<PoolError>> {
        Box::new(self.clone())
    }

    /// What `checkout` answers: at once if a connection attempt fails while
    /// waiting for `connection`.
    async fn first_of<C>(
        &self,
        connection: impl Future<Output = Result<C, RunError<PoolError>>>,
    ) -> Result<C, StoreError> {
        // Subscribed before asking: only attempts made while waiting count.
        let mut failures = self.sender.subscribe();
        tokio::select! {
            biased;
            connection = connection => connection.map_err(unavailable),
            failure = failures.recv() => Err(match failure {
                Ok(error) => StoreError::unavailable(ConnectFailed(SharedError(error))),
                // Lagged: failures came faster than they were read; still failures.
                Err(_) => StoreError::unavailable(NoConnection),
            }),
        }
    }
}

/// A connection from `pool`, failing fast when `failures` watches it (pools the
/// stores build), waiting out the pool's timeout otherwise (pools the
/// application built).
pub(crate) async fn checkout<'p, M>(
    pool: &'p bb8::Pool<M>,
    failures: Option<&ConnectFailures>,
) -> Result<PooledConnection<'p, M>, StoreError>
where
    M: ManageConnection<Error = PoolError>,
{
    match failures {
        Some(failures) => failures.first_of(pool.get()).await,
        None => pool.get().await.map_err(unavailable),
    }
}

/// As [`checkout`], for a connection that outlives the borrow of the pool (a
/// transaction kept open across store steps).
pub(crate) async fn checkout_owned<M>(
    pool: &bb8::Pool<M>,
    failures: Option<&ConnectFailures>,
) -> Result<PooledConnection<'static, M>, StoreError>
where
    M: ManageConnection<Error = PoolError>,
{
    match failures {
        Some(failures) => failures.first_of(pool.get_owned()).await,
        None => pool.get_owned().await.map_err(unavailable),
    }
}

/// The store error of a failed checkout.
fn unavailable(error: RunError<PoolError>) -> StoreError {
    match error {
        RunError::User(error) => StoreError::unavailable(error),
        RunError::TimedOut => StoreError::unavailable(NoConnection),
    }
}

impl ErrorSink<PoolError> for ConnectFailures {
    fn sink(&self, error: PoolError) {
        match error {
            // A connection could not be opened: tell the waiting checkouts.
            PoolError::ConnectionError(_) => {
                tracing::debug!(error = %error, "database connection attempt failed");
                let _ = self.sender.send(Arc::new(error));
            }
            // A pooled connection failed its checkout test: the pool drops it
            // and opens another, which the waiting checkout gets.
            PoolError::QueryError(_) => {
                tracing::debug!(error = %error, "dropped a broken pooled connection");
            }
        }
    }

    fn boxed_clone(&self) -> Box<dyn ErrorSink<PoolError>> {
        Box::new(self.clone())
    }
}

impl fmt::Display for SharedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl StdError for SharedError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        // Display already shows the pool error's message: skip to its cause.
        match &*self.0 {
            PoolError::ConnectionError(error) => error.source(),
            PoolError::QueryError(error) => error.source(),
        }
    }
}

/// The pool's settings every builder of this crate has (the stores', the
/// inboxes', the outbox's), written once: `max_connections`,
/// `connection_timeout`, `skip_schema_check`, on a `pool` field of
/// `PoolSettings`.
/// `$connections` says the default number of connections and what holds
/// one; `$ready` what is ready without the schema check.
macro_rules! pool_settings {
    (connections: $connections:literal, ready: $ready:literal $(,)?) => {
        #[doc = concat!("The most connections the pool opens (", $connections, "). Ignored by `build`.")]
        pub fn max_connections(mut self, max: u32) -> Self {
            self.pool.max_connections = max.max(1);
            self
        }

        /// How long a step waits for a pooled connection before it fails as
        /// unavailable (default 3 s). The pool does not retry a failed
        /// connection attempt, so an unreachable database is answered at
        /// once, with its cause. Ignored by `build`.
        pub fn connection_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.pool.connection_timeout = timeout;
            self
        }

        #[doc = concat!("Skips the schema check: ", $ready, " without `migrate` or `check_schema` having succeeded in this process. Skip it only when something else guarantees the tables.")]
        pub fn skip_schema_check(mut self) -> Self {
            self.pool.skip_schema_check = true;
            self
        }
    };
}
pub(crate) use pool_settings;
