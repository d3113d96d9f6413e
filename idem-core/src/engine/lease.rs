//! The lease keeper: a claimed request's handler runs while its lease is
//! renewed, so a handler slower than the lease is never run twice.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use super::{Execution, error_chain};
use crate::StoreError;
use crate::metrics;

impl Execution {
    /// Runs `handler` to completion while keeping the lease, so a handler slower
    /// than the lease is never run twice. The handler need not be `Send`
    /// (actix's are not).
    ///
    /// The lease is renewed every quarter of it, so that a renewal is due well
    /// before a third of the lease is gone. A renewal that fails is retried
    /// promptly (from 50 ms, doubling, at most a tenth of the lease apart), so a
    /// store outage shorter than the lease less one renewal interval does not
    /// let it lapse. When the store refuses a renewal (another owner holds the
    /// record) or renewals fail until the lease has certainly run out, the lease
    /// is lost: logged at error level, counted (`idem_lease_lost_total`) and
    /// signalled on [`ExecutionInfo::lease_lost`](crate::ExecutionInfo::lease_lost); the handler runs on, and its
    /// answer is sent but not recorded.
    pub async fn run<F: Future>(&self, handler: F) -> F::Output {
        let mut handler = pin!(handler);
        // A handler that answers in its first poll needs no renewal: no clock
        // reading, no timer.
        if let Poll::Ready(output) =
            std::future::poll_fn(|cx| Poll::Ready(handler.as_mut().poll(cx))).await
        {
            return output;
        }
        let lease = self.claim.lease;
        let every = (lease / 4).max(Duration::from_millis(1));
        let retry_cap = (lease / 10).max(Duration::from_millis(1));
        let mut renewing = true;
        // The lease certainly holds until this instant: it is counted from
        // before the renewal was sent.
        let mut held_until = self.held_until();
        // The first renewal is due a quarter of the lease after the claim
        // (however long that first poll took).
        let mut next = held_until
            .checked_sub(lease)
            .map_or(held_until, |claimed_at| claimed_at + every);
        let mut retry = Duration::from_millis(50).min(retry_cap);
        loop {
            let tick = tokio::time::sleep_until(next);
            tokio::select! {
                biased;
                output = &mut handler => return output,
                () = tick, if renewing => {
                    let sent = Instant::now();
                    let timer = metrics::Timer::start();
                    let renewed = self.engine.store().renew(&self.claim, lease).await;
                    metrics::store_time("renew", timer);
                    match renewed {
                        Ok(()) => {
                            held_until = sent + lease;
                            self.hold_until(held_until);
                            next = Instant::now() + every;
                            retry = Duration::from_millis(50).min(retry_cap);
                        }
                        Err(StoreError::StaleOwner) => {
                            self.lose_lease("the store refused the renewal: another request holds the key");
                            renewing = false;
                        }
                        Err(error) if Instant::now() + retry >= held_until => {
                            tracing::warn!(target: "idem", error = %error_chain(&error), "lease renewal failed");
                            self.lose_lease("renewals failed until the lease ran out");
                            renewing = false;
                        }
                        Err(error) => {
                            tracing::warn!(target: "idem", error = %error_chain(&error), retry_in_ms = retry.as_millis() as u64, "lease renewal failed; retrying");
                            next = Instant::now() + retry;
                            retry = (retry * 2).min(retry_cap);
                        }
                    }
                }
            }
        }
    }

    pub(super) fn held_until(&self) -> Instant {
        *self.held_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hold_until(&self, until: Instant) {
        *self.held_until.lock().unwrap_or_else(|p| p.into_inner()) = until;
    }

    fn lose_lease(&self, why: &str) {
        self.lease_lost.store(true, Ordering::Release);
        metrics::lease_lost();
        tracing::error!(target: "idem", outcome = "lease-lost", scope = %self.claim.scope, key = %self.claim.key.redacted(), "the claim was lost while the handler ran ({why}); another request with the key may run, and this answer will not be recorded");
    }
}
