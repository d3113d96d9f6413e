//! The dead-letter topic and the producer.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use rdkafka::types::{RDKafkaErrorCode, RDKafkaRespErr};

use crate::error::Error;

/// The dead-letter topic of `topic`: `<topic>.dlq`.
pub fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

/// The longest topic name Kafka takes.
const MAX_TOPIC_NAME_LEN: usize = 249;

/// Why Kafka would refuse `topic` as a topic's name, if it would: empty,
/// `.` or `..`, longer than 249 bytes, or a character outside ASCII
/// letters, digits, `.`, `_` and `-`.
pub(crate) fn check_name(topic: &str) -> Result<(), &'static str> {
    if topic.is_empty() {
        Err("it is empty")
    } else if topic == "." || topic == ".." {
        Err("`.` and `..` are not topic names")
    } else if topic.len() > MAX_TOPIC_NAME_LEN {
        Err("it is longer than 249 bytes (the dead-letter topic adds `.dlq`)")
    } else if !topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Err("only ASCII letters, digits, `.`, `_` and `-` are allowed")
    } else {
        Ok(())
    }
}

/// An idempotent producer that waits for every in-sync replica
/// (`enable.idempotence`: the producer's own retries write no duplicate).
///
/// `linger.ms` is 1 (librdkafka's default is 5): its callers send what they
/// have at once and wait for every acknowledgement (a relay's batch, a dead
/// letter) before they send more, so a longer wait for more records to
/// join a request only delays each batch.
pub(crate) fn producer(servers: &str) -> Result<FutureProducer, Error> {
    ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set("message.timeout.ms", "30000")
        .create()
        .map_err(Error::kafka("create the producer"))
}

/// Creates the dead-letter topic with one partition unless it exists. One
/// partition keeps the dead letters in the order they were written, so a
/// redrive's mark (the offset it reached) covers exactly the letters before
/// it.
pub(crate) async fn ensure(servers: &str, topic: &str) -> Result<(), Error> {
    create_topic(servers, topic, 1).await
}

/// How long a look at the cluster's metadata may take.
const METADATA_LIMIT: Duration = Duration::from_secs(10);

/// Whether `topic` exists on the cluster of `servers`: its metadata, asked
/// without letting the broker create it on the way. Only Kafka's "unknown
/// topic" (or no entry at all) says it does not; another error on the
/// topic's entry (its leader being elected, say) is an error, not a missing
/// topic.
pub(crate) async fn exists(servers: &str, topic: &str) -> Result<bool, Error> {
    let client: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("allow.auto.create.topics", "false")
        .create()
        .map_err(Error::kafka("create a metadata client"))?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let metadata = client
            .fetch_metadata(Some(&topic), METADATA_LIMIT)
            .map_err(Error::kafka("read the topic's metadata"))?;
        let Some(found) = metadata.topics().iter().find(|found| found.name() == topic) else {
            return Ok(false);
        };
        match found.error() {
            None => Ok(!found.partitions().is_empty()),
            Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => Ok(false),
            Some(code) => Err(Error::Kafka {
                doing: "read the topic's metadata",
                source: KafkaError::MetadataFetch(code.into()),
            }),
        }
    })
    .await
    // The blocking lookup ended without an answer (cancelled at shutdown).
    .map_err(|_| Error::TimedOut("the topic's metadata"))?
}

/// Fails with [`Error::MissingTopic`] when `topic` does not exist, unless
/// `create` says with how many partitions to create it.
pub(crate) async fn require(servers: &str, topic: &str, create: Option<i32>) -> Result<(), Error> {
    if exists(servers, topic).await? {
        return Ok(());
    }
    match create {
        Some(partitions) => create_topic(servers, topic, partitions).await,
        None => Err(Error::MissingTopic {
            topic: topic.to_owned(),
        }),
    }
}

/// Creates `topic` with `partitions` partitions (and the cluster's default
/// replication) unless it exists; a topic that exists is left as it is.
pub async fn create_topic(servers: &str, topic: &str, partitions: i32) -> Result<(), Error> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", servers)
        .create()
        .map_err(Error::kafka("create the admin client"))?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let created = admin
        .create_topics(
            &[NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(-1),
            )],
            &options,
        )
        .await
        .map_err(Error::kafka("create a topic"))?;
    for result in created {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => {
                return Err(Error::Kafka {
                    doing: "create a topic",
                    source: rdkafka::error::KafkaError::AdminOp(code),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_kafka_takes_pass() {
        for good in ["payments", "a.b_c-D9", &"x".repeat(245)] {
            assert_eq!(check_name(good), Ok(()), "{good}");
        }
        let long = "x".repeat(250);
        for bad in [
            "",
            ".",
            "..",
            "pay ments",
            "payments/1",
            "paiement-é",
            &long,
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        // A topic of 246 bytes passes; its dead-letter topic (250) does not.
        assert!(check_name(&dead_letter_topic(&"x".repeat(246))).is_err());
    }
}
