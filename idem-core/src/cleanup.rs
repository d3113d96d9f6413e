//! The cleanup job: deletes expired records (and, with idem-diesel, the
//! inbox's processed messages past their retention) in batches, one runner at
//! a time. It needs only a [`Store`], so it serves every store, the in-memory
//! one included (which otherwise frees expired records only when it needs the
//! room).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::store::StoreFuture;
use crate::{Store, StoreError};

/// Deletes expired records, in batches, for as long as the application runs.
///
/// A sweep calls [`ExpiredRows::sweep_expired`] (for a store,
/// [`Store::delete_expired`]) until a batch comes back short,
/// pausing between batches so that the deletes leave room for requests. Then the
/// job sleeps for its interval and sweeps again. When a [`SweepLock`] is set (as
/// idem-diesel's `PgStore::cleanup` does), a sweep runs only in the instance
/// that takes the lock; the others skip it.
///
/// The pause between batches follows what the job observes: after a batch that
/// took `t`, it pauses `t × (1 − duty) / duty` (at least [`pause`](Self::pause)),
/// so the job keeps the store busy for at most its [`duty_cycle`](Self::duty_cycle)
/// (default 50 %) of the time. A database with spare capacity answers quickly
/// and is swept quickly; a loaded one answers slowly and is given room. An error ends the sweep, not
/// the job: it is logged with its cause, reported, and the next interval sweeps
/// again.
///
/// Every sweep is logged (`tracing`, target `idem::cleanup`) and handed to the
/// [`on_report`](Self::on_report) callback, if any.
///
/// One job may sweep more than one table: [`also`](Self::also) adds, say,
/// idem-diesel's consumer inbox's processed messages to a store's job, under
/// the same lock and the same report.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::MemoryStore;
/// use idem_core::cleanup::{Cleanup, SweepReport};
///
/// # async fn run(store: MemoryStore) {
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let cleanup = Cleanup::new(store)
///     .batch_size(5_000)
///     .duty_cycle(0.25)
///     .interval(Duration::from_secs(300))
///     .on_report(|report| {
///         if let SweepReport::Swept(sweep) = report {
///             println!("deleted {} expired records", sweep.deleted);
///         }
///     });
/// let job = tokio::spawn(cleanup.run(async {
///     let _ = stopped.await;
/// }));
/// // … serve requests; at shutdown:
/// let _ = stop.send(());
/// let deleted_in_total = job.await.unwrap_or(0);
/// # }
/// ```
#[must_use]
pub struct Cleanup<S> {
    store: S,
    also: Vec<Arc<dyn ExpiredRows>>,
    lock: Option<Arc<dyn SweepLock>>,
    batch_size: usize,
    pause: Duration,
    duty: f64,
    interval: Duration,
    on_report: Option<Arc<OnReport>>,
}

/// The callback of [`Cleanup::on_report`].
type OnReport = dyn Fn(&SweepReport) + Send + Sync;

/// Rows that a [`Cleanup`] job deletes once they expire: every [`Store`]'s
/// records, and the consumer inbox's processed messages.
pub trait ExpiredRows: Send + Sync + 'static {
    /// Deletes up to `batch` expired rows and answers how many it deleted; the job
    /// calls it until it answers less than `batch`. (Named apart from
    /// [`Store::delete_expired`], which it is for a store, so that a store's
    /// method is never ambiguous with both traits in scope.)
    fn sweep_expired(&self, batch: usize) -> StoreFuture<'_, u64>;
}

impl<S: Store> ExpiredRows for S {
    fn sweep_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        self.delete_expired(batch)
    }
}

/// Makes sure one cleanup runner at a time sweeps a table, across processes.
pub trait SweepLock: Send + Sync + 'static {
    /// Takes the lock if it is free; `Ok(None)` when another runner holds it.
    /// The lock is held until the guard is dropped.
    fn try_lock(&self) -> StoreFuture<'_, Option<SweepGuard>>;
}

/// Proof that a runner holds a [`SweepLock`]; dropping it releases the lock.
#[must_use = "the lock is released when the guard is dropped"]
pub struct SweepGuard {
    _held: Box<dyn Send>,
}

/// What one sweep did.
#[derive(Debug)]
#[non_exhaustive]
pub enum SweepReport {
    /// The sweep ran to the end.
    Swept(Sweep),
    /// Another runner holds the sweep lock, so this one did nothing.
    Skipped,
    /// The sweep stopped at an error; what it deleted before is counted.
    Failed {
        /// What the sweep did before the error.
        swept: Sweep,
        /// The error, with its cause.
        error: StoreError,
    },
}

/// How much one sweep deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Rows deleted: records, and processed inbox messages when the job sweeps
    /// an inbox too.
    pub deleted: u64,
    /// Batches run (calls of [`Store::delete_expired`]).
    pub batches: u64,
}

impl<S: ExpiredRows> Cleanup<S> {
    /// A job over `store` (or any [`ExpiredRows`]): batches of 1 000 at a 50 %
    /// duty cycle (at least 1 ms apart), a sweep every 60 s, and no lock (every
    /// runner sweeps).
    pub fn new(store: S) -> Self {
        Self {
            store,
            also: Vec::new(),
            lock: None,
            batch_size: 1_000,
            pause: Duration::from_millis(1),
            duty: 0.5,
            interval: Duration::from_secs(60),
            on_report: None,
        }
    }

    /// Sweeps `rows` too, after the store, in the same sweep: under the same lock,
    /// counted in the same report.
    pub fn also(mut self, rows: impl ExpiredRows) -> Self {
        self.also.push(Arc::new(rows));
        self
    }

    /// Sweeps only while holding `lock`, so that one runner sweeps at a time.
    pub fn lock(mut self, lock: impl SweepLock) -> Self {
        self.lock = Some(Arc::new(lock));
        self
    }

    /// How many records one statement deletes (at least 1; default 1 000).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// The shortest pause between two batches of a sweep (default 1 ms).
    pub fn pause(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// The share of the time the job keeps the store busy, between 0.01 and 1
    /// (default 0.5): after a batch that took `t`, it pauses
    /// `t × (1 − duty) / duty`. 1 deletes back to back (after the
    /// [`pause`](Self::pause)).
    pub fn duty_cycle(mut self, duty: f64) -> Self {
        self.duty = duty.clamp(0.01, 1.0);
        self
    }

    /// The time from the end of one sweep to the start of the next (default 60 s).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Called with the report of every sweep, after it is logged.
    pub fn on_report(mut self, on_report: impl Fn(&SweepReport) + Send + Sync + 'static) -> Self {
        self.on_report = Some(Arc::new(on_report));
        self
    }

    /// How many records one statement deletes.
    pub fn get_batch_size(&self) -> usize {
        self.batch_size
    }

    /// The shortest pause between two batches of a sweep.
    pub fn get_pause(&self) -> Duration {
        self.pause
    }

    /// The share of the time the job keeps the store busy.
    pub fn get_duty_cycle(&self) -> f64 {
        self.duty
    }

    /// The time from the end of one sweep to the start of the next.
    pub fn get_interval(&self) -> Duration {
        self.interval
    }

    /// Sweeps now, once: takes the lock (if one is set), deletes batches until one
    /// comes back short, and reports what it did. The report is logged and handed
    /// to the callback, as in [`run`](Self::run).
    pub async fn sweep(&self) -> SweepReport {
        let report = self.sweep_unreported().await;
        self.report(&report);
        report
    }

    /// Sweeps at once and then every interval, until `shutdown` resolves; answers
    /// how many records it deleted in all. A sweep under way when `shutdown`
    /// resolves is abandoned between two statements' answers (each batch is one
    /// atomic statement, so nothing is half done).
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> u64 {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut total = 0;
        loop {
            tokio::select! {
                () = &mut shutdown => return total,
                report = self.sweep() => total += match report {
                    SweepReport::Swept(sweep) | SweepReport::Failed { swept: sweep, .. } => sweep.deleted,
                    SweepReport::Skipped => 0,
                },
            }
            tokio::select! {
                () = &mut shutdown => return total,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    async fn sweep_unreported(&self) -> SweepReport {
        let _guard = match &self.lock {
            None => None,
            Some(lock) => match lock.try_lock().await {
                Ok(Some(guard)) => Some(guard),
                Ok(None) => return SweepReport::Skipped,
                Err(error) => {
                    return SweepReport::Failed {
                        swept: Sweep::default(),
                        error,
                    };
                }
            },
        };
        let mut swept = Sweep::default();
        let targets = std::iter::once(&self.store as &dyn ExpiredRows)
            .chain(self.also.iter().map(|rows| &**rows));
        for rows in targets {
            if let Err(error) = self.sweep_one(rows, &mut swept).await {
                return SweepReport::Failed { swept, error };
            }
        }
        SweepReport::Swept(swept)
    }

    /// Deletes `rows` batch by batch until a batch comes back short.
    async fn sweep_one(&self, rows: &dyn ExpiredRows, swept: &mut Sweep) -> Result<(), StoreError> {
        let batch = u64::try_from(self.batch_size).unwrap_or(u64::MAX);
        loop {
            let started = Instant::now();
            let deleted = rows.sweep_expired(self.batch_size).await?;
            let took = started.elapsed();
            swept.batches += 1;
            swept.deleted += deleted;
            if deleted < batch {
                return Ok(());
            }
            tokio::time::sleep(self.pause_after(took)).await;
        }
    }

    /// The pause after a batch that took `took`: the duty cycle's, at least the
    /// minimum.
    fn pause_after(&self, took: Duration) -> Duration {
        took.mul_f64((1.0 - self.duty) / self.duty).max(self.pause)
    }

    fn report(&self, report: &SweepReport) {
        match report {
            SweepReport::Swept(Sweep {
                deleted: 0,
                batches,
            }) => {
                tracing::debug!(target: "idem::cleanup", deleted = 0, batches, "no expired idempotency records");
            }
            SweepReport::Swept(Sweep { deleted, batches }) => {
                tracing::info!(target: "idem::cleanup", deleted, batches, "expired idempotency records deleted");
            }
            SweepReport::Skipped => {
                tracing::debug!(target: "idem::cleanup", "idempotency cleanup skipped: another runner holds the lock");
            }
            SweepReport::Failed {
                swept: Sweep { deleted, batches },
                error,
            } => {
                tracing::warn!(
                    target: "idem::cleanup",
                    deleted,
                    batches,
                    error = error as &(dyn std::error::Error + 'static),
                    "idempotency cleanup failed; it will sweep again at the next interval"
                );
            }
        }
        if let Some(on_report) = &self.on_report {
            on_report(report);
        }
    }
}

impl<S> fmt::Debug for Cleanup<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cleanup")
            .field("locked", &self.lock.is_some())
            .field("also", &self.also.len())
            .field("batch_size", &self.batch_size)
            .field("pause", &self.pause)
            .field("duty", &self.duty)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl SweepGuard {
    /// A guard that holds the lock as long as it keeps `held` (a connection that
    /// holds a session lock, say).
    pub fn new(held: impl Send + 'static) -> Self {
        Self {
            _held: Box::new(held),
        }
    }
}

impl fmt::Debug for SweepGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SweepGuard")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[test]
    fn the_pause_follows_the_duty_cycle() {
        let job = Cleanup::new(MemoryStore::new());
        assert_eq!(
            job.pause_after(Duration::from_millis(8)),
            Duration::from_millis(8)
        );
        assert_eq!(job.pause_after(Duration::ZERO), Duration::from_millis(1));
        let quarter = Cleanup::new(MemoryStore::new()).duty_cycle(0.25);
        assert_eq!(
            quarter.pause_after(Duration::from_millis(8)),
            Duration::from_millis(24)
        );
        let flat_out = Cleanup::new(MemoryStore::new())
            .duty_cycle(1.0)
            .pause(Duration::ZERO);
        assert_eq!(
            flat_out.pause_after(Duration::from_millis(8)),
            Duration::ZERO
        );
    }
}
