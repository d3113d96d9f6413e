//! Waiting, bounded, for what a test expects to become true.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`until`] looks again.
const EVERY: Duration = Duration::from_millis(25);

/// Polls `check` every 25 ms until it answers `Ok`, for at most `limit`.
/// The error says what was awaited, how long, and the last state `check`
/// answered (its `Err`), so that a failed wait reads as a failed assertion.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use idem_testkit::wait::until;
///
/// let waited = until("the impossible", Duration::from_millis(50), || async {
///     Err::<(), _>("still impossible".to_owned())
/// })
/// .await;
/// assert_eq!(
///     waited,
///     Err("waited 50ms for: the impossible; last seen: still impossible".to_owned())
/// );
/// # }
/// ```
pub async fn until<F, Fut>(what: impl Display, limit: Duration, mut check: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let started = Instant::now();
    loop {
        let last = match check().await {
            Ok(()) => return Ok(()),
            Err(state) => state,
        };
        if started.elapsed() > limit {
            return Err(format!("waited {limit:?} for: {what}; last seen: {last}"));
        }
        tokio::time::sleep(EVERY).await;
    }
}
