//! The dead-letter topic and the producer.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::FutureProducer;
use rdkafka::types::RDKafkaErrorCode;

use crate::error::Error;

/// The dead-letter topic of `topic`: `<topic>.dlq`.
pub fn dead_letter_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

/// An idempotent producer that waits for every in-sync replica
/// (`enable.idempotence`: the producer's own retries write no duplicate).
pub(crate) fn producer(servers: &str) -> Result<FutureProducer, Error> {
    ClientConfig::new()
        .set("bootstrap.servers", servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
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
