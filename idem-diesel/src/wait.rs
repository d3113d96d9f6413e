//! Waiting for an in-progress record to settle, by polling with backoff.
//!
//! Both stores override [`idem_core::Store::changed`] with this rather than with
//! PostgreSQL's `LISTEN`/`NOTIFY`: a poll is one primary-key lookup, it needs no
//! connection held open per instance just to listen, it works through
//! transaction-pooling proxies (PgBouncer) where `LISTEN` does not, and waiting on
//! an in-progress record is the rare path. The first checks come quickly, for
//! handlers that finish soon; the backoff keeps a long wait cheap.

use std::future::Future;
use std::time::Duration;

use idem_core::StoreError;
use tokio::time::Instant;

/// The first pause before checking again.
const FIRST_STEP: Duration = Duration::from_millis(10);

/// The longest pause between two checks.
const LONGEST_STEP: Duration = Duration::from_millis(200);

/// Resolves once `in_progress` answers `false`, or once `poll` has passed.
///
/// Sleeps before the first check: the caller has just seen the record in
/// progress.
pub(crate) async fn until_settled<F, Fut>(
    poll: Duration,
    mut in_progress: F,
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, StoreError>>,
{
    let deadline = Instant::now() + poll;
    let mut step = FIRST_STEP;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        tokio::time::sleep(step.min(left)).await;
        if !in_progress().await? {
            return Ok(());
        }
        step = (step * 2).min(LONGEST_STEP);
    }
}
