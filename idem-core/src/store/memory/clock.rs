//! The store's clock: [`Nanos`] since the store was built, and durations clamped
//! to a century.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

/// Durations are clamped to a century so that times never overflow.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A time on the store's clock: nanoseconds since the store was built.
pub(super) type Nanos = u64;

/// Maps the store's [`Nanos`] to Tokio instants and wall-clock times, from one
/// reading of both.
pub(super) struct Clock {
    instant: Instant,
    system: SystemTime,
}

impl Clock {
    pub(super) fn new() -> Self {
        Self {
            instant: Instant::now(),
            system: SystemTime::now(),
        }
    }

    pub(super) fn now(&self) -> Nanos {
        nanos(Instant::now().saturating_duration_since(self.instant))
    }

    pub(super) fn system_time(&self, at: Nanos) -> SystemTime {
        self.system
            .checked_add(Duration::from_nanos(at))
            .unwrap_or(self.system)
    }

    pub(super) fn instant(&self, at: Nanos) -> Instant {
        self.instant
            .checked_add(Duration::from_nanos(at))
            .unwrap_or(self.instant)
    }
}

fn nanos(duration: Duration) -> Nanos {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// `now + duration`, `duration` clamped to a century.
pub(super) fn later(now: Nanos, duration: Duration) -> Nanos {
    now.saturating_add(nanos(duration.min(FOREVER)))
}
