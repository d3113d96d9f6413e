//! What a consumer does with failures: the consumer's policy.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::retry::Backoff;

/// How a consumer treats failures, built from [`ConsumerPolicy::new`]. The
/// defaults are `docs/contract.md`'s: 5 attempts, [`Backoff::for_consumers`]
/// (full jitter, first retry within 5 s, capped at 5 minutes), messages
/// without an id refused, an alert past 100 dead letters.
///
/// As on [`Policy`](crate::Policy), each setting is set by the method named
/// for it, which consumes and returns the policy, and read by `get_` and the
/// same name; the two callbacks ([`permanent_when`](Self::permanent_when), the
/// alert of [`dead_letter_alert`](Self::dead_letter_alert)) are not read back.
///
/// ```
/// use std::time::Duration;
/// use idem_core::consume::ConsumerPolicy;
/// use idem_core::retry::Backoff;
///
/// let policy = ConsumerPolicy::new()
///     .max_attempts(3)
///     .backoff(Backoff::new(Duration::from_millis(200), Duration::from_secs(60)))
///     .dead_letter_alert(10, |alert| eprintln!("dead-letter alert: {}", alert.dead_letters));
/// assert_eq!(policy.get_max_attempts(), 3);
/// assert_eq!(policy.get_dead_letter_threshold(), 10);
/// ```
#[derive(Clone)]
#[must_use]
pub struct ConsumerPolicy {
    max_attempts: u32,
    backoff: Backoff,
    permanent: Option<Arc<Classifier>>,
    missing_id: MissingId,
    dead_letter_threshold: u64,
    on_alert: Option<Arc<OnAlert>>,
    unavailable_pause: Duration,
}

type Classifier = dyn Fn(&(dyn StdError + 'static)) -> bool + Send + Sync;
type OnAlert = dyn Fn(&DeadLetterAlert) + Send + Sync;

/// What a message without an id gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingId {
    /// Dead-lettered at once (reason `no-message-id`): a redelivery could not
    /// be told from a new message. The default.
    Refuse,
    /// Keyed by the SHA-256 of its body: identical bodies are one message.
    /// Only for messages that can never be legitimately identical twice.
    KeyByBody,
}

/// Raised once each time the consumer's dead letters pass the threshold.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterAlert {
    /// The consumer.
    pub consumer: String,
    /// Its dead letters now.
    pub dead_letters: u64,
    /// The threshold they passed.
    pub threshold: u64,
}

impl ConsumerPolicy {
    /// The defaults.
    pub fn new() -> Self {
        Self {
            max_attempts: 5,
            backoff: Backoff::for_consumers(),
            permanent: None,
            missing_id: MissingId::Refuse,
            dead_letter_threshold: 100,
            on_alert: None,
            unavailable_pause: Duration::from_secs(1),
        }
    }

    /// Failed attempts after which a message is a dead letter (at least 1):
    /// with 3, the third failure buries it. Counted durably by the inbox, so
    /// a crash or a redelivery does not reset the count.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The delay before each retry: [`Backoff::delay`] of the attempts that
    /// failed so far.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Classifies an unclassified handler error as permanent when `predicate`
    /// says so (before the inbox's own knowledge of its database's errors).
    pub fn permanent_when(
        mut self,
        predicate: impl Fn(&(dyn StdError + 'static)) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.permanent = Some(Arc::new(predicate));
        self
    }

    /// What a message without an id gets (default [`MissingId::Refuse`]).
    pub fn missing_id(mut self, missing_id: MissingId) -> Self {
        self.missing_id = missing_id;
        self
    }

    /// Past `threshold` dead letters, `alert` is called (after an error line
    /// with `dead-letter alert` and the count is logged), once per crossing:
    /// by the dead letter that makes the count `threshold + 1`, again after
    /// re-drives bring it back and it crosses anew.
    pub fn dead_letter_alert(
        mut self,
        threshold: u64,
        alert: impl Fn(&DeadLetterAlert) + Send + Sync + 'static,
    ) -> Self {
        self.dead_letter_threshold = threshold;
        self.on_alert = Some(Arc::new(alert));
        self
    }

    /// The alert's threshold (default 100), keeping only the log line and the
    /// metric (or the alert set by [`dead_letter_alert`](Self::dead_letter_alert)).
    pub fn dead_letter_threshold(mut self, threshold: u64) -> Self {
        self.dead_letter_threshold = threshold;
        self
    }

    /// How long a delivery waits before it is handed back to the broker when
    /// the inbox is unavailable (default 1 s). Such a delivery is not counted
    /// as an attempt.
    pub fn unavailable_pause(mut self, pause: Duration) -> Self {
        self.unavailable_pause = pause;
        self
    }

    /// Failed attempts after which a message is a dead letter.
    pub fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The retry delays.
    pub fn get_backoff(&self) -> Backoff {
        self.backoff
    }

    /// What a message without an id gets.
    pub fn get_missing_id(&self) -> MissingId {
        self.missing_id
    }

    /// The dead-letter alert's threshold (set by
    /// [`dead_letter_threshold`](Self::dead_letter_threshold) or
    /// [`dead_letter_alert`](Self::dead_letter_alert)).
    pub fn get_dead_letter_threshold(&self) -> u64 {
        self.dead_letter_threshold
    }

    /// How long a delivery waits before it is handed back when the inbox is
    /// unavailable.
    pub fn get_unavailable_pause(&self) -> Duration {
        self.unavailable_pause
    }

    pub(crate) fn classifies_permanent(&self, error: &(dyn StdError + 'static)) -> bool {
        self.permanent.as_ref().is_some_and(|p| p(error))
    }

    pub(crate) fn alert(&self, alert: &DeadLetterAlert) {
        if let Some(on_alert) = &self.on_alert {
            on_alert(alert);
        }
    }
}

impl Default for ConsumerPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for ConsumerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerPolicy")
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("permanent_when", &self.permanent.is_some())
            .field("missing_id", &self.missing_id)
            .field("dead_letter_threshold", &self.dead_letter_threshold)
            .field("on_alert", &self.on_alert.is_some())
            .field("unavailable_pause", &self.unavailable_pause)
            .finish()
    }
}
