//! The queues and exchanges the consumer declares, and how messages move
//! between them.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};

/// The names around one work queue `Q`:
///
/// - `Q`, the work queue (producers publish to it through the default
///   exchange, routing key `Q`);
/// - `Q.retry`, the delay queue: a failed message is published to it with a
///   per-message TTL (its backoff delay); when the TTL expires, RabbitMQ
///   dead-letters it to the exchange `Q.dlx` with the routing key it was
///   published with;
/// - `Q.dlx`, a direct exchange that routes `Q` back to the work queue and
///   `Q.dlq` to the dead-letter queue;
/// - `Q.retry` is also the name of the direct exchange that feeds the delay
///   queue under both routing keys;
/// - `Q.dlq`, the dead-letter queue, which nothing consumes: it is read with
///   `dead-letters` and emptied with `redrive`.
///
/// A message that leaves for good (after its last attempt, or at once for a
/// permanent error) takes the same path with a TTL of 0 and the routing key
/// `Q.dlq`: it reaches the dead-letter queue through RabbitMQ's
/// dead-lettering, which keeps and extends its `x-death` history. (A message
/// rejected from `Q` itself is dead-lettered to `Q.dlq` too.)
///
/// RabbitMQ expires per-message TTLs at the head of a queue only: in the
/// delay queue a message waits at most for the one ahead of it, whose delay
/// is capped ([`RETRY_CAP`](crate::consume::RETRY_CAP)). The work queue is
/// never held up: failed messages wait beside it, not in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    queue: String,
}

impl Topology {
    /// The topology around the work queue `queue`.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
        }
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The delay queue, and the exchange that feeds it.
    pub fn retry_queue(&self) -> String {
        format!("{}.retry", self.queue)
    }

    /// The exchange the delay queue dead-letters to.
    pub fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.queue)
    }

    /// The dead-letter queue.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// Declares every queue, exchange and binding (durable); declaring again
    /// changes nothing. Fails if a queue exists with other arguments.
    pub async fn declare(&self, channel: &Channel) -> Result<(), lapin::Error> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        for exchange in [self.dead_letter_exchange(), self.retry_queue()] {
            channel
                .exchange_declare(
                    exchange.into(),
                    ExchangeKind::Direct,
                    durable,
                    FieldTable::default(),
                )
                .await?;
        }
        let queue_options = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let mut work = FieldTable::default();
        work.insert(
            "x-dead-letter-exchange".into(),
            string(&self.dead_letter_exchange()),
        );
        work.insert(
            "x-dead-letter-routing-key".into(),
            string(&self.dead_letter_queue()),
        );
        let mut delay = FieldTable::default();
        delay.insert(
            "x-dead-letter-exchange".into(),
            string(&self.dead_letter_exchange()),
        );
        for (queue, arguments) in [
            (self.queue.clone(), work),
            (self.retry_queue(), delay),
            (self.dead_letter_queue(), FieldTable::default()),
        ] {
            channel
                .queue_declare(queue.into(), queue_options, arguments)
                .await?;
        }
        let bindings = [
            (
                self.queue.clone(),
                self.dead_letter_exchange(),
                self.queue.clone(),
            ),
            (
                self.dead_letter_queue(),
                self.dead_letter_exchange(),
                self.dead_letter_queue(),
            ),
            (self.retry_queue(), self.retry_queue(), self.queue.clone()),
            (
                self.retry_queue(),
                self.retry_queue(),
                self.dead_letter_queue(),
            ),
        ];
        for (queue, exchange, key) in bindings {
            channel
                .queue_bind(
                    queue.into(),
                    exchange.into(),
                    ShortString::from(key),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }

    /// How many messages are ready in `queue` (unacknowledged ones not
    /// counted), by a passive declaration.
    pub async fn ready(channel: &Channel, queue: &str) -> Result<u32, lapin::Error> {
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(declared.message_count())
    }
}

fn string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}
