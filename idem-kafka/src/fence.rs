//! The offset in the effect's transaction, and the fence.
//!
//! [`WithOffset`] wraps the application's handler: on the inbox's
//! transaction it first moves the partition's row ([`OffsetsTx::advance`]),
//! then runs the handler, so the effect, the inbox row and the next offset
//! commit together. Moving the row first also takes its lock, so a member
//! that lost the partition waits for the new owner's commit and then finds
//! the row moved: fenced, its handler never runs.
//!
//! [`Fenced`] wraps the inbox: a handler refused by the fence is not a
//! failed attempt of the message (nothing is counted; the new owner runs it),
//! so the wrapper answers the protocol "unavailable", which hands the record
//! back uncounted ([`Decision::Requeue`](idem_core::consume::Decision)).

use std::error::Error as StdError;
use std::sync::atomic::{AtomicBool, Ordering};

use idem_core::consume::{
    Attempt, Counted, DeadLetter, Entered, Entry, Failure, Handler, HandlerError, HandlerFuture,
    Inbox, InboxError, InboxFuture, Message,
};

use crate::offsets::{Advance, Offsets, OffsetsTx};

/// The partition has another owner: this member's write was refused.
#[derive(Debug, thiserror::Error)]
#[error("the partition has another owner now: its stored offset moved")]
pub struct PartitionLost;

/// The application's handler, after the partition's offset on the same
/// transaction.
pub(crate) struct WithOffset<'a, H: ?Sized> {
    pub(crate) handler: &'a H,
    pub(crate) advance: Advance<'a>,
    /// Set when the fence refused the write.
    pub(crate) lost: &'a AtomicBool,
}

impl<Tx, H> Handler<Tx> for WithOffset<'_, H>
where
    Tx: OffsetsTx + ?Sized,
    H: Handler<Tx> + ?Sized,
{
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            match tx.advance(&self.advance).await {
                Ok(true) => self.handler.handle(attempt, tx).await,
                Ok(false) => {
                    self.lost.store(true, Ordering::SeqCst);
                    Err(HandlerError::transient(PartitionLost))
                }
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

impl<I: Offsets> Inbox for Fenced<I> {
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
