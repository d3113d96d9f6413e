//! Received messages: each decided by the protocol under its lease, and the
//! decision carried out on SQS.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Redacted;
use idem_core::consume::{Decision, Handler, Inbox, Letter};
use idem_core::log::error_chain;
use tokio::time::Instant;

use super::{Shared, Target};
use crate::Error;
use crate::lease;
use crate::message::{self, Received};

/// Settles `group`: one message on a standard queue; on a FIFO queue, the
/// messages of one group in order. A message that is not settled for good
/// (retried, handed back) stops its group: the messages after it are made
/// visible again at once, and SQS, which delivers no message of a group
/// while an earlier one is in flight, gives them again after it.
pub(super) async fn settle<I: Inbox, H: Handler<I::Tx> + 'static>(
    shared: Arc<Shared<I, H>>,
    target: Arc<Target>,
    group: Vec<Received>,
    received_at: Instant,
) {
    let mut rest = group.as_slice();
    while let Some((received, after)) = rest.split_first() {
        rest = after;
        let receipts: Vec<&str> = std::iter::once(received.receipt.as_str())
            .chain(after.iter().map(|m| m.receipt.as_str()))
            .collect();
        // An applied message is deleted under its lease, so that it cannot
        // lapse between the commit and the delete; the other decisions set
        // the message's visibility themselves, after the lease.
        let settled = target
            .lease
            .hold(&receipts, received_at, async {
                let decision = shared
                    .protocol
                    .decide_holding(
                        &received.message,
                        &shared.handler,
                        &shared.outage,
                        shared.stop.stopped(),
                    )
                    .await;
                match decision {
                    Decision::Ack(_) => Ok(delete(&target, received).await.map(|()| true)),
                    other => Err(other),
                }
            })
            .await;
        let done = match settled {
            Ok(deleted) => deleted,
            Err(decision) => carry_out(&shared, &target, received, decision).await,
        };
        let done = match done {
            Ok(done) => done,
            Err(error) => {
                tracing::warn!(message_id = %redacted(received), error = %error_chain(&error), "a decision could not be carried out on SQS: the message comes back after its lease");
                false
            }
        };
        if !done {
            for later in after {
                let _ = change_visibility(&target, later, Duration::ZERO).await;
            }
            return;
        }
    }
}

/// Settles a batch of a standard queue's messages (one receive's, with a
/// batch handler: see [`ConsumerBuilder::batch_handler`](super::ConsumerBuilder::batch_handler)):
/// decided together under their leases, the acknowledged ones deleted with
/// one `DeleteMessageBatch`, the others carried out one by one.
pub(super) async fn settle_batch<I: Inbox, H: Handler<I::Tx> + 'static>(
    shared: Arc<Shared<I, H>>,
    target: Arc<Target>,
    batch: Vec<Received>,
    received_at: Instant,
) {
    let receipts: Vec<&str> = batch.iter().map(|m| m.receipt.as_str()).collect();
    let messages: Vec<idem_core::consume::Message> =
        batch.iter().map(|m| m.message.clone()).collect();
    // The applied messages are deleted under their leases (see `settle`);
    // the others are carried out after, one by one.
    let rest = target
        .lease
        .hold(&receipts, received_at, async {
            let decisions = shared
                .protocol
                .decide_all_holding(
                    &messages,
                    &shared.handler,
                    &shared.outage,
                    shared.stop.stopped(),
                )
                .await;
            let mut acknowledged = Vec::with_capacity(batch.len());
            let mut rest = Vec::new();
            for (received, decision) in batch.iter().zip(decisions) {
                if matches!(decision, Decision::Ack(_)) {
                    acknowledged.push(received);
                } else {
                    rest.push((received, decision));
                }
            }
            for chunk in acknowledged.chunks(crate::consumer::MAX_BATCH) {
                if let Err(error) = delete_batch(&target, chunk).await {
                    tracing::warn!(messages = chunk.len(), error = %error_chain(&error), "applied messages could not be deleted: they come back after their lease, as duplicates");
                }
            }
            rest
        })
        .await;
    for (received, decision) in rest {
        if let Err(error) = carry_out(&shared, &target, received, decision).await {
            tracing::warn!(message_id = %redacted(received), error = %error_chain(&error), "a decision could not be carried out on SQS: the message comes back after its lease");
        }
    }
}

/// Deletes up to 10 messages in one call; a message SQS did not delete comes
/// back after its lease (a duplicate to the inbox).
async fn delete_batch(target: &Target, received: &[&Received]) -> Result<(), Error> {
    use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
    let entries = received
        .iter()
        .enumerate()
        .map(|(i, m)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(&m.receipt)
                .build()
                .map_err(|error| Error::Unexpected(format!("a delete entry: {error}")))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let deleted = target
        .lease
        .client
        .delete_message_batch()
        .queue_url(&target.queue.url)
        .set_entries(Some(entries))
        .send()
        .await
        .map_err(Error::sqs("delete a batch of messages"))?;
    if !deleted.failed().is_empty() {
        tracing::warn!(
            failed = deleted.failed().len(),
            "SQS did not delete every applied message of a batch: those come back after their lease, as duplicates"
        );
    }
    Ok(())
}

/// Carries `decision` out; answers whether the message is settled for good
/// (deleted), so that the next of its FIFO group may go.
async fn carry_out<I: Inbox, H>(
    shared: &Shared<I, H>,
    target: &Target,
    received: &Received,
    decision: Decision,
) -> Result<bool, Error> {
    match decision {
        Decision::Ack(_) => {
            delete(target, received).await?;
            Ok(true)
        }
        Decision::Retry(retry) => {
            change_visibility(target, received, retry.delay).await?;
            tracing::debug!(message_id = %redacted(received), delay_ms = retry.delay.as_millis() as u64, "visible again after the retry's delay");
            Ok(false)
        }
        Decision::DeadLetter(letter) => match dead_letter(target, received, &letter).await {
            Ok(()) => {
                shared.protocol.published(&letter).await;
                delete(target, received).await?;
                Ok(true)
            }
            Err(error) => {
                tracing::warn!(message_id = %redacted(received), error = %error_chain(&error), "the dead letter could not be sent to the dead-letter queue: the message comes back after a pause");
                let pause = shared.protocol.policy().get_unavailable_pause();
                change_visibility(target, received, pause).await?;
                Ok(false)
            }
        },
        Decision::Requeue { after } => {
            change_visibility(target, received, after).await?;
            Ok(false)
        }
    }
}

/// Sends the message's copy to the dead-letter queue with its reason and
/// attempts. On a FIFO dead-letter queue each letter is a group of its own
/// (its group in the work queue is kept in `idem-group`), deduplicated by
/// its id and attempts, so that a crash between the send and the delete
/// does not leave two copies within SQS's 5-minute window.
async fn dead_letter(target: &Target, received: &Received, letter: &Letter) -> Result<(), Error> {
    let attributes = message::dead_letter_attributes(
        received,
        &target.queue.name,
        &letter.reason,
        &letter.attempted_at,
    );
    let mut send = target
        .lease
        .client
        .send_message()
        .queue_url(&target.dead_letter_queue)
        .message_body(received.raw.body().unwrap_or_default())
        .set_message_attributes(Some(attributes));
    if target.dead_letter_fifo {
        let times: Vec<String> = letter
            .attempted_at
            .iter()
            .copied()
            .map(idem_core::consume::rfc3339)
            .collect();
        let id = message::digest(&[
            target.queue.name.as_bytes(),
            letter.message_id.as_bytes(),
            times.join(",").as_bytes(),
        ]);
        send = send.message_group_id(&id).message_deduplication_id(&id);
    }
    send.send().await.map_err(Error::sqs(format!(
        "send a dead letter of {:?} to its dead-letter queue",
        target.queue.name
    )))?;
    tracing::debug!(message_id = %redacted(received), "the dead letter is in the dead-letter queue");
    Ok(())
}

async fn delete(target: &Target, received: &Received) -> Result<(), Error> {
    target
        .lease
        .client
        .delete_message()
        .queue_url(&target.queue.url)
        .receipt_handle(&received.receipt)
        .send()
        .await
        .map_err(Error::sqs("delete a message"))?;
    Ok(())
}

/// Makes the message visible again after `delay` (rounded up to whole
/// seconds).
async fn change_visibility(
    target: &Target,
    received: &Received,
    delay: Duration,
) -> Result<(), Error> {
    target
        .lease
        .client
        .change_message_visibility()
        .queue_url(&target.queue.url)
        .receipt_handle(&received.receipt)
        .visibility_timeout(lease::seconds(delay))
        .send()
        .await
        .map_err(Error::sqs("change a message's visibility timeout"))?;
    Ok(())
}

fn redacted(received: &Received) -> Redacted<'_> {
    Redacted::of(received.message.message_id().unwrap_or(""))
}
