//! The consumer: a member of a consumer group whose positions live in the
//! inbox ([`Positions`]: on a database inbox, in its database).
//!
//! # How it runs
//!
//! - **One polling thread** owns librdkafka's consumer: it polls, serves the
//!   group's rebalances (in librdkafka's rebalance callback, on that thread),
//!   hands each record to its partition's worker, and stores the offsets the
//!   workers committed for the broker's next auto-commit.
//! - **One worker per assigned partition** (a Tokio task) applies its records
//!   in order, one at a time; partitions run side by side. A worker's queue is
//!   bounded, and so is what a partition holds in memory: each partition's
//!   records arrive in a queue of its own in librdkafka (split off the
//!   consumer's queue when the partition is assigned), and the polling thread
//!   takes one from there only when the worker's queue has room. The others
//!   wait in librdkafka, which stops fetching the partition while its queue
//!   holds `queued.min.messages` (the worker queue's size) or
//!   `queued.max.messages.kbytes`. A partition that retries in place holds
//!   back no other. (The partition is neither paused at the broker nor
//!   sought back: see `feed`.)
//! - **On assignment**, each partition's position is read from the database
//!   and the partition is assigned at it (a partition without a row starts
//!   from the group's committed offset, or `auto.offset.reset`, `earliest`
//!   by default: the first time only).
//! - **On revocation** (or a lost assignment), the revoked partitions'
//!   workers finish the record they are on (it commits or rolls back) and
//!   stop before the partitions are handed over. A member that lost a
//!   partition without knowing is stopped by the fence: its transaction finds
//!   the row moved and commits nothing.
//! - **A fenced partition is never left idle.** A position write that finds
//!   the row already where it goes (this member's own COMMIT landed and its
//!   answer was lost) is done, and the partition goes on. One that finds the
//!   row anywhere else means another member moved it: the worker stops, and
//!   the member leaves the group and joins it again (logged at WARN, with
//!   the partition), so the group hands every partition out afresh and each
//!   owner starts at the stored positions. A partition this member no
//!   longer owns goes to its owner; one it still owns restarts where the
//!   database says.
//!
//! The rebalance strategy is eager (`range`, the default): a cooperative one
//! would hand over partitions incrementally, which this member's callback
//! does not do.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak, mpsc as std_mpsc};
use std::time::Duration;

use idem_core::consume::{
    Acked, Advance, Advanced, Batch, BatchHandler, ConsumerPolicy, Decision, Handler, Letter,
    Message, PartitionBatch, Positions, Protocol, held_wait,
};
use idem_core::log::{bounded, error_chain};
use idem_core::retry::Backoff;
use rdkafka::ClientConfig;
use rdkafka::Message as _;
use rdkafka::client::ClientContext;
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};
use tokio::sync::{mpsc, oneshot, watch};

use crate::error::Error;
use crate::fence::Fenced;
use crate::record::{dead_letter_headers, message_of};
use crate::topics;

/// How many records wait in a partition's worker's queue, and in its queue
/// in librdkafka before it stops fetching the partition: see
/// [`ConsumerBuilder::prefetch`].
pub const DEFAULT_PREFETCH: usize = 256;
pub use idem_core::consume::runner::DEFAULT_SHUTDOWN_TIMEOUT;
/// How long the polling thread waits at most for a word from a worker or
/// librdkafka (and so how soon it sees a stop, or a second event queued in
/// librdkafka at once).
const POLL: Duration = Duration::from_millis(50);
/// How often librdkafka looks again at a partition whose queue was full
/// (`fetch.queue.backoff.ms`, 1000 by librdkafka's default, made for queues
/// of 100 000 records): the worker's queue drains in less.
const FETCH_QUEUE_BACKOFF_MS: &str = "50";
/// The pause before trying the database or the broker again.
const AGAIN: Duration = Duration::from_millis(500);
/// When to produce a dead letter again after a refusal that can pass.
const REFUSED: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));

/// A builder's part not given yet.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unset;

/// What the consumer was given when it joined its group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscription {
    /// The topic.
    pub topic: String,
    /// The partitions first assigned to this member (none when the group has
    /// more members than partitions).
    pub partitions: Vec<i32>,
}

/// Builds a [`Consumer`]: [`Consumer::builder`].
#[must_use]
pub struct ConsumerBuilder<I = Unset, H = Unset> {
    inbox: I,
    handler: H,
    options: Options,
}

/// A builder's settings beside its inbox and handler: what `inbox` and
/// `handler` carry over unchanged.
struct Options {
    servers: String,
    topic: String,
    group: Option<String>,
    name: Option<String>,
    policy: ConsumerPolicy,
    config: Vec<(String, String)>,
    prefetch: usize,
    shutdown_timeout: Duration,
    /// Partitions of the topic to create if it is missing; `None`: a
    /// missing topic stops the start.
    create_topic: Option<i32>,
}

/// A Kafka consumer that applies each record once: see the crate's docs.
pub struct Consumer<I, H> {
    servers: String,
    topic: String,
    group: String,
    name: String,
    inbox: I,
    policy: ConsumerPolicy,
    handler: H,
    config: Vec<(String, String)>,
    prefetch: usize,
    shutdown_timeout: Duration,
    /// Partitions of the topic to create if it is missing; `None`: a
    /// missing topic stops the start.
    create_topic: Option<i32>,
}

impl Consumer<Unset, Unset> {
    /// A consumer of `topic` on the cluster of `servers`
    /// (`HOST:PORT[,HOST:PORT…]`). Give it an inbox
    /// ([`inbox`](ConsumerBuilder::inbox)) and a handler
    /// ([`handler`](ConsumerBuilder::handler)); the group is `topic` unless
    /// [`group`](ConsumerBuilder::group) says otherwise.
    pub fn builder(servers: impl Into<String>, topic: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            inbox: Unset,
            handler: Unset,
            options: Options {
                servers: servers.into(),
                topic: topic.into(),
                group: None,
                name: None,
                policy: ConsumerPolicy::new(),
                config: Vec::new(),
                prefetch: DEFAULT_PREFETCH,
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
                create_topic: None,
            },
        }
    }
}

impl<I, H> ConsumerBuilder<I, H> {
    /// The consumer group (`group.id`).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.options.group = Some(group.into());
        self
    }

    /// The consumer's name in the inbox and in its positions (each
    /// consumer of a record applies it once); the group by default.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.options.name = Some(name.into());
        self
    }

    /// The policy: attempts, backoff, classification, the dead-letter alert.
    pub fn policy(mut self, policy: ConsumerPolicy) -> Self {
        self.options.policy = policy;
        self
    }

    /// A librdkafka consumer setting (`session.timeout.ms`, TLS, SASL…).
    /// The settings this crate relies on (`group.id`,
    /// `enable.auto.offset.store`) cannot be overridden.
    pub fn config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.config.push((key.into(), value.into()));
        self
    }

    /// How many records wait in each partition's worker's queue
    /// ([`DEFAULT_PREFETCH`]); it bounds what a slow partition holds in memory.
    ///
    /// Each partition's records arrive in a queue of its own in librdkafka,
    /// and one is taken from there only when the worker's queue has room.
    /// The consumer sets librdkafka's `queued.min.messages` to the same size:
    /// librdkafka stops fetching a partition while its queue holds that many
    /// records, and fetches again once the worker has drained it below (it
    /// looks again every `fetch.queue.backoff.ms`, which the consumer sets to
    /// 50). So a partition's records in memory are at most twice this size
    /// and one fetch (`max.partition.fetch.bytes`, 1 MiB by default), or
    /// `queued.max.messages.kbytes` (per partition) and one fetch if that
    /// comes first. Each of these can be set with [`config`](Self::config).
    ///
    /// No record is dropped or fetched twice for it, and the broker sees
    /// nothing of it: the partition is not paused (with tansu 0.6, a
    /// partition paused then resumed received nothing more).
    pub fn prefetch(mut self, records: usize) -> Self {
        self.options.prefetch = records.max(1);
        self
    }

    /// How long a revocation or a stop waits for the records being applied
    /// ([`DEFAULT_SHUTDOWN_TIMEOUT`]).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.options.shutdown_timeout = timeout;
        self
    }

    /// Creates the topic with `partitions` partitions (and the cluster's
    /// default replication) when it does not exist at start. Without it, a
    /// missing topic stops the start with [`Error::MissingTopic`], naming
    /// it: a consumer of a misspelt topic would otherwise wait for records
    /// that never come.
    pub fn create_topic(mut self, partitions: i32) -> Self {
        self.options.create_topic = Some(partitions);
        self
    }

    /// The inbox, which also keeps the positions ([`Positions`]):
    /// idem-diesel's `PgInbox` or `SqliteInbox` (the positions in its
    /// database, in the handler's transaction), or idem-core's `MemoryInbox`.
    pub fn inbox<J: Positions>(self, inbox: J) -> ConsumerBuilder<J, H> {
        ConsumerBuilder {
            inbox,
            handler: self.handler,
            options: self.options,
        }
    }

    /// The handler: applies one record on the inbox's transaction.
    pub fn handler<G>(self, handler: G) -> ConsumerBuilder<I, G> {
        ConsumerBuilder {
            inbox: self.inbox,
            handler,
            options: self.options,
        }
    }

    /// What applies records in batches, instead of [`handler`](Self::handler):
    /// each partition's worker takes the records already waiting for it
    /// (never waiting to fill a batch), up to `size`, and applies them
    /// together, in order, on one transaction with one move of the
    /// partition's position past them ([`Protocol::decide_batch_advancing`](idem_core::consume::Protocol::decide_batch_advancing)).
    /// A batch that fails is split, the earlier half first; a record that
    /// fails alone is retried in place and dead-lettered as one at a time,
    /// the records after it waiting for it.
    pub fn batch_handler<B>(self, handler: B, size: usize) -> ConsumerBuilder<I, Batch<B>> {
        self.handler(Batch::new(handler, size))
    }
}

impl<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static> ConsumerBuilder<I, H> {
    /// The consumer. Fails on a topic name Kafka cannot carry (or whose
    /// dead-letter topic, `<topic>.dlq`, it cannot); the broker is not
    /// contacted until [`run`](Consumer::run), as RabbitMQ's and SQS's
    /// builders do.
    pub fn build(self) -> Result<Consumer<I, H>, Error> {
        topics::check_name(&topics::dead_letter_topic(&self.options.topic))
            .and_then(|()| topics::check_name(&self.options.topic))
            .map_err(|why| Error::InvalidTopic {
                topic: self.options.topic.clone(),
                why,
            })?;
        let group = self
            .options
            .group
            .unwrap_or_else(|| self.options.topic.clone());
        let name = self.options.name.unwrap_or_else(|| group.clone());
        Ok(Consumer {
            servers: self.options.servers,
            topic: self.options.topic,
            group,
            name,
            inbox: self.inbox,
            policy: self.options.policy,
            handler: self.handler,
            config: self.options.config,
            prefetch: self.options.prefetch,
            shutdown_timeout: self.options.shutdown_timeout,
            create_topic: self.options.create_topic,
        })
    }
}

impl<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static> Consumer<I, H> {
    /// The dead-letter topic: `<topic>.dlq`.
    pub fn dead_letter_topic(&self) -> String {
        topics::dead_letter_topic(&self.topic)
    }

    /// Consumes until `stop` resolves; calls `subscribed` once, when the
    /// group first assigned this member its partitions. Creates where the
    /// inbox keeps the positions ([`Positions::migrate_positions`]) and the
    /// dead-letter topic if they are missing. On `stop`, the records being
    /// applied finish (they commit or roll back), the broker's offsets are
    /// committed, and the member leaves its group.
    ///
    /// **Start:** an inbox that is not ready ([`Inbox::readiness`](idem_core::consume::Inbox::readiness):
    /// idem-diesel's, neither migrated nor checked in this process) is
    /// [`Error::NotReady`] at once, before anything is contacted; a topic
    /// that does not exist is [`Error::MissingTopic`], unless the builder
    /// said to create it ([`ConsumerBuilder::create_topic`]).
    ///
    /// **Ends by itself** only when a member that had to leave its group
    /// (a partition fenced: its stored position moved under it) could not
    /// join it again:
    /// [`Error::Kafka`], after the records being applied finished.
    ///
    /// Must run on a multi-threaded Tokio runtime or a current-thread one
    /// alike: the polling thread is a thread of its own.
    pub async fn run(
        self,
        stop: impl Future<Output = ()>,
        subscribed: impl FnOnce(&Subscription),
    ) -> Result<(), Error> {
        self.inbox.readiness()?;
        self.inbox
            .migrate_positions()
            .await
            .map_err(Error::Offsets)?;
        topics::require(&self.servers, &self.topic, self.create_topic).await?;
        let dlq = self.dead_letter_topic();
        topics::ensure(&self.servers, &dlq).await?;
        let producer = topics::producer(&self.servers)?;
        let (commands, received) = std_mpsc::channel();
        let shared = Arc::new(Shared {
            protocol: Protocol::new(self.name, Fenced::new(self.inbox), self.policy),
            handler: self.handler,
            topic: self.topic.clone(),
            dlq,
            producer,
            runtime: tokio::runtime::Handle::current(),
            commands,
            prefetch: self.prefetch,
            shutdown_timeout: self.shutdown_timeout,
            stopping: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        let (assigned, first_assignment) = oneshot::channel();
        let context = Context {
            shared: Arc::clone(&shared),
            consumer: OnceLock::new(),
            workers: Mutex::new(HashMap::new()),
            assigned: Mutex::new(Some(assigned)),
        };
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.servers)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true")
            // What a partition holds in librdkafka, fetched ahead: see `queue`.
            .set("queued.min.messages", self.prefetch.to_string())
            .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS);
        for (key, value) in &self.config {
            config.set(key, value);
        }
        config
            .set("group.id", &self.group)
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false");
        let mut consumer: BaseConsumer<Context<I, H>> = config
            .create_with_context(context)
            .map_err(Error::kafka("create the consumer"))?;
        // A rebalance, an error or a commit's result wakes the polling thread.
        consumer.set_nonempty_callback(waker(&shared.commands));
        let consumer = Arc::new(consumer);
        let _ = consumer.context().consumer.set(Arc::downgrade(&consumer));
        consumer
            .subscribe(&[self.topic.as_str()])
            .map_err(Error::kafka("subscribe"))?;
        tracing::info!(target: "idem_kafka", topic = %bounded(&self.topic), group = %bounded(&self.group), "joining the group");

        let (ended, polling_ended) = oneshot::channel();
        let polling = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("idem-kafka-poll".into())
            .spawn(move || {
                poll(&consumer, &polling, &received);
                // Closing serves the revoke that leaving triggers and sends the
                // group its LeaveGroup. It is done before `run` returns, so a
                // process that exits right after leaves no member behind (a
                // broker that does not expire members, as tansu 0.6, would
                // keep its partitions with it).
                drop(consumer);
                tracing::info!(target: "idem_kafka", "left the group");
                let _ = ended.send(());
            })
            .map_err(Error::Thread)?;

        tokio::pin!(stop);
        let mut polling_ended = polling_ended;
        // The polling thread ends before a stop only when it could not join
        // the group again (see `rejoin`).
        let ended_first = tokio::select! {
            () = &mut stop => false,
            _ = &mut polling_ended => true,
            Ok(partitions) = first_assignment => {
                subscribed(&Subscription { topic: self.topic.clone(), partitions });
                tokio::select! {
                    () = &mut stop => false,
                    _ = &mut polling_ended => true,
                }
            }
        };
        if !ended_first {
            tracing::info!(target: "idem_kafka", "stopping: the records being applied finish");
            shared.stopping.store(true, Ordering::SeqCst);
            let _ = polling_ended.await;
        }
        match lock(&shared.failed).take() {
            Some(source) => Err(Error::Kafka {
                doing: "join the group again",
                source,
            }),
            None => Ok(()),
        }
    }
}

/// What the polling thread and the workers share.
struct Shared<I: Positions, H> {
    protocol: Protocol<Fenced<I>>,
    handler: H,
    topic: String,
    dlq: String,
    producer: FutureProducer,
    runtime: tokio::runtime::Handle,
    commands: std_mpsc::Sender<Command>,
    prefetch: usize,
    shutdown_timeout: Duration,
    stopping: AtomicBool,
    /// Why the polling thread stopped on its own, when it did.
    failed: Mutex<Option<KafkaError>>,
}

/// A word to the polling thread, from a worker or librdkafka.
enum Command {
    /// The partition's records up to this offset (excluded) are applied:
    /// stored for the broker's next auto-commit. The worker has room again.
    Applied { partition: i32, next: i64 },
    /// The partition's worker stopped (fenced): the member leaves the group
    /// and joins it again.
    Rejoin { partition: i32 },
    /// Something to serve: a queue in librdkafka (the consumer's, or a
    /// partition's) was empty and is not, or a worker has room again.
    Wake,
}

/// A callback for librdkafka (it runs on librdkafka's threads) that wakes the
/// polling thread.
fn waker(commands: &std_mpsc::Sender<Command>) -> impl Fn() + Send + Sync + 'static {
    let commands = commands.clone();
    move || {
        let _ = commands.send(Command::Wake);
    }
}

/// librdkafka's callbacks: the rebalances.
struct Context<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static> {
    shared: Arc<Shared<I, H>>,
    /// The consumer, once created: an assigned partition's queue is split off
    /// it, which takes an `Arc`. (Weak: the consumer owns this context.)
    consumer: OnceLock<Weak<BaseConsumer<Self>>>,
    workers: Mutex<HashMap<i32, Worker<Self>>>,
    assigned: Mutex<Option<oneshot::Sender<Vec<i32>>>>,
}

/// A partition's worker, as the polling thread holds it.
struct Worker<C: ConsumerContext> {
    /// The partition's records in librdkafka, fetched ahead of the worker.
    /// (It holds the consumer: the workers are dropped before the consumer
    /// is, in `poll`.)
    records: PartitionQueue<C>,
    /// The worker's bounded queue.
    queue: mpsc::Sender<OwnedMessage>,
    /// The most records `queue` held so far.
    peak: usize,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static> ClientContext for Context<I, H> {}

impl<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static> ConsumerContext for Context<I, H> {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.assign(consumer, tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                let lost = consumer.assignment_lost();
                tracing::info!(target: "idem_kafka", partitions = ?partitions(tpl), lost, "partitions revoked: their records finish first");
                self.stop_workers();
                if let Err(error) = consumer.unassign() {
                    tracing::warn!(target: "idem_kafka", error = %error_chain(&error), "unassign failed");
                }
            }
            other => {
                tracing::warn!(target: "idem_kafka", error = ?other, "rebalance failed: every partition is given up");
                self.stop_workers();
                let _ = consumer.unassign();
            }
        }
    }
}

/// The partitions of a list.
fn partitions(tpl: &TopicPartitionList) -> Vec<i32> {
    tpl.elements().iter().map(|e| e.partition()).collect()
}

impl<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static> Context<I, H> {
    /// Positions each partition from the database, assigns them, and starts
    /// their workers.
    fn assign(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
        let shared = &self.shared;
        let protocol = &shared.protocol;
        let positions = loop {
            let read = shared.runtime.block_on(async {
                tokio::time::timeout(
                    shared.shutdown_timeout,
                    protocol
                        .inbox()
                        .inner()
                        .positions(protocol.consumer(), &shared.topic),
                )
                .await
            });
            match read {
                Ok(Ok(positions)) => break positions,
                Ok(Err(error)) => {
                    tracing::error!(target: "idem_kafka", error = %error_chain(&error), "the positions could not be read; trying again");
                }
                Err(_) => {
                    tracing::error!(target: "idem_kafka", "reading the positions timed out; trying again");
                }
            }
            if shared.stopping.load(Ordering::SeqCst) {
                let _ = consumer.unassign();
                return;
            }
            std::thread::sleep(AGAIN);
        };
        let assigned = partitions(tpl);
        for &partition in &assigned {
            if let Some(&next) = positions.get(&partition)
                && let Err(error) =
                    tpl.set_partition_offset(&shared.topic, partition, Offset::Offset(next))
            {
                tracing::warn!(target: "idem_kafka", partition, error = %error_chain(&error), "the stored position could not be set");
            }
        }
        let split = self.split(&assigned);
        if let Err(error) = consumer.assign(tpl) {
            tracing::error!(target: "idem_kafka", error = %error_chain(&error), "assign failed");
            return;
        }
        tracing::info!(target: "idem_kafka", partitions = ?assigned, positions = ?positions, "partitions assigned at their stored positions");
        let mut workers = lock(&self.workers);
        for (partition, mut records) in split {
            records.set_nonempty_callback(waker(&shared.commands));
            let (queue, received) = mpsc::channel(shared.prefetch);
            let (stop, stopped) = watch::channel(false);
            let task = shared.runtime.spawn(work(
                Arc::clone(shared),
                partition,
                positions.get(&partition).copied(),
                received,
                stopped,
            ));
            workers.insert(
                partition,
                Worker {
                    records,
                    queue,
                    peak: 0,
                    stop,
                    task,
                },
            );
        }
        drop(workers);
        if let Some(assigned_once) = lock(&self.assigned).take() {
            let _ = assigned_once.send(assigned);
        }
    }

    /// Splits each partition's queue off the consumer's, before the partitions
    /// are assigned: librdkafka then never sends their records to the
    /// consumer's queue, where they would have to be taken (and held) to
    /// reach the rebalances behind them.
    ///
    /// A partition whose queue cannot be split (librdkafka could not create
    /// its local topic) gets no worker: this member leaves it alone, its
    /// position unmoved, until the next rebalance.
    fn split(&self, assigned: &[i32]) -> Vec<(i32, PartitionQueue<Self>)> {
        let topic = &self.shared.topic;
        let consumer = self.consumer.get().and_then(Weak::upgrade);
        let mut split = Vec::with_capacity(assigned.len());
        for &partition in assigned {
            match consumer
                .as_ref()
                .and_then(|consumer| consumer.split_partition_queue(topic, partition))
            {
                Some(records) => split.push((partition, records)),
                None => {
                    tracing::error!(target: "idem_kafka", partition, "the partition's queue could not be split off: not consumed by this member until the next rebalance");
                }
            }
        }
        split
    }

    /// Stops every worker and waits (bounded) for the record each is on.
    fn stop_workers(&self) {
        let workers: Vec<(i32, Worker<Self>)> = lock(&self.workers).drain().collect();
        if workers.is_empty() {
            return;
        }
        for (_, worker) in &workers {
            let _ = worker.stop.send(true);
        }
        let shared = &self.shared;
        // One deadline for them all, as a graceful stop has on every broker.
        let deadline = tokio::time::Instant::now() + shared.shutdown_timeout;
        shared.runtime.block_on(async {
            for (partition, worker) in workers {
                let abort = worker.task.abort_handle();
                if tokio::time::timeout_at(deadline, worker.task)
                    .await
                    .is_err()
                {
                    tracing::warn!(target: "idem_kafka", partition, "a record outlived the shutdown timeout: abandoned (its transaction rolls back)");
                    abort.abort();
                }
            }
        });
    }
}

/// The polling thread's loop, until the consumer stops.
fn poll<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static>(
    consumer: &BaseConsumer<Context<I, H>>,
    shared: &Shared<I, H>,
    commands: &std_mpsc::Receiver<Command>,
) {
    let context = consumer.context();
    while !shared.stopping.load(Ordering::SeqCst) {
        serve(consumer);
        feed(context);
        if let Some(partition) = store_applied(consumer, shared, commands, POLL) {
            rejoin(consumer, shared, partition);
        }
    }
    // The workers hold the consumer (their partitions' queues): dropped here,
    // they let it close when this thread drops it.
    context.stop_workers();
    store_applied(consumer, shared, commands, Duration::ZERO);
    if let Err(error) = consumer.commit_consumer_state(CommitMode::Sync) {
        // Nothing stored since the last auto-commit, or the broker is away:
        // the positions that matter are in the database.
        tracing::debug!(target: "idem_kafka", error = %error_chain(&error), "final commit of the broker's offsets failed");
    }
    consumer.unsubscribe();
    tracing::info!(target: "idem_kafka", "leaving the group");
}

/// Waits up to `wait` for a word from a worker or librdkafka, then stores
/// the workers' applied offsets for the broker's auto-commit (for lag tools
/// only: positions come from the database). Answers a partition whose worker
/// stopped and asked the member to rejoin its group, if one did.
fn store_applied<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static>(
    consumer: &BaseConsumer<Context<I, H>>,
    shared: &Shared<I, H>,
    commands: &std_mpsc::Receiver<Command>,
    wait: Duration,
) -> Option<i32> {
    let mut tpl = TopicPartitionList::new();
    let mut any = false;
    let mut rejoin = None;
    let mut received = commands.recv_timeout(wait).ok();
    while let Some(command) = received {
        match command {
            Command::Applied { partition, next } => {
                // A later offset of the same partition replaces an earlier one.
                let _ = tpl
                    .add_partition_offset(&shared.topic, partition, Offset::Offset(next))
                    .or_else(|_| {
                        tpl.set_partition_offset(&shared.topic, partition, Offset::Offset(next))
                    });
                any = true;
            }
            Command::Rejoin { partition } => rejoin = Some(partition),
            Command::Wake => {}
        }
        received = commands.try_recv().ok();
    }
    if any && let Err(error) = consumer.store_offsets(&tpl) {
        // A partition revoked since: its new owner stores its own.
        tracing::debug!(target: "idem_kafka", error = %error_chain(&error), "offsets not stored");
    }
    rejoin
}

/// Leaves the group and joins it again, for a partition whose worker
/// stopped: the revocation stops every worker (their records finish first),
/// and the next assignment starts each partition this member is given at its
/// stored position. A partition is never left assigned to a member that does
/// not apply it.
fn rejoin<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static>(
    consumer: &BaseConsumer<Context<I, H>>,
    shared: &Shared<I, H>,
    partition: i32,
) {
    tracing::warn!(target: "idem_kafka", topic = %bounded(&shared.topic), partition, "the partition's worker stopped applying it: leaving the group and joining again, so that every partition is handed out afresh and starts at its stored position");
    consumer.unsubscribe();
    if let Err(error) = consumer.subscribe(&[shared.topic.as_str()]) {
        // Nothing is assigned now: the member stops rather than sit in no
        // group, and `run` answers the error.
        tracing::error!(target: "idem_kafka", error = %error_chain(&error), "joining the group again failed: the consumer stops");
        *lock(&shared.failed) = Some(error);
        shared.stopping.store(true, Ordering::SeqCst);
    }
}

/// Serves the consumer's own queue: the rebalances (librdkafka's callback
/// runs in its poll), the errors, the commits' results. Records do not come
/// this way: each assigned partition's go to its own queue (see `feed`).
fn serve<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static>(
    consumer: &BaseConsumer<Context<I, H>>,
) {
    while let Some(polled) = consumer.poll(Duration::ZERO) {
        match polled {
            Ok(record) => stray(consumer.context(), record.partition()),
            Err(error) => {
                tracing::warn!(target: "idem_kafka", error = %error_chain(&error), "the consumer reported an error; librdkafka carries on");
            }
        }
    }
}

/// A record that came through the consumer's queue, not its partition's:
/// only a partition whose queue could not be split off sends its records
/// there, and it has no worker; the record is left, its position unmoved.
/// Should a partition with a worker ever send one, its worker stops, lest
/// it apply the partition's next records past this one, and the member
/// rejoins its group (see `rejoin`).
fn stray<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static>(
    context: &Context<I, H>,
    partition: i32,
) {
    if let Some(worker) = lock(&context.workers).get(&partition) {
        tracing::error!(target: "idem_kafka", partition, "a record came through the consumer's queue instead of its partition's: the partition's worker stops, and the member joins its group again");
        let _ = worker.stop.send(true);
        let _ = context.shared.commands.send(Command::Rejoin { partition });
    }
}

/// Tops each worker's queue up from its partition's queue in librdkafka, as
/// far as it has room: a partition's records in this crate's memory are at
/// most its worker's queue (and the record being applied).
///
/// The records beyond wait in librdkafka, which fetches a partition only
/// while its queue holds fewer than `queued.min.messages` records and
/// `queued.max.messages.kbytes` (per partition: the queues are split), so
/// what a slow partition holds is bounded there too, and no record is
/// dropped or fetched twice. The broker sees nothing of it:
///
/// - the partition is not paused: with tansu 0.6, a partition paused and
///   then resumed received nothing more (its consumer stalled at its first
///   full queue, even with a seek back after the resume);
/// - it is not sought back to the first record with no room either (the
///   records after it dropped). That works with tansu, but librdkafka
///   fetches again from there as soon as it has sought, so a partition
///   behind its worker is fetched over and over: with a queue of 4 records
///   and 4 held beside it, a seek every 8 records, each refetch taking a
///   quarter of a second on tansu.
fn feed<I: Positions, H: Handler<I::Tx> + Send + Sync + 'static>(context: &Context<I, H>) {
    let topic = &context.shared.topic;
    let mut workers = lock(&context.workers);
    for (&partition, worker) in workers.iter_mut() {
        while let Ok(room) = worker.queue.try_reserve() {
            match worker.records.poll(Duration::ZERO) {
                None => break,
                Some(Ok(record)) => room.send(record.detach()),
                Some(Err(error)) => {
                    tracing::warn!(target: "idem_kafka", partition, error = %error_chain(&error), "the partition's queue reported an error; librdkafka carries on");
                }
            }
        }
        let held = worker.queue.max_capacity() - worker.queue.capacity();
        if held > worker.peak {
            worker.peak = held;
            tracing::trace!(target: "idem_kafka", topic = %bounded(topic), partition, held, "records waiting in the partition's worker's queue: a new high");
        }
    }
}

/// A partition's worker: applies its records in order until stopped or its
/// queue closes.
async fn work<I: Positions, H: Handler<I::Tx>>(
    shared: Arc<Shared<I, H>>,
    partition: i32,
    mut next: Option<i64>,
    mut records: mpsc::Receiver<OwnedMessage>,
    mut stop: watch::Receiver<bool>,
) {
    let batch = shared.handler.as_batch().map_or(1, |(_, size)| size);
    let mut taken: Vec<OwnedMessage> = Vec::with_capacity(batch);
    loop {
        let record = tokio::select! {
            biased;
            _ = stop.changed() => return,
            record = records.recv() => match record {
                Some(record) => record,
                None => return,
            },
        };
        taken.push(record);
        // The records already there, up to a batch: none is waited for.
        while taken.len() < batch {
            match records.try_recv() {
                Ok(record) => taken.push(record),
                Err(_) => break,
            }
        }
        let before = taken.len();
        // Applied before (the broker's position was behind the database's).
        taken.retain(|record| next.is_none_or(|next| record.offset() >= next));
        if taken.len() < before {
            // Their room in the queue is free again.
            let _ = shared.commands.send(Command::Wake);
        }
        let mut rest = taken.as_slice();
        while !rest.is_empty() {
            if let Some((handler, _)) = shared.handler.as_batch().filter(|_| rest.len() > 1) {
                let Some(applied) =
                    apply_batch(&shared, partition, next, rest, handler, &mut stop).await
                else {
                    return;
                };
                if applied > 0 {
                    next = Some(rest[applied - 1].offset() + 1);
                    applied_up_to(&shared, partition, next);
                }
                rest = &rest[applied..];
            }
            // One at a time: the record a batch stopped at, or a lone one.
            let Some((record, after)) = rest.split_first() else {
                break;
            };
            let Some(applied) = apply(&shared, partition, next, record, &mut stop).await else {
                return;
            };
            next = Some(applied);
            applied_up_to(&shared, partition, next);
            rest = after;
        }
        taken.clear();
    }
}

/// Tells the polling thread the partition's next offset, to store.
fn applied_up_to<I: Positions, H>(shared: &Shared<I, H>, partition: i32, next: Option<i64>) {
    if let Some(next) = next {
        let _ = shared.commands.send(Command::Applied { partition, next });
    }
}

/// Applies `records` (two or more, in order) in batches
/// ([`Protocol::decide_batch_advancing`](idem_core::consume::Protocol::decide_batch_advancing)),
/// waiting out an unavailable inbox; answers how many were applied from the
/// first (the one after them, if any, goes one at a time), or `None` when
/// the worker must stop (stopped, or fenced).
async fn apply_batch<I: Positions, H>(
    shared: &Shared<I, H>,
    partition: i32,
    from: Option<i64>,
    records: &[OwnedMessage],
    handler: &(dyn BatchHandler<I::Tx> + '_),
    stop: &mut watch::Receiver<bool>,
) -> Option<usize> {
    let protocol = &shared.protocol;
    let messages: Vec<Message> = records.iter().map(message_of).collect();
    let offsets: Vec<i64> = records.iter().map(OwnedMessage::offset).collect();
    let batch = PartitionBatch {
        consumer: protocol.consumer(),
        topic: &shared.topic,
        partition,
        from,
        offsets: &offsets,
    };
    let mut waited = None;
    loop {
        if *stop.borrow() {
            return None;
        }
        match protocol
            .decide_batch_advancing(&messages, &batch, handler)
            .await
        {
            Advanced::Applied(applied) => return Some(applied),
            Advanced::Fenced => {
                fenced(shared, partition);
                return None;
            }
            Advanced::Unavailable { after } => {
                let next = held_wait(waited, after);
                waited = Some(next);
                if !sleep_or_stop(next, stop).await {
                    return None;
                }
            }
        }
    }
}

/// Applies one record as the protocol decides, retrying in place; answers the
/// partition's next offset, or `None` when the worker must stop (stopped, or
/// the partition has another owner).
async fn apply<I: Positions, H: Handler<I::Tx>>(
    shared: &Shared<I, H>,
    partition: i32,
    from: Option<i64>,
    record: &OwnedMessage,
    stop: &mut watch::Receiver<bool>,
) -> Option<i64> {
    let protocol = &shared.protocol;
    let message = message_of(record);
    let advance = Advance {
        consumer: protocol.consumer(),
        topic: &shared.topic,
        partition,
        from,
        to: record.offset() + 1,
    };
    // How long the last wait for the inbox was (see `held_wait`).
    let mut waited = None;
    loop {
        if *stop.borrow() {
            return None;
        }
        match protocol
            .decide_advancing(&message, &advance, &shared.handler)
            .await
        {
            Decision::Ack(Acked::Processed { .. }) => return Some(advance.to),
            Decision::Ack(Acked::Duplicate | Acked::DeadLetter) => {
                match advance_alone(shared, &advance, stop).await {
                    Step::Done => return Some(advance.to),
                    Step::Again => {}
                    Step::Stop => return None,
                }
            }
            Decision::Retry(retry) => {
                if !sleep_or_stop(retry.delay, stop).await {
                    return None;
                }
            }
            Decision::DeadLetter(letter) => {
                if !publish_dead_letter(shared, record, &letter, stop).await {
                    return None;
                }
                protocol.published(&letter).await;
                match advance_alone(shared, &advance, stop).await {
                    Step::Done => return Some(advance.to),
                    Step::Again => {}
                    Step::Stop => return None,
                }
            }
            Decision::Requeue { after } => {
                if protocol.inbox().take_lost(partition) {
                    fenced(shared, partition);
                    return None;
                }
                // The inbox could not take it: retried in place, soon at
                // first (one lost connection), then up to the pause.
                let next = held_wait(waited, after);
                waited = Some(next);
                if !sleep_or_stop(next, stop).await {
                    return None;
                }
            }
        }
    }
}

/// The partition's stored position moved under this member: its worker stops
/// and asks the polling thread to rejoin the group.
fn fenced<I: Positions, H>(shared: &Shared<I, H>, partition: i32) {
    tracing::warn!(target: "idem_kafka", topic = %bounded(&shared.topic), partition, "the partition's stored position was moved by another member: this member stops applying it and rejoins its group");
    let _ = shared.commands.send(Command::Rejoin { partition });
}

/// What a step outside the handler's transaction came to.
enum Step {
    Done,
    /// Failed: decide again (the record is a duplicate or a dead letter now).
    Again,
    Stop,
}

/// Moves the partition's row past a record that ran no handler.
async fn advance_alone<I: Positions, H>(
    shared: &Shared<I, H>,
    advance: &Advance<'_>,
    stop: &mut watch::Receiver<bool>,
) -> Step {
    match shared.protocol.inbox().inner().advance_alone(advance).await {
        Ok(true) => Step::Done,
        Ok(false) => {
            fenced(shared, advance.partition);
            Step::Stop
        }
        Err(error) => {
            tracing::error!(target: "idem_kafka", error = %error_chain(&error), "the position could not be stored; trying again");
            if sleep_or_stop(AGAIN, stop).await {
                Step::Again
            } else {
                Step::Stop
            }
        }
    }
}

/// Produces the record's dead letter to the dead-letter topic and waits for
/// the broker's acknowledgement; `false` when stopped first.
///
/// A refusal that can pass (the broker away, a timeout, a full queue) is
/// tried again, with full-jitter backoff. A letter refused as too large,
/// which can never pass as it is, is cut to fit (see [`cut`]) and marked
/// with [`TRUNCATED_HEADER`](crate::TRUNCATED_HEADER), so it never blocks
/// the partition behind it; a letter refused even with no value at all is
/// given up, logged at ERROR: the record stays in its topic, and the inbox
/// keeps it as a dead letter.
async fn publish_dead_letter<I: Positions, H>(
    shared: &Shared<I, H>,
    record: &OwnedMessage,
    letter: &Letter,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let value = record.payload().unwrap_or_default();
    let mut kept = value.len();
    let mut refusals = 0;
    loop {
        let truncated = (kept < value.len()).then_some(value.len());
        let mut dead = FutureRecord::to(&shared.dlq)
            .payload(&value[..kept])
            .headers(dead_letter_headers(record, letter, truncated));
        if let Some(key) = record.key() {
            dead = dead.key(key);
        }
        match shared.producer.send(dead, Duration::from_secs(30)).await {
            Ok(_) => {
                if truncated.is_some() {
                    tracing::warn!(target: "idem_kafka", topic = %bounded(&shared.dlq), size = value.len(), kept, "the dead letter was too large: produced with its value cut to fit, marked truncated (never re-driven)");
                }
                return true;
            }
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge), _)) => {
                let extra = record.key().map_or(0, <[u8]>::len)
                    + record.headers().map_or(0, |headers| {
                        headers
                            .iter()
                            .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
                            .sum()
                    });
                match cut(kept, extra) {
                    Some(next) => kept = next,
                    None => {
                        tracing::error!(target: "idem_kafka", topic = %bounded(&shared.dlq), size = value.len(), "the dead letter is refused as too large even without its value: given up (the record stays in its topic, and the inbox keeps it as a dead letter)");
                        return true;
                    }
                }
            }
            Err((error, _)) => {
                refusals += 1;
                let delay = REFUSED.delay(refusals);
                tracing::error!(target: "idem_kafka", topic = %bounded(&shared.dlq), error = %error_chain(&error), ?delay, "the dead letter was not acknowledged; trying again");
                if !sleep_or_stop(delay, stop).await {
                    return false;
                }
            }
        }
    }
}

/// What a dead letter the broker refused as too large keeps of its value,
/// `kept` bytes so far, its key and headers taking `extra`: first what fits
/// librdkafka's default `message.max.bytes` with room for the record's
/// framing, then half of what was kept at each refusal (a broker's limit may
/// be lower); `None` once nothing is left to cut.
fn cut(kept: usize, extra: usize) -> Option<usize> {
    const FITS: usize = 1_000_000 - 16 * 1024;
    if kept == 0 {
        return None;
    }
    let fits = FITS.saturating_sub(extra);
    Some(if kept > fits { fits } else { kept / 2 })
}

/// Sleeps for `delay`; `false` when stopped first.
async fn sleep_or_stop(delay: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return false;
    }
    tokio::select! {
        () = tokio::time::sleep(delay) => true,
        _ = stop.changed() => false,
    }
}

impl From<KafkaError> for Error {
    fn from(error: KafkaError) -> Self {
        Error::Kafka {
            doing: "talk to the broker",
            source: error,
        }
    }
}
