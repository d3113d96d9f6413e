//! idem-kafka against a real Kafka-compatible broker (`tansu`, in memory): one
//! throwaway broker for the binary (stopped when the trials end), a topic
//! and a consumer group per case, a SQLite file (or a PostgreSQL database of
//! one shared throwaway cluster) per case as the inbox, the positions and
//! the effect.
//!
//! Every wait is bounded and fails loudly with what it waited for and what
//! it last saw.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idem_diesel::diesel::sql_types::{BigInt, Text};
use idem_diesel::diesel::{self, QueryableByName};
use idem_diesel::diesel_async::{AsyncConnection, TransactionManager};
use idem_diesel::diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem_diesel::{AsyncSqliteConnection, Event, PgInbox, Publish, SqliteInbox, SqliteOutbox};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{
    Advance, Attempt, Backoff, Consumer, ConsumerPolicy, DEFAULT_PREFETCH, Handler, HandlerError,
    HandlerFuture, MemoryInbox, Positions, Subscription,
};
use idem_testkit::fault::{Fault, Proxy};
use idem_testkit::wait::until;
use idem_testkit::{TempDir, TestKafka, TestPostgres};
use libtest_mimic::{Arguments, Failed, Trial};
use tokio::sync::oneshot;

type Outcome = Result<(), Failed>;

/// The longest a test waits for what it expects to become true.
const WAIT: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    let args = Arguments::from_args();
    tracing_subscriber_init();
    let trials = vec![
        trial(
            "records_are_applied_once_and_positions_come_from_the_database_sqlite",
            || applied_once(Db::Sqlite),
        ),
        trial(
            "records_are_applied_once_and_positions_come_from_the_database_postgres",
            || applied_once(Db::Postgres),
        ),
        trial(
            "records_are_applied_once_and_positions_come_from_a_memory_inbox",
            applied_once_in_memory,
        ),
        trial(
            "a_missing_topic_stops_the_start_unless_the_consumer_creates_it",
            missing_topic,
        ),
        trial(
            "a_failing_record_is_dead_lettered_after_exactly_three_attempts_in_order",
            dead_lettered_in_order,
        ),
        trial(
            "a_dead_letter_too_large_for_its_topic_is_cut_to_fit_and_the_partition_moves_on",
            oversized_dead_letter,
        ),
        trial(
            "lost_commit_answers_never_halt_a_partition_and_apply_each_record_once",
            lost_commit_answers,
        ),
        trial("a_member_leaving_hands_its_partitions_over", handover),
        trial("a_stale_owner_is_fenced", fenced),
        trial(
            "two_members_that_both_own_the_partitions_apply_each_record_once",
            two_owners,
        ),
        trial(
            "the_outbox_relay_publishes_each_event_and_the_consumer_applies_it_once",
            outbox_to_consumer,
        ),
        trial(
            "a_slow_handler_keeps_at_most_the_queue_in_memory_and_applies_each_record_once_in_order",
            slow_handler_bounded,
        ),
    ];
    let conclusion = libtest_mimic::run(&args, trials);
    conclusion.exit_code()
}

/// Every event of this crate, at every level, for the cases that read them.
fn tracing_subscriber_init() {
    let logs = Captured::default();
    let _ = LOGS.set(logs.clone());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("idem_kafka=trace"))
        .with_writer(logs)
        .with_ansi(false)
        .init();
}

/// What the log events wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

static LOGS: OnceLock<Captured> = OnceLock::new();

impl Captured {
    fn text() -> String {
        LOGS.get()
            .map(|logs| String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned())
            .unwrap_or_default()
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

fn trial<F>(name: &'static str, case: fn() -> F) -> Trial
where
    F: std::future::Future<Output = Outcome> + Send + 'static,
{
    Trial::test(name, move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Failed::from(format!("no runtime: {e}")))?;
        runtime.block_on(case())
    })
}

/// Which database a case keeps its inbox, positions and effect in.
#[derive(Clone, Copy, Debug)]
enum Db {
    Sqlite,
    Postgres,
}

/// The case's database, as the consumer's inbox.
#[derive(Clone)]
enum Inboxes {
    /// The file's directory lives as long as the inbox.
    Sqlite {
        inbox: SqliteInbox,
        _dir: TempDir,
    },
    Postgres(PgInbox),
}

async fn database(db: Db) -> Inboxes {
    match db {
        Db::Sqlite => {
            let dir = TempDir::new("kafka-test").unwrap();
            let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
            let inbox = SqliteInbox::builder()
                .max_connections(4)
                .connect(&url)
                .await
                .unwrap();
            inbox.migrate().await.unwrap();
            let mut connection = inbox.pool().get().await.unwrap();
            connection.batch_execute(SCHEMA).await.unwrap();
            drop(connection);
            Inboxes::Sqlite { inbox, _dir: dir }
        }
        Db::Postgres => {
            let cluster = TestPostgres::shared().expect("a PostgreSQL cluster (initdb, pg_ctl)");
            let name = cluster.fresh_database("kafka").unwrap();
            let inbox = PgInbox::builder()
                .max_connections(4)
                .connect(&cluster.url(&name))
                .await
                .unwrap();
            inbox.migrate().await.unwrap();
            let mut connection = inbox.pool().get().await.unwrap();
            connection.batch_execute(SCHEMA).await.unwrap();
            drop(connection);
            Inboxes::Postgres(inbox)
        }
    }
}

/// The effect: one row per record applied.
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS applied (value TEXT NOT NULL)";
const INSERT: &str = "INSERT INTO applied (value) VALUES ($1)";
const COUNT: &str =
    "SELECT COUNT(*) AS count, COUNT(DISTINCT value) AS distinct_values FROM applied";
const VALUES: &str = "SELECT value FROM applied ORDER BY value";

#[derive(QueryableByName)]
struct Counted {
    #[diesel(sql_type = BigInt)]
    count: i64,
    #[diesel(sql_type = BigInt)]
    distinct_values: i64,
}

#[derive(QueryableByName)]
struct Value {
    #[diesel(sql_type = Text)]
    value: String,
}

/// The effect's statement on either connection.
trait Effect: Send {
    fn insert<'a>(&'a mut self, value: &'a str) -> HandlerFuture<'a>;
}

macro_rules! effect_on {
    ($connection:ty) => {
        impl Effect for $connection {
            fn insert<'a>(&'a mut self, value: &'a str) -> HandlerFuture<'a> {
                Box::pin(async move {
                    diesel::sql_query(INSERT)
                        .bind::<Text, _>(value)
                        .execute(self)
                        .await
                        .map(drop)
                        .map_err(HandlerError::from)
                })
            }
        }
    };
}
effect_on!(AsyncPgConnection);
effect_on!(AsyncSqliteConnection);

impl Inboxes {
    /// (rows applied, distinct values applied).
    async fn applied(&self) -> (i64, i64) {
        let counted: Counted = match self {
            Self::Sqlite { inbox, .. } => {
                let mut c = inbox.pool().get().await.unwrap();
                diesel::sql_query(COUNT).get_result(&mut *c).await.unwrap()
            }
            Self::Postgres(inbox) => {
                let mut c = inbox.pool().get().await.unwrap();
                diesel::sql_query(COUNT).get_result(&mut *c).await.unwrap()
            }
        };
        (counted.count, counted.distinct_values)
    }

    async fn values(&self) -> Vec<String> {
        let rows: Vec<Value> = match self {
            Self::Sqlite { inbox, .. } => {
                let mut c = inbox.pool().get().await.unwrap();
                diesel::sql_query(VALUES)
                    .get_results(&mut *c)
                    .await
                    .unwrap()
            }
            Self::Postgres(inbox) => {
                let mut c = inbox.pool().get().await.unwrap();
                diesel::sql_query(VALUES)
                    .get_results(&mut *c)
                    .await
                    .unwrap()
            }
        };
        rows.into_iter().map(|r| r.value).collect()
    }

    /// Runs a consumer of `topic` in `group` until the returned sender is
    /// sent to (or dropped); answers when it has joined.
    async fn consume(&self, topic: &str, group: &str, handler: Apply) -> Running {
        self.consume_as(topic, topic, group, handler).await
    }

    /// [`consume`](Self::consume), under the inbox name `name`.
    async fn consume_as(&self, name: &str, topic: &str, group: &str, handler: Apply) -> Running {
        self.consume_queued(name, topic, group, DEFAULT_PREFETCH, handler)
            .await
    }

    /// [`consume_as`](Self::consume_as), `queue` records in each
    /// partition's worker's queue.
    async fn consume_queued(
        &self,
        name: &str,
        topic: &str,
        group: &str,
        queue: usize,
        handler: Apply,
    ) -> Running {
        match self {
            Self::Sqlite { inbox, .. } => {
                run(inbox.clone(), name, topic, group, queue, handler).await
            }
            Self::Postgres(inbox) => run(inbox.clone(), name, topic, group, queue, handler).await,
        }
    }
}

/// The test's handler: applies the record's value, or fails on a value
/// starting with `fail` until healed; logs what it did; takes `slow` longer
/// on each record.
#[derive(Clone, Default)]
struct Apply {
    healed: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<String>>>,
    slow: Duration,
}

impl<Tx: Effect + ?Sized> Handler<Tx> for Apply {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            let value = String::from_utf8_lossy(attempt.body()).into_owned();
            self.log.lock().unwrap().push(value.clone());
            if !self.slow.is_zero() {
                tokio::time::sleep(self.slow).await;
            }
            if value.starts_with("fail") && !AtomicBool::load(&self.healed, Ordering::SeqCst) {
                return Err(HandlerError::transient("a failing record"));
            }
            tx.insert(&value).await
        })
    }
}

/// A running consumer.
struct Running {
    stop: oneshot::Sender<()>,
    done: tokio::task::JoinHandle<Result<(), idem_kafka::Error>>,
    subscription: Subscription,
}

impl Running {
    /// Runs `consumer` until stopped, once it has joined its group (60 s at
    /// most).
    async fn start<I, H>(consumer: Consumer<I, H>) -> Self
    where
        I: Positions + Send + Sync + 'static,
        H: idem_kafka::Handler<I::Tx> + Send + Sync + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let (joined, on_join) = oneshot::channel();
        let done = tokio::spawn(consumer.run(
            async {
                let _ = stopped.await;
            },
            move |subscription| {
                let _ = joined.send(subscription.clone());
            },
        ));
        let joined = tokio::time::timeout(Duration::from_secs(60), on_join)
            .await
            .expect("the consumer joins its group within 60 s");
        let Ok(subscription) = joined else {
            let ended = done.await;
            panic!("the consumer ended before it joined: {ended:?}");
        };
        Self {
            stop,
            done,
            subscription,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(60), self.done)
            .await
            .expect("the consumer stops within 60 s")
            .unwrap()
            .unwrap();
    }
}

async fn run<I>(
    inbox: I,
    name: &str,
    topic: &str,
    group: &str,
    queue: usize,
    handler: Apply,
) -> Running
where
    I: Positions + Clone,
    I::Tx: Effect,
{
    let consumer = Consumer::builder(TestKafka::shared().servers(), topic)
        .group(group)
        .name(name)
        .inbox(inbox)
        .policy(ConsumerPolicy::new().max_attempts(3).backoff(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(100),
        )))
        .config("session.timeout.ms", "6000")
        .config("heartbeat.interval.ms", "500")
        .prefetch(queue)
        .handler(handler)
        .build()
        .expect("a valid topic");
    Running::start(consumer).await
}

async fn create_topic(topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", TestKafka::shared().servers())
        .create()
        .unwrap();
    let created = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    for result in created {
        result.unwrap();
    }
}

fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", TestKafka::shared().servers())
        .create()
        .unwrap()
}

/// Produces `value` with `message_id` and `key`, to `partition`.
async fn produce(producer: &FutureProducer, topic: &str, partition: i32, id: &str, value: &str) {
    let record = FutureRecord::to(topic)
        .partition(partition)
        .key(id)
        .payload(value)
        .headers(OwnedHeaders::new().insert(Header {
            key: "message_id",
            value: Some(id),
        }));
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
}

async fn positions(inboxes: &Inboxes, group: &str, topic: &str) -> Vec<(i32, i64)> {
    let map = match inboxes {
        Inboxes::Sqlite { inbox, .. } => inbox.positions(group, topic).await.unwrap(),
        Inboxes::Postgres(inbox) => inbox.positions(group, topic).await.unwrap(),
    };
    let mut positions: Vec<(i32, i64)> = map.into_iter().collect();
    positions.sort_unstable();
    positions
}

/// The values a handler on [`MemoryInbox`] (no transaction) applied.
#[derive(Clone, Default)]
struct Remember(Arc<Mutex<Vec<String>>>);

impl Handler<()> for Remember {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, _tx: &'a mut ()) -> HandlerFuture<'a> {
        Box::pin(async move {
            let value = String::from_utf8_lossy(attempt.body()).into_owned();
            self.0.lock().unwrap().push(value);
            Ok(())
        })
    }
}

/// A consumer of `topic` on `inbox`, until the answer is stopped.
async fn run_in_memory(inbox: MemoryInbox, topic: &str, handler: Remember) -> Running {
    let consumer = Consumer::builder(TestKafka::shared().servers(), topic)
        .inbox(inbox)
        .config("session.timeout.ms", "6000")
        .config("heartbeat.interval.ms", "500")
        .handler(handler)
        .build()
        .expect("a valid topic");
    Running::start(consumer).await
}

/// A topic name Kafka cannot carry is refused by `build`. A topic that does
/// not exist stops the start, named, before the consumer
/// joins anything; told to create it, the consumer creates it with the
/// partitions it was given, and joins with them. The outbox's publisher
/// names a missing destination (the relay retries it) and publishes once it
/// exists.
async fn missing_topic() -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("missing");
    let consumer = |create: bool| {
        let builder = Consumer::builder(broker.servers(), &topic)
            .inbox(MemoryInbox::new())
            .config("session.timeout.ms", "6000")
            .handler(Remember::default());
        match create {
            true => builder.create_topic(2).build(),
            false => builder.build(),
        }
        .expect("a valid topic")
    };
    // A name Kafka cannot carry is refused by `build`, before any broker.
    let invalid = Consumer::builder(broker.servers(), "pay ments")
        .inbox(MemoryInbox::new())
        .handler(Remember::default())
        .build();
    match invalid {
        Err(idem_kafka::Error::InvalidTopic { topic, .. }) if topic == "pay ments" => {}
        Err(other) => return Err(format!("expected InvalidTopic, got {other:?}").into()),
        Ok(_) => return Err("a topic name with a space was accepted".into()),
    }
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        consumer(false).run(std::future::pending(), |_| {}),
    )
    .await
    .map_err(|_| "the start with a missing topic still runs after 30 s")?;
    match refused {
        Err(idem_kafka::Error::MissingTopic { topic: named }) if named == topic => {}
        other => return Err(format!("expected MissingTopic {{ {topic} }}, got {other:?}").into()),
    }
    let message = idem_kafka::Error::MissingTopic {
        topic: topic.clone(),
    }
    .to_string();
    assert!(
        message.contains(&topic) && message.contains("create_topic"),
        "{message}"
    );
    // The outbox's publisher names a missing destination, for the relay's
    // log, and publishes once it exists.
    let events = broker.fresh_topic("missing-events");
    let publisher = idem_kafka::OutboxPublisher::connect(&broker.servers()).unwrap();
    let event = Event::new(events.clone(), "acc_1", "{}");
    match publisher.publish(&event).await {
        Err(idem_core::outbox::PublishError::Unavailable(error))
            if error
                .to_string()
                .contains(&format!("the topic {events} does not exist")) => {}
        other => return Err(format!("publishing to a missing topic: {other:?}").into()),
    }
    create_topic(&events, 1).await;
    publisher
        .publish(&event)
        .await
        .map_err(|e| format!("publishing once the topic exists: {e}"))?;
    let (stop, stopped) = oneshot::channel::<()>();
    let (joined, on_join) = oneshot::channel();
    let running = tokio::spawn(consumer(true).run(
        async {
            let _ = stopped.await;
        },
        move |subscription| {
            let _ = joined.send(subscription.partitions.clone());
        },
    ));
    let mut partitions = tokio::time::timeout(WAIT, on_join)
        .await
        .map_err(|_| "the consumer did not join within 60 s")?
        .map_err(|_| {
            format!(
                "the consumer ended before it joined: {:?}",
                running.is_finished()
            )
        })?;
    partitions.sort_unstable();
    let _ = stop.send(());
    running
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    if partitions != [0, 1] {
        return Err(format!("the created topic's partitions assigned: {partitions:?}").into());
    }
    Ok(())
}

/// The consumer on idem-core's `MemoryInbox`, which keeps the positions in
/// memory: 10 records and 3 producer duplicates over 2 partitions, 10
/// applied, the positions at the ends; restarted on the same inbox, only the
/// new record runs.
async fn applied_once_in_memory() -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("memory");
    create_topic(&topic, 2).await;
    let producer = producer();
    for i in 0..10 {
        let (id, value) = (format!("m{i:02}"), format!("v{i:02}"));
        produce(&producer, &topic, i % 2, &id, &value).await;
    }
    for i in 0..3 {
        let (id, value) = (format!("m{i:02}"), format!("v{i:02}"));
        produce(&producer, &topic, i % 2, &id, &value).await;
    }
    let inbox = MemoryInbox::new();
    let applied = Remember::default();
    let stored = |inbox: MemoryInbox, topic: String| async move {
        let mut positions: Vec<(i32, i64)> = inbox
            .positions(&topic, &topic)
            .await
            .unwrap()
            .into_iter()
            .collect();
        positions.sort_unstable();
        positions
    };
    let running = run_in_memory(inbox.clone(), &topic, applied.clone()).await;
    until(
        "every record consumed, positions at the ends",
        WAIT,
        || async {
            match stored(inbox.clone(), topic.clone()).await {
                positions if positions == [(0, 7), (1, 6)] => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;
    running.stop().await;
    let values = applied.0.lock().unwrap().len();
    if values != 10 {
        return Err(format!("applied {values} records, expected 10").into());
    }

    produce(&producer, &topic, 1, "m10", "v10").await;
    let running = run_in_memory(inbox.clone(), &topic, applied.clone()).await;
    until("the new record applied", WAIT, || async {
        match applied.0.lock().unwrap().len() {
            11 => Ok(()),
            other => Err(format!("{other} applied")),
        }
    })
    .await?;
    running.stop().await;
    let positions = stored(inbox.clone(), topic.clone()).await;
    if positions != [(0, 7), (1, 7)] {
        return Err(format!("positions {positions:?}, expected [(0, 7), (1, 7)]").into());
    }
    let mut values = applied.0.lock().unwrap().clone();
    values.sort_unstable();
    values.dedup();
    if values.len() != 11 {
        return Err(format!("{} distinct values applied, expected 11", values.len()).into());
    }
    Ok(())
}

/// 20 records and 5 producer duplicates over 2 partitions: 20 applied, the
/// positions stored; a restarted consumer applies only what is new.
async fn applied_once(db: Db) -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("once");
    create_topic(&topic, 2).await;
    let inboxes = database(db).await;
    let producer = producer();
    for i in 0..20 {
        produce(
            &producer,
            &topic,
            i % 2,
            &format!("m{i:02}"),
            &format!("v{i:02}"),
        )
        .await;
    }
    for i in 0..5 {
        // A producer's resend: the same id and value, later in the partition.
        produce(
            &producer,
            &topic,
            i % 2,
            &format!("m{i:02}"),
            &format!("v{i:02}"),
        )
        .await;
    }
    let running = inboxes.consume(&topic, &topic, Apply::default()).await;
    if running.subscription.partitions.len() != 2 {
        return Err(format!("assigned {:?}, expected 2 partitions", running.subscription).into());
    }
    until(
        "every record consumed, positions at the ends",
        WAIT,
        || async {
            let positions = positions(&inboxes, &topic, &topic).await;
            if positions == [(0, 13), (1, 12)] {
                Ok(())
            } else {
                Err(format!("{positions:?}"))
            }
        },
    )
    .await?;
    let applied = inboxes.applied().await;
    if applied != (20, 20) {
        return Err(format!("applied {applied:?}, expected 20 rows of 20 values").into());
    }
    running.stop().await;

    // Restarted: the positions come from the database; only the new record runs.
    produce(&producer, &topic, 1, "m20", "v20").await;
    let running = inboxes.consume(&topic, &topic, Apply::default()).await;
    until("the new record applied", WAIT, || async {
        match inboxes.applied().await {
            (21, 21) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    running.stop().await;
    let positions = positions(&inboxes, &topic, &topic).await;
    if positions != [(0, 13), (1, 13)] {
        return Err(format!("positions {positions:?}, expected [(0, 13), (1, 13)]").into());
    }
    Ok(())
}

/// a, fail, b on one partition: a applied, fail tried 3 times then in the
/// dead-letter topic with its headers, then b; a redrive applies it once.
async fn dead_lettered_in_order() -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("dlq");
    create_topic(&topic, 1).await;
    let inboxes = database(Db::Sqlite).await;
    let producer = producer();
    for (id, value) in [("a", "a"), ("f", "fail-1"), ("b", "b")] {
        produce(&producer, &topic, 0, id, value).await;
    }
    let apply = Apply::default();
    let running = inboxes.consume(&topic, &topic, apply.clone()).await;
    until("b applied", WAIT, || async {
        match inboxes.applied().await {
            (2, 2) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    let log = apply.log.lock().unwrap().clone();
    if log != ["a", "fail-1", "fail-1", "fail-1", "b"] {
        return Err(format!("handler runs {log:?}, expected a, fail-1 ×3, b").into());
    }
    let letters = idem_kafka::dead_letters(&broker.servers(), &topic)
        .await
        .unwrap();
    let [letter] = letters.as_slice() else {
        return Err(format!("dead letters {letters:?}, expected one").into());
    };
    let expected = (
        topic.as_str(),
        Some("f"),
        3,
        "a failing record",
        &b"fail-1"[..],
        0,
    );
    let got = (
        letter.topic.as_str(),
        letter.message_id.as_deref(),
        letter.attempted_at.len(),
        letter.reason.as_str(),
        letter.body.as_ref(),
        letter.offset,
    );
    if got != expected {
        return Err(format!("dead letter {got:?}, expected {expected:?}").into());
    }

    // Fixed, then re-driven: applied once; a second redrive moves nothing.
    apply.healed.store(true, Ordering::SeqCst);
    let moved = idem_kafka::redrive(&broker.servers(), &topic)
        .await
        .unwrap()
        .republished;
    if moved != 1 {
        return Err(format!("redrive moved {moved}, expected 1").into());
    }
    until("the re-driven record applied", WAIT, || async {
        match inboxes.applied().await {
            (3, 3) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    let again = idem_kafka::redrive(&broker.servers(), &topic)
        .await
        .unwrap()
        .republished;
    let left = idem_kafka::dead_letters(&broker.servers(), &topic)
        .await
        .unwrap();
    if again != 0 || !left.is_empty() {
        return Err(format!(
            "a second redrive moved {again}, {} letters listed",
            left.len()
        )
        .into());
    }
    running.stop().await;
    let values = inboxes.values().await;
    if values != ["a", "b", "fail-1"] {
        return Err(format!("applied {values:?}").into());
    }
    Ok(())
}

/// A failing record of 1,010,000 bytes (under a broker's usual limit, over
/// the producer's 1,000,000 default) and a healthy one behind it: the dead
/// letter is produced cut to fit, marked with its whole size; the healthy
/// one is applied; a redrive republishes nothing and names the cut letter,
/// which stays listed.
async fn oversized_dead_letter() -> Outcome {
    const SIZE: usize = 1_010_000;
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("oversized");
    create_topic(&topic, 1).await;
    let inboxes = database(Db::Sqlite).await;
    let large: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.servers())
        .set("message.max.bytes", "2000000")
        .create()
        .unwrap();
    let value = format!("fail-{}", "x".repeat(SIZE - 5));
    produce(&large, &topic, 0, "big", &value).await;
    produce(&large, &topic, 0, "b", "b").await;
    let apply = Apply::default();
    let running = inboxes.consume(&topic, &topic, apply.clone()).await;
    until("the record behind the large one applied", WAIT, || async {
        match inboxes.applied().await {
            (1, 1) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    running.stop().await;
    let letters = idem_kafka::dead_letters(&broker.servers(), &topic)
        .await
        .unwrap();
    let [letter] = letters.as_slice() else {
        return Err(format!("{} dead letters, expected one", letters.len()).into());
    };
    let got = (
        letter.message_id.as_deref(),
        letter.truncated,
        letter.attempted_at.len(),
        letter.body.len() < 1_000_000,
        letter.body.starts_with(b"fail-xxx"),
    );
    let expected = (Some("big"), Some(SIZE as u64), 3, true, true);
    if got != expected {
        return Err(format!(
            "dead letter (id, truncated, attempts, cut under 1,000,000, its start) {got:?}, expected {expected:?}"
        )
        .into());
    }
    let redrive = idem_kafka::redrive(&broker.servers(), &topic)
        .await
        .unwrap();
    let listed = idem_kafka::dead_letters(&broker.servers(), &topic)
        .await
        .unwrap();
    let got = (
        redrive.republished,
        redrive
            .kept
            .iter()
            .map(|l| l.message_id.clone())
            .collect::<Vec<_>>(),
        listed.len(),
    );
    if got != (0, vec![Some("big".to_owned())], 1) {
        return Err(format!(
            "redrive (republished, kept) and letters listed after: {got:?}, expected (0, [big], 1)"
        )
        .into());
    }
    if inboxes.values().await != ["b"] {
        return Err(format!("applied {:?}", inboxes.values().await).into());
    }
    Ok(())
}

/// The inbox's PostgreSQL behind a proxy that loses the answer to every 5th
/// COMMIT (the commit lands; the consumer cannot know): 60 records over 3
/// partitions are each applied once, every partition reaches its end, and
/// no worker was fenced (a retried position write that finds the row where
/// it goes is done, not another owner's).
async fn lost_commit_answers() -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("lost");
    create_topic(&topic, 3).await;
    let cluster = TestPostgres::shared().expect("a PostgreSQL cluster (initdb, pg_ctl)");
    let name = cluster.fresh_database("lost").unwrap();
    let proxy = Proxy::postgres(([127, 0, 0, 1], cluster.port()).into()).unwrap();
    let url = format!("postgres://postgres@{}/{name}", proxy.addr());
    let inbox = PgInbox::builder()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    inbox.migrate().await.unwrap();
    let mut connection = inbox.pool().get().await.unwrap();
    connection.batch_execute(SCHEMA).await.unwrap();
    drop(connection);
    let inboxes = Inboxes::Postgres(inbox);
    let producer = producer();
    for i in 0..60 {
        produce(
            &producer,
            &topic,
            i % 3,
            &format!("m{i:02}"),
            &format!("v{i:02}"),
        )
        .await;
    }
    proxy.set(Fault::LoseCommitAnswers { every: 5 });
    let running = inboxes.consume(&topic, &topic, Apply::default()).await;
    until("every partition at its end", WAIT, || async {
        let positions = positions(&inboxes, &topic, &topic).await;
        if positions == [(0, 20), (1, 20), (2, 20)] {
            Ok(())
        } else {
            Err(format!("positions {positions:?}"))
        }
    })
    .await?;
    let lost = proxy.lost_commit_answers();
    proxy.set(Fault::None);
    running.stop().await;
    let applied = inboxes.applied().await;
    let fenced = Captured::text()
        .lines()
        .filter(|line| line.contains(&topic) && line.contains("rejoin"))
        .count();
    if applied != (60, 60) || lost < 10 || fenced != 0 {
        return Err(format!(
            "applied {applied:?} (expected (60, 60)), {lost} COMMIT answers lost (expected at least 10), {fenced} fenced lines (expected 0)"
        )
        .into());
    }
    Ok(())
}

/// Member A applies the first half; member B joins; A leaves; B applies the
/// rest: each record once.
async fn handover() -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("handover");
    create_topic(&topic, 2).await;
    let inboxes = database(Db::Sqlite).await;
    let producer = producer();
    for i in 0..10 {
        produce(
            &producer,
            &topic,
            i % 2,
            &format!("m{i:02}"),
            &format!("v{i:02}"),
        )
        .await;
    }
    let a = inboxes.consume(&topic, &topic, Apply::default()).await;
    until("the first half applied", WAIT, || async {
        match inboxes.applied().await {
            (10, 10) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    let b = inboxes.consume(&topic, &topic, Apply::default()).await;
    a.stop().await;
    for i in 10..20 {
        produce(
            &producer,
            &topic,
            i % 2,
            &format!("m{i:02}"),
            &format!("v{i:02}"),
        )
        .await;
    }
    until(
        "every record applied once, by the member left",
        WAIT,
        || async {
            match inboxes.applied().await {
                (20, 20) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await?;
    b.stop().await;
    Ok(())
}

/// The fence: a move from an offset the row no longer holds writes nothing,
/// unless the row is already where the move goes.
async fn fenced() -> Outcome {
    let inboxes = database(Db::Sqlite).await;
    let Inboxes::Sqlite { inbox, .. } = &inboxes else {
        unreachable!()
    };
    inbox.migrate_positions().await.unwrap();
    let step = |from, to| Advance {
        consumer: "c",
        topic: "t",
        partition: 0,
        from,
        to,
    };
    let moves = [
        (step(None, 5), true),
        // The same move again: the retry of a COMMIT whose answer was lost.
        (step(None, 5), true),
        (step(None, 6), false),
        (step(Some(4), 6), false),
        (step(Some(5), 6), true),
        (step(Some(5), 6), true),
        // Behind the row: another owner moved it past this record.
        (step(Some(4), 5), false),
    ];
    for (advance, expected) in moves {
        let written = inbox.advance_alone(&advance).await.unwrap();
        if written != expected {
            return Err(format!("{advance:?} wrote {written}, expected {expected}").into());
        }
    }
    Ok(())
}

/// 30 events staged in one transaction of the inbox's SQLite file, published
/// by the relay with idem-kafka's `OutboxPublisher` (each event's id as its
/// `message_id`, its key as the record's key), and one published again (a
/// relay that crashed before marking it sent): the consumer applies 30.
async fn outbox_to_consumer() -> Outcome {
    type Manager = <AsyncSqliteConnection as AsyncConnection>::TransactionManager;
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("outbox");
    create_topic(&topic, 2).await;
    let inboxes = database(Db::Sqlite).await;
    let Inboxes::Sqlite { inbox, .. } = &inboxes else {
        unreachable!()
    };
    let outbox = SqliteOutbox::builder().build(inbox.pool().clone());
    outbox.migrate().await.unwrap();
    let events: Vec<Event> = (0..30)
        .map(|i| Event::new(topic.clone(), format!("acct-{}", i % 3), format!("e{i:02}")))
        .collect();
    let mut pooled = outbox.pool().get().await.unwrap();
    let connection: &mut AsyncSqliteConnection = &mut pooled;
    Manager::begin_transaction(connection).await.unwrap();
    for event in &events {
        outbox.stage(connection, event).await.unwrap();
    }
    Manager::commit_transaction(connection).await.unwrap();
    drop(pooled);

    let running = inboxes.consume(&topic, &topic, Apply::default()).await;
    let publisher = idem_kafka::OutboxPublisher::connect(&broker.servers()).unwrap();
    let (stop_relay, relay_stopped) = oneshot::channel::<()>();
    let relay = tokio::spawn(outbox.relay(publisher).expect("migrated").run(async {
        let _ = relay_stopped.await;
    }));
    until("every event applied", WAIT, || async {
        match inboxes.applied().await {
            (30, 30) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await?;
    // Published again under the same id: a duplicate, at a new offset.
    let again = idem_kafka::OutboxPublisher::connect(&broker.servers()).unwrap();
    again.publish(&events[0]).await.unwrap();
    until("the republished event consumed", WAIT, || async {
        let passed: i64 = positions(&inboxes, &topic, &topic)
            .await
            .iter()
            .map(|(_, next)| next)
            .sum();
        if passed == 31 {
            Ok(())
        } else {
            Err(format!("the positions passed {passed} records"))
        }
    })
    .await?;
    let _ = stop_relay.send(());
    let _ = relay.await;
    running.stop().await;
    let applied = inboxes.applied().await;
    if applied != (30, 30) {
        return Err(format!("applied {applied:?}, expected each of the 30 events once").into());
    }
    Ok(())
}

/// A lost assignment at its worst: two members (in two groups, under one
/// consumer name) each own both partitions and apply them at once. The fence
/// lets one commit each record and stops the other: 200 records, 200 effects.
async fn two_owners() -> Outcome {
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("owners");
    create_topic(&topic, 2).await;
    let inboxes = database(Db::Postgres).await;
    let producer = producer();
    for i in 0..200 {
        produce(
            &producer,
            &topic,
            i % 2,
            &format!("m{i:03}"),
            &format!("v{i:03}"),
        )
        .await;
    }
    let (group_a, group_b) = (format!("{topic}-a"), format!("{topic}-b"));
    let (a, b) = tokio::join!(
        inboxes.consume_as("payments", &topic, &group_a, Apply::default()),
        inboxes.consume_as("payments", &topic, &group_b, Apply::default()),
    );
    // The stored positions, polled: they only ever move forward.
    let highest = Arc::new(Mutex::new(std::collections::HashMap::<i32, i64>::new()));
    let backwards = Arc::new(Mutex::new(Vec::new()));
    until("every record consumed once", WAIT, || {
        let (inboxes, topic) = (&inboxes, &topic);
        let (highest, backwards) = (Arc::clone(&highest), Arc::clone(&backwards));
        async move {
            let positions = positions(inboxes, "payments", topic).await;
            {
                let mut highest = highest.lock().unwrap();
                for &(partition, next) in &positions {
                    let seen = highest.entry(partition).or_insert(next);
                    if next < *seen {
                        backwards.lock().unwrap().push((partition, *seen, next));
                    }
                    *seen = (*seen).max(next);
                }
            }
            let applied = inboxes.applied().await;
            if positions == [(0, 100), (1, 100)] && applied == (200, 200) {
                Ok(())
            } else {
                Err(format!("positions {positions:?}, applied {applied:?}"))
            }
        }
    })
    .await?;
    let backwards = backwards.lock().unwrap().clone();
    if !backwards.is_empty() {
        return Err(format!(
            "stored positions moved backwards (partition, from, to): {backwards:?}"
        )
        .into());
    }
    a.stop().await;
    b.stop().await;
    let applied = inboxes.applied().await;
    if applied != (200, 200) {
        return Err(format!("applied {applied:?}, expected each of 200 once").into());
    }
    Ok(())
}

/// A slow handler and queues of 4 records: 200 records over 2 partitions,
/// fetched far ahead of the handler. Each record is applied once, each
/// partition in order, and no partition ever had more than its queue's 4
/// records in the consumer's memory (the `held` of its trace events).
async fn slow_handler_bounded() -> Outcome {
    const QUEUE: usize = 4;
    const PER_PARTITION: usize = 100;
    const END: i64 = PER_PARTITION as i64;
    let broker = TestKafka::shared();
    let topic = broker.fresh_topic("bounded");
    create_topic(&topic, 2).await;
    let inboxes = database(Db::Sqlite).await;
    let producer = producer();
    for i in 0..PER_PARTITION {
        for partition in 0..2 {
            let value = format!("p{partition}-{i:03}");
            produce(&producer, &topic, partition, &value, &value).await;
        }
    }
    let apply = Apply {
        slow: Duration::from_millis(5),
        ..Apply::default()
    };
    let running = inboxes
        .consume_queued(&topic, &topic, &topic, QUEUE, apply.clone())
        .await;
    until(
        "every record applied, positions at the ends",
        WAIT,
        || async {
            let positions = positions(&inboxes, &topic, &topic).await;
            match inboxes.applied().await {
                (200, 200) if positions == [(0, END), (1, END)] => Ok(()),
                other => Err(format!("applied {other:?}, positions {positions:?}")),
            }
        },
    )
    .await?;
    running.stop().await;

    let log = apply.log.lock().unwrap().clone();
    for partition in 0..2 {
        let prefix = format!("p{partition}-");
        let ran: Vec<&String> = log.iter().filter(|v| v.starts_with(&prefix)).collect();
        let expected: Vec<String> = (0..PER_PARTITION)
            .map(|i| format!("{prefix}{i:03}"))
            .collect();
        if ran != expected.iter().collect::<Vec<_>>() {
            return Err(format!(
                "partition {partition}: the handler ran {ran:?}, expected each of \
                 {prefix}000..{prefix}{:03} once, in order",
                PER_PARTITION - 1
            )
            .into());
        }
    }

    // The consumer's trace of the records it held: `topic=… partition=N held=N`.
    let logs = Captured::text();
    let topic_field = format!("topic={topic}");
    let mut peaks = [None::<usize>; 2];
    for line in logs.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if !fields.contains(&topic_field.as_str()) {
            continue;
        }
        let field = |name: &str| {
            fields.iter().find_map(|f| {
                f.strip_prefix(name)?
                    .strip_prefix('=')?
                    .parse::<usize>()
                    .ok()
            })
        };
        if let (Some(partition), Some(held)) = (field("partition"), field("held")) {
            let peak = &mut peaks[partition];
            *peak = Some(peak.map_or(held, |p| p.max(held)));
        }
    }
    for (partition, peak) in peaks.iter().enumerate() {
        match peak {
            Some(peak) if *peak <= QUEUE => {}
            Some(peak) => {
                return Err(format!(
                    "partition {partition} had {peak} records in the consumer's memory, \
                     more than its queue's {QUEUE}"
                )
                .into());
            }
            None => {
                return Err(format!(
                    "no trace of the records partition {partition} held (`held=`)"
                )
                .into());
            }
        }
    }
    Ok(())
}
