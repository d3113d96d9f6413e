//! The consumer inbox: each message processed once per consumer, its writes and
//! its inbox row in one PostgreSQL transaction; failures counted, and dead
//! letters kept aside until re-driven.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Text};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, TransactionManager,
};
use diesel_migrations::{EmbeddedMigrations, embed_migrations};
use idem_core::StoreError;
use idem_core::store::BoxError;
use idem_core::store::StoreFuture;

use crate::SetupError;
use crate::postgres::{PgPool, SWEEP_LOCK_CLASS, roll_back, run_migrations, transaction_depth};
use crate::prepared::PreparedExt;
use crate::row::{duration_micros, time_from_micros};
use idem_core::cleanup::{Cleanup, ExpiredRows, SweepGuard, SweepLock};

/// The migrations that create the inbox's tables.
const MIGRATIONS: EmbeddedMigrations = embed_migrations!("migrations/postgres_inbox");

/// Records the delivery (`$1` consumer, `$2` message id) unless the consumer
/// processed it already or it is a dead letter, and answers which, with the
/// attempt's start (the transaction's `now()`) in µs since the epoch.
const ENTER: &str = "WITH dead AS (
        SELECT 1 FROM idem_dead_letters WHERE consumer = $1 AND message_id = $2
    ), entered AS (
        INSERT INTO idem_inbox (consumer, message_id, processed_at)
        SELECT $1, $2, now() WHERE NOT EXISTS (SELECT 1 FROM dead)
        ON CONFLICT (consumer, message_id) DO NOTHING
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM entered) AS entered,
           EXISTS (SELECT 1 FROM dead) AS dead,
           (extract(epoch FROM now()) * 1000000)::bigint AS started_at";

/// A processed message's failures are history.
const CLEAR_FAILURES: &str =
    "DELETE FROM idem_inbox_failures WHERE consumer = $1 AND message_id = $2";

/// Counts a failed attempt (`$3` the error, `$4` its start in µs) and answers
/// how many the message has had.
const COUNT_FAILURE: &str = "INSERT INTO idem_inbox_failures AS f
        (consumer, message_id, attempts, last_error, attempted_at, last_attempt_at)
    VALUES ($1, $2, 1, $3, ARRAY[timestamptz 'epoch' + $4 * interval '1 microsecond'], now())
    ON CONFLICT (consumer, message_id) DO UPDATE SET
        attempts = f.attempts + 1,
        last_error = excluded.last_error,
        attempted_at = f.attempted_at || excluded.attempted_at,
        last_attempt_at = excluded.last_attempt_at
    RETURNING f.attempts";

/// Moves the message's failures to the dead letters, and answers how many dead
/// letters there are now (the moved one included).
const BURY: &str = "WITH moved AS (
        DELETE FROM idem_inbox_failures WHERE consumer = $1 AND message_id = $2
        RETURNING consumer, message_id, attempts, last_error, attempted_at
    ), buried AS (
        INSERT INTO idem_dead_letters (consumer, message_id, attempts, last_error, attempted_at, dead_at)
        SELECT consumer, message_id, attempts, last_error, attempted_at, now() FROM moved
        ON CONFLICT (consumer, message_id) DO UPDATE SET
            attempts = excluded.attempts, last_error = excluded.last_error,
            attempted_at = excluded.attempted_at, dead_at = excluded.dead_at
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM idem_dead_letters
            WHERE NOT (consumer = $1 AND message_id = $2))
         + (SELECT count(*) FROM buried) AS n";

/// The columns of a `DeadLetterRow`.
const DEAD_LETTER_COLUMNS: &str = "consumer, message_id, attempts, last_error, \
    ARRAY(SELECT (extract(epoch FROM t) * 1000000)::bigint FROM unnest(attempted_at) AS t) AS attempted_at, \
    (extract(epoch FROM dead_at) * 1000000)::bigint AS dead_at";

/// Deletes up to `$1` processed messages, and up to `$1` failure counts, older
/// than the retention (`$2` µs): by physical address, found through the time
/// indexes.
const DELETE_EXPIRED: &str = "WITH processed AS (
        DELETE FROM idem_inbox WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM idem_inbox
            WHERE processed_at <= now() - $2 * interval '1 microsecond' LIMIT $1))
        RETURNING 1
    ), abandoned AS (
        DELETE FROM idem_inbox_failures WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM idem_inbox_failures
            WHERE last_attempt_at <= now() - $2 * interval '1 microsecond' LIMIT $1))
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM processed) + (SELECT count(*) FROM abandoned) AS n";

/// Processes each message once per consumer, on PostgreSQL.
///
/// A consumer of an at-least-once queue (every broker redelivers: after a
/// crash, a lost acknowledgement, a rebalance) hands each delivery to
/// [`process_once`](Self::process_once) with the message's id. In one
/// transaction, the inbox records `(consumer, message_id)` with
/// `INSERT … ON CONFLICT DO NOTHING` and runs the consumer's writes: both commit,
/// or neither. A redelivery finds the row and is skipped
/// ([`Delivery::Duplicate`]); a concurrent one waits for the first to commit
/// (then it is a duplicate) or roll back (then it runs).
///
/// A failed attempt (the closure returned an error) rolls back, and is counted
/// per message with its time and error. (A closure that panics rolls back too,
/// as its connection is dropped, but is not counted.) The attempt that reaches
/// [`max_attempts`](InboxBuilder::max_attempts) moves the message to the dead
/// letters: later deliveries are skipped ([`Delivery::DeadLetter`]) until
/// [`redrive`](Self::redrive) is called for it. Every dead letter is logged;
/// when their number passes the
/// [`dead_letter_threshold`](InboxBuilder::dead_letter_threshold), a warning is
/// logged and the [`on_dead_letter_threshold`](InboxBuilder::on_dead_letter_threshold)
/// callback runs.
///
/// Processed messages are kept for the [`retention`](InboxBuilder::retention)
/// (7 days by default: longer than any redelivery); the cleanup job deletes
/// them after ([`Inbox::cleanup`], or a store's job with
/// [`Cleanup::also`](crate::Cleanup::also)). Dead letters are never deleted by
/// it.
///
/// ```no_run
/// use diesel::sql_types::{BigInt, Text};
/// use diesel_async::RunQueryDsl;
/// use idem_core::retry::Backoff;
/// use idem_diesel::{Delivery, Inbox, InboxError, PgStore};
///
/// struct Message { id: Option<String>, account: String, amount: i64 }
///
/// # async fn consume(store: PgStore, message: Message) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = Inbox::builder().max_attempts(5).build(store.pool().clone());
/// inbox.migrate().await?;
///
/// let backoff = Backoff::for_consumers();
/// loop {
///     let outcome = inbox
///         .process_once("balances", message.id.as_deref(), async |connection| {
///             diesel::sql_query("UPDATE accounts SET balance = balance + $2 WHERE id = $1")
///                 .bind::<Text, _>(&message.account)
///                 .bind::<BigInt, _>(message.amount)
///                 .execute(connection)
///                 .await
///         })
///         .await;
///     match outcome {
///         Ok(Delivery::Processed(_)) | Ok(Delivery::Duplicate) | Ok(Delivery::DeadLetter) => break,
///         // Retry after a jittered delay, so that consumers that failed together
///         // do not retry together.
///         Err(InboxError::Failed { attempt, .. }) => tokio::time::sleep(backoff.delay(attempt)).await,
///         Err(error) => return Err(error.into()),
///     }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Inbox {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    max_attempts: u32,
    retention: Duration,
    dead_letter_threshold: u64,
    on_threshold: Option<Arc<OnThreshold>>,
}

/// The callback of [`InboxBuilder::on_dead_letter_threshold`].
type OnThreshold = dyn Fn(&DeadLetterAlert) + Send + Sync;

/// Configures an [`Inbox`].
#[must_use]
pub struct InboxBuilder {
    max_attempts: u32,
    retention: Duration,
    dead_letter_threshold: u64,
    on_threshold: Option<Arc<OnThreshold>>,
}

/// What [`Inbox::process_once`] did with a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivery<R> {
    /// The consumer processed the message: its writes and the inbox row
    /// committed. Carries what the closure answered.
    Processed(R),
    /// The consumer had processed this message before: nothing ran.
    Duplicate,
    /// The message is a dead letter: nothing ran. [`Inbox::redrive`] lets it
    /// through again.
    DeadLetter,
}

/// Why [`Inbox::process_once`] (or another inbox step) failed.
#[derive(Debug, thiserror::Error)]
pub enum InboxError<E = std::convert::Infallible> {
    /// The message has no id, so a redelivery could not be told apart from a
    /// new message: it is refused, not processed, and nothing is written.
    #[error("the message has no id: it cannot be processed exactly once, and was not processed")]
    MissingMessageId,
    /// The consumer failed; its writes were rolled back and the attempt counted.
    /// Retry it (after [`Backoff::delay`](idem_core::retry::Backoff::delay)`(attempt)`).
    #[error(
        "the consumer failed on attempt {attempt} of {max_attempts}; its writes were rolled back"
    )]
    Failed {
        /// How many attempts failed so far (this one included).
        attempt: u32,
        /// How many failures dead-letter the message.
        max_attempts: u32,
        /// The consumer's error.
        #[source]
        source: E,
    },
    /// The consumer failed on the last allowed attempt: the message is now a
    /// dead letter, and its deliveries are skipped until it is re-driven.
    #[error(
        "the consumer failed on attempt {attempts}, the last allowed: the message is a dead letter"
    )]
    DeadLettered {
        /// How many attempts failed.
        attempts: u32,
        /// The consumer's error.
        #[source]
        source: E,
    },
    /// The inbox's database failed; nothing was committed (a failure of the
    /// consumer's, if any, is in the log, uncounted).
    #[error("the inbox database is unavailable")]
    Unavailable(#[source] BoxError),
}

/// A message that failed [`max_attempts`](InboxBuilder::max_attempts) times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The consumer that failed on it.
    pub consumer: String,
    /// The message's id.
    pub message_id: String,
    /// How many attempts failed.
    pub attempts: u32,
    /// The last attempt's error, as displayed.
    pub last_error: String,
    /// When each attempt started, in order.
    pub attempted_at: Vec<SystemTime>,
    /// When it became a dead letter.
    pub dead_at: SystemTime,
}

/// Raised when the number of dead letters passes the threshold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterAlert {
    /// How many dead letters there are (every consumer's).
    pub dead_letters: u64,
    /// The threshold they passed.
    pub threshold: u64,
    /// The consumer whose message tipped it over.
    pub consumer: String,
    /// That message's id.
    pub message_id: String,
}

/// An async closure that processes one message on the inbox's transaction: what
/// [`Inbox::process_once`] takes.
///
/// Every `async |connection| { … }` closure that answers a `Result` and whose
/// future is `Send` is one; there is nothing to implement. (The trait only
/// names the closure's future, so that its `Send` can be required.)
pub trait ConsumerFn<'c, R, E>:
    AsyncFnOnce(&'c mut AsyncPgConnection) -> Result<R, E>
    + FnOnce(&'c mut AsyncPgConnection) -> <Self as ConsumerFn<'c, R, E>>::Future
{
    /// The closure's future.
    type Future: Future<Output = Result<R, E>> + Send;
}

impl<'c, F, Fut, R, E> ConsumerFn<'c, R, E> for F
where
    F: AsyncFnOnce(&'c mut AsyncPgConnection) -> Result<R, E>
        + FnOnce(&'c mut AsyncPgConnection) -> Fut,
    Fut: Future<Output = Result<R, E>> + Send,
{
    type Future = Fut;
}

/// The handler left nested transactions open: its writes are not committed.
#[derive(Debug, thiserror::Error)]
#[error("the consumer left {0} nested transaction(s) open; its writes were rolled back")]
struct NestedOpen(u32);

#[derive(QueryableByName)]
struct EnterRow {
    #[diesel(sql_type = Bool)]
    entered: bool,
    #[diesel(sql_type = Bool)]
    dead: bool,
    #[diesel(sql_type = BigInt)]
    started_at: i64,
}

#[derive(QueryableByName)]
struct AttemptsRow {
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

#[derive(QueryableByName)]
struct CountRow {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(QueryableByName)]
struct LockRow {
    #[diesel(sql_type = Bool)]
    locked: bool,
}

#[derive(QueryableByName)]
struct DeadLetterRow {
    #[diesel(sql_type = Text)]
    consumer: String,
    #[diesel(sql_type = Text)]
    message_id: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Text)]
    last_error: String,
    #[diesel(sql_type = Array<BigInt>)]
    attempted_at: Vec<i64>,
    #[diesel(sql_type = BigInt)]
    dead_at: i64,
}

/// A failed attempt, as counted.
enum Counted {
    Retry(u32),
    Buried(u32),
}

impl Inbox {
    /// An inbox over `pool` with the defaults: 5 attempts, 7 days' retention, a
    /// warning past 100 dead letters.
    pub fn new(pool: PgPool) -> Self {
        Self::builder().build(pool)
    }

    /// Configures an inbox.
    pub fn builder() -> InboxBuilder {
        InboxBuilder {
            max_attempts: 5,
            retention: Duration::from_secs(7 * 24 * 60 * 60),
            dead_letter_threshold: 100,
            on_threshold: None,
        }
    }

    /// Creates the inbox's tables (`idem_inbox`, `idem_inbox_failures`,
    /// `idem_dead_letters`) with the embedded diesel migrations. Safe to call
    /// from every instance at startup.
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let failed = |source: BoxError| SetupError::Migrate {
            table: "idem_inbox".to_owned(),
            source,
        };
        let connection = self
            .inner
            .pool
            .dedicated_connection()
            .await
            .map_err(|e| failed(e.into()))?;
        tokio::task::spawn_blocking(move || run_migrations(connection, MIGRATIONS))
            .await
            .map_err(|e| failed(e.into()))?
            .map_err(failed)
    }

    /// Runs `consumer`'s `handler` for the message `message_id`, once.
    ///
    /// In one transaction: records `(consumer, message_id)`, runs the handler on
    /// the transaction's connection, and commits both, or neither. Answers
    /// [`Delivery::Processed`] with the handler's answer; [`Delivery::Duplicate`]
    /// if the consumer processed the message before; [`Delivery::DeadLetter`]
    /// if it is a dead letter (the handler does not run in either case).
    ///
    /// A message without an id (`None`, or blank) is
    /// [`InboxError::MissingMessageId`], and nothing runs or is written. A
    /// handler error rolls its writes back and counts the attempt:
    /// [`InboxError::Failed`], or [`InboxError::DeadLettered`] on the last
    /// allowed one.
    pub async fn process_once<R, E, F>(
        &self,
        consumer: &str,
        message_id: Option<&str>,
        handler: F,
    ) -> Result<Delivery<R>, InboxError<E>>
    where
        F: for<'c> ConsumerFn<'c, R, E> + Send,
        R: Send,
        E: std::error::Error + Send + Sync + 'static,
    {
        let message_id = match message_id.map(str::trim) {
            Some(id) if !id.is_empty() => id,
            _ => {
                tracing::warn!(
                    consumer,
                    "a message without an id was refused, not processed"
                );
                return Err(InboxError::MissingMessageId);
            }
        };
        let mut connection = self.inner.pool.get().await.map_err(unavailable)?;
        AnsiTransactionManager::begin_transaction(&mut *connection)
            .await
            .map_err(unavailable)?;
        let entry = match diesel::sql_query(ENTER)
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(message_id)
            .prepared()
            .get_result::<EnterRow>(&mut *connection)
            .await
        {
            Ok(entry) => entry,
            Err(error) => {
                roll_back(&mut connection).await;
                return Err(unavailable(error));
            }
        };
        if !entry.entered {
            roll_back(&mut connection).await;
            let delivery = if entry.dead {
                tracing::debug!(
                    consumer,
                    message_id = %logged(message_id),
                    "a dead letter was delivered again; skipped"
                );
                Delivery::DeadLetter
            } else {
                tracing::debug!(consumer, message_id = %logged(message_id), "a duplicate delivery was skipped");
                Delivery::Duplicate
            };
            return Ok(delivery);
        }
        match handler(&mut connection).await {
            Ok(answer) => {
                self.commit(&mut connection, consumer, message_id).await?;
                tracing::debug!(consumer, message_id = %logged(message_id), "message processed");
                Ok(Delivery::Processed(answer))
            }
            Err(error) => {
                roll_back(&mut connection).await;
                drop(connection);
                self.failed(consumer, message_id, entry.started_at, error)
                    .await
            }
        }
    }

    /// Lets a dead letter through again: removes it, so that its next delivery
    /// runs the consumer with a fresh count of attempts. Answers the dead letter
    /// it removed, or `None` if there was none. Never called by the inbox
    /// itself.
    ///
    /// ```no_run
    /// # async fn run(inbox: idem_diesel::Inbox) -> Result<(), idem_diesel::InboxError> {
    /// // After the consumer's bug is fixed: let message m-17 through, then have
    /// // the broker deliver it again (or call `process_once` with it).
    /// if let Some(letter) = inbox.redrive("balances", "m-17").await? {
    ///     println!("re-driving {} after {} attempts: {}", letter.message_id, letter.attempts, letter.last_error);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn redrive(
        &self,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<DeadLetter>, InboxError> {
        let mut connection = self.inner.pool.get().await.map_err(unavailable)?;
        let row = diesel::sql_query(format!(
            "DELETE FROM idem_dead_letters WHERE consumer = $1 AND message_id = $2
             RETURNING {DEAD_LETTER_COLUMNS}"
        ))
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(message_id)
        .get_results::<DeadLetterRow>(&mut *connection)
        .await
        .map_err(unavailable)?;
        let letter = row
            .into_iter()
            .next()
            .map(DeadLetterRow::into_letter)
            .transpose()?;
        if let Some(letter) = &letter {
            tracing::info!(
                consumer,
                message_id = %logged(message_id),
                attempts = letter.attempts,
                "dead letter re-driven"
            );
        }
        Ok(letter)
    }

    /// The dead letter of `consumer` for `message_id`, if the message is one:
    /// its attempts, their times and its last error (what a consumer that
    /// parks the message in its broker's dead-letter queue tells there).
    pub async fn dead_letter(
        &self,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<DeadLetter>, InboxError> {
        let mut connection = self.inner.pool.get().await.map_err(unavailable)?;
        diesel::sql_query(format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM idem_dead_letters
             WHERE consumer = $1 AND message_id = $2"
        ))
        .bind::<Text, _>(consumer)
        .bind::<Text, _>(message_id)
        .get_results::<DeadLetterRow>(&mut *connection)
        .await
        .map_err(unavailable)?
        .into_iter()
        .next()
        .map(DeadLetterRow::into_letter)
        .transpose()
    }

    /// The dead letters of `consumer`, oldest first.
    pub async fn dead_letters(&self, consumer: &str) -> Result<Vec<DeadLetter>, InboxError> {
        let mut connection = self.inner.pool.get().await.map_err(unavailable)?;
        diesel::sql_query(format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM idem_dead_letters
             WHERE consumer = $1 ORDER BY dead_at, message_id"
        ))
        .bind::<Text, _>(consumer)
        .get_results::<DeadLetterRow>(&mut *connection)
        .await
        .map_err(unavailable)?
        .into_iter()
        .map(DeadLetterRow::into_letter)
        .collect()
    }

    /// A cleanup job that deletes processed messages past the retention, one
    /// runner at a time across instances. (To sweep them in a store's job
    /// instead: `store.cleanup().also(inbox)`.)
    pub fn cleanup(&self) -> Cleanup<Inbox> {
        Cleanup::new(self.clone()).lock(self.clone())
    }

    /// Commits the processed message: clears its failure count, then commits.
    async fn commit<E>(
        &self,
        connection: &mut AsyncPgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<(), InboxError<E>> {
        let depth = transaction_depth(connection);
        if depth != 1 {
            roll_back(connection).await;
            return Err(InboxError::Unavailable(Box::new(NestedOpen(
                depth.saturating_sub(1),
            ))));
        }
        let cleared = diesel::sql_query(CLEAR_FAILURES)
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(message_id)
            .prepared()
            .execute(&mut *connection)
            .await;
        if let Err(error) = cleared {
            roll_back(connection).await;
            return Err(unavailable(error));
        }
        AnsiTransactionManager::commit_transaction(connection)
            .await
            .map_err(unavailable)
    }

    /// Counts the failed attempt; buries the message on the last one.
    async fn failed<R, E>(
        &self,
        consumer: &str,
        message_id: &str,
        started_at: i64,
        error: E,
    ) -> Result<Delivery<R>, InboxError<E>>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let last_error = error_chain(&error);
        let counted = match self
            .count_failure(consumer, message_id, started_at, &last_error)
            .await
        {
            Ok(counted) => counted,
            Err(store) => {
                tracing::error!(consumer, message_id = %logged(message_id), error = %last_error, "the consumer failed, and the failure could not be counted");
                return Err(InboxError::Unavailable(store));
            }
        };
        match counted {
            Counted::Retry(attempt) => {
                tracing::info!(consumer, message_id = %logged(message_id), attempt, max_attempts = self.inner.max_attempts, error = %last_error, "the consumer failed; its writes were rolled back");
                Err(InboxError::Failed {
                    attempt,
                    max_attempts: self.inner.max_attempts,
                    source: error,
                })
            }
            Counted::Buried(attempts) => Err(InboxError::DeadLettered {
                attempts,
                source: error,
            }),
        }
    }

    async fn count_failure(
        &self,
        consumer: &str,
        message_id: &str,
        started_at: i64,
        last_error: &str,
    ) -> Result<Counted, BoxError> {
        let max_attempts = self.inner.max_attempts;
        let mut connection = self.inner.pool.get().await?;
        let (counted, dead_letters) = connection
            .transaction(async |connection| {
                let attempts = diesel::sql_query(COUNT_FAILURE)
                    .bind::<Text, _>(consumer)
                    .bind::<Text, _>(message_id)
                    .bind::<Text, _>(last_error)
                    .bind::<BigInt, _>(started_at)
                    .prepared()
                    .get_result::<AttemptsRow>(connection)
                    .await?
                    .attempts;
                let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
                if attempts < max_attempts {
                    return Ok((Counted::Retry(attempts), 0));
                }
                let dead_letters = diesel::sql_query(BURY)
                    .bind::<Text, _>(consumer)
                    .bind::<Text, _>(message_id)
                    .prepared()
                    .get_result::<CountRow>(connection)
                    .await?
                    .n;
                Ok::<_, diesel::result::Error>((
                    Counted::Buried(attempts),
                    u64::try_from(dead_letters).unwrap_or(0),
                ))
            })
            .await?;
        if let Counted::Buried(attempts) = counted {
            self.buried(consumer, message_id, attempts, last_error, dead_letters);
        }
        Ok(counted)
    }

    /// Tells of a new dead letter, and raises the alert when it is the one that
    /// passes the threshold.
    fn buried(
        &self,
        consumer: &str,
        message_id: &str,
        attempts: u32,
        last_error: &str,
        dead_letters: u64,
    ) {
        tracing::warn!(consumer, message_id = %logged(message_id), attempts, error = %last_error, dead_letters, "message dead-lettered after its last allowed attempt");
        let threshold = self.inner.dead_letter_threshold;
        // Only the letter that crosses the threshold raises it (the count seen
        // in its own transaction); of concurrent crossers, at least one sees it.
        if dead_letters != threshold.saturating_add(1) {
            return;
        }
        tracing::warn!(
            dead_letters,
            threshold,
            consumer,
            message_id = %logged(message_id),
            "the dead letters passed their threshold: consumers are failing"
        );
        if let Some(on_threshold) = &self.inner.on_threshold {
            on_threshold(&DeadLetterAlert {
                dead_letters,
                threshold,
                consumer: consumer.to_owned(),
                message_id: message_id.to_owned(),
            });
        }
    }
}

impl InboxBuilder {
    /// How many failed attempts dead-letter a message (default 5, at least 1):
    /// with 3, the third failure does.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// How long processed messages are remembered (default 7 days). Make it
    /// longer than the broker redelivers: a redelivery after it runs again.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The number of dead letters (every consumer's) past which a warning is
    /// raised (default 100).
    pub fn dead_letter_threshold(mut self, threshold: u64) -> Self {
        self.dead_letter_threshold = threshold;
        self
    }

    /// Called when the dead letters pass the threshold, after the warning is
    /// logged: once per crossing (the letter that makes the count one more than
    /// the threshold), again after re-drives bring it back under and it
    /// crosses anew.
    pub fn on_dead_letter_threshold(
        mut self,
        alert: impl Fn(&DeadLetterAlert) + Send + Sync + 'static,
    ) -> Self {
        self.on_threshold = Some(Arc::new(alert));
        self
    }

    /// The inbox, over `pool`.
    pub fn build(self, pool: PgPool) -> Inbox {
        Inbox {
            inner: Arc::new(Inner {
                pool,
                max_attempts: self.max_attempts,
                retention: self.retention,
                dead_letter_threshold: self.dead_letter_threshold,
                on_threshold: self.on_threshold,
            }),
        }
    }
}

impl ExpiredRows for Inbox {
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        Box::pin(async move {
            let mut connection = self
                .inner
                .pool
                .get()
                .await
                .map_err(StoreError::unavailable)?;
            let deleted = diesel::sql_query(DELETE_EXPIRED)
                .bind::<BigInt, _>(i64::try_from(batch).unwrap_or(i64::MAX))
                .bind::<BigInt, _>(duration_micros(self.inner.retention))
                .prepared()
                .get_result::<CountRow>(&mut *connection)
                .await
                .map_err(StoreError::unavailable)?;
            Ok(u64::try_from(deleted.n).unwrap_or(0))
        })
    }
}

/// One inbox sweep at a time, across instances: a session-scoped advisory lock
/// keyed by the inbox's table, on a connection of its own.
impl SweepLock for Inbox {
    fn try_lock(&self) -> StoreFuture<'_, Option<SweepGuard>> {
        Box::pin(async move {
            let mut connection = self
                .inner
                .pool
                .dedicated_connection()
                .await
                .map_err(StoreError::unavailable)?;
            let row = diesel::sql_query("SELECT pg_try_advisory_lock($1, hashtext($2)) AS locked")
                .bind::<Integer, _>(SWEEP_LOCK_CLASS)
                .bind::<Text, _>("idem_inbox")
                .get_result::<LockRow>(&mut connection)
                .await
                .map_err(StoreError::unavailable)?;
            Ok(row.locked.then(|| SweepGuard::new(connection)))
        })
    }
}

impl fmt::Debug for Inbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("max_attempts", &self.inner.max_attempts)
            .field("retention", &self.inner.retention)
            .field("dead_letter_threshold", &self.inner.dead_letter_threshold)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for InboxBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InboxBuilder")
            .field("max_attempts", &self.max_attempts)
            .field("retention", &self.retention)
            .field("dead_letter_threshold", &self.dead_letter_threshold)
            .finish_non_exhaustive()
    }
}

impl DeadLetterRow {
    fn into_letter(self) -> Result<DeadLetter, InboxError> {
        let time = |micros| {
            time_from_micros(micros).map_err(|error| InboxError::Unavailable(error.into()))
        };
        Ok(DeadLetter {
            consumer: self.consumer,
            message_id: self.message_id,
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            last_error: self.last_error,
            attempted_at: self
                .attempted_at
                .into_iter()
                .map(time)
                .collect::<Result<_, _>>()?,
            dead_at: time(self.dead_at)?,
        })
    }
}

/// A message id as the log shows it: redacted like an idempotency key
/// (`IdempotencyKey::redacted`), never whole, as ids are often keys.
fn logged(message_id: &str) -> String {
    match idem_core::IdempotencyKey::new(message_id) {
        Ok(key) => key.redacted().to_string(),
        Err(_) => format!("…({})", message_id.len()),
    }
}

fn unavailable<E>(error: impl Into<BoxError>) -> InboxError<E> {
    InboxError::Unavailable(error.into())
}

/// An error and its sources, on one line: what the dead letter keeps.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
