//! `dead-letters` and `redrive`: the dead-letter queue, read and emptied by
//! hand.

use lapin::options::{BasicAckOptions, BasicGetOptions, ConfirmSelectOptions};
use lapin::{Channel, Connection, ConnectionProperties};
use serde::Serialize;
use serde_json::Value;

use crate::ConsumerError;
use crate::consume::publish_confirmed;
use crate::message;
use crate::topology::Topology;

/// A dead letter, as `dead-letters` prints it (one JSON line each).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadLetterView {
    /// The work queue it failed in.
    pub queue: String,
    /// Its `message_id` (`null` when it had none: one reason to be here).
    pub message_id: Option<String>,
    /// When each failed attempt started, RFC 3339.
    pub attempts: Vec<String>,
    /// Why the last attempt failed.
    pub reason: String,
    /// The body: its JSON, or its text when it is not JSON.
    pub body: Value,
}

/// Every message in the dead-letter queue of `queue`, oldest first; none is
/// removed. (They are fetched unacknowledged and handed back when the channel
/// closes, so that the queue keeps them in their order.)
pub async fn list(amqp: &str, queue: &str) -> Result<Vec<DeadLetterView>, ConsumerError> {
    let (connection, channel, topology) = open(amqp, queue).await?;
    let mut letters = Vec::new();
    while let Some(got) = channel
        .basic_get(
            topology.dead_letter_queue().into(),
            BasicGetOptions::default(),
        )
        .await?
    {
        letters.push(view(&topology, &got.delivery));
    }
    // Closing hands back every message fetched without an acknowledgement.
    channel.close(200, "read".into()).await?;
    let _ = connection.close(200, "bye".into()).await;
    Ok(letters)
}

/// Moves the messages in the dead-letter queue of `queue` back to it (as many
/// as it held when called), marked re-driven so that the consumer lets them
/// through its inbox again; answers how many.
pub async fn redrive(amqp: &str, queue: &str) -> Result<u32, ConsumerError> {
    let (connection, channel, topology) = open(amqp, queue).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let waiting = Topology::ready(&channel, &topology.dead_letter_queue()).await?;
    let mut moved = 0;
    while moved < waiting {
        let Some(got) = channel
            .basic_get(
                topology.dead_letter_queue().into(),
                BasicGetOptions::default(),
            )
            .await?
        else {
            break;
        };
        publish_confirmed(
            &channel,
            "",
            topology.queue(),
            &got.delivery.data,
            message::redriven_properties(&got.delivery.properties),
        )
        .await?;
        got.delivery.ack(BasicAckOptions::default()).await?;
        moved += 1;
    }
    let _ = connection.close(200, "bye".into()).await;
    Ok(moved)
}

async fn open(amqp: &str, queue: &str) -> Result<(Connection, Channel, Topology), ConsumerError> {
    let connection = Connection::connect(amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let topology = Topology::new(queue);
    topology.declare(&channel).await?;
    Ok((connection, channel, topology))
}

fn view(topology: &Topology, delivery: &lapin::message::Delivery) -> DeadLetterView {
    let properties = &delivery.properties;
    let reason = message::string_header(properties, message::REASON_HEADER)
        .or_else(|| message::string_header(properties, "x-first-death-reason"))
        .unwrap_or_default();
    DeadLetterView {
        queue: message::string_header(properties, message::QUEUE_HEADER)
            .unwrap_or_else(|| topology.queue().to_owned()),
        message_id: properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned()),
        attempts: message::attempt_times(properties),
        reason,
        body: serde_json::from_slice(&delivery.data)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&delivery.data).into())),
    }
}
