//! The dead-letter queue, read and emptied by hand: [`dead_letters`],
//! [`redrive`], [`redrive_message`].

use std::fmt;
use std::time::SystemTime;

use bytes::Bytes;
use idem_core::Redacted;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel, Connection};

use crate::Error;
use crate::broker::{Address, publish_confirmed};
use crate::message::{self, ATTEMPTS_HEADER, QUEUE_HEADER, REASON_HEADER};
use crate::topology::{self, dead_letter_queue};

/// A message in a dead-letter queue, as [`dead_letters`] reads it. Its
/// `Debug` shows neither the body nor the whole message id.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterMessage {
    /// The work queue it failed in.
    pub queue: String,
    /// Its `message_id` (`None` when it had none: one reason to be here).
    pub message_id: Option<String>,
    /// When each failed attempt started, in order (`idem-attempts`).
    pub attempted_at: Vec<SystemTime>,
    /// Why it is here: the consumer's reason (`idem-reason`), else
    /// RabbitMQ's (`x-first-death-reason`: `delivery_limit`, `rejected`…).
    pub reason: String,
    /// Its RabbitMQ dead-lettering history (`x-death`), latest first.
    pub deaths: Vec<Death>,
    /// The body.
    pub body: Bytes,
}

/// One entry of a message's `x-death` history.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Death {
    /// The queue it was dead-lettered from.
    pub queue: String,
    /// Why: `expired` (a delay queue, the hop to the dead-letter queue),
    /// `rejected`, `delivery_limit`, `maxlen`.
    pub reason: String,
    /// How many times it was dead-lettered from that queue for that reason.
    pub count: u64,
}

/// Every message in the dead-letter queue of `queue` (`queue.dlq`), oldest
/// first; none is removed. They are fetched without an acknowledgement
/// (`basic.get`) and handed back when the channel closes, so that the queue
/// keeps them in their order. (A queue of millions is read into memory:
/// inspect such a queue with RabbitMQ's tools.)
pub async fn dead_letters(url: &str, queue: &str) -> Result<Vec<DeadLetterMessage>, Error> {
    let (connection, channel, dlq) = open(url, queue, "list dead letters").await?;
    let waiting = topology::ready(&channel, &dlq).await?;
    let mut letters = Vec::new();
    for _ in 0..waiting {
        let Some(got) = get(&channel, &dlq).await? else {
            break;
        };
        letters.push(DeadLetterMessage::read(queue, got.delivery));
    }
    // Closing hands back every message fetched without an acknowledgement.
    channel
        .close(200, "read".into())
        .await
        .map_err(Error::broker("close the channel"))?;
    let _ = connection.close(200, "bye".into()).await;
    Ok(letters)
}

/// Moves every message of `queue.dlq` (as many as it held when called) back
/// to `queue`, marked re-driven, so that the consumer's protocol forgets
/// the inbox's dead letter and runs it again from attempt 1. Each is
/// published with a confirmation, then acknowledged from the dead-letter
/// queue (a failure in between leaves it in both: the inbox makes the
/// second one a duplicate). Answers how many moved.
pub async fn redrive(url: &str, queue: &str) -> Result<u64, Error> {
    move_back(url, queue, |_| true).await
}

/// [`redrive`], for the dead letters whose `message_id` is `message_id`
/// only: the others stay, in their order. Answers how many moved (a
/// producer that sent a message twice may have two there).
pub async fn redrive_message(url: &str, queue: &str, message_id: &str) -> Result<u64, Error> {
    move_back(url, queue, |properties| {
        properties
            .message_id()
            .as_ref()
            .is_some_and(|id| id.as_str() == message_id)
    })
    .await
}

async fn move_back(
    url: &str,
    queue: &str,
    wanted: impl Fn(&BasicProperties) -> bool,
) -> Result<u64, Error> {
    let (connection, channel, dlq) = open(url, queue, "redrive").await?;
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .map_err(Error::broker("enable publisher confirms"))?;
    let waiting = topology::ready(&channel, &dlq).await?;
    let mut moved = 0u64;
    for _ in 0..waiting {
        let Some(got) = get(&channel, &dlq).await? else {
            break;
        };
        let delivery = got.delivery;
        if !wanted(&delivery.properties) {
            // Left unacknowledged: back in its place when the channel closes.
            continue;
        }
        publish_confirmed(
            &channel,
            queue,
            &delivery.data,
            message::redriven(&delivery.properties),
        )
        .await?;
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(Error::broker(format!(
                "acknowledge a dead letter of {dlq:?}"
            )))?;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .map_or("", |id| id.as_str());
        tracing::info!(queue, message_id = %Redacted::of(id), "dead letter re-driven");
        moved += 1;
    }
    let _ = channel.close(200, "redriven".into()).await;
    let _ = connection.close(200, "bye".into()).await;
    tracing::info!(queue, moved, "re-driven from the dead-letter queue");
    Ok(moved)
}

async fn open(url: &str, queue: &str, what: &str) -> Result<(Connection, Channel, String), Error> {
    topology::check_queue_name(queue)?;
    let address = Address::parse(url)?;
    let connection = address.connect(&format!("idem-rabbitmq {what}")).await?;
    let channel = connection
        .create_channel()
        .await
        .map_err(Error::broker("open a channel"))?;
    Ok((connection, channel, dead_letter_queue(queue)))
}

async fn get(
    channel: &Channel,
    dlq: &str,
) -> Result<Option<lapin::message::BasicGetMessage>, Error> {
    channel
        .basic_get(dlq.into(), BasicGetOptions::default())
        .await
        .map_err(Error::broker(format!("read {dlq:?}")))
}

impl DeadLetterMessage {
    fn read(queue: &str, delivery: Delivery) -> Self {
        let properties = &delivery.properties;
        let reason = message::string_header(properties, REASON_HEADER)
            .or_else(|| message::string_header(properties, "x-first-death-reason"))
            .unwrap_or_default();
        Self {
            queue: message::string_header(properties, QUEUE_HEADER)
                .unwrap_or_else(|| queue.to_owned()),
            message_id: properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_owned()),
            attempted_at: message::strings_header(properties, ATTEMPTS_HEADER)
                .iter()
                .filter_map(|time| idem_core::consume::parse_rfc3339(time))
                .collect(),
            reason,
            deaths: deaths(properties),
            body: Bytes::from(delivery.data),
        }
    }
}

/// The `x-death` header's entries.
fn deaths(properties: &BasicProperties) -> Vec<Death> {
    let Some(AMQPValue::FieldArray(entries)) = message::header(properties, "x-death") else {
        return Vec::new();
    };
    entries
        .as_slice()
        .iter()
        .filter_map(|entry| match entry {
            AMQPValue::FieldTable(table) => {
                let field = |name: &str| table.inner().get(name);
                Some(Death {
                    queue: field("queue")
                        .and_then(message::as_string)
                        .unwrap_or_default(),
                    reason: field("reason")
                        .and_then(message::as_string)
                        .unwrap_or_default(),
                    count: field("count")
                        .and_then(message::integer)
                        .and_then(|n| u64::try_from(n).ok())
                        .unwrap_or(0),
                })
            }
            _ => None,
        })
        .collect()
}

impl fmt::Debug for DeadLetterMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetterMessage")
            .field("queue", &self.queue)
            .field("message_id", &self.message_id.as_deref().map(Redacted::of))
            .field("attempted_at", &self.attempted_at)
            .field("reason", &self.reason)
            .field("deaths", &self.deaths)
            .field("body_len", &self.body.len())
            .finish()
    }
}
