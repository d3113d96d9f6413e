//! The visibility timeout as a lease: extended while a handler runs, as
//! idem-core's engine renews an HTTP request's lease.

use std::future::Future;
use std::pin::{Pin, pin};
use std::time::Duration;

use aws_sdk_sqs::Client;
use tokio::time::Instant;

use crate::Error;

/// The lease on some received messages: their visibility timeout, which
/// [`Lease::hold`] extends while a future runs.
#[derive(Clone, Debug)]
pub(crate) struct Lease {
    pub(crate) client: Client,
    pub(crate) queue_url: String,
    /// How long each extension makes the messages invisible (whole seconds,
    /// at least 1).
    pub(crate) length: Duration,
}

impl Lease {
    /// The lease length in whole seconds, as SQS takes it.
    pub(crate) fn seconds(&self) -> i32 {
        seconds(self.length)
    }

    /// Runs `work` while keeping `receipts` invisible to other receivers.
    ///
    /// The visibility is extended to the lease's length every quarter of it,
    /// counted from when the previous extension was sent (the first from
    /// `received_at`, when the receive that took them was sent), so that a
    /// slow answer does not push the next one back: the server sees one
    /// every quarter of the lease, or every round trip when that is longer.
    /// An extension runs beside `work`, which it never holds up (the
    /// handler's transaction waits for no SQS answer), one at a time; the
    /// one in flight when `work` ends is waited for, so that it cannot land
    /// after what the caller does next with the messages' visibility.
    ///
    /// A failed extension is retried promptly (from 50 ms, doubling, at most
    /// a tenth of the lease apart) and reported when its retry is due: one
    /// that failed as `work` ended (sent as the message was deleted) says
    /// nothing above debug level. When extensions fail until the lease has
    /// certainly run out, it is lost: logged at error level, and the work
    /// runs on (another receiver may get the messages: the inbox makes that
    /// a duplicate).
    pub(crate) async fn hold<F: Future>(
        &self,
        receipts: &[&str],
        received_at: Instant,
        work: F,
    ) -> F::Output {
        let mut work = pin!(work);
        let length = self.length;
        let every = (length / 4).max(Duration::from_millis(100));
        let retry_cap = (length / 10).max(Duration::from_millis(50));
        let first_retry = Duration::from_millis(50).min(retry_cap);
        let mut held_until = received_at + length;
        let mut next = received_at + every;
        let mut retry = first_retry;
        let mut failed: Option<Error> = None;
        let mut holding = !receipts.is_empty();
        let mut extension = pin!(None);
        let output = loop {
            tokio::select! {
                biased;
                output = &mut work => break output,
                (sent, extended) = answer(extension.as_mut()), if extension.is_some() => {
                    extension.set(None);
                    match extended {
                        Ok(()) => {
                            held_until = sent + length;
                            next = sent + every;
                            retry = first_retry;
                        }
                        Err(error) if Instant::now() + retry >= held_until => {
                            tracing::error!(error = %idem_core::log::error_chain(&error), "the visibility timeout could not be extended until it ran out: the message may be received again (the inbox makes it a duplicate)");
                            holding = false;
                        }
                        Err(error) => {
                            failed = Some(error);
                            next = Instant::now() + retry;
                            retry = (retry * 2).min(retry_cap);
                        }
                    }
                }
                () = tokio::time::sleep_until(next), if holding && extension.is_none() => {
                    if let Some(error) = failed.take() {
                        tracing::warn!(error = %idem_core::log::error_chain(&error), retry_in_ms = retry.as_millis() as u64, "extending the visibility timeout failed; retrying");
                    }
                    extension.set(Some(self.extend_from_now(receipts)));
                }
            }
        };
        if extension.is_some() {
            let (_, extended) = answer(extension.as_mut()).await;
            failed = extended.err().or(failed);
        }
        if let Some(error) = failed {
            tracing::debug!(error = %idem_core::log::error_chain(&error), "an extension of the visibility timeout failed as the work ended");
        }
        output
    }

    /// [`extend`](Self::extend), answering when it was sent.
    async fn extend_from_now(&self, receipts: &[&str]) -> (Instant, Result<(), Error>) {
        let sent = Instant::now();
        (sent, self.extend(receipts).await)
    }

    /// Makes `receipts` invisible for the lease's length from now: one
    /// `ChangeMessageVisibilityBatch` per ten receipts (SQS's most a call),
    /// one `ChangeMessageVisibility` for a lone one. An entry SQS did not
    /// change fails the extension, which is retried whole (an extension
    /// repeated changes nothing).
    async fn extend(&self, receipts: &[&str]) -> Result<(), Error> {
        use aws_sdk_sqs::types::ChangeMessageVisibilityBatchRequestEntry;
        let seconds = self.seconds();
        if let [receipt] = receipts {
            self.client
                .change_message_visibility()
                .queue_url(&self.queue_url)
                .receipt_handle(*receipt)
                .visibility_timeout(seconds)
                .send()
                .await
                .map_err(Error::sqs("extend a message's visibility timeout"))?;
            return Ok(());
        }
        for chunk in receipts.chunks(crate::consumer::MAX_BATCH) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, receipt)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(*receipt)
                        .visibility_timeout(seconds)
                        .build()
                        .map_err(|error| Error::Unexpected(format!("a visibility entry: {error}")))
                })
                .collect::<Result<Vec<_>, Error>>()?;
            let answer = self
                .client
                .change_message_visibility_batch()
                .queue_url(&self.queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(Error::sqs(
                    "extend the visibility timeout of a batch of messages",
                ))?;
            // SQS's code only: its message may quote the receipt handle.
            if let Some(failed) = answer.failed().first() {
                return Err(Error::Unexpected(format!(
                    "SQS did not extend {} of {} messages' visibility timeout ({})",
                    answer.failed().len(),
                    chunk.len(),
                    failed.code(),
                )));
            }
        }
        Ok(())
    }
}

/// The answer of the extension in flight in `slot` ([`Lease::hold`]'s);
/// pending forever when there is none.
async fn answer<F: Future>(slot: Pin<&mut Option<F>>) -> F::Output {
    match slot.as_pin_mut() {
        Some(extension) => extension.await,
        None => std::future::pending().await,
    }
}

/// The most SQS takes as a visibility timeout: 12 hours.
pub(crate) const MAX_VISIBILITY: Duration = Duration::from_secs(43_200);

/// `duration` in whole seconds, rounded up, within SQS's visibility range
/// (0 to 12 hours).
pub(crate) fn seconds(duration: Duration) -> i32 {
    let duration = duration.min(MAX_VISIBILITY);
    let whole = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    i32::try_from(whole).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibilities_round_up_to_whole_seconds_within_twelve_hours() {
        assert_eq!(seconds(Duration::ZERO), 0);
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_millis(1000)), 1);
        assert_eq!(seconds(Duration::from_millis(1001)), 2);
        assert_eq!(seconds(Duration::from_secs(100_000)), 43_200);
    }
}
