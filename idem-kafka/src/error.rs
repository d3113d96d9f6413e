//! Why a consumer, a listing or a redrive stopped.

use idem_core::consume::InboxError;
use rdkafka::error::KafkaError;

/// Why a consumer, a listing or a redrive stopped. Retrying cannot help the
/// consumer's errors: it rides out a broker or a database away by itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker refused or failed an operation this crate cannot go on
    /// without (creating the client, subscribing, reading a topic).
    #[error("Kafka: could not {doing}")]
    Kafka {
        /// What was being done.
        doing: &'static str,
        /// librdkafka's error.
        #[source]
        source: KafkaError,
    },
    /// The inbox is not ready ([`Inbox::readiness`](idem_core::consume::Inbox::readiness)):
    /// its tables were not verified in this process. The consumer did not
    /// start; the message names the fix.
    #[error("the consumer did not start: {0}")]
    NotReady(#[from] idem_core::store::NotReady),
    /// Where the inbox keeps the positions could not be created
    /// ([`Positions::migrate_positions`](idem_core::consume::Positions::migrate_positions):
    /// idem-diesel's `idem_kafka_offsets` table).
    #[error("the offsets table could not be created")]
    Offsets(#[source] InboxError),
    /// The inbox failed during a redrive.
    #[error("the inbox is unavailable")]
    Inbox(#[source] InboxError),
    /// The topic does not exist: the consumer's (and its builder did not say
    /// to create it: [`ConsumerBuilder::create_topic`](crate::ConsumerBuilder::create_topic)),
    /// or an outbox event's destination ([`OutboxPublisher`](crate::OutboxPublisher):
    /// the relay tries again later, and logs this each time).
    #[error(
        "the topic {topic} does not exist: create it (idem_kafka::create_topic), \
         or let the consumer create it (ConsumerBuilder::create_topic)"
    )]
    MissingTopic {
        /// The topic's name.
        topic: String,
    },
    /// The topic's name is one Kafka cannot carry, or its dead-letter
    /// topic's (`<topic>.dlq`) is: [`ConsumerBuilder::build`](crate::ConsumerBuilder::build).
    #[error("the topic name {topic:?} cannot be used: {why}")]
    InvalidTopic {
        /// The name given.
        topic: String,
        /// What Kafka would refuse in it.
        why: &'static str,
    },
    /// The polling thread could not be started.
    #[error("the polling thread could not be started")]
    Thread(#[source] std::io::Error),
    /// A read of the topic took longer than its bound.
    #[error("reading {0} timed out")]
    TimedOut(&'static str),
}

impl Error {
    /// Maps a librdkafka error met while `doing`.
    pub(crate) fn kafka(doing: &'static str) -> impl FnOnce(KafkaError) -> Self {
        move |source| Self::Kafka { doing, source }
    }
}
