//! `kafka-consume`: one drain of a topic of payments, through idem-kafka (the
//! inbox row, the effect and the partition's next offset in one transaction
//! of `PgInbox` or `SqliteInbox`), or through a bare rdkafka consumer with
//! auto-commit that applies the same transaction, without an inbox and
//! without its offsets in the database.
//!
//! As `consume` does for RabbitMQ:
//!
//! 1. **Set-up, not measured:** the database's ledger (`consume`'s), a fresh
//!    topic of `--concurrency` partitions and its warm-up topic, filled with
//!    payments keyed by account, each with its `message_id` header, by an
//!    idempotent producer.
//! 2. **Warm-up, not measured:** the same kind of consumer drains the warm-up
//!    topic.
//! 3. **The drain, measured:** idem-kafka's window starts when the group
//!    assigned it its partitions, the bare consumer's when it receives its
//!    first record (its assignment happens inside its first poll), and both
//!    end when the last payment has committed. idem applies each partition
//!    in order, a worker per partition; the bare consumer applies up to
//!    `--concurrency` records at once, as they come, in no particular order
//!    (`enable.auto.commit` with the offsets stored on receipt: the classic
//!    consumer that loses or repeats records on a crash).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::Message as _;
use idem_kafka::rdkafka::consumer::{Consumer as _, StreamConsumer};
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{ConsumerPolicy, Positions};
use tokio::task::JoinSet;

use crate::BoxError;
use crate::consume::{
    Apply, ApplyBatch, BareTransaction, BatchLedger, Database, Kind, Payment, Progress, Window,
    payment_body,
};

/// What `kafka-consume` runs.
#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// The bootstrap servers, `HOST:PORT`.
    #[arg(long)]
    kafka: String,
    /// The run's topic (a fresh name: created, filled and drained here).
    #[arg(long)]
    topic: String,
    /// What every consume command takes beside its broker.
    #[command(flatten)]
    drain: crate::consume::Drain,
}

/// The consumer's name in the inbox and the offsets table.
const CONSUMER: &str = "payments";

pub(crate) fn run(options: Options) -> Result<(), BoxError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.drain.workers.max(1))
        .enable_all()
        .build()?
        .block_on(drain_once(options))
}

async fn drain_once(options: Options) -> Result<(), BoxError> {
    if options.drain.messages == 0 {
        return Err("--messages must be at least 1".into());
    }
    let warmup_topic = format!("{}.warmup", options.topic);
    let partitions = i32::try_from(options.drain.concurrency.max(1))?;
    let (_, stop) = options
        .drain
        .publish(async |warmup, count| {
            let topic = if warmup {
                &warmup_topic
            } else {
                &options.topic
            };
            idem_kafka::create_topic(&options.kafka, topic, partitions).await?;
            publish(&options, topic, count).await
        })
        .await?;
    if stop {
        return Ok(());
    }
    // A connection per partition's worker (or bare task), as `consume` gives.
    let database = Database::open(
        &options.drain.database,
        options.drain.accounts,
        None,
        options.drain.concurrency,
    )
    .await?;
    if options.drain.warmup > 0 {
        let mut ignored = Window::new(None);
        drain(
            &database,
            &options,
            &warmup_topic,
            options.drain.warmup,
            &mut ignored,
        )
        .await?;
    }
    let before = database.tally().await?;
    let mut window = Window::new(database.postgres_port());
    let drained = drain(
        &database,
        &options,
        &options.topic,
        options.drain.messages,
        &mut window,
    )
    .await?;
    let measured = window.end()?;
    if drained != options.drain.messages {
        return Err(format!("{drained} messages drained, not {}", options.drain.messages).into());
    }
    let after = database.tally_after().await?;
    after.applied_since(&before, options.drain.messages)?;
    println!(
        "{}",
        serde_json::json!({
            "messages": options.drain.messages,
            "seconds": measured.seconds,
            "cpu_seconds": measured.cpu_seconds,
            "database_cpu_seconds": measured.database_cpu_seconds,
            "statements": after.statements_since(&before),
            "peak_rss_bytes": crate::memory::peak_resident_bytes().ok(),
        })
    );
    Ok(())
}

async fn drain(
    database: &Database,
    options: &Options,
    topic: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError> {
    match (database, options.drain.consumer) {
        (Database::Postgres { inbox, .. }, Kind::Idem) => {
            idem(inbox.clone(), options, topic, count, window).await
        }
        (Database::Sqlite { inbox }, Kind::Idem) => {
            idem(inbox.clone(), options, topic, count, window).await
        }
        (Database::Postgres { inbox, .. }, Kind::Bare) => {
            bare(inbox.pool().clone(), options, topic, count, window).await
        }
        (Database::Sqlite { inbox }, Kind::Bare) => {
            bare(inbox.pool().clone(), options, topic, count, window).await
        }
    }
}

/// idem-kafka's consumer on `inbox`, stopped once its handler ran `count`
/// times.
async fn idem<I>(
    inbox: I,
    options: &Options,
    topic: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError>
where
    I: Positions,
    I::Tx: BatchLedger + Sized,
{
    let progress = Progress::new(count);
    let builder = idem_kafka::Consumer::builder(&options.kafka, topic)
        .group(format!("{topic}-idem"))
        .name(CONSUMER)
        .inbox(inbox)
        .policy(ConsumerPolicy::new());
    if let Some(size) = options.drain.batch {
        let apply = ApplyBatch {
            progress: Arc::clone(&progress),
        };
        // Room for a few batches in each partition's worker's queue (and
        // librdkafka's): a batch drained does not wait for the next fetch.
        let consumer = builder
            .prefetch(size.saturating_mul(8).max(idem_kafka::DEFAULT_PREFETCH))
            .batch_handler(apply, size)
            .build()?;
        run_idem(consumer, &progress, window).await
    } else {
        let apply = Apply {
            progress: Arc::clone(&progress),
        };
        run_idem(builder.handler(apply).build()?, &progress, window).await
    }
}

/// Runs idem-kafka's `consumer` until its handler ran the drain's count.
async fn run_idem<I, H>(
    consumer: idem_kafka::Consumer<I, H>,
    progress: &Progress,
    window: &mut Window,
) -> Result<usize, BoxError>
where
    I: Positions,
    H: idem_kafka::Handler<I::Tx> + Send + Sync + 'static,
{
    // The window opens when the first record reaches the handler, as the
    // bare consumer's opens at its first record: the group's join and the
    // first fetch after the assignment (about 360 ms on tansu, the same for
    // both) are not the drain.
    let drained = async {
        progress.first.notified().await;
        window.start();
        progress.reached.notified().await;
    };
    consumer.run(drained, |_| {}).await?;
    Ok(progress.count())
}

/// A bare rdkafka consumer with auto-commit: up to `--concurrency` records at
/// once, each parsed and applied in its transaction; stops once `count` have
/// committed.
async fn bare<T: BareTransaction>(
    transaction: T,
    options: &Options,
    topic: &str,
    count: usize,
    window: &mut Window,
) -> Result<usize, BoxError> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &options.kafka)
        .set("group.id", format!("{topic}-bare"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .create()?;
    consumer.subscribe(&[topic])?;
    let concurrency = options.drain.concurrency.max(1);
    let mut running: JoinSet<Result<(), BoxError>> = JoinSet::new();
    let mut records = consumer.stream();
    let mut applied = 0;
    let mut started = false;
    while applied < count {
        tokio::select! {
            biased;
            Some(joined) = running.join_next() => {
                joined??;
                applied += 1;
            }
            record = records.next(), if running.len() < concurrency => {
                let record = record.ok_or("the consumer's stream ended")??;
                if !started {
                    window.start();
                    started = true;
                }
                let body = record.payload().unwrap_or_default().to_vec();
                let transaction = transaction.clone();
                running.spawn(async move {
                    let payment: Payment = serde_json::from_slice(&body)?;
                    transaction.run(&payment).await
                });
            }
        }
    }
    drop(records);
    consumer.unsubscribe();
    Ok(applied)
}

/// Fills `topic` with `count` payments keyed by account, each with its own
/// `message_id`, waiting for every acknowledgement.
async fn publish(options: &Options, topic: &str, count: usize) -> Result<(), BoxError> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &options.kafka)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()?;
    let accounts = options.drain.accounts.max(1);
    futures_util::stream::iter(0..count)
        .map(|n| {
            let producer = &producer;
            async move {
                let id = uuid::Uuid::now_v7().to_string();
                let body = payment_body(&id, n, accounts);
                let account = format!("acc-{:05}", n.wrapping_mul(7_919) % accounts);
                let record = FutureRecord::to(topic)
                    .key(&account)
                    .payload(&body)
                    .headers(OwnedHeaders::new().insert(Header {
                        key: "message_id",
                        value: Some(id.as_str()),
                    }));
                producer
                    .send(record, Duration::from_secs(30))
                    .await
                    .map(drop)
                    .map_err(|(error, _)| BoxError::from(error))
            }
        })
        .buffer_unordered(256)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<(), BoxError>>()
}
