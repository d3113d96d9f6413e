//! The offset in the effect's transaction, and the fence.
//!
//! [`WithOffset`] wraps the application's handler: on the inbox's
//! transaction it first moves the partition's position
//! ([`Positions::advance_in`]), then runs the handler, so the effect, the
//! inbox row and the next offset commit together, on whatever inbox keeps
//! the positions. On a database, moving the row first also takes its lock,
//! so a member that lost the partition waits for the new owner's commit and
//! then finds the row moved: fenced, its handler never runs.
//!
//! [`Fenced`] wraps the inbox: a handler refused by the fence is not a
//! failed attempt of the message (nothing is counted; the new owner runs it),
//! so the wrapper answers the protocol "unavailable", which hands the record
//! back uncounted ([`Decision::Requeue`](idem_core::consume::Decision)).

use std::error::Error as StdError;
use std::sync::atomic::{AtomicBool, Ordering};

use idem_core::consume::{
    Advance, Attempt, Counted, DeadLetter, Entered, Entry, Failure, Handler, HandlerError,
    HandlerFuture, Inbox, InboxError, InboxFuture, Message, Positions,
};

/// The partition has another owner: this member's write was refused.
#[derive(Debug, thiserror::Error)]
#[error("the partition has another owner now: its stored offset moved")]
pub struct PartitionLost;

/// The application's handler, after the partition's offset on the same
/// transaction.
pub(crate) struct WithOffset<'a, I, H: ?Sized> {
    /// The inbox that keeps the positions.
    pub(crate) inbox: &'a I,
    pub(crate) handler: &'a H,
    pub(crate) advance: Advance<'a>,
    /// Set when the fence refused the write.
    pub(crate) lost: &'a AtomicBool,
}

impl<I, H> Handler<I::Tx> for WithOffset<'_, I, H>
where
    I: Positions,
    H: Handler<I::Tx> + ?Sized,
{
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut I::Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            match self.inbox.advance_in(tx, &self.advance).await {
                Ok(true) => self.handler.handle(attempt, tx).await,
                Ok(false) => {
                    self.lost.store(true, Ordering::SeqCst);
                    Err(HandlerError::transient(PartitionLost))
                }
                // The database's own error, as the handler's (a failed
                // attempt, retried in place).
                Err(InboxError::Unavailable(source)) => Err(HandlerError::transient(source)),
                Err(error) => Err(HandlerError::transient(error)),
            }
        })
    }
}

/// An inbox whose fenced attempts are not counted.
pub struct Fenced<I> {
    inner: I,
}

impl<I> Fenced<I> {
    pub(crate) fn new(inner: I) -> Self {
        Self { inner }
    }

    /// The wrapped inbox.
    pub fn inner(&self) -> &I {
        &self.inner
    }
}

impl<I: Positions> Inbox for Fenced<I> {
    type Tx = I::Tx;
    const TRANSACTIONAL: bool = I::TRANSACTIONAL;

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(async move {
            match self.inner.process(entry, message, handler).await? {
                Entered::Failed { error, .. } if error.source_error().is::<PartitionLost>() => {
                    Err(InboxError::unavailable(PartitionLost))
                }
                entered => Ok(entered),
            }
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

    fn is_permanent(&self, error: &(dyn StdError + 'static)) -> bool {
        self.inner.is_permanent(error)
    }

    fn readiness(&self) -> Result<(), idem_core::store::NotReady> {
        self.inner.readiness()
    }
}
