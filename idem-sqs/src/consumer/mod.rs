//! The consumer: a queue, an inbox, a policy and a handler, polled until
//! shut down.

mod delivery;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::MessageSystemAttributeName;
use idem_core::consume::runner::{Intake, Runner, Taken, Work, default_broker_backoff};
use idem_core::consume::{
    Batch, ConsumerPolicy, Handler, Inbox, MemoryInbox, Outage, Protocol, StopSignal,
};
use idem_core::log::error_chain;
use idem_core::retry::Backoff;
use tokio::time::Instant;

use crate::Error;
use crate::lease::{self, Lease};
use crate::message::{self, Received};
use crate::queue::{self, Queue};

/// How long a receive waits for messages (long polling), unless told
/// otherwise ([`ConsumerBuilder::wait_time`]): SQS's longest, 20 s.
pub const DEFAULT_WAIT_TIME: Duration = Duration::from_secs(20);

pub use idem_core::consume::runner::DEFAULT_SHUTDOWN_TIMEOUT;

/// The most messages one receive takes: SQS's limit.
pub const MAX_BATCH: usize = 10;

/// An at-least-once SQS consumer whose handler applies each message once:
/// each received message is translated into a
/// [`Message`](idem_core::consume::Message), [`Protocol::decide`] decides,
/// and the consumer carries the [`Decision`](idem_core::consume::Decision)
/// out on SQS:
///
/// | decision | on SQS |
/// |---|---|
/// | `Ack` | `DeleteMessage` (after the commit) |
/// | `Retry` | `ChangeMessageVisibility` to the full-jitter delay: the message is received again after it |
/// | `DeadLetter` | `SendMessage` to the dead-letter queue with `idem-reason` and `idem-attempts`, then [`Protocol::published`], then `DeleteMessage` |
/// | `Requeue` | none while the consumer runs: the message is held (see below) |
///
/// While a handler runs, the message's visibility timeout is its lease,
/// extended every quarter of it ([`ConsumerBuilder::lease`]): a handler
/// slower than the queue's visibility timeout is not run a second time.
///
/// **While the inbox is unavailable** (its database is down), the consumer
/// holds the messages it has, their leases extended, deciding each again
/// after the policy's pause ([`Protocol::decide_holding`]), and receives no
/// more until the inbox answers again. Every receive of an SQS message
/// counts against its queue's redrive policy (`maxReceiveCount`): handing
/// messages back through an outage would move healthy ones to the
/// dead-letter queue. An outage spends no receive and no attempt. (SQS keeps
/// a message invisible for at most 12 hours from its receive: one held
/// longer comes back once.) A shutdown during an outage hands the held
/// messages back after the pause.
///
/// Built with [`Consumer::builder`], run with [`Consumer::run`].
pub struct Consumer<I: Inbox, H> {
    shared: Arc<Shared<I, H>>,
    client: Client,
    queue_url: String,
    concurrency: usize,
    batch: usize,
    wait_time: Duration,
    lease: Option<Duration>,
    shutdown_timeout: Duration,
    backoff: Backoff,
}

/// What the consumer's tasks share.
pub(crate) struct Shared<I: Inbox, H> {
    pub(crate) protocol: Protocol<I>,
    pub(crate) handler: H,
    /// The messages held while the inbox is unavailable.
    pub(crate) outage: Outage,
    /// Set when the consumer shuts down: a held message stops waiting.
    pub(crate) stop: StopSignal,
}

/// A builder of [`Consumer`]; an inbox and a handler are required, the rest
/// has defaults.
#[must_use]
pub struct ConsumerBuilder<I, H> {
    inbox: I,
    handler: H,
    options: Options,
}

/// A builder's settings beside its inbox and handler: what `inbox` and
/// `handler` carry over unchanged.
struct Options {
    client: Client,
    queue_url: String,
    name: Option<String>,
    policy: ConsumerPolicy,
    concurrency: usize,
    batch: usize,
    wait_time: Duration,
    lease: Option<Duration>,
    shutdown_timeout: Duration,
    backoff: Backoff,
}

/// A part of a [`ConsumerBuilder`] not given yet (the inbox, the handler).
#[derive(Clone, Copy, Debug)]
pub struct Unset;

/// What [`Consumer::run`] tells its `on_polling` callback once the queue is
/// read and its dead-letter queue found or created, before the first poll.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Polling {
    /// The queue's name.
    pub queue: String,
    /// The dead-letter queue's URL.
    pub dead_letter_queue: String,
    /// Whether it is a FIFO queue.
    pub fifo: bool,
    /// The lease: how long a received message stays invisible between two
    /// extensions.
    pub lease: Duration,
}

impl Consumer<MemoryInbox, Unset> {
    /// A builder of the consumer of the queue at `queue_url`, through
    /// `client` ([`ClientConfig`](crate::ClientConfig) builds one from the
    /// environment). The type parameters are the inbox's and the handler's,
    /// set by [`ConsumerBuilder::inbox`] and [`ConsumerBuilder::handler`].
    pub fn builder(client: Client, queue_url: impl Into<String>) -> ConsumerBuilder<Unset, Unset> {
        ConsumerBuilder {
            inbox: Unset,
            handler: Unset,
            options: Options {
                client,
                queue_url: queue_url.into(),
                name: None,
                policy: ConsumerPolicy::new(),
                concurrency: 1,
                batch: MAX_BATCH,
                wait_time: DEFAULT_WAIT_TIME,
                lease: None,
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
                backoff: default_broker_backoff(),
            },
        }
    }
}

impl<I, H> ConsumerBuilder<I, H> {
    /// The inbox that remembers which messages were applied (required):
    /// idem-diesel's PostgreSQL or SQLite inbox, or [`MemoryInbox`].
    pub fn inbox<J: Inbox>(self, inbox: J) -> ConsumerBuilder<J, H> {
        ConsumerBuilder {
            inbox,
            handler: self.handler,
            options: self.options,
        }
    }

    /// What applies a message (required): a [`Handler`] on the inbox's
    /// transaction, such as a closure wrapped in
    /// [`handler`](idem_core::consume::handler).
    pub fn handler<G>(self, handler: G) -> ConsumerBuilder<I, G> {
        ConsumerBuilder {
            inbox: self.inbox,
            handler,
            options: self.options,
        }
    }

    /// How failures are treated: attempts, backoff, classification, the
    /// dead-letter alert (default [`ConsumerPolicy::new`]).
    pub fn policy(mut self, policy: ConsumerPolicy) -> Self {
        self.options.policy = policy;
        self
    }

    /// The consumer's name in the inbox (default: the queue's name). Each
    /// consumer of a message applies it once, so two consumers of one queue
    /// that apply the same effect share a name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.options.name = Some(name.into());
        self
    }

    /// How many messages are in hand at once (default 1; at least 1): each
    /// is processed by its own task (on a FIFO queue, the messages of one
    /// group one after the other).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.options.concurrency = concurrency.max(1);
        self
    }

    /// The most messages one receive takes (default and most
    /// [`MAX_BATCH`]; at least 1); never more than the free slots of the
    /// concurrency.
    pub fn batch_size(mut self, batch: usize) -> Self {
        self.options.batch = batch.clamp(1, MAX_BATCH);
        self
    }

    /// How long a receive waits for a message (long polling; default
    /// [`DEFAULT_WAIT_TIME`], at most 20 s).
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.options.wait_time = wait.min(DEFAULT_WAIT_TIME);
        self
    }

    /// The lease: how long a received message stays invisible between two
    /// extensions, in whole seconds (default: the queue's
    /// `VisibilityTimeout`). It is extended every quarter of it while the
    /// handler runs; a consumer that dies stops extending it, and the
    /// message is received again once it runs out.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = Some(lease.max(Duration::from_secs(1)));
        self
    }

    /// How long a graceful shutdown waits for the running handlers (default
    /// [`DEFAULT_SHUTDOWN_TIMEOUT`]). Handlers still running then are
    /// dropped (a database inbox rolls their transaction back) and their
    /// messages come back when their lease runs out.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.options.shutdown_timeout = timeout;
        self
    }

    /// The delays between polls after SQS failed (default
    /// [`default_broker_backoff`]: full jitter from 250 ms, capped at 10 s).
    pub fn broker_backoff(mut self, backoff: Backoff) -> Self {
        self.options.backoff = backoff;
        self
    }
}

impl<I, H> ConsumerBuilder<I, H> {
    /// What applies messages in batches, instead of [`handler`](Self::handler),
    /// on a standard queue: the messages of one receive (up to
    /// [`batch_size`](Self::batch_size), and up to `size`) are entered in the
    /// inbox together and handed to `handler` on one transaction, one
    /// commit ([`Protocol::decide_batch`](idem_core::consume::Protocol::decide_batch)),
    /// and those applied are deleted with one `DeleteMessageBatch`. A
    /// message that fails its batch is tried again alone, so it alone is
    /// retried and dead-lettered. [`concurrency`](Self::concurrency) is then
    /// the number of batches at once. On a FIFO queue, whose groups are
    /// applied in order, each message is still decided alone.
    pub fn batch_handler<B>(self, handler: B, size: usize) -> ConsumerBuilder<I, Batch<B>> {
        self.handler(Batch::new(handler, size))
    }
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> ConsumerBuilder<I, H> {
    /// The consumer. Fails on a queue URL without a queue name; SQS is not
    /// contacted until [`run`](Consumer::run).
    pub fn build(self) -> Result<Consumer<I, H>, Error> {
        let name = match self.options.name {
            Some(name) => name,
            None => queue::queue_name(&self.options.queue_url)?.to_owned(),
        };
        queue::queue_name(&self.options.queue_url)?;
        Ok(Consumer {
            shared: Arc::new(Shared {
                protocol: Protocol::new(name, self.inbox, self.options.policy),
                handler: self.handler,
                outage: Outage::new(),
                stop: StopSignal::new(),
            }),
            client: self.options.client,
            queue_url: self.options.queue_url,
            concurrency: self.options.concurrency,
            batch: self.options.batch,
            wait_time: self.options.wait_time,
            lease: self.options.lease,
            shutdown_timeout: self.options.shutdown_timeout,
            backoff: self.options.backoff,
        })
    }
}

/// The queue as the consumer's tasks settle messages on it.
#[derive(Clone, Debug)]
pub(crate) struct Target {
    pub(crate) queue: Queue,
    pub(crate) dead_letter_queue: String,
    pub(crate) dead_letter_fifo: bool,
    pub(crate) lease: Lease,
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> Consumer<I, H> {
    /// The protocol: the inbox, the policy, the inbox's dead letters.
    pub fn protocol(&self) -> &Protocol<I> {
        &self.shared.protocol
    }

    /// The messages a unit of work holds at most: a batch's (a batch
    /// handler, on a standard queue: up to a receive), or 1.
    fn unit(&self, target: &Target) -> usize {
        match self.shared.handler.as_batch() {
            Some((_, size)) if !target.queue.fifo => size.min(self.batch).max(1),
            _ => 1,
        }
    }

    /// Reads the queue, finds or creates its dead-letter queue, calls
    /// `on_polling`, and consumes until `shutdown` resolves.
    ///
    /// **Start:** an inbox that is not ready ([`Inbox::readiness`](idem_core::consume::Inbox::readiness):
    /// idem-diesel's, neither migrated nor checked in this process) is
    /// [`Error::NotReady`] at once, before anything is contacted.
    ///
    /// **Across failures:** SQS unreachable, throttling or a server error is
    /// not an error: the consumer polls again after a full-jitter delay
    /// ([`broker_backoff`](ConsumerBuilder::broker_backoff)). It answers an
    /// error only when retrying cannot help ([`Error::is_permanent`]: no
    /// such queue, refused credentials).
    ///
    /// **Shutdown:** once `shutdown` resolves, the consumer receives no
    /// more (a receive waiting is abandoned: a message it would have taken
    /// comes back after the lease), lets the running handlers finish and
    /// carries out their decisions (for at most
    /// [`shutdown_timeout`](ConsumerBuilder::shutdown_timeout)), and
    /// answers `Ok`.
    pub async fn run(
        &self,
        shutdown: impl Future<Output = ()>,
        on_polling: impl FnOnce(&Polling),
    ) -> Result<(), Error> {
        self.shared.protocol.readiness()?;
        tokio::pin!(shutdown);
        let target = tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            target = self.prepare() => target?,
        };
        let target = Arc::new(target);
        let queue = target.queue.name.as_str();
        tracing::info!(
            queue,
            fifo = target.queue.fifo,
            lease_s = target.lease.seconds(),
            concurrency = self.concurrency,
            "polling"
        );
        on_polling(&Polling {
            queue: queue.to_owned(),
            dead_letter_queue: target.dead_letter_queue.clone(),
            fifo: target.queue.fifo,
            lease: target.lease.length,
        });

        let runner = Runner {
            concurrency: self.concurrency.saturating_mul(self.unit(&target)),
            shutdown_timeout: self.shutdown_timeout,
            outage: &self.shared.outage,
            stop: &self.shared.stop,
            source: queue,
            comes_back: "after their lease",
        };
        let intake = Polls {
            consumer: self,
            target: Arc::clone(&target),
            failures: 0,
        };
        runner.run(intake, shutdown.as_mut()).await
    }

    /// Reads the queue and its dead-letter queue, polling again after
    /// failures retrying can help.
    async fn prepare(&self) -> Result<Target, Error> {
        let mut failures = 0u32;
        loop {
            match self.try_prepare().await {
                Ok(target) => return Ok(target),
                Err(error) if error.is_permanent() => return Err(error),
                Err(error) => {
                    failures = failures.saturating_add(1);
                    let delay = self.backoff.delay(failures);
                    tracing::warn!(error = %error_chain(&error), failures, delay_ms = delay.as_millis() as u64, "could not read the queue from SQS; trying again");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn try_prepare(&self) -> Result<Target, Error> {
        let queue = Queue::describe(&self.client, &self.queue_url).await?;
        let dead_letter_queue = queue
            .dead_letter_queue(&self.client, true)
            .await?
            .ok_or_else(|| Error::Unexpected("no URL for the dead-letter queue".to_owned()))?;
        let max_attempts = self.protocol().policy().get_max_attempts();
        if let Some(redrive) = &queue.redrive
            && redrive.max_receive_count < max_attempts
        {
            tracing::warn!(queue = %queue.name, max_receive_count = redrive.max_receive_count, max_attempts, "the queue's redrive policy moves a message after fewer receives than the consumer's attempts: SQS, not the consumer, will dead-letter failing messages, without their reason");
        }
        let dead_letter_fifo =
            queue::queue_name(&dead_letter_queue).is_ok_and(|name| name.ends_with(".fifo"));
        let length = self.lease.unwrap_or(queue.visibility_timeout);
        let length = Duration::from_secs(u64::try_from(lease::seconds(length)).unwrap_or(1).max(1));
        Ok(Target {
            lease: Lease {
                client: self.client.clone(),
                queue_url: queue.url.clone(),
                length,
            },
            queue,
            dead_letter_queue,
            dead_letter_fifo,
        })
    }

    /// One long poll for up to `count` messages, leased from the start.
    async fn receive(
        &self,
        target: &Target,
        count: usize,
    ) -> Result<(Vec<Received>, Instant), Error> {
        let received_at = Instant::now();
        let answer = self
            .client
            .receive_message()
            .queue_url(&target.queue.url)
            .max_number_of_messages(i32::try_from(count.clamp(1, MAX_BATCH)).unwrap_or(1))
            .wait_time_seconds(lease::seconds(self.wait_time))
            .visibility_timeout(target.lease.seconds())
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(Error::sqs(format!(
                "receive from the queue {:?}",
                target.queue.name
            )))?;
        let messages = answer
            .messages
            .unwrap_or_default()
            .into_iter()
            .filter_map(|raw| {
                let received = message::translate(raw);
                if received.is_none() {
                    tracing::warn!(
                        "SQS gave a message without a receipt handle: it cannot be settled"
                    );
                }
                received
            })
            .collect();
        Ok((messages, received_at))
    }
}

/// The consumer's long polls, as the runner takes them.
struct Polls<'c, I: Inbox, H> {
    consumer: &'c Consumer<I, H>,
    target: Arc<Target>,
    /// The receives that failed in a row.
    failures: u32,
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> Intake for Polls<'_, I, H> {
    type Error = Error;

    /// One long poll: each message alone (on a FIFO queue, each group's
    /// messages together). An empty receive, or one that failed where
    /// polling again can help (after a full-jitter delay), answers nothing,
    /// so that the runner looks at its room and the outage before the next.
    async fn take(&mut self, room: usize) -> Taken<Error> {
        let consumer = self.consumer;
        let queue = self.target.queue.name.as_str();
        let unit = consumer.unit(&self.target);
        match consumer
            .receive(&self.target, room.min(consumer.batch).min(unit.max(1)))
            .await
        {
            Ok((messages, received_at)) if unit > 1 => {
                self.failures = 0;
                if messages.is_empty() {
                    return Ok(Vec::new());
                }
                let work = delivery::settle_batch(
                    Arc::clone(&consumer.shared),
                    Arc::clone(&self.target),
                    messages,
                    received_at,
                );
                // A batch takes a whole batch's room: the next receive waits
                // for a free one.
                Ok(vec![(unit, settled(work))])
            }
            Ok((messages, received_at)) => {
                self.failures = 0;
                Ok(groups(messages, self.target.queue.fifo)
                    .into_iter()
                    .map(|group| {
                        let size = group.len();
                        let work = settled(delivery::settle(
                            Arc::clone(&consumer.shared),
                            Arc::clone(&self.target),
                            group,
                            received_at,
                        ));
                        (size, work)
                    })
                    .collect())
            }
            Err(error) if error.is_permanent() => {
                tracing::error!(queue, error = %error_chain(&error), "the consumer stops: polling again cannot help");
                Err(error)
            }
            Err(error) => {
                self.failures = self.failures.saturating_add(1);
                let delay = consumer.backoff.delay(self.failures);
                tracing::warn!(queue, error = %error_chain(&error), failures = self.failures, delay_ms = delay.as_millis() as u64, "receiving from SQS failed; polling again");
                tokio::time::sleep(delay).await;
                Ok(Vec::new())
            }
        }
    }
}

/// A settlement as the runner's unit of work: it never fails the run (what
/// it could not settle comes back after its lease).
fn settled(settle: impl Future<Output = ()> + Send + 'static) -> Work<Error> {
    Box::pin(async move {
        settle.await;
        Ok(())
    })
}

/// The received messages as the tasks take them: each alone on a standard
/// queue; on a FIFO queue, the messages of one group together, in the order
/// SQS gave them.
fn groups(messages: Vec<Received>, fifo: bool) -> Vec<Vec<Received>> {
    if !fifo {
        return messages.into_iter().map(|m| vec![m]).collect();
    }
    let mut order: Vec<Vec<Received>> = Vec::new();
    let mut index: HashMap<Option<String>, usize> = HashMap::new();
    for message in messages {
        match index.get(&message.group) {
            Some(&i) => order[i].push(message),
            None => {
                index.insert(message.group.clone(), order.len());
                order.push(vec![message]);
            }
        }
    }
    order
}

impl<I: Inbox, H> std::fmt::Debug for Consumer<I, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("queue_url", &self.queue_url)
            .field("protocol", &self.shared.protocol)
            .field("concurrency", &self.concurrency)
            .field("batch", &self.batch)
            .field("wait_time", &self.wait_time)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl<I, H> std::fmt::Debug for ConsumerBuilder<I, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("queue_url", &self.options.queue_url)
            .field("name", &self.options.name)
            .field("policy", &self.options.policy)
            .field("concurrency", &self.options.concurrency)
            .field("batch", &self.options.batch)
            .finish_non_exhaustive()
    }
}
