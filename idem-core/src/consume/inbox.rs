//! The `Inbox` trait: where a consumer's messages are remembered, each step
//! atomic.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::time::SystemTime;

use super::{BatchEntry, BatchHandler, Batched, Handler, HandlerError, Message};
use crate::Fingerprint;
use crate::store::{BoxError, NotReady};

/// The future an inbox step answers.
pub type InboxFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, InboxError>> + Send + 'a>>;

/// Remembers which messages a consumer applied, counts failed attempts, and
/// keeps the dead letters' record.
///
/// Like a [`Store`](crate::Store), an inbox makes each step atomic and decides
/// nothing: the protocol ([`Protocol`](super::Protocol)) calls it and decides.
/// Every inbox passes the conformance suite ([`conformance`](super::conformance),
/// feature `test-util`).
///
/// Implementations: idem-diesel's PostgreSQL and SQLite inboxes (the effect
/// and the inbox row in one database transaction), and
/// [`StoreInbox`](super::StoreInbox) over any [`Store`](crate::Store) (for an
/// effect outside a database: one execution at a time per message, a finished
/// one never run again), and [`MemoryInbox`](super::MemoryInbox) (in this
/// process's memory, for tests and demos).
pub trait Inbox: Send + Sync + 'static {
    /// What the handler works in: the open transaction its writes join, or
    /// `()` for an inbox without one.
    type Tx: Send + ?Sized;

    /// Whether the handler's writes commit or roll back with the inbox row
    /// (a database inbox); `false` when the effect is the handler's own
    /// business ([`MemoryInbox`](super::MemoryInbox)).
    const TRANSACTIONAL: bool;

    /// Whether [`process_batch`](Self::process_batch) applies a batch in
    /// one transaction (an inbox that overrides it: idem-diesel's); `false`
    /// for the default, which applies each message alone, and then a
    /// partition's records go one at a time
    /// ([`Protocol::decide_batch_advancing`](super::Protocol::decide_batch_advancing)
    /// answers at once that none was applied as a batch).
    const BATCHES: bool = false;

    /// Applies `message` once, in one transaction:
    ///
    /// - a message this consumer applied before answers
    ///   [`Entered::Duplicate`] (same fingerprint) or [`Entered::Reused`]
    ///   (another fingerprint under its id);
    /// - a dead letter answers [`Entered::Dead`];
    /// - otherwise the inbox records the entry, runs `handler` on the
    ///   transaction with the attempt number (its failures so far, plus one),
    ///   and commits both ([`Entered::Processed`]), or, when the handler fails,
    ///   rolls both back ([`Entered::Failed`], not yet counted: the protocol
    ///   calls [`fail`](Self::fail)).
    ///
    /// A concurrent entry of the same message waits for the first to commit
    /// (then it is a duplicate) or roll back (then it runs).
    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Entered>;

    /// Applies a batch of messages (their keys distinct) in one
    /// transaction: each entered as [`process`](Self::process) enters one,
    /// and `handler` run once on the new ones, in the batch's order, with
    /// their attempt numbers; then one commit. A handler that fails rolls
    /// everything back: with one new message, its slot answers
    /// [`Entered::Failed`] (the others what they found); with more,
    /// [`Batched::Failed`], and the protocol splits the batch.
    ///
    /// The default applies each message alone, in order ([`process`](Self::process)
    /// with `handler` run on a batch of one): correct on any inbox, one
    /// transaction each. idem-diesel's inboxes enter the batch with one
    /// statement and commit once.
    fn process_batch<'a>(
        &'a self,
        batch: &'a [BatchEntry<'a>],
        handler: &'a (dyn BatchHandler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Batched> {
        Box::pin(super::batch::one_by_one(self, batch, handler))
    }

    /// Counts a failed attempt (`failure.at`, `failure.reason`) and answers
    /// the message's attempts so far. The count that reaches
    /// `failure.bury_at` (1 buries at once) makes the message a dead letter in
    /// the same step, and answers how many dead letters the consumer has now,
    /// counted so that of concurrent buries each sees a different number.
    /// A message that is a dead letter already is not counted again
    /// ([`Buried::Already`]).
    fn fail<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        failure: &'a Failure<'a>,
    ) -> InboxFuture<'a, Counted>;

    /// Marks the consumer's dead letter `message_id` as published to the
    /// broker's dead-letter queue, so that a redelivery of it is not
    /// published there again.
    fn published<'a>(&'a self, consumer: &'a str, message_id: &'a str) -> InboxFuture<'a, ()>;

    /// The consumer's dead letter `message_id`, if it is one.
    fn dead_letter<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>>;

    /// The consumer's dead letters, oldest first.
    fn dead_letters<'a>(&'a self, consumer: &'a str) -> InboxFuture<'a, Vec<DeadLetter>>;

    /// Lets a dead letter through again: forgets it and its failures, so that
    /// its next delivery runs with attempt 1. Answers the dead letter it
    /// forgot, if any.
    fn redrive<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>>;

    /// Whether `error` (a handler's, unclassified) is one this inbox's
    /// database gives for a write that can never succeed (a constraint
    /// violated, a value out of range or too long), so that it is not
    /// retried. The default knows none.
    fn is_permanent(&self, error: &(dyn StdError + 'static)) -> bool {
        let _ = error;
        false
    }

    /// Whether the inbox may take messages: a database inbox answers
    /// [`NotReady`] until its tables were verified in this process
    /// (idem-diesel's inboxes: `migrate()` or `check_schema()` succeeded),
    /// unless the check was explicitly skipped. The broker crates' consumers
    /// ask once, when they start ([`Protocol::readiness`](super::Protocol::readiness)),
    /// and refuse to run on an inbox that is not ready, so a forgotten
    /// migration stops the start instead of failing every message. The
    /// default: ready.
    fn readiness(&self) -> Result<(), NotReady> {
        Ok(())
    }
}

/// Which message of which consumer an inbox step is about.
#[derive(Clone, Debug)]
pub struct Entry<'a> {
    /// The consumer's name: each consumer of a message applies it once.
    pub consumer: &'a str,
    /// The message's key (see [`Attempt::key`](super::Attempt::key)).
    pub message_id: &'a str,
    /// The message's fingerprint ([`Message::fingerprint`]).
    pub fingerprint: Fingerprint,
    /// When this attempt started.
    pub at: SystemTime,
}

/// What [`Inbox::process`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Entered {
    /// The handler ran and its writes committed with the inbox row.
    Processed {
        /// The attempt that succeeded.
        attempt: u32,
    },
    /// The consumer applied this message before: nothing ran.
    Duplicate,
    /// The consumer applied a different message (another fingerprint) under
    /// this id: nothing ran.
    Reused,
    /// The message is a dead letter: nothing ran.
    Dead {
        /// Whether it was published to the dead-letter queue already.
        published: bool,
    },
    /// The handler failed; its writes and the entry were rolled back.
    Failed {
        /// The attempt that failed.
        attempt: u32,
        /// The handler's error.
        error: HandlerError,
    },
}

/// A failed attempt, for [`Inbox::fail`].
#[derive(Clone, Debug)]
pub struct Failure<'a> {
    /// Why it failed (the error and its sources, on one line).
    pub reason: &'a str,
    /// The count of failed attempts that makes the message a dead letter: the
    /// policy's maximum, or 1 for a failure that can never succeed.
    pub bury_at: u32,
}

/// What [`Inbox::fail`] counted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counted {
    /// How many attempts failed, this one included.
    pub attempts: u32,
    /// When each failed attempt started, in order.
    pub attempted_at: Vec<SystemTime>,
    /// Whether the message is a dead letter now.
    pub buried: Option<Buried>,
}

/// How a failed attempt left the message dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buried {
    /// This attempt made it a dead letter; the consumer has this many now
    /// (this one included).
    New {
        /// The consumer's dead letters.
        dead_letters: u64,
    },
    /// It was a dead letter already.
    Already {
        /// Whether it was published to the dead-letter queue already.
        published: bool,
    },
}

/// A message that will not be applied until it is re-driven: the inbox's
/// record of it. The broker's dead-letter queue holds its body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// The consumer that gave up on it.
    pub consumer: String,
    /// The message's key.
    pub message_id: String,
    /// How many attempts failed.
    pub attempts: u32,
    /// Why the last one failed.
    pub reason: String,
    /// When each failed attempt started, in order.
    pub attempted_at: Vec<SystemTime>,
    /// When it became a dead letter.
    pub dead_at: SystemTime,
    /// Whether it was published to the dead-letter queue.
    pub published: bool,
}

/// Why an inbox step failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// The inbox's database could not be reached or failed: nothing was
    /// committed (the handler's writes, if it ran, were rolled back).
    #[error("the inbox is unavailable")]
    Unavailable(#[source] BoxError),
    /// A stored record could not be read back.
    #[error("an inbox record is corrupt: {0}")]
    Corrupt(String),
}

impl InboxError {
    /// An unavailable inbox, from any error.
    pub fn unavailable(error: impl Into<BoxError>) -> Self {
        Self::Unavailable(error.into())
    }
}
