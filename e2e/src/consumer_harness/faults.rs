//! The database's faults, the same on every broker (`docs/contract.md`
//! §9): a fault proxy between the consumers and PostgreSQL
//! ([`Case::proxy_database`]) that loses the answers to COMMITs (the commit
//! landed; the consumer cannot know), or resets and refuses every
//! connection for a while (an outage). Each broker's module runs them on its
//! own transport; the checks are the same: every balance exact, no healthy
//! message dead-lettered, the consumer alive and its queue or partitions
//! drained.

use std::time::Duration;

use idem_testkit::fault::{Fault, Proxy};

use super::process::{Case, ConsumerProcess};

/// The share of COMMITs whose answer is lost: every 5th (20 %).
pub(super) const LOST_EVERY: u32 = 5;

/// How long the database is away in an outage.
pub(super) const OUTAGE: Duration = Duration::from_secs(25);

/// Fails the scenario with `message` unless `condition` holds.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+));
        }
    };
}

/// A proxy between the case's consumers and its database that loses the
/// answer to every [`LOST_EVERY`]th COMMIT.
pub(super) fn losing_commit_answers(case: &mut Case) -> Result<Proxy, String> {
    let proxy = case.proxy_database()?;
    proxy.set(Fault::LoseCommitAnswers { every: LOST_EVERY });
    Ok(proxy)
}

/// The database away for [`OUTAGE`]: every connection reset, every new one
/// refused; then back.
pub(super) async fn outage(proxy: &Proxy) {
    proxy.set(Fault::Reset);
    tokio::time::sleep(OUTAGE).await;
    proxy.set(Fault::None);
}

/// What every fault scenario checks of its consumer at the end: it is alive
/// (it rode the fault out), then it stops on SIGTERM, exiting 0.
pub(super) async fn alive(mut consumer: ConsumerProcess) -> Result<(), String> {
    ensure!(
        consumer.running(),
        "the consumer exited during the fault; its log:\n{}",
        consumer.log_text()
    );
    consumer.terminate().await
}

/// How many COMMIT answers the proxy lost, at least `least`.
pub(super) fn lost_at_least(proxy: &Proxy, least: u64) -> Result<u64, String> {
    let lost = proxy.lost_commit_answers();
    ensure!(
        lost >= least,
        "the proxy lost {lost} COMMIT answers, fewer than {least}: the fault was not exercised"
    );
    Ok(lost)
}
