//! The dead-letter queue, read and emptied by hand: [`dead_letters`],
//! [`redrive`].

use std::fmt;
use std::time::SystemTime;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use bytes::Bytes;
use idem_core::Redacted;

use crate::Error;
use crate::message::{
    self, ATTEMPTS_ATTRIBUTE, GROUP_ATTRIBUTE, QUEUE_ATTRIBUTE, REASON_ATTRIBUTE,
};
use crate::queue::Queue;

/// The reason of a dead letter SQS moved by itself (the queue's redrive
/// policy), without this crate's `idem-reason`.
pub const MOVED_BY_REDRIVE_POLICY: &str = "moved by the queue's redrive policy (maxReceiveCount)";

/// How long the messages read stay invisible to others while they are
/// read or moved; they are made visible again at the end.
const READ_LEASE_SECS: i32 = 60;

/// A message in a dead-letter queue, as [`dead_letters`] reads it. Its
/// `Debug` shows neither the body nor the whole message id.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterMessage {
    /// The name of the queue it failed in.
    pub queue: String,
    /// Its idempotency key: the `message_id` attribute, else its FIFO
    /// deduplication id, else its SQS message id.
    pub message_id: Option<String>,
    /// When each failed attempt started, in order (`idem-attempts`).
    pub attempted_at: Vec<SystemTime>,
    /// Why it is here (`idem-reason`, else [`MOVED_BY_REDRIVE_POLICY`]).
    pub reason: String,
    /// How many times SQS says it was received in all
    /// (`ApproximateReceiveCount`, this read included).
    pub receive_count: u32,
    /// The body.
    pub body: Bytes,
}

/// Every message in the dead-letter queue of the queue at `queue_url`
/// (its redrive policy's target, else `<name>-dlq`), as many as it held when
/// called; none is removed. Each is received (invisible to others for a
/// minute while the listing runs) and made visible again at the end, so
/// the listing counts as one receive of each. Letters from other queues
/// sharing the dead-letter queue are left out. An absent dead-letter queue
/// has none.
pub async fn dead_letters(
    client: &Client,
    queue_url: &str,
) -> Result<Vec<DeadLetterMessage>, Error> {
    let queue = Queue::describe(client, queue_url).await?;
    let Some(dlq) = queue.dead_letter_queue(client, false).await? else {
        return Ok(Vec::new());
    };
    let mut letters = Vec::new();
    let read = read_all(client, &dlq, |raw| {
        if let Some(letter) = DeadLetterMessage::read(&queue.name, raw) {
            letters.push(letter);
        }
        false
    })
    .await;
    read.map(|_| letters)
}

/// Moves every dead letter of the queue at `queue_url` (as many as its
/// dead-letter queue held when called) back to it, marked re-driven
/// (`idem-redriven`), so that the consumer's protocol forgets the inbox's
/// dead letter and runs it again from attempt 1. On a FIFO queue each goes
/// back to its group (`idem-group`), with a deduplication id of its own.
/// Each is sent, then deleted from the dead-letter queue (a failure in
/// between leaves it in both: the inbox makes the second a duplicate).
/// Answers how many moved.
pub async fn redrive(client: &Client, queue_url: &str) -> Result<u64, Error> {
    let queue = Queue::describe(client, queue_url).await?;
    let Some(dlq) = queue.dead_letter_queue(client, false).await? else {
        return Ok(0);
    };
    let mut pending = Vec::new();
    read_all(client, &dlq, |raw| {
        let ours =
            message::string_attribute(raw, QUEUE_ATTRIBUTE).is_none_or(|name| name == queue.name);
        if ours {
            pending.push(raw.clone());
        }
        ours
    })
    .await?;
    let mut moved = 0u64;
    for letter in pending {
        let mut send = client
            .send_message()
            .queue_url(&queue.url)
            .message_body(letter.body().unwrap_or_default())
            .set_message_attributes(Some(message::redriven_attributes(&letter)));
        if queue.fifo {
            let group = message::string_attribute(&letter, GROUP_ATTRIBUTE)
                .or_else(|| {
                    message::system_attribute(&letter, MessageSystemAttributeName::MessageGroupId)
                })
                .unwrap_or("idem-redriven");
            let dedup = message::digest(&[
                b"redrive",
                letter.message_id().unwrap_or_default().as_bytes(),
            ]);
            send = send.message_group_id(group).message_deduplication_id(dedup);
        }
        send.send().await.map_err(Error::sqs(format!(
            "send a dead letter back to {:?}",
            queue.name
        )))?;
        if let Some(receipt) = letter.receipt_handle() {
            client
                .delete_message()
                .queue_url(&dlq)
                .receipt_handle(receipt)
                .send()
                .await
                .map_err(Error::sqs("delete a re-driven dead letter"))?;
        }
        tracing::info!(queue = %queue.name, message_id = %Redacted::of(message::message_id(&letter).unwrap_or("")), "dead letter re-driven");
        moved += 1;
    }
    tracing::info!(queue = %queue.name, moved, "re-driven from the dead-letter queue");
    Ok(moved)
}

/// Receives every message of `dlq` (as many as it held when called), hands
/// each to `take` (which answers whether it keeps it: kept messages are not
/// made visible again), then makes the others visible again.
async fn read_all(
    client: &Client,
    dlq: &str,
    mut take: impl FnMut(&aws_sdk_sqs::types::Message) -> bool,
) -> Result<(), Error> {
    let waiting = client
        .get_queue_attributes()
        .queue_url(dlq)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .send()
        .await
        .map_err(Error::sqs("count the dead letters"))?
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessages))
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);
    let mut seen = 0usize;
    let mut returned = Vec::new();
    let read = async {
        while seen < waiting {
            let answer = client
                .receive_message()
                .queue_url(dlq)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .visibility_timeout(READ_LEASE_SECS)
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .message_attribute_names("All")
                .send()
                .await
                .map_err(Error::sqs("read the dead-letter queue"))?;
            let messages = answer.messages();
            if messages.is_empty() {
                break;
            }
            for raw in messages {
                seen += 1;
                if !take(raw)
                    && let Some(receipt) = raw.receipt_handle()
                {
                    returned.push(receipt.to_owned());
                }
            }
        }
        Ok::<(), Error>(())
    }
    .await;
    // Visible again to the consumer's redrive and the next listing, even
    // after a failure.
    for receipt in returned {
        let _ = client
            .change_message_visibility()
            .queue_url(dlq)
            .receipt_handle(receipt)
            .visibility_timeout(0)
            .send()
            .await;
    }
    read
}

impl DeadLetterMessage {
    /// The letter of `raw`, unless it failed in another queue than `queue`.
    fn read(queue: &str, raw: &aws_sdk_sqs::types::Message) -> Option<Self> {
        let from = message::string_attribute(raw, QUEUE_ATTRIBUTE).unwrap_or(queue);
        if from != queue {
            return None;
        }
        Some(Self {
            queue: from.to_owned(),
            message_id: message::message_id(raw).map(str::to_owned).or_else(|| {
                // An id attribute that is not UTF-8, shown escaped.
                raw.message_attributes()?
                    .get(message::MESSAGE_ID_ATTRIBUTE)?
                    .binary_value()
                    .map(|bytes| idem_core::consume::id_text(bytes.as_ref()))
            }),
            attempted_at: message::string_attribute(raw, ATTEMPTS_ATTRIBUTE)
                .map(message::parse_attempts)
                .unwrap_or_default(),
            reason: message::string_attribute(raw, REASON_ATTRIBUTE)
                .unwrap_or(MOVED_BY_REDRIVE_POLICY)
                .to_owned(),
            receive_count: message::system_attribute(
                raw,
                MessageSystemAttributeName::ApproximateReceiveCount,
            )
            .and_then(|n| n.parse().ok())
            .unwrap_or(0),
            body: Bytes::copy_from_slice(raw.body().unwrap_or_default().as_bytes()),
        })
    }
}

impl fmt::Debug for DeadLetterMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetterMessage")
            .field("queue", &self.queue)
            .field("message_id", &self.message_id.as_deref().map(Redacted::of))
            .field("attempted_at", &self.attempted_at)
            .field("reason", &self.reason)
            .field("receive_count", &self.receive_count)
            .field("body_len", &self.body.len())
            .finish()
    }
}
