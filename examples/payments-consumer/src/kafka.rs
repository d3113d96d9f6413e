//! `run --kafka`, `dead-letters --kafka`, `redrive --kafka`
//! (`docs/contract.md` §10), on idem-kafka: the payment, the inbox row and the
//! partition's next offset commit in one transaction of `--database`.

use std::time::Duration;

use idem_diesel::idem_core::cleanup::{Cleanup, ExpiredRows};
use idem_kafka::{Consumer, Positions};

use crate::ConsumerError;
use crate::consume::{Settings, beside_cleanup, inbox_name, stop_signal, with_handler};
use crate::database::with_inbox;
use crate::dead_letters::{DeadLetterLine, Source};
use crate::ledger::Ledger;

/// The partitions of the topic when the consumer finds none and creates it
/// (a consumer started before anything was published): as many as the
/// payments examples create for their events (`--publish kafka://…`).
const TOPIC_PARTITIONS: i32 = 3;

/// How long the group waits for a member that stopped answering (killed, cut
/// off) before its partitions go to the others: librdkafka's default is 45 s.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// What `run --kafka` needs.
#[derive(Clone, Debug)]
pub struct KafkaOptions {
    /// The bootstrap servers, `HOST:PORT[,HOST:PORT…]`.
    pub servers: String,
    /// The topic.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// The flags every broker shares (`--concurrency` is not one of them on
    /// Kafka: each assigned partition is applied by a worker of its own, in
    /// order).
    pub settings: Settings,
}

/// Opens the database (migrating it), then consumes from the topic until
/// SIGTERM or Ctrl-C; calls `subscribed` with the topic once the consumer
/// has joined its group. On the signal the records being applied finish and
/// commit, and the consumer leaves its group.
pub async fn run(
    options: KafkaOptions,
    subscribed: impl FnOnce(&str),
) -> Result<(), ConsumerError> {
    with_inbox!(options.settings.open().await?, inbox => {
        consume(inbox.clone(), inbox.cleanup(), options, subscribed).await
    })
}

async fn consume<I>(
    inbox: I,
    cleanup: Cleanup<I>,
    options: KafkaOptions,
    subscribed: impl FnOnce(&str),
) -> Result<(), ConsumerError>
where
    I: Positions + ExpiredRows,
    I::Tx: Ledger,
{
    let stop = stop_signal()?;
    let settings = &options.settings;
    let builder = Consumer::builder(&options.servers, &options.topic)
        .create_topic(TOPIC_PARTITIONS)
        .group(&options.group)
        .name(inbox_name(&options.topic))
        .inbox(inbox)
        .policy(settings.policy())
        .config(
            "session.timeout.ms",
            SESSION_TIMEOUT.as_millis().to_string(),
        );
    with_handler!(settings, builder, consumer => {
        let consumed = beside_cleanup(
            cleanup,
            consumer.run(stop, |subscription| subscribed(&subscription.topic)),
        )
        .await;
        Ok(consumed?)
    })
}

/// The topic's dead letters (in `<topic>.dlq`), not re-driven yet; nothing
/// is consumed.
pub async fn dead_letters(
    servers: &str,
    topic: &str,
) -> Result<Vec<DeadLetterLine>, ConsumerError> {
    Ok(idem_kafka::dead_letters(servers, topic)
        .await?
        .into_iter()
        .map(|letter| {
            DeadLetterLine::new(
                Source::Topic(letter.topic),
                letter.message_id,
                &letter.attempted_at,
                letter.reason,
                &letter.body,
            )
            .truncated(letter.truncated)
        })
        .collect())
}

/// Republishes to the topic every dead letter not re-driven before but those
/// cut to fit the dead-letter topic; answers what it did.
pub async fn redrive(servers: &str, topic: &str) -> Result<idem_kafka::Redrive, ConsumerError> {
    Ok(idem_kafka::redrive(servers, topic).await?)
}
