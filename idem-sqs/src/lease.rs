//! The visibility timeout as a lease: extended while a handler runs, as
//! idem-core's engine renews an HTTP request's lease.

use std::future::Future;
use std::pin::pin;
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
    /// The visibility is extended to the lease's length every quarter of it
    /// (counted from `received_at`, when the receive that took them was
    /// sent), so an extension is due well before a third of the lease is
    /// gone. A failed extension is retried promptly (from 50 ms, doubling,
    /// at most a tenth of the lease apart); when extensions fail until the
    /// lease has certainly run out, it is lost: logged at error level, and
    /// the work runs on (another receiver may get the messages: the inbox
    /// makes that a duplicate).
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
        let mut held_until = received_at + length;
        let mut next = received_at + every;
        let mut retry = Duration::from_millis(50).min(retry_cap);
        let mut holding = !receipts.is_empty();
        loop {
            tokio::select! {
                biased;
                output = &mut work => return output,
                () = tokio::time::sleep_until(next), if holding => {
                    let sent = Instant::now();
                    match self.extend(receipts).await {
                        Ok(()) => {
                            held_until = sent + length;
                            next = Instant::now() + every;
                            retry = Duration::from_millis(50).min(retry_cap);
                        }
                        Err(error) if Instant::now() + retry >= held_until => {
                            tracing::error!(error = %idem_core::log::error_chain(&error), "the visibility timeout could not be extended until it ran out: the message may be received again (the inbox makes it a duplicate)");
                            holding = false;
                        }
                        Err(error) => {
                            tracing::warn!(error = %idem_core::log::error_chain(&error), retry_in_ms = retry.as_millis() as u64, "extending the visibility timeout failed; retrying");
                            next = Instant::now() + retry;
                            retry = (retry * 2).min(retry_cap);
                        }
                    }
                }
            }
        }
    }

    /// Makes `receipts` invisible for the lease's length from now.
    async fn extend(&self, receipts: &[&str]) -> Result<(), Error> {
        let seconds = self.seconds();
        for receipt in receipts {
            self.client
                .change_message_visibility()
                .queue_url(&self.queue_url)
                .receipt_handle(*receipt)
                .visibility_timeout(seconds)
                .send()
                .await
                .map_err(Error::sqs("extend a message's visibility timeout"))?;
        }
        Ok(())
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
