//! Producing records that a consumer applies once: the outbox's publisher.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use idem_core::outbox::{Event, Publish, PublishError, PublishFuture};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::error::Error;
use crate::record::MESSAGE_ID_HEADER;
use crate::topics;

/// How long a record may wait for the broker's acknowledgement.
const DELIVERY_LIMIT: Duration = Duration::from_secs(30);

/// The transactional outbox's publisher on Kafka ([`Publish`]): idem-diesel's
/// relay publishes each staged event with it to the topic its destination
/// names, the event's key as the record's key (so a key's events keep their
/// order in one partition), its id as the `message_id` header, and its
/// headers. An event is sent once the broker acknowledged it (`acks=all`);
/// the producer is idempotent, so its own retries write no duplicate.
///
/// `enable.idempotence` is not what makes a consumer apply each event once: it
/// removes the duplicates a producer's retries would write, not those of a
/// relay that crashed before marking an event sent, nor a consumer's
/// redeliveries. The consumer's inbox, keyed by `message_id`, does that.
///
/// The first event to each destination looks the topic up: a topic that does
/// not exist is [`Error::MissingTopic`], which the relay logs (naming it)
/// and tries again later, rather than an event waiting out the delivery
/// limit unexplained. Once seen, a topic is not looked up again. The lookup
/// never creates the topic, even on a cluster that creates topics on a first
/// produce (`auto.create.topics.enable`): create each destination
/// ([`create_topic`](crate::create_topic)), as the examples do at start.
pub struct OutboxPublisher {
    producer: FutureProducer,
    servers: String,
    /// The destinations seen to exist.
    known: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for OutboxPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxPublisher").finish_non_exhaustive()
    }
}

impl OutboxPublisher {
    /// A publisher to the cluster of `servers` (`HOST:PORT[,HOST:PORT…]`).
    pub fn connect(servers: &str) -> Result<Self, Error> {
        Ok(Self {
            producer: topics::producer(servers)?,
            servers: servers.to_owned(),
            known: Mutex::default(),
        })
    }

    /// Whether the destination's topic is known to exist, looking it up the
    /// first time.
    async fn check_topic(&self, topic: &str) -> Result<(), PublishError> {
        let known = |known: &Mutex<HashSet<String>>| {
            known
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(topic)
        };
        if known(&self.known) {
            return Ok(());
        }
        match topics::exists(&self.servers, topic).await {
            Ok(true) => {
                self.known
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(topic.to_owned());
                Ok(())
            }
            Ok(false) => Err(PublishError::unavailable(Error::MissingTopic {
                topic: topic.to_owned(),
            })),
            Err(error) => Err(PublishError::unavailable(error)),
        }
    }
}

impl Publish for OutboxPublisher {
    fn publish<'a>(&'a self, event: &'a Event) -> PublishFuture<'a> {
        Box::pin(async move {
            self.check_topic(event.destination()).await?;
            let id = event.id().to_string();
            let mut headers = OwnedHeaders::new().insert(Header {
                key: MESSAGE_ID_HEADER,
                value: Some(id.as_str()),
            });
            for (name, value) in event.headers() {
                headers = headers.insert(Header {
                    key: name.as_str(),
                    value: Some(value.as_ref()),
                });
            }
            let record = FutureRecord::to(event.destination())
                .key(event.key())
                .payload(event.payload().as_ref())
                .headers(headers);
            match self.producer.send(record, DELIVERY_LIMIT).await {
                Ok(_) => Ok(()),
                Err((error, _)) => Err(classify(error)),
            }
        })
    }
}

/// A refusal the event itself causes is parked; anything else is tried again.
fn classify(error: KafkaError) -> PublishError {
    match error.rdkafka_error_code() {
        Some(
            code @ (RDKafkaErrorCode::MessageSizeTooLarge
            | RDKafkaErrorCode::InvalidMessageSize
            | RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::InvalidRecord),
        ) => PublishError::Refused(format!("the broker refused it: {code}")),
        _ => PublishError::Unavailable(Box::new(error)),
    }
}
