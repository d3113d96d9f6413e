//! Batches: several deliveries applied in one transaction, one commit.
//!
//! One at a time, every message costs its own transaction: the inbox row,
//! the handler's writes and a `COMMIT` (a disk flush) each. A batch takes
//! the deliveries that are already there (a broker crate never waits on a
//! timer to fill one), enters them all in one inbox step, hands the new ones
//! to a [`BatchHandler`] on one transaction and commits once.
//!
//! A failure inside a batch never fails its neighbours: the protocol
//! ([`Protocol::decide_batch`]) splits the batch in two and tries each half,
//! the earlier first, down to single messages, so a message that keeps
//! failing ends alone, counted, retried and dead-lettered after exactly its
//! attempts, while the rest are applied once. Nothing of a failed batch is
//! counted: only a message that failed alone is.

use std::collections::HashSet;
use std::time::SystemTime;

use futures_util::FutureExt;
use tracing::Instrument;

use super::handler::guard_batch;
use super::{
    Attempt, Decision, Entered, Entry, Handler, HandlerError, HandlerFuture, Inbox, InboxError,
    Message, Plain, Protocol,
};
use crate::log::bounded;

/// Applies a batch of messages' effects on one transaction `Tx` (as
/// [`Handler`] does one message's): the attempts are the batch's new
/// messages, in their order of delivery. An error rolls every one of them
/// back; the protocol then tries them again in smaller batches, so return an
/// error only for what failed (a message the handler cannot apply fails its
/// batch until it is alone).
///
/// Any `Fn(&[Attempt<'_>], &mut Tx) -> HandlerFuture<'_>` closure is one;
/// wrap it in [`batch_handler`] so that Rust infers its signature. A
/// one-at-a-time [`Handler`] runs on a batch with [`each`].
pub trait BatchHandler<Tx: ?Sized>: Send + Sync {
    /// Applies every attempt's message on `tx`.
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], tx: &'a mut Tx) -> HandlerFuture<'a>;
}

impl<Tx, F> BatchHandler<Tx> for F
where
    Tx: ?Sized,
    F: for<'a> Fn(&'a [Attempt<'a>], &'a mut Tx) -> HandlerFuture<'a> + Send + Sync,
{
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], tx: &'a mut Tx) -> HandlerFuture<'a> {
        self(batch, tx)
    }
}

/// Fixes a closure's signature as a [`BatchHandler`]'s.
///
/// ```
/// use idem_core::consume::{Attempt, HandlerError, batch_handler};
///
/// let apply = batch_handler(|batch: &[Attempt<'_>], _tx: &mut ()| {
///     Box::pin(async move {
///         let total: i64 = batch
///             .iter()
///             .map(|attempt| std::str::from_utf8(attempt.body())?.parse::<i64>().map_err(Into::into))
///             .sum::<Result<i64, Box<dyn std::error::Error + Send + Sync>>>()
///             .map_err(HandlerError::permanent)?;
///         // ... one statement for the whole batch, on the transaction ...
///         let _ = total;
///         Ok(())
///     })
/// });
/// # let _ = apply;
/// ```
pub fn batch_handler<Tx, F>(f: F) -> F
where
    Tx: ?Sized,
    F: for<'a> Fn(&'a [Attempt<'a>], &'a mut Tx) -> HandlerFuture<'a> + Send + Sync,
{
    f
}

/// A one-at-a-time [`Handler`] run on a batch: it applies each message in
/// turn, all on the batch's one transaction (one commit for all).
pub fn each<H>(handler: H) -> Each<H> {
    Each(handler)
}

/// See [`each`].
#[derive(Clone, Debug)]
pub struct Each<H>(H);

impl<Tx: ?Sized + Send, H: Handler<Tx>> BatchHandler<Tx> for Each<H> {
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            for attempt in batch {
                self.0.handle(*attempt, &mut *tx).await?;
            }
            Ok(())
        })
    }
}

/// A batch handler run on one message: what a batch falls back to when it
/// is split down to one.
pub(crate) struct One<'h, Tx: ?Sized>(pub(crate) &'h (dyn BatchHandler<Tx> + 'h));

impl<Tx: ?Sized + Send> Handler<Tx> for One<'_, Tx> {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move { self.0.handle(std::slice::from_ref(&attempt), tx).await })
    }
}

/// One message of a batch, for [`Inbox::process_batch`].
#[derive(Clone, Debug)]
pub struct BatchEntry<'a> {
    /// Which message of which consumer.
    pub entry: Entry<'a>,
    /// The message.
    pub message: &'a Message,
}

/// What [`Inbox::process_batch`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Batched {
    /// What each message came to, in the batch's order: the new ones'
    /// handler ran once and committed with their rows
    /// ([`Entered::Processed`]), or a new one alone failed
    /// ([`Entered::Failed`], rolled back, not yet counted).
    Entered(Vec<Entered>),
    /// The handler failed on two or more new messages: everything was
    /// rolled back and nothing counted. The protocol splits the batch.
    Failed(HandlerError),
}

/// The default [`Inbox::process_batch`]: each message alone, in order, with
/// the batch handler run on it.
pub(crate) async fn one_by_one<I: Inbox + ?Sized>(
    inbox: &I,
    batch: &[BatchEntry<'_>],
    handler: &(dyn BatchHandler<I::Tx> + '_),
) -> Result<Batched, InboxError> {
    let mut entered = Vec::with_capacity(batch.len());
    for item in batch {
        entered.push(
            inbox
                .process(&item.entry, item.message, &One(handler))
                .await?,
        );
    }
    Ok(Batched::Entered(entered))
}

/// The application's batch handler as the protocol hands it to an inbox:
/// a panic is a failure of the batch, and the time it ran is measured.
pub(crate) struct BatchGuarded<'h, Tx: ?Sized>(pub(crate) &'h (dyn BatchHandler<Tx> + 'h));

impl<Tx: ?Sized> BatchHandler<Tx> for BatchGuarded<'_, Tx> {
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], tx: &'a mut Tx) -> HandlerFuture<'a> {
        guard_batch(self.0, batch, tx)
    }
}

impl<I: Inbox> Protocol<I> {
    /// Decides a batch of deliveries: one [`Decision`] per message, in the
    /// same order, each what [`decide`](Self::decide) would answer for it.
    ///
    /// The messages refused before any handler runs (no id, an unreadable
    /// one) are decided alone; a message whose id came earlier in the same
    /// batch is decided after the batch (a duplicate, unless the first
    /// failed); the rest are entered together ([`Inbox::process_batch`]) and
    /// the new ones handed to `handler` on one transaction. When the handler
    /// fails on several, the batch is split in two and each half decided,
    /// the earlier first, down to single messages: only a message that
    /// failed alone is counted (retried, or dead-lettered after the
    /// policy's attempts), and the others are applied once. An unavailable
    /// inbox makes every message of the step it met
    /// [`Requeue`](Decision::Requeue).
    pub async fn decide_batch(
        &self,
        messages: &[Message],
        handler: &(dyn BatchHandler<I::Tx> + '_),
    ) -> Vec<Decision> {
        let span = tracing::info_span!(
            target: "idem",
            "idem.batch",
            consumer = %bounded(self.consumer()),
            size = messages.len(),
        );
        self.decide_batch_in(messages, handler)
            .instrument(span)
            .await
    }

    async fn decide_batch_in(
        &self,
        messages: &[Message],
        handler: &(dyn BatchHandler<I::Tx> + '_),
    ) -> Vec<Decision> {
        let at = SystemTime::now();
        let keys: Vec<String> = messages.iter().map(Self::key_of).collect();
        let entries: Vec<Entry<'_>> = keys
            .iter()
            .zip(messages)
            .map(|(key, message)| Entry {
                consumer: self.consumer(),
                message_id: key,
                fingerprint: message.fingerprint(),
                at,
            })
            .collect();
        let mut decisions: Vec<Option<Decision>> = vec![None; messages.len()];
        let mut together = Vec::with_capacity(messages.len());
        let mut after = Vec::new();
        let mut seen = HashSet::with_capacity(messages.len());
        for (i, message) in messages.iter().enumerate() {
            let entry = &entries[i];
            if let Some(reason) = self.refused(message) {
                decisions[i] = Some(self.refuse(entry, reason).await);
            } else if message.is_redriven()
                && let Err(error) = self.redrive(entry.message_id).await
            {
                decisions[i] = Some(self.unavailable(Some(error)));
            } else if seen.insert(entry.message_id) {
                together.push(i);
            } else {
                after.push(i);
            }
        }
        // Split halves wait on a stack, the earlier on top: a partition's
        // order is kept.
        let mut groups = vec![together];
        while let Some(group) = groups.pop() {
            if group.is_empty() {
                continue;
            }
            if let [i] = group[..] {
                let decided = self
                    .process(&entries[i], &messages[i], &One(handler), &Plain)
                    .await;
                decisions[i] = Some(decided);
                continue;
            }
            let batch: Vec<BatchEntry<'_>> = group
                .iter()
                .map(|&i| BatchEntry {
                    entry: entries[i].clone(),
                    message: &messages[i],
                })
                .collect();
            match self
                .inbox()
                .process_batch(&batch, &BatchGuarded(handler))
                .await
            {
                Ok(Batched::Entered(entered)) if entered.len() == group.len() => {
                    for (&i, entered) in group.iter().zip(entered) {
                        decisions[i] = Some(self.settle(&entries[i], entered).await);
                    }
                }
                Ok(Batched::Entered(entered)) => {
                    tracing::error!(target: "idem", size = group.len(), answered = entered.len(), "the inbox answered a batch with another number of outcomes: its messages go back to the broker");
                    for &i in &group {
                        decisions[i] = Some(self.unavailable(None));
                    }
                }
                Ok(Batched::Failed(error)) => {
                    tracing::info!(target: "idem", size = group.len(), error = %bounded(&error.reason()), "the batch's handler failed; rolled back, uncounted: each half is tried alone");
                    let half = group.len() / 2;
                    groups.push(group[half..].to_vec());
                    groups.push(group[..half].to_vec());
                }
                Err(error) => {
                    tracing::error!(target: "idem", outcome = "requeued", size = group.len(), error = %crate::log::error_chain(&error), "the inbox is unavailable: the batch goes back to the broker, uncounted");
                    let after = self.policy().get_unavailable_pause();
                    for &i in &group {
                        super::metrics::outcome(super::metrics::Outcome::Requeued);
                        decisions[i] = Some(Decision::Requeue { after });
                    }
                }
            }
        }
        for i in after {
            let decided = self
                .process(&entries[i], &messages[i], &One(handler), &Plain)
                .await;
            decisions[i] = Some(decided);
        }
        decisions
            .into_iter()
            .map(|decision| decision.unwrap_or_else(|| self.unavailable(None)))
            .collect()
    }

    /// [`decide_batch`](Self::decide_batch), holding the messages the
    /// inbox could not take as [`decide_holding`](Self::decide_holding)
    /// does one: those answered [`Requeue`](Decision::Requeue) are decided
    /// again after the policy's pause (and nothing new is taken meanwhile,
    /// through `outage`), until none is, or until `stop` resolves (then
    /// they stay `Requeue`).
    pub async fn decide_batch_holding(
        &self,
        messages: &[Message],
        handler: &(dyn BatchHandler<I::Tx> + '_),
        outage: &super::Outage,
        stop: impl std::future::Future<Output = ()>,
    ) -> Vec<Decision> {
        let mut stop = std::pin::pin!(stop);
        let mut decisions = self.decide_batch(messages, handler).await;
        let mut held = None;
        let mut wait = None;
        loop {
            let waiting: Vec<usize> = (0..decisions.len())
                .filter(|&i| matches!(decisions[i], Decision::Requeue { .. }))
                .collect();
            let Some(&first) = waiting.first() else {
                return decisions;
            };
            let Decision::Requeue { after } = decisions[first] else {
                return decisions;
            };
            held.get_or_insert_with(|| outage.hold());
            let next = super::held_wait(wait, after);
            wait = Some(next);
            tokio::select! {
                biased;
                () = &mut stop => return decisions,
                () = tokio::time::sleep(next) => {}
            }
            let again: Vec<Message> = waiting.iter().map(|&i| messages[i].clone()).collect();
            let decided = self.decide_batch(&again, handler).await;
            for (i, decision) in waiting.into_iter().zip(decided) {
                decisions[i] = decision;
            }
        }
    }
}

/// A [`BatchHandler`] and the most messages it takes at once: what a broker
/// crate's `ConsumerBuilder::batch_handler` sets.
#[derive(Clone, Debug)]
pub struct Batch<B> {
    handler: B,
    size: usize,
}

impl<B> Batch<B> {
    /// `handler`, given up to `size` messages at once (at least 1).
    pub fn new(handler: B, size: usize) -> Self {
        Self {
            handler,
            size: size.max(1),
        }
    }

    /// The most messages a batch holds.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The handler.
    pub fn handler(&self) -> &B {
        &self.handler
    }
}

impl<Tx: ?Sized + Send, B: BatchHandler<Tx>> Handler<Tx> for Batch<B> {
    /// One message: the batch handler on a batch of one.
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            self.handler
                .handle(std::slice::from_ref(&attempt), tx)
                .await
        })
    }

    fn as_batch(&self) -> Option<(&dyn BatchHandler<Tx>, usize)> {
        Some((&self.handler, self.size))
    }
}

impl<I: Inbox> Protocol<I> {
    /// Decides a unit of deliveries with `handler`, as a broker crate's
    /// consumer does: a [`Batch`] decides them together
    /// ([`decide_batch_holding`](Self::decide_batch_holding)), any other
    /// handler one after the other ([`decide_holding`](Self::decide_holding)).
    /// One decision per message, in order.
    pub async fn decide_all_holding(
        &self,
        messages: &[Message],
        handler: &(dyn Handler<I::Tx> + '_),
        outage: &super::Outage,
        stop: impl std::future::Future<Output = ()>,
    ) -> Vec<Decision> {
        if let Some((batch, _)) = handler.as_batch() {
            return self
                .decide_batch_holding(messages, batch, outage, stop)
                .await;
        }
        if let [message] = messages {
            // One delivery, the usual unit: no shared stop to make.
            return vec![self.decide_holding(message, handler, outage, stop).await];
        }
        let stop = std::pin::pin!(stop);
        let stop = stop.shared();
        let mut decisions = Vec::with_capacity(messages.len());
        for message in messages {
            let decided = self
                .decide_holding(message, handler, outage, stop.clone())
                .await;
            decisions.push(decided);
        }
        decisions
    }
}

/// What [`Protocol::decide_batch_advancing`] came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Advanced {
    /// The first `n` records are applied, their position moved past them
    /// (committed with their effects). When `n` is short of the batch, the
    /// record at `n` is for the one-at-a-time path
    /// ([`Protocol::decide_advancing`]): it failed alone, or it is not new
    /// (a duplicate, a dead letter, a reused id), or it cannot be batched
    /// (no readable id, re-driven, its id earlier in the batch); the records
    /// after it wait for it, in order.
    Applied(usize),
    /// The partition has another owner: its stored position moved. Nothing
    /// of the step that met the fence committed.
    Fenced,
    /// The inbox is unavailable: nothing of the step that met it committed;
    /// decide the rest again after `after`.
    Unavailable {
        /// The pause before deciding again.
        after: std::time::Duration,
    },
}

/// The batch's moves of one partition: the consumer, the topic, the
/// partition, and where its position was before the batch.
#[derive(Clone, Debug)]
pub struct PartitionBatch<'a> {
    /// The consumer's name (the inbox's).
    pub consumer: &'a str,
    /// The topic.
    pub topic: &'a str,
    /// The partition.
    pub partition: i32,
    /// The next offset the position held before the batch (`None`: none).
    pub from: Option<i64>,
    /// Each record's offset, in order (as many as the messages).
    pub offsets: &'a [i64],
}

/// A batch handler run after the partition's position moved over the whole
/// batch on its transaction; fails the batch (so that nothing commits)
/// when the batch holds a message that is not new, and notes a fence.
struct MoveFirst<'a, P: super::Positions> {
    positions: &'a P,
    advance: &'a super::Advance<'a>,
    handler: &'a (dyn BatchHandler<P::Tx> + 'a),
    size: usize,
    fenced: std::sync::atomic::AtomicBool,
}

/// The batch holds messages that are not new: it is applied one by one.
#[derive(Debug, thiserror::Error)]
#[error("the batch holds messages applied before or dead: they go one at a time")]
struct NotAllNew;

impl<P: super::Positions> BatchHandler<P::Tx> for MoveFirst<'_, P> {
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], tx: &'a mut P::Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            if batch.len() != self.size {
                return Err(HandlerError::transient(NotAllNew));
            }
            if let Err(error) = super::positions::moved(self.positions, tx, self.advance).await {
                if error.source_error().is::<super::PartitionLost>() {
                    self.fenced.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                return Err(error);
            }
            self.handler.handle(batch, tx).await
        })
    }
}

impl<I: super::Positions> Protocol<I> {
    /// Applies a partition's records in order, in batches, each with the
    /// partition's move past it on the same transaction
    /// ([`Positions::advance_in`](super::Positions::advance_in)): the
    /// batch's effects, its inbox rows and the position commit together,
    /// fenced as one record's are.
    ///
    /// Only batches whose every message is new are applied together; a
    /// batch that fails is split in two and the earlier half tried first,
    /// so the records stay in order. A record that would be decided alone
    /// (see [`Advanced::Applied`]) ends the step: its caller applies it one
    /// at a time, then goes on with the rest. Nothing a batch ran is
    /// counted as an attempt.
    pub async fn decide_batch_advancing(
        &self,
        messages: &[Message],
        partition: &PartitionBatch<'_>,
        handler: &(dyn BatchHandler<I::Tx> + '_),
    ) -> Advanced {
        let span = tracing::info_span!(
            target: "idem",
            "idem.batch",
            consumer = %bounded(self.consumer()),
            size = messages.len(),
        );
        self.decide_batch_advancing_in(messages, partition, handler)
            .instrument(span)
            .await
    }

    async fn decide_batch_advancing_in(
        &self,
        messages: &[Message],
        partition: &PartitionBatch<'_>,
        handler: &(dyn BatchHandler<I::Tx> + '_),
    ) -> Advanced {
        let at = SystemTime::now();
        let keys: Vec<String> = messages.iter().map(Self::key_of).collect();
        // The batch ends before the first message that cannot be batched.
        let mut seen = HashSet::with_capacity(messages.len());
        let end = messages
            .iter()
            .zip(&keys)
            .position(|(message, key)| {
                self.refused(message).is_some()
                    || message.is_redriven()
                    || !seen.insert(key.as_str())
            })
            .unwrap_or(messages.len())
            .min(partition.offsets.len());
        let entries: Vec<BatchEntry<'_>> = keys[..end]
            .iter()
            .zip(messages)
            .map(|(key, message)| BatchEntry {
                entry: Entry {
                    consumer: self.consumer(),
                    message_id: key,
                    fingerprint: message.fingerprint(),
                    at,
                },
                message,
            })
            .collect();
        if !I::BATCHES {
            // Its batches would be one message each, each failing the
            // batch's move: the records go one at a time.
            return Advanced::Applied(0);
        }
        let mut from = partition.from;
        let mut applied = 0;
        // Ranges still to apply, the earliest on top.
        let mut ranges: Vec<std::ops::Range<usize>> = Vec::with_capacity(8);
        ranges.push(0..end);
        while let Some(range) = ranges.pop() {
            if range.len() < 2 {
                break;
            }
            let advance = super::Advance {
                consumer: partition.consumer,
                topic: partition.topic,
                partition: partition.partition,
                from,
                to: partition.offsets[range.end - 1] + 1,
            };
            let first = MoveFirst {
                positions: self.inbox(),
                advance: &advance,
                handler,
                size: range.len(),
                fenced: std::sync::atomic::AtomicBool::new(false),
            };
            let outcome = self
                .inbox()
                .process_batch(&entries[range.clone()], &BatchGuarded(&first))
                .await;
            if first.fenced.load(std::sync::atomic::Ordering::SeqCst) {
                return Advanced::Fenced;
            }
            match outcome {
                Ok(Batched::Entered(entered))
                    if entered.len() == range.len()
                        && entered
                            .iter()
                            .all(|e| matches!(e, Entered::Processed { .. })) =>
                {
                    for _ in &entered {
                        super::metrics::outcome(super::metrics::Outcome::Processed);
                    }
                    tracing::debug!(target: "idem", outcome = "processed", records = range.len(), "a batch of records applied, its position moved");
                    applied = range.end;
                    from = Some(advance.to);
                }
                Ok(_) => {
                    let half = range.start + range.len() / 2;
                    tracing::debug!(target: "idem", size = range.len(), "the batch did not apply as one: each half is tried alone, in order");
                    ranges.push(half..range.end);
                    ranges.push(range.start..half);
                }
                Err(error) => {
                    tracing::error!(target: "idem", outcome = "requeued", size = range.len(), error = %crate::log::error_chain(&error), "the inbox is unavailable: the batch is decided again after a pause, uncounted");
                    if applied > 0 {
                        return Advanced::Applied(applied);
                    }
                    return Advanced::Unavailable {
                        after: self.policy().get_unavailable_pause(),
                    };
                }
            }
        }
        Advanced::Applied(applied)
    }
}
