//! Recording a handler's answer: the completion, retried a few times, then
//! (deferred) in the background while the lease holds.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{COMPLETE_ATTEMPTS, Execution, Recorded, error_chain};
use crate::metrics;
use crate::{StoreError, StoredResponse};

impl Execution {
    /// Records the handler's answer: completes the record when the policy stores
    /// `response.status`, releases it otherwise (so a retry runs the handler
    /// again). A failure is logged and returned.
    pub(super) async fn record(
        &mut self,
        response: &StoredResponse,
    ) -> Result<Recorded, StoreError> {
        self.settled = true;
        let engine = self.engine.clone();
        let policy = engine.policy();
        if !policy.stores(response.status) {
            tracing::info!(target: "idem", outcome = "executed", stored = false, status = response.status, scope = %self.claim.scope, key = %self.claim.key.redacted());
            metrics::outcome(metrics::Outcome::Executed);
            self.release_now().await?;
            return Ok(Recorded::Released);
        }
        let mut attempt = 1;
        loop {
            let timer = metrics::Timer::start();
            let completed = engine
                .store()
                .complete(&self.claim, response, policy.get_retention())
                .await;
            metrics::store_time("complete", timer);
            match completed {
                Ok(()) => {
                    tracing::info!(target: "idem", outcome = "executed", stored = true, replayable = response.replayable, status = response.status, scope = %self.claim.scope, key = %self.claim.key.redacted());
                    metrics::outcome(metrics::Outcome::Executed);
                    return Ok(Recorded::Completed);
                }
                Err(StoreError::StaleOwner) => {
                    tracing::warn!(target: "idem", outcome = "executed", stored = false, scope = %self.claim.scope, key = %self.claim.key.redacted(), "completion refused: the claim was lost (lease lapsed) while the handler ran");
                    metrics::outcome(metrics::Outcome::Executed);
                    return Err(StoreError::StaleOwner);
                }
                // The transaction is gone: trying again cannot bring it back.
                Err(error @ StoreError::Uncommitted(_)) => {
                    tracing::error!(target: "idem", outcome = "uncommitted", stored = false, scope = %self.claim.scope, key = %self.claim.key.redacted(), error = %error_chain(&error), "the completion was not committed and the handler's writes were rolled back with it; a retry runs the handler again");
                    metrics::outcome(metrics::Outcome::StoreFailure);
                    return Err(error);
                }
                // The client is not kept waiting: the record is completed in
                // the background while the lease holds, so a store blip does
                // not let the record lapse and the handler run again.
                Err(error) if attempt >= COMPLETE_ATTEMPTS => {
                    tracing::warn!(target: "idem", outcome = "executed", stored = false, scope = %self.claim.scope, key = %self.claim.key.redacted(), error = %error_chain(&error), "could not record the answer yet; retrying in the background while the lease holds");
                    metrics::outcome(metrics::Outcome::Executed);
                    self.complete_later(response.clone());
                    return Err(error);
                }
                Err(error) => {
                    tracing::warn!(target: "idem", attempt, error = %error_chain(&error), "completion failed; retrying");
                    tokio::time::sleep(Duration::from_millis(20 * u64::from(attempt))).await;
                    attempt += 1;
                }
            }
        }
    }

    /// Goes on completing the record in a task of its own, from 50 ms apart
    /// doubling to a tenth of the lease (at most 1 s), until it succeeds, the
    /// store refuses it, or the lease has certainly run out.
    fn complete_later(&self, response: StoredResponse) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(self.engine.store());
        let claim = self.claim.clone();
        let retention = self.engine.policy().get_retention();
        let held_until = self.held_until();
        let cap = (claim.lease / 10).clamp(Duration::from_millis(1), Duration::from_secs(1));
        runtime.spawn(async move {
            let mut backoff = Duration::from_millis(50).min(cap);
            loop {
                if Instant::now() + backoff >= held_until {
                    tracing::error!(target: "idem", stored = false, scope = %claim.scope, key = %claim.key.redacted(), "could not record the answer before the lease ran out; a retry after it lapses runs the handler again");
                    return;
                }
                tokio::time::sleep(backoff).await;
                match store.complete(&claim, &response, retention).await {
                    Ok(()) => {
                        tracing::info!(target: "idem", stored = true, scope = %claim.scope, key = %claim.key.redacted(), "the answer was recorded once the store answered again");
                        return;
                    }
                    Err(error @ (StoreError::StaleOwner | StoreError::Uncommitted(_))) => {
                        tracing::error!(target: "idem", stored = false, scope = %claim.scope, key = %claim.key.redacted(), error = %error_chain(&error), "the answer cannot be recorded any more");
                        return;
                    }
                    Err(_) => backoff = (backoff * 2).min(cap),
                }
            }
        });
    }
}
