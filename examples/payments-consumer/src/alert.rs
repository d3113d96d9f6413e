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
}

/// Counts the dead-letter queue every [`WATCH_INTERVAL`], sets the gauge, and
/// on each crossing logs an error with `dead-letter alert` and the count, and
/// counts it. Ends only on a broker error.
pub(crate) async fn watch(
    channel: Channel,
    topology: Topology,
    threshold: u64,
) -> Result<(), ConsumerError> {
    let queue = topology.dead_letter_queue();
    let gauge = metrics::gauge!(DEAD_LETTERS_GAUGE, "queue" => queue.clone());
    let alerts = metrics::counter!(ALERTS_COUNTER, "queue" => queue.clone());
    let mut alarm = DeadLetterAlarm::new(threshold);
    let mut ticks = tokio::time::interval(WATCH_INTERVAL);
    loop {
        ticks.tick().await;
        let dead_letters = u64::from(Topology::ready(&channel, &queue).await?);
        gauge.set(dead_letters as f64);
        if alarm.observe(dead_letters) {
            alerts.increment(1);
            tracing::error!(
                dead_letters,
                threshold,
                queue = %queue,
                "dead-letter alert: {dead_letters} dead letters in {queue}, more than {threshold}; \
                 read them with `payments-consumer dead-letters`, fix the cause, then `redrive`"
            );
        }
    }
}
