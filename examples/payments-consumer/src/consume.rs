//! `run`: the consumer loop.

use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use idem_core::retry::Backoff;
use idem_diesel::{Delivery as Outcome, Inbox, InboxError, PgStore};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use crate::ConsumerError;
use crate::alert;
use crate::ledger;
use crate::message;
use crate::topology::Topology;

/// How many unacknowledged deliveries the broker sends ahead.
pub const PREFETCH: u16 = 32;

/// How long a delivery waits before it is handed back when the database is
/// unavailable.
const UNAVAILABLE_PAUSE: Duration = Duration::from_secs(1);

/// How long the connection's close may take at the end.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);

/// What `run` needs.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The broker, `amqp://user:password@host:port/vhost`.
    pub amqp: String,
    /// The PostgreSQL database, `postgres://…`.
    pub database: String,
    /// The work queue.
    pub queue: String,
    /// How many failed attempts send a message to the dead-letter queue.
    pub max_attempts: u32,
    /// The first retry comes within this delay (full jitter), each later one
    /// within twice the previous bound, up to [`RETRY_CAP`].
    pub retry_base: Duration,
    /// More dead letters than this raise the alert.
    pub dead_letter_alert_threshold: u64,
    /// Every payment to this account fails (the deliberate bug).
    pub fail_account: Option<String>,
}

/// No retry waits longer (the cap of `Backoff::for_consumers`).
pub const RETRY_CAP: Duration = Duration::from_secs(300);

/// Declares the topology, subscribes, calls `subscribed`, and consumes until
/// SIGTERM or Ctrl-C (then it closes the connection: deliveries not yet
/// acknowledged go back to the queue) or a broker error.
pub async fn run(
    options: RunOptions,
    subscribed: impl FnOnce(&Topology),
) -> Result<(), ConsumerError> {
    let store = PgStore::connect(&options.database).await?;
    let pool = store.pool().clone();
    // The alert is the broker's (its dead-letter queue also holds the
    // messages that never reach the inbox): the inbox's own stays quiet.
    let inbox = Inbox::builder()
        .max_attempts(options.max_attempts)
        .dead_letter_threshold(u64::MAX)
        .build(pool.clone());
    inbox.migrate().await?;
    ledger::migrate(&pool).await?;

    let connection = Connection::connect(&options.amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let topology = Topology::new(options.queue.clone());
    topology.declare(&channel).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let watcher = tokio::spawn(alert::watch(
        connection.create_channel().await?,
        topology.clone(),
        options.dead_letter_alert_threshold,
    ));
    let mut deliveries = channel
        .basic_consume(
            topology.queue().into(),
            "payments-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    subscribed(&topology);

    let handler = Handler {
        channel: channel.clone(),
        topology,
        consumer: format!("payments-consumer/{}", options.queue),
        inbox,
        backoff: Backoff::new(options.retry_base, RETRY_CAP.max(options.retry_base)),
        fail_account: options.fail_account,
    };
    let stopped = stop_signal()?;
    tokio::pin!(stopped);
    tokio::pin!(watcher);
    let ended = loop {
        tokio::select! {
            delivery = deliveries.next() => match delivery {
                Some(Ok(delivery)) => {
                    if let Err(error) = handler.handle(delivery).await {
                        break Err(error);
                    }
                }
                Some(Err(error)) => break Err(error.into()),
                None => break Err(ConsumerError::Cancelled),
            },
            watched = &mut watcher => break match watched {
                Ok(Err(error)) => Err(error),
                _ => Err(ConsumerError::Cancelled),
            },
            () = &mut stopped => {
                tracing::info!("stopping: deliveries not acknowledged go back to the queue");
                break Ok(());
            }
        }
    };
    watcher.abort();
    // The broker hands back what was not acknowledged when the connection
    // ends, cleanly or not: the close is not waited for long.
    let _ = tokio::time::timeout(CLOSE_LIMIT, async {
        let _ = channel
            .basic_cancel("payments-consumer".into(), BasicCancelOptions::default())
            .await;
        drop(deliveries);
        let _ = channel.close(200, "bye".into()).await;
        let _ = connection.close(200, "bye".into()).await;
    })
    .await;
    ended
}

/// Handles one delivery at a time.
struct Handler {
    channel: Channel,
    topology: Topology,
    /// The inbox's consumer name.
    consumer: String,
    inbox: Inbox,
    backoff: Backoff,
    fail_account: Option<String>,
}

impl Handler {
    async fn handle(&self, delivery: Delivery) -> Result<(), ConsumerError> {
        let started = SystemTime::now();
        let (key, payment) = match message::parse(&delivery.properties, &delivery.data) {
            Ok(parsed) => parsed,
            Err(permanent) => {
                tracing::warn!(
                    queue = self.topology.queue(),
                    error = permanent.kind(),
                    "a message that can never be processed goes to the dead-letter queue at once"
                );
                return self
                    .dead_letter(&delivery, &permanent.to_string(), &[started])
                    .await;
            }
        };
        let id = key.as_str();
        if message::redriven(&delivery.properties) {
            match self.inbox.redrive(&self.consumer, id).await {
                Ok(_) => {}
                Err(error) => return self.unavailable(&delivery, &error).await,
            }
        }
        let failing = self.fail_account.as_deref();
        let outcome = self
            .inbox
            .process_once(&self.consumer, Some(id), async |connection| {
                ledger::apply(connection, &payment, failing).await
            })
            .await;
        match outcome {
            Ok(Outcome::Processed(())) | Ok(Outcome::Duplicate) => {
                delivery.ack(BasicAckOptions::default()).await?;
                Ok(())
            }
            // Its last attempt failed before, but it did not reach the
            // dead-letter queue (the consumer stopped in between), or a
            // producer sent it again: it goes there (again).
            Ok(Outcome::DeadLetter) => {
                let letter = match self.inbox.dead_letter(&self.consumer, id).await {
                    Ok(letter) => letter,
                    Err(error) => return self.unavailable(&delivery, &error).await,
                };
                let (reason, attempts) = letter.map_or_else(
                    || ("a dead letter of the inbox".to_owned(), vec![started]),
                    |letter| (letter.last_error, letter.attempted_at),
                );
                self.dead_letter(&delivery, &reason, &attempts).await
            }
            Err(InboxError::Failed {
                attempt,
                max_attempts,
                source,
            }) => {
                let delay = self.backoff.delay(attempt);
                tracing::info!(
                    key = %key.redacted(),
                    attempt,
                    max_attempts,
                    delay_ms = delay.as_millis() as u64,
                    error = %error_chain(&source),
                    "payment failed; retried through the delay queue"
                );
                self.retry(&delivery, &error_chain(&source), delay).await
            }
            Err(InboxError::DeadLettered { attempts, source }) => {
                let reason = error_chain(&source);
                tracing::error!(
                    key = %key.redacted(),
                    attempts,
                    error = %reason,
                    "payment failed on its last attempt; it goes to the dead-letter queue"
                );
                let times = match self.inbox.dead_letter(&self.consumer, id).await {
                    Ok(Some(letter)) => letter.attempted_at,
                    Ok(None) => vec![started],
                    Err(error) => return self.unavailable(&delivery, &error).await,
                };
                self.dead_letter(&delivery, &reason, &times).await
            }
            Err(InboxError::MissingMessageId) => {
                self.dead_letter(
                    &delivery,
                    &message::Permanent::NoMessageId.to_string(),
                    &[started],
                )
                .await
            }
            Err(error @ InboxError::Unavailable(_)) => self.unavailable(&delivery, &error).await,
        }
    }

    /// Publishes the message to the delay queue with a TTL of `delay`, after
    /// which RabbitMQ dead-letters it back to the work queue; then
    /// acknowledges this delivery.
    async fn retry(
        &self,
        delivery: &Delivery,
        reason: &str,
        delay: Duration,
    ) -> Result<(), ConsumerError> {
        let properties = message::failed(&delivery.properties, self.topology.queue(), reason, None)
            .with_expiration(delay.as_millis().to_string().into());
        self.hop(delivery, self.topology.queue(), properties).await
    }

    /// Sends the message to the dead-letter queue, through the delay queue
    /// with a TTL of 0 (so that RabbitMQ dead-letters it and its `x-death`
    /// history grows), with the reason and the attempt times; then
    /// acknowledges this delivery.
    async fn dead_letter(
        &self,
        delivery: &Delivery,
        reason: &str,
        attempts: &[SystemTime],
    ) -> Result<(), ConsumerError> {
        let properties = message::failed(
            &delivery.properties,
            self.topology.queue(),
            reason,
            Some(attempts),
        )
        .with_expiration("0".into());
        self.hop(delivery, &self.topology.dead_letter_queue(), properties)
            .await
    }

    /// Publishes a copy of the delivery to the delay queue's exchange under
    /// `destination`, waits for the broker's confirmation, then acknowledges
    /// the delivery. (A crash in between leaves both: the copy and the
    /// redelivered original; the inbox makes the second a duplicate.)
    async fn hop(
        &self,
        delivery: &Delivery,
        destination: &str,
        properties: BasicProperties,
    ) -> Result<(), ConsumerError> {
        publish_confirmed(
            &self.channel,
            &self.topology.retry_queue(),
            destination,
            &delivery.data,
            properties,
        )
        .await?;
        delivery.ack(BasicAckOptions::default()).await?;
        Ok(())
    }

    /// The database is unavailable: the delivery goes back to the queue after
    /// a pause, uncounted.
    async fn unavailable(
        &self,
        delivery: &Delivery,
        error: &(dyn std::error::Error + 'static),
    ) -> Result<(), ConsumerError> {
        tracing::error!(error = %error_chain(error), "the inbox is unavailable; the delivery goes back to the queue");
        tokio::time::sleep(UNAVAILABLE_PAUSE).await;
        delivery
            .nack(BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            })
            .await?;
        Ok(())
    }
}

/// Publishes `body` (mandatory: an unroutable message is an error) on a
/// channel in confirm mode, and waits for the broker's acknowledgement.
pub(crate) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), ConsumerError> {
    let confirmation = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await?
        .await?;
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(ConsumerError::NotConfirmed(format!(
            "no queue is bound to {exchange:?} under {routing_key:?}"
        ))),
        Confirmation::Nack(_) => Err(ConsumerError::NotConfirmed(
            "the broker could not store it".to_owned(),
        )),
        Confirmation::NotRequested => Err(ConsumerError::NotConfirmed(
            "the channel is not in confirm mode".to_owned(),
        )),
    }
}

/// Resolves on SIGTERM or Ctrl-C.
fn stop_signal() -> Result<impl Future<Output = ()>, ConsumerError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).map_err(ConsumerError::Signal)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(ConsumerError::Signal)?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    })
}

/// An error and its sources, on one line.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
