//! The consumer: a work queue, an inbox, a policy and a handler, run until
//! shut down, across broker restarts.

mod delivery;

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{FutureExt, StreamExt};
use idem_core::consume::runner::{Intake, Runner, Taken, Work, default_broker_backoff};
use idem_core::consume::{
    Batch, ConsumerPolicy, Handler, Inbox, MemoryInbox, Outage, Protocol, StopSignal,
};
use idem_core::retry::Backoff;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use crate::Error;
use crate::broker::Address;
use crate::topology::{self, QueueType, Topology};

/// How many unacknowledged deliveries the broker sends ahead, unless told
/// otherwise ([`ConsumerBuilder::prefetch`]).
pub const DEFAULT_PREFETCH: u16 = 32;

pub use idem_core::consume::runner::DEFAULT_SHUTDOWN_TIMEOUT;

/// How long closing the channel and the connection may take at the end: the
/// broker hands back what was not acknowledged whether or not the close
/// completes.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// An at-least-once RabbitMQ consumer whose handler applies each message
/// once: each delivery is translated into a [`Message`](idem_core::consume::Message),
/// [`Protocol::decide`] decides, and the consumer carries the
/// [`Decision`](idem_core::consume::Decision) out on the broker, acknowledging the delivery
/// only after that work is confirmed:
///
/// | decision | on the broker, then the delivery is acknowledged |
/// |---|---|
/// | `Ack` | nothing more |
/// | `Retry` | a copy to the delay queue of its delay ([`Topology`]), with a per-message TTL; confirmed |
/// | `DeadLetter` | a copy to `Q.dlq` (through `Q.dlq.hop`: `x-death` kept) with `idem-reason` and `idem-attempts`; confirmed; then [`Protocol::published`] |
/// | `Requeue` | none while the session lasts: the delivery is held (see below) |
///
/// **While the inbox is unavailable** (its database is down), the consumer
/// holds the deliveries it has, unacknowledged, deciding each again after
/// the policy's pause ([`Protocol::decide_holding`]), and starts no other
/// until the inbox answers again: a requeued delivery would come straight
/// back, and a quorum queue's `delivery-limit` counts each return. An outage
/// costs no attempt. When the session ends (a shutdown, a lost connection),
/// the held deliveries are handed back.
///
/// A copy the broker does not confirm (refused, unroutable) leaves the
/// delivery unacknowledged: it is handed back after a pause of a second,
/// and the protocol, which counted the attempt, decides
/// again. A crash between a confirmed copy and the acknowledgement leaves
/// both; the inbox makes the second one a duplicate.
///
/// Built with [`Consumer::builder`], run with [`Consumer::run`].
pub struct Consumer<I: Inbox, H> {
    shared: Arc<Shared<I, H>>,
    address: Address,
    prefetch: u16,
    /// The most deliveries in hand at once: the concurrency times the batch.
    concurrency: usize,
    /// The most deliveries decided together (1 one at a time).
    batch: usize,
    shutdown_timeout: Duration,
    reconnect: Backoff,
}

/// What the consumer's tasks share.
struct Shared<I: Inbox, H> {
    protocol: Protocol<I>,
    handler: H,
    topology: Topology,
    /// The delay queues declared on the current connection.
    declared: Mutex<HashSet<String>>,
    /// The deliveries held while the inbox is unavailable.
    outage: Outage,
    /// Set when the session ends: a held delivery stops waiting.
    stop: StopSignal,
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
    url: String,
    queue: String,
    name: Option<String>,
    policy: ConsumerPolicy,
    prefetch: u16,
    concurrency: usize,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    shutdown_timeout: Duration,
    reconnect: Backoff,
}

/// A part of a [`ConsumerBuilder`] not given yet (the inbox, the handler).
#[derive(Clone, Copy, Debug)]
pub struct Unset;

/// What [`Consumer::run`] tells its `on_subscribed` callback each time it
/// subscribes: once at the start, then after each reconnection.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Subscribed {
    /// The work queue.
    pub queue: String,
    /// Which subscription this is: 1 for the first, 2 after the first
    /// reconnection, and so on.
    pub subscription: u64,
}

impl Consumer<MemoryInbox, Unset> {
    /// A builder of the consumer of `queue` on the broker at `url`
    /// (`amqp://user:password@host:port/vhost`, the virtual host
    /// percent-encoded: `%2f` for `/`). The type parameters are the inbox's
    /// and the handler's, set by [`ConsumerBuilder::inbox`] and
    /// [`ConsumerBuilder::handler`].
    pub fn builder(
        url: impl Into<String>,
        queue: impl Into<String>,
    ) -> ConsumerBuilder<Unset, Unset> {
        ConsumerBuilder {
            inbox: Unset,
            handler: Unset,
            options: Options {
                url: url.into(),
                queue: queue.into(),
                name: None,
                policy: ConsumerPolicy::new(),
                prefetch: DEFAULT_PREFETCH,
                concurrency: 1,
                queue_type: QueueType::Classic,
                delivery_limit: Some(topology::DEFAULT_DELIVERY_LIMIT),
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
                reconnect: default_broker_backoff(),
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
    /// consumer of a message applies it once, so two consumers of one
    /// queue that apply the same effect share a name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.options.name = Some(name.into());
        self
    }

    /// How many unacknowledged deliveries the broker sends ahead (`basic.qos`,
    /// default [`DEFAULT_PREFETCH`]); raised to the concurrency if lower.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.options.prefetch = prefetch;
        self
    }

    /// How many handlers run at once (default 1; at least 1).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.options.concurrency = concurrency.max(1);
        self
    }

    /// The type of every queue of the topology (default
    /// [`QueueType::Classic`]).
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.options.queue_type = queue_type;
        self
    }

    /// A quorum work queue's `x-delivery-limit` (default
    /// [`DEFAULT_DELIVERY_LIMIT`](topology::DEFAULT_DELIVERY_LIMIT)); see
    /// [`Topology::delivery_limit`] for how it relates to the inbox's count.
    pub fn delivery_limit(mut self, limit: Option<u32>) -> Self {
        self.options.delivery_limit = limit;
        self
    }

    /// How long a graceful shutdown waits for the running handlers (default
    /// [`DEFAULT_SHUTDOWN_TIMEOUT`]). Handlers still running then are
    /// dropped (a database inbox rolls their transaction back) and their
    /// deliveries go back to the queue.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.options.shutdown_timeout = timeout;
        self
    }

    /// The delays between attempts to connect again after the broker failed
    /// (default [`default_broker_backoff`]: full jitter from 250 ms, capped
    /// at 10 s).
    pub fn broker_backoff(mut self, backoff: Backoff) -> Self {
        self.options.reconnect = backoff;
        self
    }
}

impl<I, H> ConsumerBuilder<I, H> {
    /// What applies messages in batches, instead of [`handler`](Self::handler):
    /// each take of what the broker already sent (never waiting to fill a
    /// batch) is split in batches of up to `size` deliveries, entered in
    /// the inbox together and handed to `handler` on one transaction, one
    /// commit ([`Protocol::decide_batch`](idem_core::consume::Protocol::decide_batch)):
    /// a message that fails its batch is tried again alone, so it alone is
    /// retried and dead-lettered. [`concurrency`](Self::concurrency) is then
    /// the number of batches at once; the prefetch is raised to hold them.
    pub fn batch_handler<B>(self, handler: B, size: usize) -> ConsumerBuilder<I, Batch<B>> {
        self.handler(Batch::new(handler, size))
    }
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> ConsumerBuilder<I, H> {
    /// The consumer. Fails on a URL that cannot be parsed or a queue name
    /// AMQP cannot carry; the broker is not contacted until
    /// [`run`](Consumer::run).
    pub fn build(self) -> Result<Consumer<I, H>, Error> {
        let address = Address::parse(&self.options.url)?;
        topology::check_queue_name(&self.options.queue)?;
        let name = self
            .options
            .name
            .unwrap_or_else(|| self.options.queue.clone());
        let topology = Topology::new(self.options.queue)
            .queue_type(self.options.queue_type)
            .delivery_limit(self.options.delivery_limit);
        let batch = self.handler.as_batch().map_or(1, |(_, size)| size);
        let in_hand = self.options.concurrency.saturating_mul(batch);
        let prefetch = self
            .options
            .prefetch
            .max(u16::try_from(in_hand).unwrap_or(u16::MAX));
        Ok(Consumer {
            shared: Arc::new(Shared {
                protocol: Protocol::new(name, self.inbox, self.options.policy),
                handler: self.handler,
                topology,
                declared: Mutex::new(HashSet::new()),
                outage: Outage::new(),
                stop: StopSignal::new(),
            }),
            address,
            prefetch,
            concurrency: in_hand.min(usize::from(prefetch)),
            batch,
            shutdown_timeout: self.options.shutdown_timeout,
            reconnect: self.options.reconnect,
        })
    }
}

/// How a session ended, short of a shutdown.
struct Lost {
    error: Error,
    subscribed: bool,
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> Consumer<I, H> {
    /// The protocol: the inbox, the policy, the inbox's dead letters.
    pub fn protocol(&self) -> &Protocol<I> {
        &self.shared.protocol
    }

    /// The queues the consumer declares and uses.
    pub fn topology(&self) -> &Topology {
        &self.shared.topology
    }

    /// Connects, declares the topology, subscribes, calls `on_subscribed`,
    /// and consumes until `shutdown` resolves.
    ///
    /// **Start:** an inbox that is not ready ([`Inbox::readiness`](idem_core::consume::Inbox::readiness):
    /// idem-diesel's, neither migrated nor checked in this process) is
    /// [`Error::NotReady`] at once, before anything is contacted.
    ///
    /// **Across failures:** a dropped connection, a broker restart or a
    /// broker that is not up yet is not an error: the consumer waits for the
    /// running handlers, reconnects after a full-jitter delay
    /// ([`broker_backoff`](ConsumerBuilder::broker_backoff)), declares
    /// again and resumes, calling `on_subscribed` again. The deliveries it
    /// had not acknowledged come back from the broker; those whose effect
    /// committed are duplicates to the inbox. It answers an error only when
    /// reconnecting cannot help ([`Error::is_permanent`]: refused
    /// credentials, a queue declared with other arguments).
    ///
    /// **Shutdown:** once `shutdown` resolves, the consumer takes no more
    /// deliveries (`basic.cancel`), lets the running handlers finish and
    /// carries out their decisions (for at most
    /// [`shutdown_timeout`](ConsumerBuilder::shutdown_timeout)), then closes
    /// the channel and the connection: the deliveries it had received but
    /// not started go back to the queue.
    pub async fn run(
        &self,
        shutdown: impl Future<Output = ()>,
        mut on_subscribed: impl FnMut(&Subscribed),
    ) -> Result<(), Error> {
        self.shared.protocol.readiness()?;
        tokio::pin!(shutdown);
        let mut subscriptions = 0u64;
        let mut failures = 0u32;
        loop {
            let lost = match self
                .session(&mut shutdown, &mut on_subscribed, &mut subscriptions)
                .await
            {
                Ok(()) => return Ok(()),
                Err(lost) => lost,
            };
            if lost.error.is_permanent() {
                tracing::error!(queue = self.topology().queue(), error = %error_chain(&lost.error), "the consumer stops: reconnecting cannot help");
                return Err(lost.error);
            }
            if lost.subscribed {
                failures = 0;
            }
            failures = failures.saturating_add(1);
            let delay = self.reconnect.delay(failures);
            tracing::warn!(
                queue = self.topology().queue(),
                broker = %self.address,
                error = %error_chain(&lost.error),
                failures,
                delay_ms = delay.as_millis() as u64,
                "the connection to RabbitMQ is lost or could not be made; reconnecting"
            );
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// One connection: set up, consume, and end on shutdown (`Ok`) or on a
    /// failure.
    async fn session(
        &self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        on_subscribed: &mut impl FnMut(&Subscribed),
        subscriptions: &mut u64,
    ) -> Result<(), Lost> {
        let unsubscribed = |error| Lost {
            error,
            subscribed: false,
        };
        let opened = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(()),
            opened = self.open() => opened.map_err(unsubscribed)?,
        };
        let Opened {
            connection,
            channel,
            tag,
            deliveries,
        } = opened;
        *subscriptions += 1;
        let queue = self.topology().queue();
        tracing::info!(queue, broker = %self.address, subscription = *subscriptions, prefetch = self.prefetch, concurrency = self.concurrency, "consuming");
        on_subscribed(&Subscribed {
            queue: queue.to_owned(),
            subscription: *subscriptions,
        });

        let runner = Runner {
            concurrency: self.concurrency,
            shutdown_timeout: self.shutdown_timeout,
            outage: &self.shared.outage,
            stop: &self.shared.stop,
            source: queue,
            comes_back: "from the broker",
        };
        let intake = Deliveries {
            shared: Arc::clone(&self.shared),
            batch: self.batch,
            channel: channel.clone(),
            tag,
            deliveries,
            failed: None,
        };
        // The deliveries not acknowledged come back from the broker: on a
        // failure, the running handlers finish first (their acknowledgements
        // fail with the connection, which is harmless), the held ones stop
        // waiting.
        let ended = runner.run(intake, shutdown.as_mut()).await;
        close(&connection, &channel).await;
        ended.map_err(|error| Lost {
            error,
            subscribed: true,
        })
    }

    /// Connects, declares, and subscribes.
    async fn open(&self) -> Result<Opened, Error> {
        let name = format!("idem-rabbitmq consumer {}", self.protocol().consumer());
        let (connection, channel) = self.address.open_confirmed(&name).await?;
        self.shared.forget_declared();
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(Error::broker("set the prefetch"))?;
        self.topology().declare(&channel).await?;
        let tag = format!("idem-{}", uuid::Uuid::new_v4().simple());
        let deliveries = channel
            .basic_consume(
                self.topology().queue().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(Error::broker(format!(
                "consume from {:?}",
                self.topology().queue()
            )))?;
        Ok(Opened {
            connection,
            channel,
            tag,
            deliveries,
        })
    }
}

impl<I: Inbox, H> Shared<I, H> {
    fn forget_declared(&self) {
        self.declared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
    }
}

impl<I: Inbox, H> std::fmt::Debug for Consumer<I, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("broker", &self.address)
            .field("topology", &self.shared.topology)
            .field("protocol", &self.shared.protocol)
            .field("prefetch", &self.prefetch)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl<I, H> std::fmt::Debug for ConsumerBuilder<I, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("queue", &self.options.queue)
            .field("name", &self.options.name)
            .field("policy", &self.options.policy)
            .field("prefetch", &self.options.prefetch)
            .field("concurrency", &self.options.concurrency)
            .field("queue_type", &self.options.queue_type)
            .finish_non_exhaustive()
    }
}

/// A session's connection, set up.
struct Opened {
    connection: Connection,
    channel: Channel,
    tag: String,
    deliveries: lapin::Consumer,
}

/// A session's deliveries, as the runner takes them.
struct Deliveries<I: Inbox, H> {
    shared: Arc<Shared<I, H>>,
    /// The most deliveries in a unit.
    batch: usize,
    channel: Channel,
    tag: String,
    deliveries: lapin::Consumer,
    /// A failure met while taking what was already there: the next take's
    /// answer.
    failed: Option<Error>,
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> Deliveries<I, H> {
    /// The deliveries taken, in units of up to the batch's size, in order.
    /// Each unit takes a whole batch's room, however few it holds: at most
    /// `concurrency` units run, and what arrives meanwhile waits to fill
    /// the next.
    fn units(&self, mut taken: Vec<lapin::message::Delivery>) -> Vec<(usize, Work<Error>)> {
        let mut units = Vec::with_capacity(taken.len().div_ceil(self.batch));
        while !taken.is_empty() {
            let rest = taken.split_off(self.batch.min(taken.len()));
            let work = delivery::carry_out(Arc::clone(&self.shared), self.channel.clone(), taken);
            units.push((self.batch, Box::pin(work) as Work<Error>));
            taken = rest;
        }
        units
    }
}

fn received(
    delivery: Option<lapin::Result<lapin::message::Delivery>>,
) -> Result<lapin::message::Delivery, Error> {
    match delivery {
        Some(Ok(delivery)) => Ok(delivery),
        Some(Err(error)) => Err(Error::Broker {
            step: "receive deliveries".to_owned(),
            source: error,
        }),
        None => Err(Error::Cancelled),
    }
}

impl<I: Inbox, H: Handler<I::Tx> + 'static> Intake for Deliveries<I, H> {
    type Error = Error;

    /// The next delivery, and those already received behind it (up to
    /// `room`); nothing once a delivery is held through an outage (the
    /// subscription keeps the rest: no new delivery starts until the inbox
    /// is back).
    async fn take(&mut self, room: usize) -> Taken<Error> {
        if let Some(error) = self.failed.take() {
            return Err(error);
        }
        let next = tokio::select! {
            biased;
            () = self.shared.outage.began() => return Ok(Vec::new()),
            next = self.deliveries.next() => next,
        };
        let mut taken = vec![received(next)?];
        while taken.len() < room && !self.shared.outage.is_on() {
            let Some(next) = self.deliveries.next().now_or_never() else {
                break;
            };
            match received(next) {
                Ok(delivery) => taken.push(delivery),
                Err(error) => {
                    self.failed = Some(error);
                    break;
                }
            }
        }
        Ok(self.units(taken))
    }

    /// A delivery's task that failed ends the session: its delivery comes
    /// back only when the channel closes.
    fn task_failed(why: &tokio::task::JoinError) -> Option<Error> {
        Some(Error::Internal(format!("a delivery's task failed: {why}")))
    }

    /// `basic.cancel`: the broker sends nothing more.
    fn stopper(&self) -> impl Future<Output = ()> + Send + 'static {
        let (channel, tag) = (self.channel.clone(), self.tag.clone());
        let queue = self.shared.topology.queue().to_owned();
        async move {
            if let Ok(Err(error)) = tokio::time::timeout(
                CLOSE_LIMIT,
                channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()),
            )
            .await
            {
                tracing::warn!(queue, error = %error_chain(&error), "could not cancel the subscription; closing");
            }
        }
    }
}

async fn close(connection: &Connection, channel: &Channel) {
    let _ = tokio::time::timeout(CLOSE_LIMIT, async {
        let _ = channel.close(200, "bye".into()).await;
        let _ = connection.close(200, "bye".into()).await;
    })
    .await;
}

pub(crate) use idem_core::log::error_chain;
