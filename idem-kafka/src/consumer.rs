//! The consumer: a member of a consumer group whose positions live in the
//! inbox's database.
//!
//! # How it runs
//!
//! - **One polling thread** owns librdkafka's consumer: it polls, serves the
//!   group's rebalances (in librdkafka's rebalance callback, on that thread),
//!   hands each record to its partition's worker, and stores the offsets the
//!   workers committed for the broker's next auto-commit.
//! - **One worker per assigned partition** (a Tokio task) applies its records
//!   in order, one at a time; partitions run side by side. A worker's queue is
//!   bounded: when it is full, its partition's records wait on the polling
//!   thread, so a partition that retries in place holds back no other. (The
//!   partition is not paused at the broker: see `dispatch`.)
//! - **On assignment**, each partition's position is read from the database
//!   and the partition is assigned at it (a partition without a row starts
//!   from the group's committed offset, or `auto.offset.reset`, `earliest`
//!   by default: the first time only).
//! - **On revocation** (or a lost assignment), the revoked partitions'
//!   workers finish the record they are on (it commits or rolls back) and
//!   stop before the partitions are handed over. A member that lost a
//!   partition without knowing is stopped by the fence: its transaction finds
//!   the row moved and commits nothing.
//!
//! The rebalance strategy is eager (`range`, the default): a cooperative one
//! would hand over partitions incrementally, which this member's callback
//! does not do.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc as std_mpsc};
use std::time::Duration;

use idem_core::consume::{Acked, ConsumerPolicy, Decision, Handler, Letter, Protocol};
use idem_core::log::{bounded, error_chain};
use rdkafka::ClientConfig;
use rdkafka::Message as _;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use tokio::sync::{mpsc, oneshot, watch};

use crate::error::Error;
use crate::fence::{Fenced, WithOffset};
use crate::offsets::{Advance, Offsets};
use crate::record::{dead_letter_headers, message_of};
use crate::topics;

/// How many records wait in a partition's worker's queue (more wait on the
/// polling thread).
pub const DEFAULT_QUEUE: usize = 256;
/// How long a revocation or a stop waits for a worker's record to finish.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the polling thread waits for a record at a time (and so how soon
/// it sees a stop or a worker's offset).
const POLL: Duration = Duration::from_millis(50);
/// The pause before trying the database or the broker again.
const AGAIN: Duration = Duration::from_millis(500);

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
    servers: String,
    topic: String,
    group: Option<String>,
    name: Option<String>,
    inbox: I,
    handler: H,
    policy: ConsumerPolicy,
    config: Vec<(String, String)>,
    queue: usize,
    shutdown_timeout: Duration,
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
    queue: usize,
    shutdown_timeout: Duration,
}

impl Consumer<Unset, Unset> {
    /// A consumer of `topic` on the cluster of `servers`
    /// (`HOST:PORT[,HOST:PORT…]`). Give it an inbox
    /// ([`inbox`](ConsumerBuilder::inbox)) and a handler
    /// ([`handler`](ConsumerBuilder::handler)); the group is `topic` unless
    /// [`group`](ConsumerBuilder::group) says otherwise.
    pub fn builder(servers: impl Into<String>, topic: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            servers: servers.into(),
            topic: topic.into(),
            group: None,
            name: None,
            inbox: Unset,
            handler: Unset,
            policy: ConsumerPolicy::new(),
            config: Vec::new(),
            queue: DEFAULT_QUEUE,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }
}

impl<I, H> ConsumerBuilder<I, H> {
    /// The consumer group (`group.id`).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// The consumer's name in the inbox and in the offsets table (each
    /// consumer of a record applies it once); the group by default.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The policy: attempts, backoff, classification, the dead-letter alert.
    pub fn policy(mut self, policy: ConsumerPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// A librdkafka consumer setting (`session.timeout.ms`, TLS, SASL…).
    /// The settings this crate relies on (`group.id`,
    /// `enable.auto.offset.store`) cannot be overridden.
    pub fn config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.push((key.into(), value.into()));
        self
    }

    /// How many records wait in a partition's worker's queue
    /// ([`DEFAULT_QUEUE`]; more wait on the polling thread).
    pub fn queue(mut self, records: usize) -> Self {
        self.queue = records.max(1);
        self
    }

    /// How long a revocation or a stop waits for the records being applied
    /// ([`DEFAULT_SHUTDOWN_TIMEOUT`]).
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// The inbox, whose database also keeps the positions: idem-diesel's
    /// `PgInbox` or `SqliteInbox`.
    pub fn inbox<J: Offsets>(self, inbox: J) -> ConsumerBuilder<J, H> {
        ConsumerBuilder {
            servers: self.servers,
            topic: self.topic,
            group: self.group,
            name: self.name,
            inbox,
            handler: self.handler,
            policy: self.policy,
            config: self.config,
            queue: self.queue,
            shutdown_timeout: self.shutdown_timeout,
        }
    }

    /// The handler: applies one record on the inbox's transaction.
    pub fn handler<G>(self, handler: G) -> ConsumerBuilder<I, G> {
        ConsumerBuilder {
            servers: self.servers,
            topic: self.topic,
            group: self.group,
            name: self.name,
            inbox: self.inbox,
            handler,
            policy: self.policy,
            config: self.config,
            queue: self.queue,
            shutdown_timeout: self.shutdown_timeout,
        }
    }
}

impl<I: Offsets, H: Handler<I::Tx> + Send + Sync + 'static> ConsumerBuilder<I, H> {
    /// The consumer.
    pub fn build(self) -> Consumer<I, H> {
        let group = self.group.unwrap_or_else(|| self.topic.clone());
        let name = self.name.unwrap_or_else(|| group.clone());
        Consumer {
            servers: self.servers,
            topic: self.topic,
            group,
            name,
            inbox: self.inbox,
            policy: self.policy,
            handler: self.handler,
            config: self.config,
            queue: self.queue,
            shutdown_timeout: self.shutdown_timeout,
        }
    }
}

impl<I: Offsets, H: Handler<I::Tx> + Send + Sync + 'static> Consumer<I, H> {
    /// The dead-letter topic: `<topic>.dlq`.
    pub fn dead_letter_topic(&self) -> String {
        topics::dead_letter_topic(&self.topic)
    }

    /// Consumes until `stop` resolves; calls `subscribed` once, when the
    /// group first assigned this member its partitions. Creates the offsets
    /// table and the dead-letter topic if they are missing. On `stop`, the
    /// records being applied finish (they commit or roll back), the broker's
    /// offsets are committed, and the member leaves its group.
    ///
    /// Must run on a multi-threaded Tokio runtime or a current-thread one
    /// alike: the polling thread is a thread of its own.
    pub async fn run(
        self,
        stop: impl Future<Output = ()>,
        subscribed: impl FnOnce(&Subscription),
    ) -> Result<(), Error> {
        self.inbox.migrate_offsets().await.map_err(Error::Offsets)?;
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
            queue: self.queue,
            shutdown_timeout: self.shutdown_timeout,
            stopping: AtomicBool::new(false),
        });
        let (assigned, first_assignment) = oneshot::channel();
        let context = Context {
            shared: Arc::clone(&shared),
            workers: Mutex::new(HashMap::new()),
            assigned: Mutex::new(Some(assigned)),
        };
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.servers)
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "true");
        for (key, value) in &self.config {
            config.set(key, value);
        }
        config
            .set("group.id", &self.group)
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false");
        let consumer: BaseConsumer<Context<I, H>> = config
            .create_with_context(context)
            .map_err(Error::kafka("create the consumer"))?;
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
        tokio::select! {
            () = &mut stop => {}
            Ok(partitions) = first_assignment => {
                subscribed(&Subscription { topic: self.topic.clone(), partitions });
                stop.await;
            }
        }
        tracing::info!(target: "idem_kafka", "stopping: the records being applied finish");
        shared.stopping.store(true, Ordering::SeqCst);
        let _ = polling_ended.await;
        Ok(())
    }
}

/// What the polling thread and the workers share.
struct Shared<I: Offsets, H> {
    protocol: Protocol<Fenced<I>>,
    handler: H,
    topic: String,
    dlq: String,
    producer: FutureProducer,
    runtime: tokio::runtime::Handle,
    commands: std_mpsc::Sender<Command>,
    queue: usize,
    shutdown_timeout: Duration,
    stopping: AtomicBool,
}

/// A worker's word to the polling thread.
enum Command {
    /// The partition's records up to this offset (excluded) are applied:
    /// stored for the broker's next auto-commit.
    Applied { partition: i32, next: i64 },
}

/// librdkafka's callbacks: the rebalances.
struct Context<I: Offsets, H> {
    shared: Arc<Shared<I, H>>,
    workers: Mutex<HashMap<i32, Worker>>,
    assigned: Mutex<Option<oneshot::Sender<Vec<i32>>>>,
}

/// A partition's worker, as the polling thread holds it.
struct Worker {
    queue: mpsc::Sender<OwnedMessage>,
    /// Records the queue had no room for, in order.
    waiting: VecDeque<OwnedMessage>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<I: Offsets, H: Send + Sync + 'static> ClientContext for Context<I, H> {}

impl<I: Offsets, H: Handler<I::Tx> + Send + Sync + 'static> ConsumerContext for Context<I, H> {
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

impl<I: Offsets, H: Handler<I::Tx> + Send + Sync + 'static> Context<I, H> {
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
        if let Err(error) = consumer.assign(tpl) {
            tracing::error!(target: "idem_kafka", error = %error_chain(&error), "assign failed");
            return;
        }
        tracing::info!(target: "idem_kafka", partitions = ?assigned, positions = ?positions, "partitions assigned at their stored positions");
        let mut workers = lock(&self.workers);
        for &partition in &assigned {
            let (queue, records) = mpsc::channel(shared.queue);
            let (stop, stopped) = watch::channel(false);
            let task = shared.runtime.spawn(work(
                Arc::clone(shared),
                partition,
                positions.get(&partition).copied(),
                records,
                stopped,
            ));
            workers.insert(
                partition,
                Worker {
                    queue,
                    waiting: VecDeque::new(),
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

    /// Stops every worker and waits (bounded) for the record each is on.
    fn stop_workers(&self) {
        let workers: Vec<(i32, Worker)> = lock(&self.workers).drain().collect();
        if workers.is_empty() {
            return;
        }
        for (_, worker) in &workers {
            let _ = worker.stop.send(true);
        }
        let shared = &self.shared;
        shared.runtime.block_on(async {
            for (partition, worker) in workers {
                let abort = worker.task.abort_handle();
                if tokio::time::timeout(shared.shutdown_timeout, worker.task)
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
fn poll<I: Offsets, H: Handler<I::Tx> + Send + Sync + 'static>(
    consumer: &BaseConsumer<Context<I, H>>,
    shared: &Shared<I, H>,
    commands: &std_mpsc::Receiver<Command>,
) {
    let context = consumer.context();
    while !shared.stopping.load(Ordering::SeqCst) {
        store_applied(consumer, shared, commands);
        flush(context);
        match consumer.poll(POLL) {
            None => {}
            Some(Ok(record)) => dispatch(context, record.detach()),
            Some(Err(error)) => {
                tracing::warn!(target: "idem_kafka", error = %error_chain(&error), "the consumer reported an error; librdkafka carries on");
            }
        }
    }
    context.stop_workers();
    store_applied(consumer, shared, commands);
    if let Err(error) = consumer.commit_consumer_state(CommitMode::Sync) {
        // Nothing stored since the last auto-commit, or the broker is away:
        // the positions that matter are in the database.
        tracing::debug!(target: "idem_kafka", error = %error_chain(&error), "final commit of the broker's offsets failed");
    }
    consumer.unsubscribe();
    tracing::info!(target: "idem_kafka", "leaving the group");
}

/// Stores the workers' applied offsets for the broker's auto-commit (for lag
/// tools only: positions come from the database).
fn store_applied<I: Offsets, H>(
    consumer: &BaseConsumer<Context<I, H>>,
    shared: &Shared<I, H>,
    commands: &std_mpsc::Receiver<Command>,
) where
    Context<I, H>: ConsumerContext,
{
    let mut tpl = TopicPartitionList::new();
    let mut any = false;
    while let Ok(Command::Applied { partition, next }) = commands.try_recv() {
        // A later offset of the same partition replaces an earlier one.
        let _ = tpl
            .add_partition_offset(&shared.topic, partition, Offset::Offset(next))
            .or_else(|_| tpl.set_partition_offset(&shared.topic, partition, Offset::Offset(next)));
        any = true;
    }
    if any && let Err(error) = consumer.store_offsets(&tpl) {
        // A partition revoked since: its new owner stores its own.
        tracing::debug!(target: "idem_kafka", error = %error_chain(&error), "offsets not stored");
    }
}

/// Hands a record to its partition's worker, or holds it when the worker's
/// queue is full.
///
/// The partition is not paused at the broker meanwhile: with tansu 0.6, a
/// partition paused and then resumed received nothing more (its consumer
/// stalled at its first full queue, even with a seek back after the
/// resume), so records beyond the queue wait here, in memory, up to what
/// librdkafka prefetches.
fn dispatch<I: Offsets, H>(context: &Context<I, H>, record: OwnedMessage)
where
    Context<I, H>: ConsumerContext,
{
    let partition = record.partition();
    let mut workers = lock(&context.workers);
    let Some(worker) = workers.get_mut(&partition) else {
        // Revoked since it was fetched: its new owner reads it again.
        return;
    };
    if !worker.waiting.is_empty() {
        worker.waiting.push_back(record);
        return;
    }
    match worker.queue.try_send(record) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(record)) => worker.waiting.push_back(record),
        Err(mpsc::error::TrySendError::Closed(_)) => {}
    }
}

/// Moves held records into the queues that have room.
fn flush<I: Offsets, H>(context: &Context<I, H>)
where
    Context<I, H>: ConsumerContext,
{
    let mut workers = lock(&context.workers);
    for worker in workers.values_mut() {
        while let Some(record) = worker.waiting.pop_front() {
            match worker.queue.try_send(record) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(record)) => {
                    worker.waiting.push_front(record);
                    break;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    worker.waiting.clear();
                    break;
                }
            }
        }
    }
}

/// A partition's worker: applies its records in order until stopped or its
/// queue closes.
async fn work<I: Offsets, H: Handler<I::Tx>>(
    shared: Arc<Shared<I, H>>,
    partition: i32,
    mut next: Option<i64>,
    mut records: mpsc::Receiver<OwnedMessage>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let record = tokio::select! {
            biased;
            _ = stop.changed() => return,
            record = records.recv() => match record {
                Some(record) => record,
                None => return,
            },
        };
        if next.is_some_and(|next| record.offset() < next) {
            // Applied before (the broker's position was behind the database's).
            continue;
        }
        match apply(&shared, partition, next, &record, &mut stop).await {
            Some(applied) => {
                next = Some(applied);
                let _ = shared.commands.send(Command::Applied {
                    partition,
                    next: applied,
                });
            }
            None => return,
        }
    }
}

/// Applies one record as the protocol decides, retrying in place; answers the
/// partition's next offset, or `None` when the worker must stop (stopped, or
/// the partition has another owner).
async fn apply<I: Offsets, H: Handler<I::Tx>>(
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
    loop {
        if *stop.borrow() {
            return None;
        }
        let lost = AtomicBool::new(false);
        let handler = WithOffset {
            handler: &shared.handler,
            advance: advance.clone(),
            lost: &lost,
        };
        match protocol.decide(&message, &handler).await {
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
                if lost.load(Ordering::SeqCst) {
                    tracing::warn!(target: "idem_kafka", partition, "the partition has another owner: this member stops applying it");
                    return None;
                }
                if !sleep_or_stop(after, stop).await {
                    return None;
                }
            }
        }
    }
}

/// What a step outside the handler's transaction came to.
enum Step {
    Done,
    /// Failed: decide again (the record is a duplicate or a dead letter now).
    Again,
    Stop,
}

/// Moves the partition's row past a record that ran no handler.
async fn advance_alone<I: Offsets, H>(
    shared: &Shared<I, H>,
    advance: &Advance<'_>,
    stop: &mut watch::Receiver<bool>,
) -> Step {
    match shared.protocol.inbox().inner().advance_alone(advance).await {
        Ok(true) => Step::Done,
        Ok(false) => {
            tracing::warn!(target: "idem_kafka", partition = advance.partition, "the partition has another owner: this member stops applying it");
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
/// the broker's acknowledgement, trying again until it comes; `false` when
/// stopped first.
async fn publish_dead_letter<I: Offsets, H>(
    shared: &Shared<I, H>,
    record: &OwnedMessage,
    letter: &Letter,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    loop {
        let mut dead = FutureRecord::to(&shared.dlq)
            .payload(record.payload().unwrap_or_default())
            .headers(dead_letter_headers(record, letter));
        if let Some(key) = record.key() {
            dead = dead.key(key);
        }
        match shared.producer.send(dead, Duration::from_secs(30)).await {
            Ok(_) => return true,
            Err((error, _)) => {
                tracing::error!(target: "idem_kafka", topic = %bounded(&shared.dlq), error = %error_chain(&error), "the dead letter was not acknowledged; trying again");
                if !sleep_or_stop(AGAIN, stop).await {
                    return false;
                }
            }
        }
    }
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
