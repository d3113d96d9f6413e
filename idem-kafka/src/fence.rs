//! The offset in the effect's transaction, and the fence.
//!
//! Each record is processed with its partition's move
//! ([`Positions::process_advancing`]): the effect, the inbox row and the
//! next offset commit together, on whatever inbox keeps the positions. On a
//! database the move also takes the position's lock, so a member that lost
//! the partition waits for the new owner's commit and then finds the
//! position moved: fenced, its handler never runs.
//!
//! [`Fenced`] wraps the inbox: a record refused by the fence is not a failed
//! attempt of the message (nothing is counted; the new owner runs it), so
//! the wrapper answers the protocol "unavailable", which hands the record
//! back uncounted ([`Decision::Requeue`](idem_core::consume::Decision)), and
//! notes the partition lost for its worker ([`Fenced::take_lost`]).

use std::collections::{HashMap, HashSet};
use std::error::Error as StdError;
use std::sync::{Mutex, PoisonError};

pub use idem_core::consume::PartitionLost;
use idem_core::consume::{
    Advance, BatchEntry, BatchHandler, Batched, Counted, DeadLetter, Entered, Entry, Failure,
    Handler, Inbox, InboxError, InboxFuture, Message, Positions,
};

/// An inbox whose fenced attempts are not counted.
pub struct Fenced<I> {
    inner: I,
    /// The partitions a record of which was fenced since their worker last
    /// looked ([`take_lost`](Self::take_lost)).
    lost: Mutex<HashSet<i32>>,
}

impl<I> Fenced<I> {
    pub(crate) fn new(inner: I) -> Self {
        Self {
            inner,
            lost: Mutex::default(),
        }
    }

    /// The wrapped inbox.
    pub fn inner(&self) -> &I {
        &self.inner
    }

    /// Whether a record of `partition` was fenced since the last call: its
    /// worker stops applying it.
    pub(crate) fn take_lost(&self, partition: i32) -> bool {
        self.lost
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&partition)
    }
}

/// A fenced attempt as the protocol should see it: unavailable, uncounted.
fn uncounted(entered: Entered) -> Result<Entered, InboxError> {
    match entered {
        Entered::Failed { error, .. } if error.source_error().is::<PartitionLost>() => {
            Err(InboxError::unavailable(PartitionLost))
        }
        entered => Ok(entered),
    }
}

impl<I: Positions> Inbox for Fenced<I> {
    type Tx = I::Tx;
    const TRANSACTIONAL: bool = I::TRANSACTIONAL;
    const BATCHES: bool = I::BATCHES;

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(async move { uncounted(self.inner.process(entry, message, handler).await?) })
    }

    /// The inner inbox's batch, as it is: a batch's fence is noted by the
    /// protocol ([`Advanced::Fenced`](idem_core::consume::Advanced::Fenced)),
    /// and a failed batch is never counted.
    fn process_batch<'a>(
        &'a self,
        batch: &'a [BatchEntry<'a>],
        handler: &'a (dyn BatchHandler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Batched> {
        self.inner.process_batch(batch, handler)
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

impl<I: Positions> Positions for Fenced<I> {
    fn migrate_positions(&self) -> InboxFuture<'_, ()> {
        self.inner.migrate_positions()
    }

    fn positions<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> InboxFuture<'a, HashMap<i32, i64>> {
        self.inner.positions(consumer, topic)
    }

    fn advance_in<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        advance: &'a Advance<'a>,
    ) -> InboxFuture<'a, bool> {
        self.inner.advance_in(tx, advance)
    }

    fn advance_alone<'a>(&'a self, advance: &'a Advance<'a>) -> InboxFuture<'a, bool> {
        self.inner.advance_alone(advance)
    }

    fn process_advancing<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        advance: &'a Advance<'a>,
        handler: &'a (dyn Handler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(async move {
            let entered = self
                .inner
                .process_advancing(entry, message, advance, handler)
                .await?;
            let entered = uncounted(entered);
            if entered.is_err() {
                self.lost
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(advance.partition);
            }
            entered
        })
    }
}
