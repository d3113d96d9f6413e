//! The dead-letter alert: the dead-letter queue watched, an error logged and a
//! metric counted each time it grows past the threshold.

use std::time::Duration;

use lapin::Channel;

use crate::ConsumerError;
use crate::topology::Topology;

/// The gauge of dead letters waiting in the dead-letter queue (label `queue`).
pub const DEAD_LETTERS_GAUGE: &str = "payments_consumer_dead_letters";
/// The counter of alerts raised (label `queue`).
pub const ALERTS_COUNTER: &str = "payments_consumer_dead_letter_alerts_total";

/// How often the dead-letter queue is counted.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(250);

/// Raises an alert once per crossing: when the count goes from at most the
/// threshold to more than it (or is above it at the first look).
///
/// ```
/// use payments_consumer::alert::DeadLetterAlarm;
///
/// let mut alarm = DeadLetterAlarm::new(10);
/// let raised: Vec<bool> = [3, 11, 12, 11, 10, 11].map(|n| alarm.observe(n)).to_vec();
/// assert_eq!(raised, [false, true, false, false, false, true]);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadLetterAlarm {
    threshold: u64,
    above: bool,
}

impl DeadLetterAlarm {
    /// An alarm for more than `threshold` dead letters.
    pub fn new(threshold: u64) -> Self {
        Self {
            threshold,
            above: false,
        }
    }

    /// Takes a new count; answers whether it raises the alert.
    pub fn observe(&mut self, dead_letters: u64) -> bool {
        let above = dead_letters > self.threshold;
        let raised = above && !self.above;
        self.above = above;
        raised
    }

    /// Takes a new count of `queue`: sets the gauge; when it raises the alert,
    /// logs an error with `dead-letter alert` and the count, and counts it.
    /// Answers whether it raised it.
    pub fn record(&mut self, dead_letters: u64, queue: &str) -> bool {
        metrics::gauge!(DEAD_LETTERS_GAUGE, "queue" => queue.to_owned()).set(dead_letters as f64);
        if !self.observe(dead_letters) {
            return false;
        }
        metrics::counter!(ALERTS_COUNTER, "queue" => queue.to_owned()).increment(1);
        let threshold = self.threshold;
        tracing::error!(
            dead_letters,
            threshold,
            queue,
            "dead-letter alert: {dead_letters} dead letters in {queue}, more than {threshold}; \
             read them with `payments-consumer dead-letters`, fix the cause, then `redrive`"
        );
        true
    }
}

/// Counts the dead-letter queue every [`WATCH_INTERVAL`] and
/// [`record`](DeadLetterAlarm::record)s the count. Ends only on a broker
/// error.
pub(crate) async fn watch(
    channel: Channel,
    topology: Topology,
    threshold: u64,
) -> Result<(), ConsumerError> {
    let queue = topology.dead_letter_queue();
    let mut alarm = DeadLetterAlarm::new(threshold);
    let mut ticks = tokio::time::interval(WATCH_INTERVAL);
    loop {
        ticks.tick().await;
        let dead_letters = u64::from(Topology::ready(&channel, &queue).await?);
        alarm.record(dead_letters, &queue);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    use super::*;

    /// Every counter into one atomic, every gauge into another.
    #[derive(Default)]
    struct Totals {
        alerts: Arc<AtomicU64>,
        gauge: Arc<AtomicU64>,
        names: std::sync::Mutex<Vec<String>>,
    }

    impl Recorder for Totals {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            self.names.lock().unwrap().push(shown(key));
            Counter::from_arc(self.alerts.clone())
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            self.names.lock().unwrap().push(shown(key));
            Gauge::from_arc(self.gauge.clone())
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// `name{label=value,…}`.
    fn shown(key: &Key) -> String {
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }

    #[test]
    fn each_crossing_counts_one_alert_and_the_gauge_follows_the_count() {
        let totals = Totals::default();
        let mut alarm = DeadLetterAlarm::new(10);
        let raised = metrics::with_local_recorder(&totals, || {
            [5, 11, 12, 9, 11].map(|n| alarm.record(n, "payments.dlq"))
        });
        assert_eq!(raised, [false, true, false, false, true]);
        assert_eq!(totals.alerts.load(Ordering::Relaxed), 2);
        assert_eq!(f64::from_bits(totals.gauge.load(Ordering::Relaxed)), 11.0);
        let names = totals.names.lock().unwrap();
        assert!(
            names.contains(&format!("{ALERTS_COUNTER}{{queue=payments.dlq}}")),
            "{names:?}"
        );
        assert!(
            names.contains(&format!("{DEAD_LETTERS_GAUGE}{{queue=payments.dlq}}")),
            "{names:?}"
        );
    }
}
