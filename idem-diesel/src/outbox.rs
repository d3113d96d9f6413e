//! The transactional outbox: [`Outbox`] stages events in the caller's
//! transaction, and a [`Relay`] publishes them once committed (see the
//! crate's README, "The outbox").

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use futures_util::FutureExt as _;
use futures_util::future::join_all;
use idem_core::outbox::{Event, Publish, PublishError};
use idem_core::retry::Backoff;
use idem_core::{Redacted, StoreError};
use tokio::sync::Notify;

use crate::database::{Database, PoolSettings};

/// How long a relay's shutdown waits for a batch that is settling (see
/// `Relay::run`).
const SETTLE_GRACE: Duration = Duration::from_secs(5);

/// How long sent events are kept by default before the cleanup job deletes
/// them: a day.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The outbox's table.
pub(crate) const OUTBOX_TABLE: &str = "idem_outbox";

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// The outbox's table with the columns both backends' statements use: what
/// `check_schema` verifies.
pub(crate) const OUTBOX_SCHEMA: [(&str, &[&str]); 1] = [(
    OUTBOX_TABLE,
    &[
        "position",
        "id",
        "destination",
        "key",
        "payload",
        "headers",
        "staged_at",
        "attempts",
        "next_attempt_at",
        "sent_at",
        "parked_at",
        "reason",
    ],
)];

#[cfg(any(feature = "postgres", feature = "sqlite"))]
/// Whether the columns the database described for the outbox's table (none:
/// it does not exist) are what the outbox's statements need.
pub(crate) fn check_outbox_columns(
    found: &[Vec<crate::table::ColumnRow>],
) -> Result<(), crate::SetupError> {
    let missing = crate::table::missing_columns(&OUTBOX_SCHEMA, found);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(crate::SetupError::OutboxSchema { missing })
    }
}

/// Events staged in the caller's database transaction, published by a
/// [`Relay`] once committed: on PostgreSQL ([`PgOutbox`](crate::PgOutbox))
/// or SQLite ([`SqliteOutbox`](crate::SqliteOutbox)).
///
/// Cheap to clone: clones share the pool. See the crate's README ("The
/// outbox") for an example, the table, and what the relay guarantees.
pub struct Outbox<B: Backend> {
    pub(crate) inner: Arc<Inner<B>>,
}

pub(crate) struct Inner<B: Backend> {
    /// The pool and the schema gate, which `relay` asks first.
    pub(crate) db: Database<B>,
    pub(crate) retention: Duration,
    /// PostgreSQL: whether a stage notifies the relays on commit.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) notify: bool,
    /// Wakes this process's relay (SQLite: at each stage).
    pub(crate) wake: Arc<Notify>,
    pub(crate) staged: AtomicU64,
}

/// The database an [`Outbox`] is on: [`Postgres`] or [`Sqlite`]. Sealed.
pub trait Backend: sealed::Sealed + Send + Sync + Sized + 'static {
    /// The pool the outbox checks connections out of.
    type Pool: Clone + Send + Sync + 'static;
}

/// PostgreSQL (feature `postgres`): several relays at once, woken on commit by
/// `LISTEN`/`NOTIFY`.
#[derive(Debug)]
pub enum Postgres {}

/// SQLite (feature `sqlite`): one relay per file, woken in process.
#[derive(Debug)]
pub enum Sqlite {}

mod sealed {
    #[allow(unreachable_pub)]
    pub trait Sealed {}
    impl Sealed for super::Postgres {}
    impl Sealed for super::Sqlite {}
}

/// Configures an [`Outbox`]: the retention of sent events, and the pool it
/// builds.
#[must_use]
pub struct OutboxBuilder<B: Backend> {
    pub(crate) retention: Duration,
    pub(crate) pool: PoolSettings,
    pub(crate) notify: bool,
    backend: PhantomData<fn() -> B>,
}

/// What is waiting in an outbox ([`Outbox::backlog`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    /// Events staged and not yet published (parked ones aside).
    pub unsent: u64,
    /// Events parked: never publishable as they stand.
    pub parked: u64,
    /// How long the oldest unsent event has waited.
    pub oldest_unsent: Option<Duration>,
}

/// An event the relay parked, and why ([`Outbox::parked`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParkedEvent {
    /// The event's id.
    pub id: uuid::Uuid,
    /// Its destination.
    pub destination: String,
    /// Its key.
    pub key: String,
    /// Why it can never be published, as the publisher said.
    pub reason: String,
    /// Publish attempts, the refused one included.
    pub attempts: u32,
    /// When it was parked.
    pub parked_at: SystemTime,
}

/// Publishes what an [`Outbox`] staged, with a [`Publish`] (a broker crate's
/// publisher): `run` it as a task for as long as the application runs.
///
/// It takes batches of the events whose turn it is (the oldest unsent one of
/// each destination and key, with those behind it), publishes the events of
/// different keys concurrently and those of one key one after the other,
/// and marks each sent only once the broker confirmed it. An event the
/// broker did not take is tried again after a full-jitter delay, and the
/// events behind it in its key wait; an event refused for good is parked
/// with its reason and its key goes on.
#[must_use]
pub struct Relay<P> {
    source: Arc<dyn Source>,
    publisher: Arc<P>,
    batch_size: usize,
    poll_interval: Duration,
    backoff: Backoff,
    publish_timeout: Duration,
    in_flight: usize,
    counters: Arc<RelayCounters>,
}

/// What a relay did ([`Relay::run_once`], [`Relay::run`], [`Relay::report`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Relayed {
    /// Events published and marked sent.
    pub published: u64,
    /// Events parked.
    pub parked: u64,
    /// Failed attempts, to be tried again.
    pub retried: u64,
}

#[derive(Default)]
struct RelayCounters {
    published: AtomicU64,
    parked: AtomicU64,
    retried: AtomicU64,
}

/// One staged event as the relay took it.
pub(crate) struct Taken {
    pub(crate) position: i64,
    pub(crate) attempts: u32,
    pub(crate) event: Event,
}

/// What became of a batch's events, for the database.
#[derive(Default)]
pub(crate) struct Settlement {
    pub(crate) sent: Vec<i64>,
    /// Position, reason.
    pub(crate) parked: Vec<(i64, String)>,
    /// Position, delay before the next attempt (µs).
    pub(crate) retried: Vec<(i64, i64)>,
}

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A backend's side of a relay.
pub(crate) trait Source: Send + Sync + 'static {
    /// Takes up to `limit` events whose turn it is, held for this relay until
    /// the batch is settled or dropped.
    fn take(&self, limit: usize) -> BoxFuture<'_, Result<Box<dyn Batch>, StoreError>>;

    /// Resolves when events may have been committed: a notification, or (for a
    /// wake-up that may precede its commit) never sooner than told.
    fn woken(&self) -> BoxFuture<'_, ()>;

    /// Whether a wake-up may come before the commit it announces (SQLite's
    /// in-process wake-up, at the stage).
    fn wakes_early(&self) -> bool;

    /// How many batches may be taken at once: PostgreSQL's take skips what
    /// another batch holds (any number), SQLite's has one writer (one).
    fn batches_at_once(&self) -> usize;

    /// A task that turns the database's notifications into wake-ups, if the
    /// backend has them.
    fn listen(&self, poll_interval: Duration) -> Option<BoxFuture<'static, ()>>;

    /// How long the oldest unsent, unparked event has waited: one query on
    /// the unsent events' index, for the gauge (feature `metrics`).
    #[cfg(feature = "metrics")]
    fn oldest_unsent(&self) -> BoxFuture<'_, Result<Option<Duration>, StoreError>>;
}

/// A batch taken by a relay.
pub(crate) trait Batch: Send {
    fn events(&self) -> &[Taken];
    fn settle(
        self: Box<Self>,
        settlement: Settlement,
    ) -> BoxFuture<'static, Result<(), StoreError>>;
}

impl<B: Backend> Clone for Outbox<B> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<B: Backend> Outbox<B> {
    /// Configures the retention and the pool.
    pub fn builder() -> OutboxBuilder<B> {
        OutboxBuilder {
            retention: DEFAULT_RETENTION,
            pool: PoolSettings::new(4),
            notify: true,
            backend: PhantomData,
        }
    }

    /// An outbox on `db`, as `builder` configures it.
    pub(crate) fn with_database(db: Database<B>, builder: &OutboxBuilder<B>) -> Self {
        Self {
            inner: Arc::new(Inner {
                db,
                retention: builder.retention,
                notify: builder.notify,
                wake: Arc::new(Notify::new()),
                staged: AtomicU64::new(0),
            }),
        }
    }

    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    /// Whether `migrate` or `check_schema` passed in
    /// this process (or the builder skipped the check): a relay starts only
    /// then, so that a forgotten migration stops the start, naming the fix,
    /// instead of leaving every event unsent.
    pub(crate) fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.inner.db.schema_gate.outbox_readiness("OutboxBuilder")
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &B::Pool {
        &self.inner.db.pool
    }

    /// How long sent events are kept before the cleanup job deletes them.
    pub fn retention(&self) -> Duration {
        self.inner.retention
    }

    /// Events staged through this outbox (in this process) since it was
    /// made, committed or not.
    pub fn staged(&self) -> u64 {
        self.inner.staged.load(Ordering::Relaxed)
    }

    pub(crate) fn count_staged(&self, event: &Event) {
        self.inner.staged.fetch_add(1, Ordering::Relaxed);
        crate::metrics::staged();
        tracing::trace!(
            target: "idem",
            event_id = %Redacted::of(&event.id().to_string()),
            destination = %idem_core::log::bounded(event.destination()),
            "outbox event staged"
        );
    }
}

impl<B: Backend> fmt::Debug for Outbox<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("retention", &self.inner.retention)
            .field("staged", &self.staged())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> OutboxBuilder<B> {
    /// How long sent events are kept before the cleanup job deletes them
    /// (default 24 h). Parked events are never deleted by it.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    crate::pool::pool_settings! {
        connections: "default 4: a relay holds one per batch, PostgreSQL's listener one of its own outside the pool",
        ready: "a relay starts",
    }
}

impl<B: Backend> fmt::Debug for OutboxBuilder<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxBuilder")
            .field("retention", &self.retention)
            .field("pool", &self.pool)
            .field("notify", &self.notify)
            .finish_non_exhaustive()
    }
}

impl<P: Publish> Relay<P> {
    pub(crate) fn new(source: Arc<dyn Source>, publisher: P) -> Self {
        Self {
            source,
            publisher: Arc::new(publisher),
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(60)),
            publish_timeout: Duration::from_secs(30),
            in_flight: 2,
            counters: Arc::default(),
        }
    }

    /// The most events taken at once (default 100).
    pub fn batch_size(mut self, size: usize) -> Self {
        self.batch_size = size.max(1);
        self
    }

    /// How many batches the relay works on at once (default 2): one is
    /// taken and settled by the database while another is published, so
    /// that neither the database nor the broker waits on the other. Each
    /// holds a pooled connection while it is taken, published and settled.
    /// Events of one key are never in two batches at once: a batch takes
    /// the earliest unsent event of each key it takes, and skips the keys
    /// another batch holds, as two relays do. On SQLite, whose one writer
    /// takes one batch at a time, the relay keeps one.
    pub fn batches_in_flight(mut self, batches: usize) -> Self {
        self.in_flight = batches.max(1);
        self
    }

    /// How often the outbox is looked at when nothing woke the relay
    /// (default 1 s): the fallback when a notification is lost, and when an
    /// event's retry falls due.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The delay before an event the broker did not take is tried again
    /// (default: full jitter, first retry within 100 ms, at most 60 s).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How long one publish may wait for the broker's confirmation (default
    /// 30 s; RabbitMQ holds publishers back under a memory or disk alarm):
    /// past it the event counts as not taken and is tried again later, so a
    /// stalled broker does not hold the batch's transaction, and its keys,
    /// for ever.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// What this relay did so far.
    pub fn report(&self) -> Relayed {
        Relayed {
            published: self.counters.published.load(Ordering::Relaxed),
            parked: self.counters.parked.load(Ordering::Relaxed),
            retried: self.counters.retried.load(Ordering::Relaxed),
        }
    }

    /// Takes one batch, publishes it and settles it: what [`run`](Self::run)
    /// does each time it looks.
    pub async fn run_once(&self) -> Result<Relayed, StoreError> {
        let mut never = std::pin::pin!(std::future::pending::<()>());
        self.run_once_unless(&mut never)
            .await
            .map(Option::unwrap_or_default)
    }

    /// [`run_once`](Self::run_once), given up (`None`) when `shutdown`
    /// resolves while the batch is taken or published: the batch is dropped,
    /// its transaction rolls back, nothing of it is marked sent. A batch
    /// settling when `shutdown` resolves is given 5 s to finish
    /// (its COMMIT may have reached the database, and only its answer says
    /// what was marked and counted), then the answer is `None` too.
    async fn run_once_unless(
        &self,
        shutdown: &mut Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> Result<Option<Relayed>, StoreError> {
        let batch = tokio::select! {
            biased;
            () = &mut *shutdown => return Ok(None),
            batch = self.source.take(self.batch_size) => batch?,
        };
        if batch.events().is_empty() {
            drop(batch);
            self.gauge_oldest_unsent().await;
            return Ok(Some(Relayed::default()));
        }
        let settlement = tokio::select! {
            biased;
            () = &mut *shutdown => return Ok(None),
            settlement = self.publish(batch.events()) => settlement,
        };
        let relayed = Relayed {
            published: settlement.sent.len() as u64,
            parked: settlement.parked.len() as u64,
            retried: settlement.retried.len() as u64,
        };
        // Settling is not given up at once: its COMMIT may have reached the
        // database, and only its answer says what was marked. A shutdown
        // waits for it at most `SETTLE_GRACE` (a database that stopped
        // answering cannot hold the relay's stop), then gives it up: what it
        // marked is not counted, and what it did not mark is published
        // again by the next relay, with the same ids.
        let settling = batch.settle(settlement);
        let mut settling = std::pin::pin!(settling);
        let stopping = tokio::select! {
            biased;
            settled = &mut settling => {
                settled?;
                false
            }
            () = &mut *shutdown => {
                match tokio::time::timeout(SETTLE_GRACE, &mut settling).await {
                    Ok(settled) => settled?,
                    Err(_) => return Ok(None),
                }
                true
            }
        };
        self.counters
            .published
            .fetch_add(relayed.published, Ordering::Relaxed);
        self.counters
            .parked
            .fetch_add(relayed.parked, Ordering::Relaxed);
        self.counters
            .retried
            .fetch_add(relayed.retried, Ordering::Relaxed);
        crate::metrics::relayed(relayed.published, relayed.parked, relayed.retried);
        self.gauge_oldest_unsent().await;
        tracing::debug!(
            target: "idem",
            published = relayed.published,
            parked = relayed.parked,
            retried = relayed.retried,
            "outbox batch relayed"
        );
        Ok((!stopping).then_some(relayed))
    }

    /// Sets the oldest unsent event's gauge, once the look's transaction has
    /// ended (feature `metrics`; nothing without it). A failure is logged
    /// and leaves the gauge as it was.
    #[inline]
    async fn gauge_oldest_unsent(&self) {
        #[cfg(feature = "metrics")]
        match self.source.oldest_unsent().await {
            Ok(age) => crate::metrics::oldest_unsent(age),
            Err(error) => tracing::debug!(
                target: "idem",
                error = %idem_core::log::error_chain(&error),
                "the outbox relay could not measure its oldest unsent event"
            ),
        }
    }

    /// Publishes staged events until `shutdown` resolves, then answers what
    /// it did. A batch being taken or published when `shutdown` resolves is
    /// dropped: its transaction rolls back, nothing of it is marked sent, and
    /// the next relay publishes those events again, with the same ids (so an
    /// inbox applies each once). A batch already settling is given 5 s to
    /// finish first (its COMMIT may have landed: the answer says what it
    /// marked); a database that stopped answering cannot hold the stop. A database error is logged and the relay looks
    /// again at the next poll.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Relayed {
        let listener = self
            .source
            .listen(self.poll_interval)
            .map(|listen| AbortOnDrop(tokio::spawn(listen)));
        let shutdown = shutdown.shared();
        let lanes = self.in_flight.min(self.source.batches_at_once()).max(1);
        join_all((0..lanes).map(|_| self.lane(shutdown.clone()))).await;
        drop(listener);
        self.report()
    }

    /// One of the relay's batches in flight, one after the other, until
    /// `shutdown` resolves.
    async fn lane(&self, shutdown: impl Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let result = match self.run_once_unless(&mut shutdown).await {
                Ok(None) => break,
                Ok(Some(relayed)) => Ok(relayed),
                Err(error) => Err(error),
            };
            match result {
                Ok(relayed) if relayed.published + relayed.parked + relayed.retried > 0 => {
                    continue;
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(
                    target: "idem",
                    error = %idem_core::log::error_chain(&error),
                    "the outbox relay could not take or settle a batch"
                ),
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = self.source.woken() => {
                    if self.source.wakes_early() && self.after_early_wake(&mut shutdown).await {
                        break;
                    }
                }
                () = tokio::time::sleep(self.poll_interval) => {}
            }
        }
    }

    /// After a wake-up that may precede its commit: looks again a few times,
    /// 5 ms apart and doubling, until something is found. Answers whether
    /// `shutdown` resolved meanwhile.
    async fn after_early_wake(
        &self,
        shutdown: &mut Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> bool {
        let mut delay = Duration::from_millis(5);
        while delay < self.poll_interval.max(Duration::from_millis(10)) {
            tokio::select! {
                biased;
                () = &mut *shutdown => return true,
                () = tokio::time::sleep(delay) => {}
            }
            match self.run_once().await {
                Ok(relayed) if relayed.published + relayed.parked + relayed.retried > 0 => {
                    return false;
                }
                Ok(_) => delay = delay.saturating_mul(2),
                Err(_) => return false,
            }
        }
        false
    }

    /// Publishes `events`: the keys concurrently, each key's events in order,
    /// a key stopping at its first event the broker did not take.
    async fn publish(&self, events: &[Taken]) -> Settlement {
        let mut keys: HashMap<(&str, &str), Vec<&Taken>> = HashMap::new();
        let mut order = Vec::new();
        for taken in events {
            let key = (taken.event.destination(), taken.event.key());
            let queue = keys.entry(key).or_default();
            if queue.is_empty() {
                order.push(key);
            }
            queue.push(taken);
        }
        let runs = order
            .into_iter()
            .filter_map(|key| keys.remove(&key))
            .map(|queue| self.publish_key(queue));
        let mut settlement = Settlement::default();
        for part in join_all(runs).await {
            settlement.sent.extend(part.sent);
            settlement.parked.extend(part.parked);
            settlement.retried.extend(part.retried);
        }
        settlement
    }

    async fn publish_key(&self, queue: Vec<&Taken>) -> Settlement {
        let mut settlement = Settlement::default();
        for taken in queue {
            let event = &taken.event;
            let published =
                match tokio::time::timeout(self.publish_timeout, self.publisher.publish(event))
                    .await
                {
                    Ok(published) => published,
                    Err(_) => Err(PublishError::unavailable(Unconfirmed(self.publish_timeout))),
                };
            match published {
                Ok(()) => settlement.sent.push(taken.position),
                Err(PublishError::Refused(reason)) => {
                    tracing::error!(
                        target: "idem",
                        event_id = %Redacted::of(&event.id().to_string()),
                        destination = %idem_core::log::bounded(event.destination()),
                        reason = %idem_core::log::bounded(&reason),
                        "outbox event parked: it can never be published"
                    );
                    settlement.parked.push((taken.position, reason));
                }
                Err(error) => {
                    let attempt = taken.attempts.saturating_add(1);
                    let delay = self.backoff.delay(attempt);
                    tracing::warn!(
                        target: "idem",
                        event_id = %Redacted::of(&event.id().to_string()),
                        destination = %idem_core::log::bounded(event.destination()),
                        attempt,
                        retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        error = %idem_core::log::error_chain(&error),
                        "outbox event not published; retrying later"
                    );
                    settlement
                        .retried
                        .push((taken.position, crate::row::duration_micros(delay)));
                    // The events behind it in its key wait for it.
                    break;
                }
            }
        }
        settlement
    }
}

impl<P> fmt::Debug for Relay<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("batch_size", &self.batch_size)
            .field("poll_interval", &self.poll_interval)
            .field("batches_in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

/// The broker did not confirm a publish in time.
#[derive(Debug, thiserror::Error)]
#[error("the broker did not confirm the event within {0:?}")]
struct Unconfirmed(Duration);

/// Aborts the listener task when the relay ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
