//! `run --sqs`, `dead-letters --sqs`, `redrive --sqs` (`docs/contract.md` §12).

use crate::ConsumerError;
use crate::consume::Settings;
use crate::dead_letters::DeadLetterLine;

/// What `run --sqs` needs.
#[derive(Clone, Debug)]
pub struct SqsOptions {
    /// The queue's URL.
    pub queue_url: String,
    /// The endpoint, when not AWS's.
    pub endpoint: Option<String>,
    /// The flags every broker shares.
    pub settings: Settings,
}

/// Consumes from the queue until SIGTERM.
pub async fn run(options: SqsOptions, subscribed: impl FnOnce(&str)) -> Result<(), ConsumerError> {
    let _ = (options, subscribed);
    Err(idem_sqs::Error::NotBuilt.into())
}

/// The queue's dead letters, without removing them.
pub async fn dead_letters(
    queue_url: &str,
    endpoint: Option<&str>,
) -> Result<Vec<DeadLetterLine>, ConsumerError> {
    let _ = (queue_url, endpoint);
    Err(idem_sqs::Error::NotBuilt.into())
}

/// Moves the dead letters back; answers how many.
pub async fn redrive(queue_url: &str, endpoint: Option<&str>) -> Result<usize, ConsumerError> {
    let _ = (queue_url, endpoint);
    Err(idem_sqs::Error::NotBuilt.into())
}
