//! The queues around one work queue, and how a message moves between them.

use std::time::Duration;

use lapin::Channel;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};

use crate::Error;

/// The queues around one work queue `Q`, all durable, all reached through
/// the default exchange (no exchange or binding of their own):
///
/// | queue | holds | arguments |
/// |---|---|---|
/// | `Q` | the work | dead-letters to `Q.dlq` (a rejected message; a quorum queue's delivery limit) |
/// | `Q.retry.<B>ms`, declared when first needed | retries whose delay is in `[B/2, B)` ms, each with its delay as per-message TTL | dead-letters back to `Q` when the TTL expires |
/// | `Q.dlq.hop` | nothing for long: a TTL of 0 | dead-letters at once to `Q.dlq` |
/// | `Q.dlq` | the dead letters, consumed by nobody | |
///
/// **Retries block neither the work queue nor each other.** A failed message
/// waits beside the work queue, not in it. RabbitMQ expires per-message TTLs
/// only at the head of a queue, so one delay queue would hold a 200 ms retry
/// behind a 3 s one. Here each power of two of milliseconds has its own delay
/// queue: a message of delay `d` goes to the queue whose bound `B` is the
/// power of two with `B/2 ≤ d < B` (`B = 2` for `d < 2 ms`). Every message
/// ahead of it there was queued earlier with a TTL under `B`, so it leaves
/// less than `B` after it was queued: **it waits at most `max(d, B)`, less
/// than twice its delay** (and less than 2 ms for a delay under 1 ms). Delays
/// are capped at [`MAX_DELAY`]; a full-jitter policy uses about twenty such
/// queues at most (1 ms to 5 minutes).
///
/// **Dead letters keep their history.** A message that leaves for good is
/// published to `Q.dlq.hop`, whose TTL of 0 makes RabbitMQ dead-letter it to
/// `Q.dlq` at once: its `x-death` header gains that hop (after the
/// `Q.retry.*` hops of its retries), and the headers the consumer writes
/// (`idem-reason`, `idem-attempts`) travel with it.
///
/// **Quorum queues** ([`QueueType::Quorum`]) make every queue above a quorum
/// queue, and those that dead-letter do it *at least once*
/// (`x-dead-letter-strategy: at-least-once`, which needs
/// `x-overflow: reject-publish`): a message expiring from a delay queue is
/// not lost if `Q` is unavailable at that instant. The work queue gets
/// `x-delivery-limit` ([`Topology::delivery_limit`]).
///
/// Declaring is idempotent; a queue that exists with other arguments (another
/// queue type, another delivery limit) fails with `PRECONDITION_FAILED`,
/// which the consumer reports instead of reconnecting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    queue: String,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
}

/// The longest retry delay: longer ones are cut to it (about 24 days).
pub const MAX_DELAY: Duration = Duration::from_millis(1 << 31);

/// A quorum work queue's `x-delivery-limit` unless told otherwise
/// ([`Topology::delivery_limit`]).
pub const DEFAULT_DELIVERY_LIMIT: u32 = 100;

/// The kind of every queue of a [`Topology`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueType {
    /// RabbitMQ's classic queue, on one node. The default.
    #[default]
    Classic,
    /// A replicated quorum queue (`x-queue-type: quorum`, RabbitMQ 3.10 or
    /// later for the delay queues' per-message TTL).
    Quorum,
}

impl Topology {
    /// The topology around the work queue `queue`: classic queues.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            queue_type: QueueType::Classic,
            delivery_limit: Some(DEFAULT_DELIVERY_LIMIT),
        }
    }

    /// The type of every queue (default [`QueueType::Classic`]).
    #[must_use]
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// A quorum work queue's `x-delivery-limit` (default
    /// [`DEFAULT_DELIVERY_LIMIT`]; `None` sets none, and RabbitMQ 4's
    /// default of 20 applies). Ignored for classic queues.
    ///
    /// It is not the attempt count: the inbox counts the attempts the
    /// handler failed ([`ConsumerPolicy::max_attempts`](idem_core::consume::ConsumerPolicy::max_attempts)),
    /// and each retry is a new copy, acknowledged, whose broker count starts
    /// over. The broker counts only deliveries that came back
    /// unacknowledged: the consumer died or lost its connection while a
    /// handler ran, or the inbox was unavailable (each pause of
    /// `unavailable_pause` hands a delivery back once). The limit is the
    /// backstop for a message that kills the consumer before the inbox can
    /// count its failure: past it, RabbitMQ dead-letters the message into
    /// `Q.dlq` itself (`x-death` reason `delivery_limit`, without the
    /// inbox's record). Keep it well above the hand-backs an inbox outage
    /// can cause.
    #[must_use]
    pub fn delivery_limit(mut self, limit: Option<u32>) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The kind of the queues.
    pub fn kind(&self) -> QueueType {
        self.queue_type
    }

    /// The dead-letter queue, `Q.dlq`.
    pub fn dead_letter_queue(&self) -> String {
        dead_letter_queue(&self.queue)
    }

    /// The queue a dead letter goes through to reach `Q.dlq`, `Q.dlq.hop`.
    pub fn dead_letter_hop(&self) -> String {
        format!("{}.dlq.hop", self.queue)
    }

    /// The delay queue for a retry after `delay`, `Q.retry.<B>ms`, and
    /// the delay to set as its TTL (cut to [`MAX_DELAY`]).
    pub fn delay_queue(&self, delay: Duration) -> (String, Duration) {
        let delay = delay.min(MAX_DELAY);
        let millis = delay.as_millis() as u64;
        let bound = bucket_bound(millis);
        (format!("{}.retry.{bound}ms", self.queue), delay)
    }

    /// Declares the work queue, `Q.dlq.hop` and `Q.dlq` (the delay queues
    /// are declared when first used: [`declare_delay_queue`](Self::declare_delay_queue)).
    pub async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let dlq = self.dead_letter_queue();
        let mut work = self.arguments(Some(&dlq));
        if self.queue_type == QueueType::Quorum
            && let Some(limit) = self.delivery_limit
        {
            work.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongInt(i32::try_from(limit).unwrap_or(i32::MAX)),
            );
        }
        self.declare_queue(channel, &dlq, self.arguments(None))
            .await?;
        let mut hop = self.arguments(Some(&dlq));
        hop.insert("x-message-ttl".into(), AMQPValue::LongInt(0));
        self.declare_queue(channel, &self.dead_letter_hop(), hop)
            .await?;
        self.declare_queue(channel, &self.queue, work).await
    }

    /// Declares the delay queue `name` (from [`delay_queue`](Self::delay_queue)).
    pub async fn declare_delay_queue(&self, channel: &Channel, name: &str) -> Result<(), Error> {
        self.declare_queue(channel, name, self.arguments(Some(&self.queue)))
            .await
    }

    /// A queue's arguments: its type and, when `dead_letter_to` is given,
    /// dead-lettering to that queue through the default exchange.
    fn arguments(&self, dead_letter_to: Option<&str>) -> FieldTable {
        let mut arguments = FieldTable::default();
        if self.queue_type == QueueType::Quorum {
            arguments.insert("x-queue-type".into(), string("quorum"));
        }
        if let Some(target) = dead_letter_to {
            arguments.insert("x-dead-letter-exchange".into(), string(""));
            arguments.insert("x-dead-letter-routing-key".into(), string(target));
            if self.queue_type == QueueType::Quorum {
                arguments.insert("x-dead-letter-strategy".into(), string("at-least-once"));
                arguments.insert("x-overflow".into(), string("reject-publish"));
            }
        }
        arguments
    }

    async fn declare_queue(
        &self,
        channel: &Channel,
        name: &str,
        arguments: FieldTable,
    ) -> Result<(), Error> {
        channel
            .queue_declare(name.into(), QueueDeclareOptions::durable(), arguments)
            .await
            .map_err(|source| Error::Declare {
                queue: name.to_owned(),
                source,
            })?;
        Ok(())
    }
}

/// The longest work queue name: AMQP names have at most 255 bytes, and the
/// longest derived name adds `.retry.4294967296ms`.
pub const MAX_QUEUE_NAME_LEN: usize = 255 - ".retry.4294967296ms".len();

/// Checks that `queue` can name a work queue: 1 to [`MAX_QUEUE_NAME_LEN`]
/// bytes.
pub(crate) fn check_queue_name(queue: &str) -> Result<(), Error> {
    if queue.is_empty() || queue.len() > MAX_QUEUE_NAME_LEN {
        return Err(Error::Invalid(format!(
            "a work queue's name has 1 to {MAX_QUEUE_NAME_LEN} bytes, not {}",
            queue.len()
        )));
    }
    Ok(())
}

/// `Q.dlq`.
pub(crate) fn dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dlq")
}

/// The power of two `B` with `B/2 ≤ millis < B`, at least 2.
fn bucket_bound(millis: u64) -> u64 {
    (millis + 1).next_power_of_two().max(2)
}

/// How many messages are ready in `queue` (those delivered and not yet
/// acknowledged are not counted), by a passive declaration; the queue must
/// exist. On a channel of its own: a missing queue closes the channel.
pub async fn ready(channel: &Channel, queue: &str) -> Result<u32, Error> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|source| match source.kind() {
            lapin::ErrorKind::ProtocolError(error)
                if error.kind()
                    == &lapin::protocol::AMQPErrorKind::Soft(
                        lapin::protocol::AMQPSoftError::NOTFOUND,
                    ) =>
            {
                Error::NoSuchQueue(queue.to_owned())
            }
            _ => Error::Broker {
                step: format!("count the messages of {queue:?}"),
                source,
            },
        })?;
    Ok(declared.message_count())
}

pub(crate) fn string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value.as_bytes().to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delay_goes_to_the_queue_of_its_power_of_two() {
        let topology = Topology::new("payments");
        let name = |ms| topology.delay_queue(Duration::from_millis(ms)).0;
        assert_eq!(name(0), "payments.retry.2ms");
        assert_eq!(name(1), "payments.retry.2ms");
        assert_eq!(name(2), "payments.retry.4ms");
        assert_eq!(name(200), "payments.retry.256ms");
        assert_eq!(name(255), "payments.retry.256ms");
        assert_eq!(name(256), "payments.retry.512ms");
        assert_eq!(name(3000), "payments.retry.4096ms");
        for ms in [0u64, 1, 5, 127, 128, 1000, 299_999] {
            let bound = bucket_bound(ms);
            assert!(
                bound / 2 <= ms.max(1) && ms < bound,
                "{ms} ms in [{}, {bound})",
                bound / 2
            );
            assert!(bound <= (2 * ms).max(2), "waits under twice its delay");
        }
        let (_, cut) = topology.delay_queue(Duration::from_secs(60 * 60 * 24 * 365));
        assert_eq!(cut, MAX_DELAY);
    }
}
