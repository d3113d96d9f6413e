//! One delivery: translated, decided by the protocol, and the decision
//! carried out on the broker before the acknowledgement.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Redacted;
use idem_core::consume::{Decision, Handler, Inbox, Message};
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{Acker, BasicProperties, Channel};

use super::Shared;
use crate::Error;
use crate::broker::publish_confirmed;
use crate::message;

/// Decides a unit of deliveries (one, or a batch's: see
/// [`ConsumerBuilder::batch_handler`](super::ConsumerBuilder::batch_handler))
/// and carries each decision out. An error is the broker's (the connection
/// or the channel is gone): the session ends and the deliveries not yet
/// acknowledged come back.
pub(super) async fn carry_out<I: Inbox, H: Handler<I::Tx> + 'static>(
    shared: Arc<Shared<I, H>>,
    channel: Channel,
    deliveries: Vec<lapin::message::Delivery>,
) -> Result<(), Error> {
    let topology = &shared.topology;
    let mut settling = Vec::with_capacity(deliveries.len());
    let mut messages = Vec::with_capacity(deliveries.len());
    for delivery in deliveries {
        let lapin::message::Delivery {
            properties,
            data,
            redelivered,
            acker,
            ..
        } = delivery;
        messages.push(message::translate(
            &properties,
            data,
            redelivered,
            topology.kind(),
        ));
        settling.push((properties, acker));
    }
    let decisions = shared
        .protocol
        .decide_all_holding(
            &messages,
            &shared.handler,
            &shared.outage,
            shared.stop.stopped(),
        )
        .await;
    for ((decision, message), (properties, acker)) in
        decisions.into_iter().zip(&messages).zip(settling)
    {
        settle(&shared, &channel, decision, message, &properties, &acker).await?;
    }
    Ok(())
}

/// Carries out one delivery's decision, then acknowledges it (or hands it
/// back).
async fn settle<I: Inbox, H>(
    shared: &Shared<I, H>,
    channel: &Channel,
    decision: Decision,
    message: &Message,
    properties: &BasicProperties,
    acker: &Acker,
) -> Result<(), Error> {
    let topology = &shared.topology;
    // A copy the broker refused: handed back after the policy's pause, as
    // when the inbox is unavailable.
    let pause = shared.protocol.policy().get_unavailable_pause();
    match decision {
        Decision::Ack(_) => ack(acker).await,
        Decision::Retry(retry) => {
            let (queue, delay) = topology.delay_queue(retry.delay);
            shared.declare_delay_queue(channel, &queue).await?;
            let properties = message::hop(properties, topology.queue(), &retry.reason, None)
                .with_expiration(delay.as_millis().to_string().into());
            match hop(channel, &queue, message, properties).await? {
                Hopped::Confirmed => {
                    tracing::debug!(message_id = %redacted(message), delay_queue = %queue, delay_ms = delay.as_millis() as u64, "the retry's copy waits in its delay queue");
                    ack(acker).await
                }
                Hopped::Refused => hand_back(acker, pause).await,
            }
        }
        Decision::DeadLetter(letter) => {
            let properties = message::hop(
                properties,
                topology.queue(),
                &letter.reason,
                Some(&letter.attempted_at),
            );
            match hop(channel, &topology.dead_letter_hop(), message, properties).await? {
                Hopped::Confirmed => {
                    tracing::debug!(message_id = %redacted(message), dead_letter_queue = %topology.dead_letter_queue(), "the dead letter is in the dead-letter queue");
                    shared.protocol.published(&letter).await;
                    ack(acker).await
                }
                Hopped::Refused => hand_back(acker, pause).await,
            }
        }
        Decision::Requeue { after } => hand_back(acker, after).await,
    }
}

enum Hopped {
    Confirmed,
    /// The broker did not take the copy: the delivery is handed back.
    Refused,
}

/// Publishes the message's copy to `queue` and waits for the confirmation.
async fn hop(
    channel: &Channel,
    queue: &str,
    message: &Message,
    properties: BasicProperties,
) -> Result<Hopped, Error> {
    match publish_confirmed(channel, queue, message.body(), properties).await {
        Ok(()) => Ok(Hopped::Confirmed),
        Err(error @ Error::NotConfirmed { .. }) => {
            tracing::warn!(message_id = %redacted(message), error = %error, "the broker did not take the message's copy: the delivery goes back to the queue");
            Ok(Hopped::Refused)
        }
        Err(error) => Err(error),
    }
}

fn redacted(message: &Message) -> Redacted<'_> {
    Redacted::of(message.message_id().unwrap_or(""))
}

async fn ack(acker: &Acker) -> Result<(), Error> {
    acker
        .ack(BasicAckOptions::default())
        .await
        .map_err(Error::broker("acknowledge a delivery"))?;
    Ok(())
}

/// Hands the delivery back to the queue after `pause`, not acknowledged.
async fn hand_back(acker: &Acker, pause: Duration) -> Result<(), Error> {
    tokio::time::sleep(pause).await;
    acker
        .nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        })
        .await
        .map_err(Error::broker("hand a delivery back"))?;
    Ok(())
}

impl<I: Inbox, H> Shared<I, H> {
    /// Declares the delay queue `queue` unless it was on this connection.
    async fn declare_delay_queue(&self, channel: &Channel, queue: &str) -> Result<(), Error> {
        let known = |declared: &std::collections::HashSet<String>| declared.contains(queue);
        if known(&self.lock_declared()) {
            return Ok(());
        }
        self.topology.declare_delay_queue(channel, queue).await?;
        self.lock_declared().insert(queue.to_owned());
        Ok(())
    }

    fn lock_declared(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.declared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
