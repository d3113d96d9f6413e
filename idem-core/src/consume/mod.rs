//! The consumer protocol: what an at-least-once consumer does with each
//! delivery, decided in one place for every broker.
//!
//! Every broker redelivers what was not acknowledged (a crash between the
//! effect and the ack, a lost ack, a rebalance), and producers that retry
//! publish twice. A consumer that applies an effect must therefore apply each
//! message **once per message id**, whatever number of times it arrives. This
//! module plays for consumers the role [`protocol`](crate::protocol) plays for
//! HTTP: broker crates (idem-rabbitmq) translate a delivery into a
//! [`Message`], ask [`Protocol::decide`] what to do, and carry out the
//! [`Decision`] on their broker.
//!
//! # What is decided
//!
//! | the inbox says | the decision |
//! |---|---|
//! | applied now (the handler's writes and the inbox row committed together) | [`Decision::Ack`] |
//! | applied before, same body | [`Decision::Ack`] (a duplicate: nothing ran) |
//! | applied before, another body under the id | [`Decision::DeadLetter`], reason `message-id-reused`, at once |
//! | the handler failed, a retry can help, attempts left | [`Decision::Retry`] after [`Backoff::delay`](crate::retry::Backoff::delay) (full jitter) |
//! | the handler failed on the last attempt, or can never succeed | [`Decision::DeadLetter`] with the reason and every attempt's time |
//! | a dead letter, not yet in the dead-letter queue (a crash came between) | [`Decision::DeadLetter`] |
//! | a dead letter already in the dead-letter queue (a producer resent it) | [`Decision::Ack`]: it is not published twice |
//! | the inbox is unavailable | [`Decision::Requeue`]: back to the broker after a pause, not counted; or held until the inbox is back ([`Protocol::decide_holding`]) |
//!
//! A message marked re-driven ([`Message::redriven`]: a broker crate's
//! redrive sets a header that says so) has its dead letter forgotten first,
//! so it runs again from attempt 1.
//!
//! A message without an id is dead-lettered at once (reason `no-message-id`)
//! unless the policy keys it by its body ([`MissingId`]). One whose id is
//! there but cannot be read ([`Message::id_problem`]: not UTF-8, two that
//! differ) is dead-lettered at once, whatever the policy
//! ([`UNREADABLE_MESSAGE_ID`], [`AMBIGUOUS_MESSAGE_ID`]). An id over
//! [`MAX_MESSAGE_ID_LEN`] bytes is keyed by its SHA-256.
//!
//! # One dead-letter truth
//!
//! The **inbox** is the record of which messages are dead and why: the
//! attempts, their times, the reason, whether the letter reached the broker's
//! dead-letter queue. It is updated in the same step that counts the last
//! failure, so the count the alert reads is exact (concurrent buries see
//! different counts, so each crossing alerts once) and the "published" mark
//! makes a dead letter reach the queue once, whether a crash came between the
//! steps or a producer resent the message. Messages refused before any
//! handler ran (no id, an id reused) are recorded there too, so the inbox's
//! count and the queue's depth agree. The broker's **dead-letter queue**
//! carries the bodies (an inbox never stores a body): listing shows them from
//! there, and re-driving goes through the library, which forgets the inbox's
//! record ([`Protocol::redrive`]) before it moves the body back.
//!
//! # Running deliveries
//!
//! Every broker crate runs its deliveries in one loop, [`runner::Runner`]:
//! up to the consumer's concurrency at once, nothing more taken while a
//! delivery is held through an inbox outage ([`Outage`]), a graceful stop
//! that lets the running ones finish within the shutdown timeout. The broker
//! crate says only how it takes deliveries ([`runner::Intake`]) and how it
//! settles one.
//!
//! # Batches
//!
//! A [`BatchHandler`] applies several messages on one transaction, one
//! commit ([`Protocol::decide_batch`], [`Inbox::process_batch`]; the broker
//! crates' `ConsumerBuilder::batch_handler`). A failure inside a batch is
//! nobody's until it is alone: the batch is rolled back uncounted, split in
//! two and each half decided, the earlier first, so a poison message ends
//! alone and is retried and dead-lettered after exactly its attempts, and
//! its neighbours are applied once. A partition's records go in order, each
//! batch with one move of the position ([`Protocol::decide_batch_advancing`]).
//!
//! # Positions
//!
//! A partitioned broker (Kafka) reads from a position per partition. An inbox
//! that keeps those positions too ([`Positions`]) moves them in the
//! handler's transaction, fenced against a member that lost the partition
//! ([`Advance`]), so the effect, the inbox row and the position commit
//! together on any inbox that implements it.
//!
//! # Observability
//!
//! One `idem.message` span per delivery, with the consumer and the message id
//! redacted as keys are (never the body). With the feature `metrics`:
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idem_messages_total` | counter | `outcome` | deliveries by outcome: `processed`, `duplicate`, `retried`, `dead_lettered`, `dead_letter_skipped`, `requeued` |
//! | `idem_message_handler_seconds` | histogram | | time the handler ran |
//! | `idem_dead_letters` | gauge | `consumer` | the consumer's dead letters |
//! | `idem_dead_letter_alerts_total` | counter | `consumer` | crossings of the alert threshold |

mod batch;
mod handler;
mod inbox;
mod memory;
mod message;
mod metrics;
mod outage;
mod policy;
mod positions;
pub mod runner;
mod store_inbox;

#[cfg(feature = "test-util")]
pub mod conformance;

pub use batch::{
    Advanced, Batch, BatchEntry, BatchHandler, Batched, Each, PartitionBatch, batch_handler, each,
};
pub use handler::{ErrorKind, Handler, HandlerError, HandlerFuture, handler};
pub use inbox::{
    Buried, Counted, DeadLetter, Entered, Entry, Failure, Inbox, InboxError, InboxFuture,
};
pub use memory::MemoryInbox;
pub use message::{Attempt, MAX_MESSAGE_ID_LEN, Message, id_text, parse_rfc3339, rfc3339};
pub use outage::{Outage, StopSignal, held_wait};
pub use policy::{ConsumerPolicy, DeadLetterAlert, MissingId};
pub use positions::{Advance, PartitionLost, Positions};
pub use store_inbox::StoreInbox;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tracing::Instrument;

use crate::Redacted;
use crate::log::bounded;
use handler::Guarded;
use metrics::Outcome;

/// The reason of a message dead-lettered because it has no id.
pub const NO_MESSAGE_ID: &str = "no-message-id";
/// The reason of a message dead-lettered because its id is not UTF-8.
pub const UNREADABLE_MESSAGE_ID: &str = "unreadable-message-id";
/// The reason of a message dead-lettered because it carries two ids that
/// differ.
pub const AMBIGUOUS_MESSAGE_ID: &str = "ambiguous-message-id";
/// The reason of a message dead-lettered because its id was applied before to
/// another message.
pub const MESSAGE_ID_REUSED: &str = "message-id-reused";

/// The consumer protocol over an inbox, for one consumer: cheap to clone.
pub struct Protocol<I: Inbox> {
    inner: Arc<Inner<I>>,
}

struct Inner<I> {
    consumer: String,
    inbox: I,
    policy: ConsumerPolicy,
}

/// What a broker crate does with a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Decision {
    /// Acknowledge it: it was applied, now or before.
    Ack(Acked),
    /// Acknowledge it after putting a copy back on the queue for
    /// `retry.delay` (a delay that blocks no other message).
    Retry(Retry),
    /// Publish it to the dead-letter queue (with the letter's reason and
    /// attempt times), wait for the broker's confirmation, call
    /// [`Protocol::published`], then acknowledge it.
    DeadLetter(Letter),
    /// Hand it back to the broker (not acknowledged) after `after`: the
    /// inbox is unavailable, nothing ran or was counted.
    Requeue {
        /// The pause before handing it back.
        after: Duration,
    },
}

/// Why a delivery is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acked {
    /// Applied now, on this attempt.
    Processed {
        /// The attempt that succeeded (1 for the first).
        attempt: u32,
    },
    /// Applied before: nothing ran.
    Duplicate,
    /// A dead letter already in the dead-letter queue: nothing ran.
    DeadLetter,
}

/// A retry, as decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retry {
    /// The inbox's key of the message.
    pub message_id: String,
    /// How many attempts failed so far.
    pub attempts: u32,
    /// The delay before the next attempt (full jitter).
    pub delay: Duration,
    /// Why the last attempt failed.
    pub reason: String,
}

/// A dead letter to publish, as decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Letter {
    /// The inbox's key of the message.
    pub message_id: String,
    /// Why it is dead: the last error, or [`NO_MESSAGE_ID`],
    /// [`MESSAGE_ID_REUSED`].
    pub reason: String,
    /// When each failed attempt started, in order.
    pub attempted_at: Vec<SystemTime>,
}

impl<I: Inbox> Protocol<I> {
    /// The protocol of `consumer` (its name in the inbox: each consumer of a
    /// message applies it once) over `inbox`, applying `policy`.
    pub fn new(consumer: impl Into<String>, inbox: I, policy: ConsumerPolicy) -> Self {
        Self {
            inner: Arc::new(Inner {
                consumer: consumer.into(),
                inbox,
                policy,
            }),
        }
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    /// The inbox.
    pub fn inbox(&self) -> &I {
        &self.inner.inbox
    }

    /// Whether the inbox may take messages ([`Inbox::readiness`]): what a
    /// broker crate's consumer asks when it starts, refusing to run otherwise.
    pub fn readiness(&self) -> Result<(), crate::store::NotReady> {
        self.inner.inbox.readiness()
    }

    /// The policy.
    pub fn policy(&self) -> &ConsumerPolicy {
        &self.inner.policy
    }

    /// Decides what to do with `message`: runs `handler` on the inbox's
    /// transaction if the message is new, records what happened, and answers
    /// what the broker crate must do (see the module's table).
    pub async fn decide(&self, message: &Message, handler: &(dyn Handler<I::Tx> + '_)) -> Decision {
        self.decide_entering(message, handler, &Plain).await
    }

    /// [`decide`](Self::decide) for a partition's record: the handler runs
    /// on the transaction that moves the partition's position as `advance`
    /// says ([`Positions::process_advancing`]). Fenced, the inbox answers
    /// [`Entered::Failed`] with [`PartitionLost`], which this decides as any
    /// failed attempt: the broker crate's inbox wrapper turns it into what it
    /// does for a partition lost (idem-kafka: stop applying it, uncounted).
    pub async fn decide_advancing(
        &self,
        message: &Message,
        advance: &Advance<'_>,
        handler: &(dyn Handler<I::Tx> + '_),
    ) -> Decision
    where
        I: Positions,
    {
        self.decide_entering(message, handler, &Advancing(advance))
            .await
    }

    async fn decide_entering(
        &self,
        message: &Message,
        handler: &(dyn Handler<I::Tx> + '_),
        enter: &impl Enter<I>,
    ) -> Decision {
        let consumer = self.consumer();
        let key = Self::key_of(message);
        let span = tracing::info_span!(
            target: "idem",
            "idem.message",
            consumer = %bounded(consumer),
            message_id = %Redacted::of(&key),
        );
        let entry = Entry {
            consumer,
            message_id: &key,
            fingerprint: message.fingerprint(),
            at: SystemTime::now(),
        };
        async {
            if let Some(reason) = self.refused(message) {
                return self.refuse(&entry, reason).await;
            }
            if message.is_redriven()
                && let Err(error) = self.redrive(entry.message_id).await
            {
                return self.unavailable(Some(error));
            }
            self.process(&entry, message, handler, enter).await
        }
        .instrument(span)
        .await
    }

    async fn process(
        &self,
        entry: &Entry<'_>,
        message: &Message,
        handler: &(dyn Handler<I::Tx> + '_),
        enter: &impl Enter<I>,
    ) -> Decision {
        let entered = enter
            .enter(self.inbox(), entry, message, &Guarded(handler))
            .await;
        match entered {
            Ok(entered) => self.settle(entry, entered).await,
            Err(error) => self.unavailable(Some(error)),
        }
    }

    /// Decides what the inbox answered for a message.
    async fn settle(&self, entry: &Entry<'_>, entered: Entered) -> Decision {
        match entered {
            Entered::Processed { attempt } => {
                tracing::debug!(target: "idem", outcome = "processed", attempt);
                metrics::outcome(Outcome::Processed);
                Decision::Ack(Acked::Processed { attempt })
            }
            Entered::Duplicate => {
                tracing::debug!(target: "idem", outcome = "duplicate");
                metrics::outcome(Outcome::Duplicate);
                Decision::Ack(Acked::Duplicate)
            }
            Entered::Reused => {
                tracing::warn!(target: "idem", reason = MESSAGE_ID_REUSED, "a different message under an id already applied: dead-lettered, not applied");
                self.bury(entry, MESSAGE_ID_REUSED, 1).await
            }
            Entered::Dead { published: true } => {
                tracing::info!(target: "idem", outcome = "dead_letter_skipped", "a dead letter arrived again; it is in the dead-letter queue already");
                metrics::outcome(Outcome::DeadLetterSkipped);
                Decision::Ack(Acked::DeadLetter)
            }
            Entered::Dead { published: false } => self.republish(entry).await,
            Entered::Failed { attempt, error } => {
                let permanent = self.is_permanent(&error);
                let reason = error.reason();
                let bury_at = if permanent {
                    1
                } else {
                    self.policy().get_max_attempts()
                };
                tracing::info!(target: "idem", attempt, permanent, error = %bounded(&reason), "the handler failed; its writes were rolled back");
                self.failed(entry, &reason, bury_at).await
            }
        }
    }

    /// Why `message` is dead-lettered before any handler runs, if it is: its
    /// id cannot be read, or it has none and the policy does not key it by
    /// its body.
    fn refused(&self, message: &Message) -> Option<&'static str> {
        if let Some(reason) = message.get_id_problem() {
            return Some(reason);
        }
        (message.message_id().is_none() && self.policy().get_missing_id() == MissingId::Refuse)
            .then_some(NO_MESSAGE_ID)
    }

    /// Dead-letters a message [`refused`](Self::refused) for `reason`.
    async fn refuse(&self, entry: &Entry<'_>, reason: &'static str) -> Decision {
        if reason == NO_MESSAGE_ID {
            tracing::warn!(target: "idem", reason, "a message without an id cannot be applied exactly once: dead-lettered");
        } else {
            tracing::warn!(target: "idem", reason, "a message whose id cannot be read cannot be applied exactly once: dead-lettered");
        }
        self.bury(entry, reason, 1).await
    }

    /// Whether a failed attempt can never succeed.
    fn is_permanent(&self, error: &HandlerError) -> bool {
        match error.kind() {
            ErrorKind::Permanent => true,
            ErrorKind::Transient | ErrorKind::Panicked => false,
            ErrorKind::Unclassified => {
                let source: &(dyn std::error::Error + 'static) = error.source_error();
                self.policy().classifies_permanent(source) || self.inbox().is_permanent(source)
            }
        }
    }

    /// Buries the message at once with `reason`.
    async fn bury(&self, entry: &Entry<'_>, reason: &str, bury_at: u32) -> Decision {
        self.failed(entry, reason, bury_at).await
    }

    /// Counts a failure and decides: retry, or dead-letter.
    async fn failed(&self, entry: &Entry<'_>, reason: &str, bury_at: u32) -> Decision {
        let failure = Failure { reason, bury_at };
        let counted = match self.inbox().fail(entry, &failure).await {
            Ok(counted) => counted,
            Err(error) => return self.unavailable(Some(error)),
        };
        match counted.buried {
            None => {
                let delay = self.policy().get_backoff().delay(counted.attempts);
                tracing::info!(target: "idem", outcome = "retried", attempts = counted.attempts, max_attempts = self.policy().get_max_attempts(), delay_ms = delay.as_millis() as u64, "retried after a full-jitter delay");
                metrics::outcome(Outcome::Retried);
                Decision::Retry(Retry {
                    message_id: entry.message_id.to_owned(),
                    attempts: counted.attempts,
                    delay,
                    reason: reason.to_owned(),
                })
            }
            Some(Buried::Already { published: true }) => {
                metrics::outcome(Outcome::DeadLetterSkipped);
                Decision::Ack(Acked::DeadLetter)
            }
            Some(Buried::Already { published: false }) => self.republish(entry).await,
            Some(Buried::New { dead_letters }) => {
                tracing::warn!(target: "idem", outcome = "dead_lettered", attempts = counted.attempts, dead_letters, reason = %bounded(reason), "the message is a dead letter");
                metrics::outcome(Outcome::DeadLettered);
                metrics::dead_letters(self.consumer(), dead_letters);
                self.alert_if_crossing(dead_letters);
                Decision::DeadLetter(Letter {
                    message_id: entry.message_id.to_owned(),
                    reason: reason.to_owned(),
                    attempted_at: counted.attempted_at,
                })
            }
        }
    }

    /// A dead letter that did not reach the dead-letter queue (a crash came
    /// between): it goes there now, as recorded.
    async fn republish(&self, entry: &Entry<'_>) -> Decision {
        match self
            .inbox()
            .dead_letter(entry.consumer, entry.message_id)
            .await
        {
            Ok(Some(letter)) => {
                tracing::info!(target: "idem", outcome = "dead_lettered", "a dead letter not yet in the dead-letter queue goes there");
                metrics::outcome(Outcome::DeadLettered);
                Decision::DeadLetter(Letter {
                    message_id: letter.message_id,
                    reason: letter.reason,
                    attempted_at: letter.attempted_at,
                })
            }
            // Re-driven in between: it is no longer dead; the broker
            // delivers it again and it runs.
            Ok(None) => self.unavailable(None),
            Err(error) => self.unavailable(Some(error)),
        }
    }

    fn alert_if_crossing(&self, dead_letters: u64) {
        let threshold = self.policy().get_dead_letter_threshold();
        if dead_letters != threshold.saturating_add(1) {
            return;
        }
        let consumer = self.consumer();
        tracing::error!(target: "idem", consumer = %bounded(consumer), dead_letters, threshold, "dead-letter alert: {dead_letters} dead letters, over the threshold of {threshold}");
        metrics::alert(consumer);
        self.policy().alert(&DeadLetterAlert {
            consumer: consumer.to_owned(),
            dead_letters,
            threshold,
        });
    }

    fn unavailable(&self, error: Option<InboxError>) -> Decision {
        let after = self.policy().get_unavailable_pause();
        match error {
            Some(error) => {
                tracing::error!(target: "idem", outcome = "requeued", error = %crate::log::error_chain(&error), "the inbox is unavailable: the delivery goes back to the broker, uncounted");
            }
            None => {
                tracing::info!(target: "idem", outcome = "requeued", "the delivery goes back to the broker")
            }
        }
        metrics::outcome(Outcome::Requeued);
        Decision::Requeue { after }
    }

    /// Records that the dead letter reached the dead-letter queue (the broker
    /// confirmed it), so that a redelivery of the message is acknowledged
    /// without publishing it twice. A failure is logged: the next delivery
    /// publishes it again.
    pub async fn published(&self, letter: &Letter) {
        if let Err(error) = self
            .inbox()
            .published(self.consumer(), &letter.message_id)
            .await
        {
            tracing::warn!(target: "idem", message_id = %Redacted::of(&letter.message_id), error = %crate::log::error_chain(&error), "could not mark the dead letter published; a redelivery publishes it again");
        }
    }

    /// The consumer's dead letters, as the inbox records them, oldest first.
    pub async fn dead_letters(&self) -> Result<Vec<DeadLetter>, InboxError> {
        self.inbox().dead_letters(self.consumer()).await
    }

    /// Forgets the dead letter `message_id` (its key: the id, as
    /// [`Attempt::key`] gives it) so that its next delivery runs with
    /// attempt 1; answers what was forgotten. The broker crate moves the body
    /// back after this.
    pub async fn redrive(&self, message_id: &str) -> Result<Option<DeadLetter>, InboxError> {
        let consumer = self.consumer();
        let forgotten = self.inbox().redrive(consumer, message_id).await?;
        if let Some(letter) = &forgotten {
            tracing::info!(target: "idem", consumer = %bounded(consumer), message_id = %Redacted::of(message_id), attempts = letter.attempts, "dead letter re-driven");
            #[cfg(feature = "metrics")]
            if let Ok(letters) = self.inbox().dead_letters(consumer).await {
                metrics::dead_letters(consumer, letters.len() as u64);
            }
        }
        Ok(forgotten)
    }

    /// The key the inbox files `message` under: its id, a digest of a long id,
    /// or (no id) a digest of its body.
    pub fn key_of(message: &Message) -> String {
        match message.message_id() {
            Some(id) => message::key_of_id(id),
            None => message::digest_key(message.body()),
        }
    }
}

impl<I: Inbox> Clone for Protocol<I> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<I: Inbox> fmt::Debug for Protocol<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Protocol")
            .field("consumer", &self.inner.consumer)
            .field("policy", &self.inner.policy)
            .finish_non_exhaustive()
    }
}

/// How [`Protocol`] hands a new message to its inbox: [`Inbox::process`],
/// or [`Positions::process_advancing`] for a partition's record.
trait Enter<I: Inbox> {
    fn enter<'a>(
        &'a self,
        inbox: &'a I,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<I::Tx> + 'a),
    ) -> InboxFuture<'a, Entered>;
}

/// [`Inbox::process`].
struct Plain;

impl<I: Inbox> Enter<I> for Plain {
    fn enter<'a>(
        &'a self,
        inbox: &'a I,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<I::Tx> + 'a),
    ) -> InboxFuture<'a, Entered> {
        inbox.process(entry, message, handler)
    }
}

/// [`Positions::process_advancing`] with this move.
struct Advancing<'x>(&'x Advance<'x>);

impl<I: Positions> Enter<I> for Advancing<'_> {
    fn enter<'a>(
        &'a self,
        inbox: &'a I,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<I::Tx> + 'a),
    ) -> InboxFuture<'a, Entered> {
        inbox.process_advancing(entry, message, self.0, handler)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    use super::conformance::Untransacted;
    use super::*;
    use crate::retry::Backoff;

    async fn fresh() -> Untransacted<MemoryInbox> {
        Untransacted::new(MemoryInbox::new())
    }

    mod memory_inbox_conformance {
        use super::fresh;
        crate::inbox_conformance_tests!(fresh);
    }

    async fn fresh_memory() -> MemoryInbox {
        MemoryInbox::new()
    }

    mod memory_inbox_positions_conformance {
        use super::fresh_memory;
        crate::positions_conformance_tests!(fresh_memory);
    }

    /// A [`StoreInbox`] over a [`MemoryStore`](crate::MemoryStore).
    async fn fresh_over_store() -> Untransacted<StoreInbox> {
        Untransacted::new(StoreInbox::new(crate::MemoryStore::new()))
    }

    mod store_inbox_conformance {
        use super::fresh_over_store;
        crate::inbox_conformance_tests!(fresh_over_store);
    }

    fn policy() -> ConsumerPolicy {
        ConsumerPolicy::new().max_attempts(3).backoff(Backoff::new(
            Duration::from_millis(100),
            Duration::from_secs(1),
        ))
    }

    fn protocol(policy: ConsumerPolicy) -> Protocol<MemoryInbox> {
        Protocol::new("payments", MemoryInbox::new(), policy)
    }

    /// Counts its runs; fails with `fail` while it is set.
    struct Counting {
        runs: AtomicU32,
        fail: Option<fn() -> HandlerError>,
    }

    impl Counting {
        fn ok() -> Self {
            Self {
                runs: AtomicU32::new(0),
                fail: None,
            }
        }
        fn failing(fail: fn() -> HandlerError) -> Self {
            Self {
                runs: AtomicU32::new(0),
                fail: Some(fail),
            }
        }
    }

    impl Handler<()> for Counting {
        fn handle<'a>(&'a self, _attempt: Attempt<'a>, _tx: &'a mut ()) -> HandlerFuture<'a> {
            Box::pin(async move {
                self.runs.fetch_add(1, Ordering::SeqCst);
                match self.fail {
                    Some(fail) => Err(fail()),
                    None => Ok(()),
                }
            })
        }
    }

    #[tokio::test]
    async fn a_message_is_acked_once_applied_and_its_redelivery_is_a_duplicate() {
        let protocol = protocol(policy());
        let handler = Counting::ok();
        let message = Message::new("{}").id("m-1");
        assert_eq!(
            protocol.decide(&message, &handler).await,
            Decision::Ack(Acked::Processed { attempt: 1 })
        );
        assert_eq!(
            protocol.decide(&message, &handler).await,
            Decision::Ack(Acked::Duplicate)
        );
        assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_failing_message_is_retried_then_dead_lettered_after_exactly_max_attempts() {
        let protocol = protocol(policy());
        let handler = Counting::failing(|| HandlerError::from("the ledger is down"));
        let message = Message::new("{}").id("m-2");
        for attempts in 1..=2 {
            match protocol.decide(&message, &handler).await {
                Decision::Retry(retry) => {
                    assert_eq!(retry.attempts, attempts);
                    assert!(
                        retry.delay
                            <= Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
                                .ceiling(attempts)
                    );
                    assert_eq!(retry.reason, "the ledger is down");
                }
                other => panic!("attempt {attempts} is retried, got {other:?}"),
            }
        }
        let Decision::DeadLetter(letter) = protocol.decide(&message, &handler).await else {
            panic!("the third failure dead-letters it");
        };
        assert_eq!(
            (letter.reason.as_str(), letter.attempted_at.len()),
            ("the ledger is down", 3)
        );
        assert_eq!(handler.runs.load(Ordering::SeqCst), 3);
        // Not yet published (a crash before the broker confirmed): it goes again.
        assert!(matches!(
            protocol.decide(&message, &handler).await,
            Decision::DeadLetter(_)
        ));
        protocol.published(&letter).await;
        assert_eq!(
            protocol.decide(&message, &handler).await,
            Decision::Ack(Acked::DeadLetter),
            "a dead letter in the queue already is not published twice"
        );
        assert_eq!(
            handler.runs.load(Ordering::SeqCst),
            3,
            "a dead letter never runs"
        );
    }

    #[tokio::test]
    async fn permanent_errors_and_panics_are_told_apart() {
        let protocol = protocol(policy());
        let permanent = Counting::failing(|| HandlerError::permanent("amount must be positive"));
        let decision = protocol
            .decide(&Message::new("{}").id("m-3"), &permanent)
            .await;
        assert!(
            matches!(decision, Decision::DeadLetter(ref l) if l.attempted_at.len() == 1),
            "{decision:?}"
        );

        let panicking =
            crate::consume::handler(|_attempt: Attempt<'_>, _tx: &mut ()| -> HandlerFuture<'_> {
                Box::pin(async { panic!("boom") })
            });
        let decision = protocol
            .decide(&Message::new("{}").id("m-4"), &panicking)
            .await;
        assert!(
            matches!(decision, Decision::Retry(ref r) if r.reason.contains("boom")),
            "a panic is retried like a transient error: {decision:?}"
        );

        let classified = Protocol::new(
            "payments",
            MemoryInbox::new(),
            policy().permanent_when(|error| error.to_string().contains("overflow")),
        );
        let overflow = Counting::failing(|| HandlerError::from("bigint overflow"));
        assert!(matches!(
            classified
                .decide(&Message::new("{}").id("m-5"), &overflow)
                .await,
            Decision::DeadLetter(_)
        ));
        let forced = Counting::failing(|| HandlerError::transient("overflow, but retry"));
        assert!(matches!(
            classified
                .decide(&Message::new("{}").id("m-6"), &forced)
                .await,
            Decision::Retry(_)
        ));
    }

    #[tokio::test]
    async fn a_message_without_an_id_or_with_a_reused_id_is_dead_lettered_at_once() {
        let protocol = protocol(policy());
        let handler = Counting::ok();
        let Decision::DeadLetter(letter) = protocol.decide(&Message::new("{}"), &handler).await
        else {
            panic!("no id: dead-lettered");
        };
        assert_eq!(letter.reason, NO_MESSAGE_ID);
        assert!(letter.message_id.starts_with("sha256:"));

        assert!(matches!(
            protocol
                .decide(&Message::new("amount 5").id("m-7"), &handler)
                .await,
            Decision::Ack(Acked::Processed { attempt: 1 })
        ));
        let Decision::DeadLetter(letter) = protocol
            .decide(&Message::new("amount 7").id("m-7"), &handler)
            .await
        else {
            panic!("a reused id: dead-lettered");
        };
        assert_eq!(
            (letter.reason.as_str(), letter.message_id.as_str()),
            (MESSAGE_ID_REUSED, "m-7")
        );
        assert_eq!(handler.runs.load(Ordering::SeqCst), 1);

        let by_body = Protocol::new(
            "p",
            MemoryInbox::new(),
            policy().missing_id(MissingId::KeyByBody),
        );
        assert!(matches!(
            by_body.decide(&Message::new("x"), &handler).await,
            Decision::Ack(Acked::Processed { .. })
        ));
        assert!(matches!(
            by_body.decide(&Message::new("x"), &handler).await,
            Decision::Ack(Acked::Duplicate)
        ));
        // An id there but unreadable is dead-lettered even when keying by
        // the body is allowed.
        let Decision::DeadLetter(letter) = by_body
            .decide(
                &Message::new("y").id_problem(AMBIGUOUS_MESSAGE_ID),
                &handler,
            )
            .await
        else {
            panic!("an ambiguous id: dead-lettered");
        };
        assert_eq!(letter.reason, AMBIGUOUS_MESSAGE_ID);
        assert_eq!(handler.runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_batch_dead_letters_its_refusals_alone_and_applies_the_rest() {
        let protocol = protocol(policy());
        let runs = AtomicU32::new(0);
        let each = super::each(handler(
            |_attempt: Attempt<'_>, _tx: &mut ()| -> HandlerFuture<'_> {
                runs.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(()) })
            },
        ));
        let batch = [
            Message::new("{}"),
            Message::new("{}").id("b-1"),
            Message::new("{\"n\": 2}").id_problem(AMBIGUOUS_MESSAGE_ID),
            Message::new("{}").id("b-2"),
        ];
        let decisions = protocol.decide_batch(&batch, &each).await;
        let reasons: Vec<Option<&str>> = decisions
            .iter()
            .map(|decision| match decision {
                Decision::DeadLetter(letter) => Some(letter.reason.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(
            reasons,
            [Some(NO_MESSAGE_ID), None, Some(AMBIGUOUS_MESSAGE_ID), None]
        );
        assert_eq!(decisions[1], Decision::Ack(Acked::Processed { attempt: 1 }));
        assert_eq!(decisions[3], Decision::Ack(Acked::Processed { attempt: 1 }));
        assert_eq!(runs.load(Ordering::SeqCst), 2, "the refused never ran");
    }

    #[tokio::test]
    async fn a_message_marked_redriven_runs_again_from_attempt_one() {
        let protocol = protocol(policy());
        let failing = Counting::failing(|| HandlerError::permanent("a bug"));
        let message = Message::new("{}").id("m-8");
        let Decision::DeadLetter(letter) = protocol.decide(&message, &failing).await else {
            panic!("dead-lettered");
        };
        protocol.published(&letter).await;
        let fixed = Counting::ok();
        assert_eq!(
            protocol.decide(&message, &fixed).await,
            Decision::Ack(Acked::DeadLetter),
            "unmarked, it is still a dead letter"
        );
        let redriven = message.clone().redriven(true);
        assert_eq!(
            protocol.decide(&redriven, &fixed).await,
            Decision::Ack(Acked::Processed { attempt: 1 })
        );
        assert_eq!(
            protocol.decide(&redriven, &fixed).await,
            Decision::Ack(Acked::Duplicate),
            "a redelivery of the re-driven message is a duplicate"
        );
        assert_eq!(fixed.runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_memory_inbox_entry_abandoned_midway_runs_again() {
        let protocol = protocol(policy());
        let stuck = handler(|_attempt: Attempt<'_>, _tx: &mut ()| -> HandlerFuture<'_> {
            Box::pin(std::future::pending())
        });
        let message = Message::new("{}").id("m-9");
        let abandoned =
            tokio::time::timeout(Duration::from_millis(20), protocol.decide(&message, &stuck))
                .await;
        assert!(abandoned.is_err(), "the stuck handler is cut off");
        let fixed = Counting::ok();
        let decided =
            tokio::time::timeout(Duration::from_secs(5), protocol.decide(&message, &fixed)).await;
        assert_eq!(
            decided.ok(),
            Some(Decision::Ack(Acked::Processed { attempt: 1 })),
            "a later delivery runs instead of waiting for the abandoned one"
        );
    }

    #[tokio::test]
    async fn the_alert_is_raised_once_per_crossing() {
        let alerts = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&alerts);
        let protocol = protocol(policy().dead_letter_alert(2, move |alert| {
            assert_eq!((alert.dead_letters, alert.threshold), (3, 2));
            seen.fetch_add(1, Ordering::SeqCst);
        }));
        let handler = Counting::failing(|| HandlerError::permanent("no"));
        for i in 0..5 {
            let _ = protocol
                .decide(&Message::new("{}").id(format!("d-{i}")), &handler)
                .await;
        }
        assert_eq!(
            alerts.load(Ordering::SeqCst),
            1,
            "five dead letters over a threshold of 2: one alert"
        );
        for i in 0..3 {
            assert!(protocol.redrive(&format!("d-{i}")).await.unwrap().is_some());
        }
        for i in 0..3 {
            let _ = protocol
                .decide(&Message::new("{}").id(format!("d-{i}")), &handler)
                .await;
        }
        assert_eq!(
            alerts.load(Ordering::SeqCst),
            2,
            "back under, then over again: a second alert"
        );
    }
}
