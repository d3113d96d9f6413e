//! The consumer's counters, histogram and gauge, through the `metrics`
//! facade (feature `metrics`; see the module's table). Without the feature
//! every call here compiles to nothing.

/// How a delivery ended, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Processed,
    Duplicate,
    Retried,
    DeadLettered,
    DeadLetterSkipped,
    Requeued,
}

impl Outcome {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn label(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Duplicate => "duplicate",
            Self::Retried => "retried",
            Self::DeadLettered => "dead_lettered",
            Self::DeadLetterSkipped => "dead_letter_skipped",
            Self::Requeued => "requeued",
        }
    }
}

/// Counts a delivery's outcome.
#[inline]
pub(crate) fn outcome(outcome: Outcome) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_messages_total", "outcome" => outcome.label()).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// Records how long a handler ran.
#[inline]
pub(crate) fn handler_time(timer: crate::metrics::Timer) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idem_message_handler_seconds")
        .record(timer.started.elapsed().as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = timer;
}

/// Sets the consumer's dead-letter gauge.
#[inline]
pub(crate) fn dead_letters(consumer: &str, count: u64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("idem_dead_letters", "consumer" => consumer.to_owned()).set(count as f64);
    #[cfg(not(feature = "metrics"))]
    let _ = (consumer, count);
}

/// Counts a crossing of the dead-letter alert's threshold.
#[inline]
pub(crate) fn alert(consumer: &str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_dead_letter_alerts_total", "consumer" => consumer.to_owned())
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = consumer;
}
