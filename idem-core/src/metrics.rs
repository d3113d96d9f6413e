//! Counters and histograms of every keyed request, through the
//! [`metrics`](https://docs.rs/metrics) facade (feature `metrics`): the
//! application installs the recorder (Prometheus, StatsD, …) it likes. Without
//! the feature every call here compiles to nothing.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idem_requests_total` | counter | `outcome` | keyed requests by outcome: `executed`, `replayed`, `conflict`, `mismatch`, `refused`, `store_failure`, `unguarded`, `handler_failed`, `not_replayable` |
//! | `idem_handler_seconds` | histogram | | time the handler ran (its body read included) |
//! | `idem_store_call_seconds` | histogram | `op` | time of each store call: `claim`, `complete`, `renew`, `release` |
//! | `idem_lease_lost_total` | counter | | executions whose lease was lost while the handler ran |
//! | `idem_store_full_total` | counter | `limit` | claims the in-memory store refused for want of room (it evicts nothing): `records`, `bytes`, `scope_records`, `scope_bytes` |

/// How a keyed request ended, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Executed,
    Replayed,
    Conflict,
    Mismatch,
    Refused,
    StoreFailure,
    Unguarded,
    HandlerFailed,
    NotReplayable,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn label(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Refused => "refused",
            Self::StoreFailure => "store_failure",
            Self::Unguarded => "unguarded",
            Self::HandlerFailed => "handler_failed",
            Self::NotReplayable => "not_replayable",
        }
    }
}

/// Counts a request's outcome.
#[inline]
pub(crate) fn outcome(outcome: Outcome) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_requests_total", "outcome" => outcome.label()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// Counts a lost lease.
#[inline]
pub(crate) fn lease_lost() {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_lease_lost_total").increment(1);
}

/// Counts a claim the in-memory store refused for want of room under `limit`.
#[inline]
pub(crate) fn store_full(limit: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_store_full_total", "limit" => limit).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = limit;
}

/// A started measurement; free without the feature.
#[derive(Clone, Copy)]
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    pub(crate) started: std::time::Instant,
}

impl Timer {
    #[inline]
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            started: std::time::Instant::now(),
        }
    }
}

/// Records how long the handler ran.
#[inline]
pub(crate) fn handler_time(timer: Timer) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idem_handler_seconds").record(timer.started.elapsed().as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = timer;
}

/// Records how long a store call took.
#[inline]
pub(crate) fn store_time(op: &'static str, timer: Timer) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idem_store_call_seconds", "op" => op)
        .record(timer.started.elapsed().as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (op, timer);
}
