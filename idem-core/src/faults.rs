//! A store that stumbles on purpose (feature `test-util`): [`FaultyStore`]
//! wraps any store and injects delays, errors and outages into its steps from a
//! seeded [`FaultPlan`], on Tokio's clock, so a simulation with paused time is
//! deterministic per seed.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::MemoryStore;
//! use idem_core::faults::{FaultPlan, FaultyStore};
//!
//! let plan = FaultPlan::seeded(7)
//!     .error_rate(0.05)
//!     .delays(0.2, Duration::from_millis(50))
//!     .outage(Duration::from_secs(3), Duration::from_secs(2));
//! let store = FaultyStore::new(MemoryStore::new(), plan);
//! # drop(store);
//! ```

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use crate::store::{Claim, ClaimOutcome, ClaimRequest, Record, StoreFuture, StoreLayer};
use crate::{IdempotencyKey, Scope, Store, StoreError, StoredResponse};

/// What a [`FaultyStore`] does to the steps it forwards.
#[derive(Clone, Debug)]
#[must_use]
pub struct FaultPlan {
    seed: u64,
    error_rate: f64,
    delay_rate: f64,
    max_delay: Duration,
    outages: Vec<(Duration, Duration)>,
}

/// A store whose steps fail, stall and go away as its [`FaultPlan`] says.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    plan: FaultPlan,
    started: Instant,
    rng: Mutex<StdRng>,
    injected: AtomicU64,
}

/// The error a [`FaultyStore`] injects.
#[derive(Debug, thiserror::Error)]
#[error("injected store fault")]
pub struct InjectedFault;

impl FaultPlan {
    /// No faults yet, drawn from `seed`.
    pub fn seeded(seed: u64) -> Self {
        Self {
            seed,
            error_rate: 0.0,
            delay_rate: 0.0,
            max_delay: Duration::ZERO,
            outages: Vec::new(),
        }
    }

    /// Each step fails at once with this probability.
    pub fn error_rate(mut self, rate: f64) -> Self {
        self.error_rate = rate;
        self
    }

    /// Each step is delayed with probability `rate`, by up to `max` (a delay
    /// past the caller's patience is a timeout).
    pub fn delays(mut self, rate: f64, max: Duration) -> Self {
        self.delay_rate = rate;
        self.max_delay = max;
        self
    }

    /// Every step fails from `at` (after the store was made) for `lasting`.
    pub fn outage(mut self, at: Duration, lasting: Duration) -> Self {
        self.outages.push((at, lasting));
        self
    }

    /// The outages planned: `(at, lasting)`.
    pub fn outages(&self) -> &[(Duration, Duration)] {
        &self.outages
    }
}

impl<S: Store> FaultyStore<S> {
    /// `inner` with the faults of `plan`, timed from now.
    pub fn new(inner: S, plan: FaultPlan) -> Self {
        Self {
            inner,
            rng: Mutex::new(StdRng::seed_from_u64(plan.seed)),
            plan,
            started: Instant::now(),
            injected: AtomicU64::new(0),
        }
    }

    /// How many faults (errors, delays, outage refusals) were injected.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// `step` after this step's fate: a delay, then perhaps a failure instead.
    fn stumbling<'a, T: Send + 'a>(&'a self, step: StoreFuture<'a, T>) -> StoreFuture<'a, T> {
        Box::pin(async move {
            self.stumble().await?;
            step.await
        })
    }

    /// Draws this step's fate: a delay, then whether it fails.
    async fn stumble(&self) -> Result<(), StoreError> {
        let (delay, fail) = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            let delay = (rng.random::<f64>() < self.plan.delay_rate)
                .then(|| self.plan.max_delay.mul_f64(rng.random::<f64>()));
            (delay, rng.random::<f64>() < self.plan.error_rate)
        };
        if let Some(delay) = delay {
            self.injected.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(delay).await;
        }
        let now = self.started.elapsed();
        let down = self
            .plan
            .outages
            .iter()
            .any(|&(at, lasting)| now >= at && now < at + lasting);
        if fail || down {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::unavailable(InjectedFault));
        }
        Ok(())
    }
}

impl<S: Store> StoreLayer for FaultyStore<S> {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    fn claim<'a>(&'a self, request: &'a ClaimRequest) -> StoreFuture<'a, ClaimOutcome> {
        self.stumbling(self.inner.claim(request))
    }
    fn renew<'a>(&'a self, claim: &'a Claim, lease: Duration) -> StoreFuture<'a, ()> {
        self.stumbling(self.inner.renew(claim, lease))
    }
    fn complete<'a>(
        &'a self,
        claim: &'a Claim,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> StoreFuture<'a, ()> {
        self.stumbling(self.inner.complete(claim, response, retention))
    }
    fn release<'a>(&'a self, claim: &'a Claim) -> StoreFuture<'a, ()> {
        self.stumbling(self.inner.release(claim))
    }
    fn load<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a IdempotencyKey,
    ) -> StoreFuture<'a, Option<Record>> {
        self.stumbling(self.inner.load(scope, key))
    }
    fn delete_expired(&self, batch: usize) -> StoreFuture<'_, u64> {
        self.stumbling(self.inner.delete_expired(batch))
    }
}
