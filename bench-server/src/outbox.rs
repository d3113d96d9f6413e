//! `outbox-drain` and `outbox-lag`: idem-diesel's relay (`PgOutbox::relay`,
//! `Relay::run`) publishing to RabbitMQ with idem-rabbitmq's
//! `OutboxPublisher`, in this process, on a fresh queue (or, with
//! `--kafka`, to a fresh topic with idem-kafka's).
//!
//! - **`outbox-drain`**: stages `--events` events (not measured; pipelined
//!   on one connection, each on its own), then measures a relay draining
//!   them: from its start until every event is confirmed by the broker and
//!   marked sent (the backlog's unsent count is 0). Prints `events`,
//!   `seconds`, `cpu_seconds` (this process) and `database_cpu_seconds`.
//! - **`outbox-lag`**: while a relay runs, charges at a fixed rate
//!   (`--rate` a second): each a transactional first execution in process
//!   (`Engine` over `PgStore::transactional`, as the layered route runs it,
//!   without HTTP) that stages one event in its transaction. An event's lag
//!   runs from its charge's commit (the settlement's return) to the broker's
//!   confirm of its publish. The first `--warmup-ms` are not measured.
//!   Prints `events`, `seconds`, `p50_ms`, `p99_ms`, `max_ms`, and the
//!   relay's `retried` publishes (each waits for its backoff).
//!
//! The events are [`charge_event`]s, keyed by one of 1 000 accounts: a batch
//! holds many keys, which the relay publishes concurrently.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idem_core::outbox::PublishFuture;
use idem_core::{Begin, Engine, Fingerprint, IdempotencyKey, Policy, Scope};
use idem_diesel::{Event, PgOutbox, PgStore, PgTransaction, Publish};
use idem_rabbitmq::lapin::{self, ConnectionProperties};
use idem_rabbitmq::{OutboxPublisher, Topology};
use tokio::sync::Notify;

use crate::BoxError;
use crate::consume::{Window, delete_queue, port_of};
use crate::handler::{self, SCOPE};

/// The destination of the served route's events (`serve --outbox`).
const CHARGES: &str = "bench-charges";

/// Accounts the events are keyed by.
const ACCOUNTS: u64 = 1_000;

/// The event a charge stages: `{"account_id", "amount"}`, keyed by the
/// account, as payments-axum's `--publish` stages it.
pub(crate) fn charge_event() -> Event {
    charge_event_to(CHARGES)
}

fn charge_event_to(destination: &str) -> Event {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let account = format!("acc_{}", NEXT.fetch_add(1, Ordering::Relaxed) % ACCOUNTS);
    let payload = format!(r#"{{"account_id":"{account}","amount":100}}"#);
    Event::new(destination, account, payload).header("content-type", "application/json")
}

/// What both commands take.
#[derive(Debug, clap::Args)]
pub(crate) struct Common {
    /// The broker: `amqp://user:password@host:port/vhost`.
    #[arg(long)]
    amqp: String,
    /// Publishes to Kafka at these bootstrap servers (`HOST:PORT`) instead
    /// of RabbitMQ, with idem-kafka's `OutboxPublisher`, to a fresh topic of
    /// the queue's name (1 partition).
    #[arg(long)]
    kafka: Option<String>,
    /// The database: `postgres://…`.
    #[arg(long)]
    database: String,
    /// The run's queue (a fresh name: declared, filled and deleted here).
    #[arg(long)]
    queue: String,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
}

/// What `outbox-drain` runs.
#[derive(Debug, clap::Args)]
pub(crate) struct DrainOptions {
    #[command(flatten)]
    common: Common,
    /// Events staged, then drained.
    #[arg(long)]
    events: usize,
    /// The relay's batches in flight (`Relay::batches_in_flight`; default:
    /// the relay's).
    #[arg(long)]
    batches_in_flight: Option<usize>,
}

/// What `outbox-lag` runs.
#[derive(Debug, clap::Args)]
pub(crate) struct LagOptions {
    #[command(flatten)]
    common: Common,
    /// Charges a second.
    #[arg(long)]
    rate: u32,
    /// Charges before this (ms) are not measured.
    #[arg(long)]
    warmup_ms: u64,
    /// The measured window (ms).
    #[arg(long)]
    duration_ms: u64,
}

/// The publisher, noting when the broker confirmed each event.
struct Timed {
    inner: Box<dyn Publish>,
    confirmed: Mutex<HashMap<uuid::Uuid, Instant>>,
    count: AtomicUsize,
    /// Told at each confirm.
    progress: Notify,
}

impl Publish for Timed {
    fn publish<'a>(&'a self, event: &'a Event) -> PublishFuture<'a> {
        Box::pin(async move {
            self.inner.publish(event).await?;
            let now = Instant::now();
            self.confirmed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(event.id(), now);
            self.count.fetch_add(1, Ordering::Relaxed);
            self.progress.notify_waiters();
            Ok(())
        })
    }
}

impl Timed {
    /// Resolves once `count` events were confirmed.
    async fn reached(&self, count: usize) {
        loop {
            let progress = self.progress.notified();
            if self.count.load(Ordering::Relaxed) >= count {
                return;
            }
            // A confirm between the load and the wait is caught by the timeout.
            let _ = tokio::time::timeout(Duration::from_millis(10), progress).await;
        }
    }
}

/// The outbox (migrated), the queue (declared) and the timed publisher.
struct Setup {
    outbox: PgOutbox,
    publisher: Arc<Timed>,
}

impl Common {
    fn runtime(&self) -> Result<tokio::runtime::Runtime, BoxError> {
        Ok(tokio::runtime::Builder::new_multi_thread()
            .worker_threads(self.workers.max(1))
            .enable_all()
            .build()?)
    }

    async fn set_up(&self) -> Result<Setup, BoxError> {
        let outbox = PgOutbox::builder()
            .max_connections(4)
            .connect(&self.database)
            .await?;
        outbox.migrate().await?;
        let inner: Box<dyn Publish> = match &self.kafka {
            Some(servers) => {
                idem_kafka::create_topic(servers, &self.queue, 1).await?;
                Box::new(idem_kafka::OutboxPublisher::connect(servers)?)
            }
            None => {
                let (connection, channel) = self.channel().await?;
                Topology::new(&self.queue).declare(&channel).await?;
                connection.close(200, "declared".into()).await?;
                Box::new(OutboxPublisher::connect(&self.amqp).await?)
            }
        };
        let publisher = Arc::new(Timed {
            inner,
            confirmed: Mutex::default(),
            count: AtomicUsize::new(0),
            progress: Notify::new(),
        });
        Ok(Setup { outbox, publisher })
    }

    async fn channel(&self) -> Result<(lapin::Connection, lapin::Channel), BoxError> {
        let connection =
            lapin::Connection::connect(&self.amqp, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        Ok((connection, channel))
    }

    /// Deletes the run's queue and its dead-letter queues (a topic stays:
    /// the in-memory broker ends with the bench).
    async fn clean_up(&self) -> Result<(), BoxError> {
        if self.kafka.is_some() {
            return Ok(());
        }
        let (connection, channel) = self.channel().await?;
        delete_queue(&channel, &self.queue).await?;
        connection.close(200, "bye".into()).await?;
        Ok(())
    }
}

/// Forwards to an `Arc`'d publisher, so that the run keeps a handle on it.
struct Shared(Arc<Timed>);

impl Publish for Shared {
    fn publish<'a>(&'a self, event: &'a Event) -> PublishFuture<'a> {
        self.0.publish(event)
    }
}

pub(crate) fn drain(options: DrainOptions) -> Result<(), BoxError> {
    let common = &options.common;
    common.runtime()?.block_on(async {
        let Setup { outbox, publisher } = common.set_up().await?;
        stage(&outbox, &common.queue, options.events).await?;
        reset_statements(&outbox).await;
        let mut window = Window::new(port_of(&common.database));
        window.start();
        let mut relay = outbox.relay(Shared(Arc::clone(&publisher)))?;
        if let Some(batches) = options.batches_in_flight {
            relay = relay.batches_in_flight(batches);
        }
        let drained = async {
            publisher.reached(options.events).await;
            // The last batch is marked sent after its confirms.
            while outbox.backlog().await.map_or(true, |b| b.unsent > 0) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        let relayed = tokio::time::timeout(Duration::from_secs(600), relay.run(drained))
            .await
            .map_err(|_| "the relay did not drain the outbox within 600 s")?;
        let measured = window.end()?;
        let statements = statements(&outbox, options.events).await;
        common.clean_up().await?;
        println!(
            "{}",
            serde_json::json!({
                "events": options.events,
                "statements": statements,
                "published": relayed.published,
                "retried": relayed.retried,
                "seconds": measured.seconds,
                "cpu_seconds": measured.cpu_seconds,
                "database_cpu_seconds": measured.database_cpu_seconds,
            })
        );
        Ok(())
    })
}

/// Clears `pg_stat_statements`, so that what it counts next is the drain's.
/// The bench's clusters load it; elsewhere this does nothing.
async fn reset_statements(outbox: &PgOutbox) {
    use idem_diesel::diesel_async::RunQueryDsl;
    if let Ok(mut connection) = outbox.pool().get().await {
        let _ = diesel::sql_query("SELECT pg_stat_statements_reset()")
            .execute(&mut *connection)
            .await;
    }
}

/// One statement's share of a drain, as `pg_stat_statements` counted it.
#[derive(diesel::QueryableByName, serde::Serialize)]
struct Statement {
    /// The statement's first words.
    #[diesel(sql_type = diesel::sql_types::Text)]
    query: String,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    calls: i64,
    /// Its execution time per event drained, in microseconds.
    #[diesel(sql_type = diesel::sql_types::Double)]
    us_per_event: f64,
}

/// The statements of this database since [`reset_statements`], the most
/// time first: each one's calls and execution time per event (planning and
/// the protocol are not in it). Empty where `pg_stat_statements` cannot be
/// read.
async fn statements(outbox: &PgOutbox, events: usize) -> Vec<Statement> {
    use idem_diesel::diesel_async::RunQueryDsl;
    let Ok(mut connection) = outbox.pool().get().await else {
        return Vec::new();
    };
    diesel::sql_query(
        "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 60) AS query, calls, \
         total_exec_time * 1000 / $1 AS us_per_event FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query NOT LIKE '%pg_stat_statements%' \
         ORDER BY total_exec_time DESC LIMIT 8",
    )
    .bind::<diesel::sql_types::Double, _>(events.max(1) as f64)
    .load::<Statement>(&mut *connection)
    .await
    .unwrap_or_default()
}

/// Stages `count` events to `destination`, each on its own, pipelined on one
/// connection.
async fn stage(outbox: &PgOutbox, destination: &str, count: usize) -> Result<(), BoxError> {
    let mut connection = outbox.pool().get().await?;
    let connection = &mut *connection;
    let connection: &idem_diesel::diesel_async::AsyncPgConnection = connection;
    futures_util::stream::iter(0..count)
        .map(|_| async move {
            outbox
                .stage(connection, &charge_event_to(destination))
                .await
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<(), _>>()?;
    Ok(())
}

pub(crate) fn lag(options: LagOptions) -> Result<(), BoxError> {
    let common = &options.common;
    common.runtime()?.block_on(async {
        let Setup { outbox, publisher } = common.set_up().await?;
        let store = PgStore::builder()
            .max_connections(16)
            .connect(&common.database)
            .await?;
        store.migrate().await?;
        let engine = Engine::new(store.transactional(), Policy::required());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay = tokio::spawn(
            outbox
                .relay(Shared(Arc::clone(&publisher)))?
                .run(async move { drop(stopped.await) }),
        );
        let committed = Arc::new(Mutex::new(Vec::<(uuid::Uuid, Instant)>::new()));
        let warmup = Duration::from_millis(options.warmup_ms);
        let started = Instant::now();
        let end = started + warmup + Duration::from_millis(options.duration_ms);
        let mut tick = tokio::time::interval(Duration::from_secs(1) / options.rate.max(1));
        let mut charges = tokio::task::JoinSet::new();
        let mut staged = 0;
        while Instant::now() < end {
            tick.tick().await;
            let measured = started.elapsed() >= warmup;
            staged += 1;
            let (engine, outbox, queue, committed) = (
                engine.clone(),
                outbox.clone(),
                common.queue.clone(),
                Arc::clone(&committed),
            );
            charges.spawn(async move {
                let (id, at) = charge(&engine, &outbox, &queue).await?;
                if measured {
                    committed
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((id, at));
                }
                Ok::<_, BoxError>(())
            });
        }
        while let Some(charged) = charges.join_next().await {
            charged??;
        }
        tokio::time::timeout(Duration::from_secs(60), publisher.reached(staged))
            .await
            .map_err(|_| "the relay did not publish every event within 60 s")?;
        let _ = stop.send(());
        let relayed = relay.await?;
        let lags = lags(&publisher, &committed)?;
        let quantile = |q: f64| {
            lags.get(((lags.len() as f64 * q).ceil() as usize).saturating_sub(1))
                .copied()
        };
        common.clean_up().await?;
        println!(
            "{}",
            serde_json::json!({
                "events": lags.len(),
                "seconds": options.duration_ms as f64 / 1e3,
                "p50_ms": quantile(0.5),
                "p99_ms": quantile(0.99),
                "max_ms": lags.last(),
                "retried": relayed.retried,
            })
        );
        Ok(())
    })
}

/// Each measured event's lag, from its commit to its confirm, in ms, sorted.
fn lags(
    publisher: &Timed,
    committed: &Mutex<Vec<(uuid::Uuid, Instant)>>,
) -> Result<Vec<f64>, BoxError> {
    let confirmed = publisher
        .confirmed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let committed = committed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut lags: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            let confirmed = confirmed.get(id)?;
            Some(confirmed.saturating_duration_since(*at).as_secs_f64() * 1e3)
        })
        .collect();
    if lags.len() != committed.len() {
        return Err("an event was committed and never confirmed".into());
    }
    lags.sort_by(f64::total_cmp);
    Ok(lags)
}

/// One transactional charge that stages its event: the event's id and when
/// the charge committed.
async fn charge(
    engine: &Engine,
    outbox: &PgOutbox,
    destination: &str,
) -> Result<(uuid::Uuid, Instant), BoxError> {
    let key = IdempotencyKey::new(&uuid::Uuid::new_v4().to_string())?;
    let Begin::Execute(execution) = engine
        .begin(Scope::new(SCOPE), key, Fingerprint::from_bytes([1; 32]))
        .await
    else {
        return Err("a fresh key was not claimed".into());
    };
    let event = charge_event_to(destination);
    let transaction = execution
        .info()
        .context::<PgTransaction>()
        .ok_or("no transaction: the store is not transactional")?;
    let staged = execution
        .run(async {
            let connection = transaction.connection().await?;
            outbox.stage(&connection, &event).await?;
            Ok::<_, BoxError>(())
        })
        .await;
    if let Err(error) = staged {
        execution.release().await;
        return Err(error);
    }
    match execution.settle(&handler::recorded(0)).await {
        idem_core::Settlement::Deliver => Ok((event.id(), Instant::now())),
        other => Err(format!("the charge did not commit: {other:?}").into()),
    }
}
