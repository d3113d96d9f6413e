//! Holding deliveries while the inbox is unavailable.
//!
//! Handing a delivery back to its broker is not free on every broker: each
//! receive of an SQS message counts against its queue's redrive policy
//! (`maxReceiveCount`), so a consumer that hands messages back through a
//! database outage sends healthy messages to the dead-letter queue; a
//! RabbitMQ requeue brings the delivery straight back to the same consumer.
//! So a broker crate that can keep a delivery (extend its lease, keep it
//! unacknowledged) holds it instead: [`Protocol::decide_holding`] waits out
//! the pause and decides again, and the consumer's receiving loop asks the
//! [`Outage`] before it takes anything more. An outage costs no attempt and
//! no receive anywhere; when the database is back, the held deliveries are
//! decided and the loop receives again by itself.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::{Decision, Handler, Inbox, Message, Protocol};

/// The shortest wait before a held delivery is decided again.
const FIRST_WAIT: Duration = Duration::from_millis(10);

/// How long a delivery the inbox could not take waits before it is decided
/// again, after waiting `last` (`None`: the first time), the `Requeue`'s
/// pause being `pause`: first a sixteenth of the pause (at least 10 ms: one
/// lost connection, or a COMMIT whose answer was lost, is over at once),
/// then twice the last wait, up to the pause (an outage). What
/// [`Protocol::decide_holding`] waits, and a broker crate that retries in
/// place (idem-kafka's partitions) too.
///
/// ```
/// use std::time::Duration;
/// use idem_core::consume::held_wait;
///
/// let pause = Duration::from_secs(1);
/// let first = held_wait(None, pause);
/// assert_eq!(first, Duration::from_micros(62_500));
/// assert_eq!(held_wait(Some(first), pause), Duration::from_millis(125));
/// assert_eq!(held_wait(Some(pause), pause), pause);
/// ```
pub fn held_wait(last: Option<Duration>, pause: Duration) -> Duration {
    last.map_or_else(
        || (pause / 16).max(FIRST_WAIT),
        |last| last.saturating_mul(2),
    )
    .min(pause)
}

/// How many deliveries a consumer holds because its inbox is unavailable,
/// shared by its tasks and its receiving loop (clones share it). While any
/// is held, the loop receives nothing more ([`Outage::is_on`]) and waits for
/// [`Outage::over`].
///
/// Why hold rather than hand back: handing a delivery back to its broker is
/// not free on every broker. Each receive of an SQS message counts against
/// its queue's redrive policy (`maxReceiveCount`), so a consumer that hands
/// messages back through a database outage sends healthy messages to the
/// dead-letter queue; a RabbitMQ requeue brings the delivery straight back
/// to the same consumer (and a quorum queue's `delivery-limit` counts it).
/// Held ([`Protocol::decide_holding`]), an outage costs no attempt and no
/// receive; when the database is back, the held deliveries are decided and
/// the loop receives again by itself.
#[derive(Clone, Debug)]
pub struct Outage {
    held: Arc<watch::Sender<usize>>,
}

impl Default for Outage {
    fn default() -> Self {
        Self::new()
    }
}

impl Outage {
    /// No delivery held.
    pub fn new() -> Self {
        Self {
            held: Arc::new(watch::Sender::new(0)),
        }
    }

    /// Whether a delivery is held because the inbox is unavailable: receive
    /// nothing more while so.
    pub fn is_on(&self) -> bool {
        *self.held.borrow() > 0
    }

    /// How many deliveries are held now.
    pub fn held(&self) -> usize {
        *self.held.borrow()
    }

    /// Resolves once a delivery is held (at once when one is): a take that
    /// can stop without losing anything (a subscription's next delivery)
    /// stops there, so that nothing new starts during an outage.
    pub async fn began(&self) {
        let mut held = self.held.subscribe();
        // The sender lives in `self`: the wait ends only by the count.
        let _ = held.wait_for(|&held| held > 0).await;
    }

    /// Resolves once no delivery is held (at once when none is).
    pub async fn over(&self) {
        let mut held = self.held.subscribe();
        // The sender lives in `self`: the wait ends only by the count.
        let _ = held.wait_for(|&held| held == 0).await;
    }

    pub(crate) fn hold(&self) -> Held<'_> {
        self.held.send_modify(|held| {
            *held += 1;
            if *held == 1 {
                tracing::warn!(target: "idem", "the inbox is unavailable: the consumer holds its deliveries and receives nothing more until it is back");
            }
        });
        Held { outage: self }
    }
}

/// A consumer's stop, as the tasks holding deliveries see it: set when it
/// shuts down (or its session with the broker ends), so that a delivery held
/// through an outage stops waiting ([`Protocol::decide_holding`]'s `stop`).
/// Clones share it.
#[derive(Clone, Debug)]
pub struct StopSignal {
    stopping: Arc<watch::Sender<bool>>,
}

impl Default for StopSignal {
    fn default() -> Self {
        Self::new()
    }
}

impl StopSignal {
    /// Not stopping.
    pub fn new() -> Self {
        Self {
            stopping: Arc::new(watch::Sender::new(false)),
        }
    }

    /// Sets it (`true`: stopping) or clears it (a new run or session).
    pub fn set(&self, stopping: bool) {
        self.stopping.send_replace(stopping);
    }

    /// Whether it is set.
    pub fn is_set(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Resolves once it is set (at once when it is).
    pub async fn stopped(&self) {
        let mut stopping = self.stopping.subscribe();
        // The sender lives in `self`: the wait ends only when it is set.
        let _ = stopping.wait_for(|&stopping| stopping).await;
    }
}

/// One delivery held; dropped (however the wait ends), it is not.
pub(crate) struct Held<'a> {
    outage: &'a Outage,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.outage.held.send_modify(|held| {
            *held = held.saturating_sub(1);
            if *held == 0 {
                tracing::info!(target: "idem", "the inbox answers again: the consumer receives again");
            }
        });
    }
}

impl<I: Inbox> Protocol<I> {
    /// [`decide`](Protocol::decide), holding the delivery while the inbox is
    /// unavailable: where `decide` answers [`Decision::Requeue`], this waits
    /// and decides again, `outage` counting the delivery as held meanwhile,
    /// until another decision comes. The first wait is short (a sixteenth of
    /// the `Requeue`'s pause, at least 10 ms: one lost connection, or a
    /// COMMIT whose answer was lost, is over at once), each next one twice
    /// the last, up to the pause (an outage). When `stop` resolves first (the
    /// consumer shuts down), it answers the `Requeue`. The caller keeps
    /// the delivery while this runs (extends its lease, leaves it
    /// unacknowledged); see [`Outage`] for why.
    pub async fn decide_holding(
        &self,
        message: &Message,
        handler: &(dyn Handler<I::Tx> + '_),
        outage: &Outage,
        stop: impl Future<Output = ()>,
    ) -> Decision {
        let mut stop = std::pin::pin!(stop);
        let mut held = None;
        let mut wait = None;
        loop {
            let decision = self.decide(message, handler).await;
            let Decision::Requeue { after } = decision else {
                return decision;
            };
            held.get_or_insert_with(|| outage.hold());
            let next = held_wait(wait, after);
            wait = Some(next);
            tokio::select! {
                biased;
                () = &mut stop => return decision,
                () = tokio::time::sleep(next) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::consume::{
        Acked, ConsumerPolicy, Counted, DeadLetter, Entered, Entry, Failure, HandlerError,
        InboxError, InboxFuture, MemoryInbox, handler,
    };

    /// A memory inbox that is unavailable for its first `down` calls.
    struct Flaky {
        inner: MemoryInbox,
        down: AtomicU32,
    }

    impl Flaky {
        fn check(&self) -> Result<(), InboxError> {
            let left = self.down.load(Ordering::SeqCst);
            if left == 0 {
                return Ok(());
            }
            self.down.store(left - 1, Ordering::SeqCst);
            Err(InboxError::unavailable(std::io::Error::other(
                "the database is away",
            )))
        }
    }

    impl Inbox for Flaky {
        type Tx = <MemoryInbox as Inbox>::Tx;
        const TRANSACTIONAL: bool = false;

        fn process<'a>(
            &'a self,
            entry: &'a Entry<'a>,
            message: &'a Message,
            handler: &'a (dyn Handler<Self::Tx> + 'a),
        ) -> InboxFuture<'a, Entered> {
            Box::pin(async move {
                self.check()?;
                self.inner.process(entry, message, handler).await
            })
        }

        fn fail<'a>(
            &'a self,
            entry: &'a Entry<'a>,
            failure: &'a Failure<'a>,
        ) -> InboxFuture<'a, Counted> {
            self.inner.fail(entry, failure)
        }

        fn published<'a>(&'a self, consumer: &'a str, message_id: &'a str) -> InboxFuture<'a, ()> {
            self.inner.published(consumer, message_id)
        }

        fn dead_letter<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> InboxFuture<'a, Option<DeadLetter>> {
            self.inner.dead_letter(consumer, message_id)
        }

        fn dead_letters<'a>(&'a self, consumer: &'a str) -> InboxFuture<'a, Vec<DeadLetter>> {
            self.inner.dead_letters(consumer)
        }

        fn redrive<'a>(
            &'a self,
            consumer: &'a str,
            message_id: &'a str,
        ) -> InboxFuture<'a, Option<DeadLetter>> {
            self.inner.redrive(consumer, message_id)
        }
    }

    fn protocol(down: u32) -> Protocol<Flaky> {
        let inbox = Flaky {
            inner: MemoryInbox::new(),
            down: AtomicU32::new(down),
        };
        let policy = ConsumerPolicy::new()
            .max_attempts(3)
            .unavailable_pause(Duration::from_millis(100));
        Protocol::new("c", inbox, policy)
    }

    #[tokio::test(start_paused = true)]
    async fn a_delivery_is_held_through_an_outage_and_applied_once_uncounted() {
        let protocol = protocol(5);
        let outage = Outage::new();
        let runs = AtomicU32::new(0);
        let apply = handler(|_, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok::<(), HandlerError>(()) })
        });
        let message = Message::new("body").id("m-1");
        let deciding = protocol.decide_holding(&message, &apply, &outage, std::future::pending());
        let watching = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let during = (outage.is_on(), outage.held());
            outage.over().await;
            during
        };
        let (decision, during) = tokio::join!(deciding, watching);
        assert_eq!(decision, Decision::Ack(Acked::Processed { attempt: 1 }));
        assert_eq!(during, (true, 1));
        assert!(!outage.is_on());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stop_during_an_outage_answers_the_requeue_and_holds_nothing() {
        let protocol = protocol(u32::MAX);
        let outage = Outage::new();
        let apply = handler(|_, _| Box::pin(async { Ok::<(), HandlerError>(()) }));
        let message = Message::new("body").id("m-1");
        let decision = protocol
            .decide_holding(
                &message,
                &apply,
                &outage,
                tokio::time::sleep(Duration::from_millis(350)),
            )
            .await;
        assert_eq!(
            decision,
            Decision::Requeue {
                after: Duration::from_millis(100)
            }
        );
        assert_eq!(outage.held(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn began_resolves_when_a_delivery_is_held_and_over_when_none_is() {
        let outage = Outage::new();
        let began = tokio::time::timeout(Duration::from_millis(10), outage.began()).await;
        assert!(began.is_err(), "nothing held: no outage began");
        let held = outage.hold();
        assert!(
            tokio::time::timeout(Duration::from_millis(10), outage.began())
                .await
                .is_ok()
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(10), outage.over())
                .await
                .is_err()
        );
        drop(held);
        assert!(
            tokio::time::timeout(Duration::from_millis(10), outage.over())
                .await
                .is_ok()
        );
        assert_eq!(outage.held(), 0);
    }
}
