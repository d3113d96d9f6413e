//! `run --sqs`, `dead-letters --sqs`, `redrive --sqs` (`docs/contract.md` §12),
//! on idem-sqs.

use idem_diesel::idem_core::cleanup::{Cleanup, ExpiredRows};
use idem_sqs::{ClientConfig, Consumer, Inbox};

use crate::ConsumerError;
use crate::consume::{Settings, beside_cleanup, inbox_name, stop_signal, with_handler};
use crate::database::Database;
use crate::dead_letters::{DeadLetterLine, Source};
use crate::ledger::Ledger;

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

/// The SDK's client: region `AWS_REGION` (default `us-east-1`), credentials
/// from the environment, `endpoint` when given.
fn client(endpoint: Option<&str>) -> Result<idem_sqs::aws_sdk_sqs::Client, ConsumerError> {
    let mut config = ClientConfig::from_env();
    if let Some(endpoint) = endpoint {
        config = config.endpoint(endpoint);
    }
    Ok(config.build()?)
}

/// Opens the database (migrating it), then consumes from the queue until
/// SIGTERM or Ctrl-C; calls `subscribed` with the queue's name once polling.
/// On the signal the consumer receives no more, finishes and deletes what it
/// is processing, and answers `Ok`.
pub async fn run(options: SqsOptions, subscribed: impl FnOnce(&str)) -> Result<(), ConsumerError> {
    let client = client(options.endpoint.as_deref())?;
    idem_sqs::queue_name(&options.queue_url)?;
    match options.settings.open().await? {
        Database::Postgres(inbox) => {
            consume(inbox.clone(), inbox.cleanup(), client, options, subscribed).await
        }
        Database::Sqlite(inbox) => {
            consume(inbox.clone(), inbox.cleanup(), client, options, subscribed).await
        }
    }
}

async fn consume<I>(
    inbox: I,
    cleanup: Cleanup<I>,
    client: idem_sqs::aws_sdk_sqs::Client,
    options: SqsOptions,
    subscribed: impl FnOnce(&str),
) -> Result<(), ConsumerError>
where
    I: Inbox + ExpiredRows,
    I::Tx: Ledger,
{
    let stop = stop_signal()?;
    let settings = &options.settings;
    let queue = idem_sqs::queue_name(&options.queue_url)?.to_owned();
    let builder = Consumer::builder(client, &options.queue_url)
        .name(inbox_name(&queue))
        .inbox(inbox)
        .policy(settings.policy())
        .concurrency(settings.concurrency);
    with_handler!(settings, builder, consumer => {
        let consumed = beside_cleanup(
            cleanup,
            consumer.run(stop, |polling| subscribed(&polling.queue)),
        )
        .await;
        Ok(consumed?)
    })
}

/// The queue's dead letters, without removing them.
pub async fn dead_letters(
    queue_url: &str,
    endpoint: Option<&str>,
) -> Result<Vec<DeadLetterLine>, ConsumerError> {
    let client = client(endpoint)?;
    let letters = idem_sqs::dead_letters(&client, queue_url).await?;
    Ok(letters
        .into_iter()
        .map(|letter| {
            DeadLetterLine::new(
                Source::Queue(letter.queue.clone()),
                letter.message_id.clone(),
                &letter.attempted_at,
                letter.reason.clone(),
                &letter.body,
            )
        })
        .collect())
}

/// Moves the dead letters back; answers how many.
pub async fn redrive(queue_url: &str, endpoint: Option<&str>) -> Result<usize, ConsumerError> {
    let client = client(endpoint)?;
    let moved = idem_sqs::redrive(&client, queue_url).await?;
    Ok(usize::try_from(moved).unwrap_or(usize::MAX))
}
