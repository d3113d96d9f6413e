//! The outbox's counters and gauge, through the [`metrics`](https://docs.rs/metrics)
//! facade (feature `metrics`; the table is in the crate's README, "The
//! outbox"). Without the feature every call here compiles to nothing.
//!
//! No label: a destination is a name the application chooses, and the
//! counters stay a fixed set of series whatever it chooses.
//! [`Outbox::parked`](crate::Outbox) and the logs say which destination.

use std::time::Duration;

/// Counts an event staged (committed or not).
#[inline]
pub(crate) fn staged() {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_outbox_staged_total").increment(1);
}

/// Counts what a settled batch did: published, parked, retried.
#[inline]
pub(crate) fn relayed(published: u64, parked: u64, retried: u64) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("idem_outbox_published_total").increment(published);
        metrics::counter!("idem_outbox_parked_total").increment(parked);
        metrics::counter!("idem_outbox_retried_total").increment(retried);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (published, parked, retried);
}

/// Sets the age of the oldest unsent, unparked event (0 when there is none).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
#[inline]
pub(crate) fn oldest_unsent(age: Option<Duration>) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("idem_outbox_oldest_unsent_seconds")
        .set(age.map_or(0.0, |age| age.as_secs_f64()));
    #[cfg(not(feature = "metrics"))]
    let _ = age;
}
