//! `run --kafka`, `dead-letters --kafka`, `redrive --kafka` (`docs/contract.md` §10).

use crate::ConsumerError;
use crate::consume::Settings;
use crate::dead_letters::DeadLetterLine;

/// What `run --kafka` needs.
#[derive(Clone, Debug)]
pub struct KafkaOptions {
    /// The bootstrap servers, `HOST:PORT[,HOST:PORT…]`.
    pub servers: String,
    /// The topic.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// The flags every broker shares.
    pub settings: Settings,
}

/// Consumes from the topic until SIGTERM.
pub async fn run(
    options: KafkaOptions,
    subscribed: impl FnOnce(&str),
) -> Result<(), ConsumerError> {
    let _ = (options, subscribed);
    Err(idem_kafka::Error::NotBuilt.into())
}

/// The topic's dead letters, without removing them.
pub async fn dead_letters(
    servers: &str,
    topic: &str,
) -> Result<Vec<DeadLetterLine>, ConsumerError> {
    let _ = (servers, topic);
    Err(idem_kafka::Error::NotBuilt.into())
}

/// Moves the dead letters back; answers how many.
pub async fn redrive(servers: &str, topic: &str) -> Result<usize, ConsumerError> {
    let _ = (servers, topic);
    Err(idem_kafka::Error::NotBuilt.into())
}
