//! Where a partitioned broker's consumer keeps each partition's position: in
//! the inbox, written in the same transaction as the effect and the inbox
//! row, so that the record applied and the position past it commit together.
//!
//! A position is kept per consumer, topic and partition, and holds the
//! partition's **next** offset (the offset after the last record applied).
//! Every write is fenced: it moves the position from the offset the writer
//! last saw to the next one ([`Advance`]), and writes nothing when the
//! position holds anything else, because then another member owns the
//! partition now and has moved it. A write that finds no position inserts it
//! (the partition's first record), unless another member inserted it first.
//!
//! A position already at the write's target counts as written: that is the
//! position after this writer's own COMMIT that landed but whose answer was
//! lost (the retry of a commit that succeeded), or after another member
//! applied the same record; either way the record is done and the partition
//! goes on from there. (Whoever moved it, the record's effect is the inbox's
//! to keep once: its row is in the same transaction.)
//!
//! Implementations: idem-diesel's `PgInbox` and `SqliteInbox` (a row per
//! partition in `idem_kafka_offsets`, beside the inbox's tables), and
//! [`MemoryInbox`](super::MemoryInbox) (in this process's memory, moved when
//! the inbox settles a processed message). Every implementation passes the
//! positions' conformance suite
//! ([`conformance::positions`](super::conformance::positions), feature
//! `test-util`). idem-kafka's consumer runs on any of them.

use std::collections::HashMap;

use super::{
    Attempt, Entered, Entry, Handler, HandlerError, HandlerFuture, Inbox, InboxError, InboxFuture,
    Message,
};

/// The partition has another owner: its stored position moved, and this
/// member's write was refused.
#[derive(Debug, thiserror::Error)]
#[error("the partition has another owner now: its stored offset moved")]
pub struct PartitionLost;

/// One partition's move, from the offset its owner saw to the next one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advance<'a> {
    /// The consumer's name (the inbox's).
    pub consumer: &'a str,
    /// The topic.
    pub topic: &'a str,
    /// The partition.
    pub partition: i32,
    /// The next offset the position held when this owner last read or wrote
    /// it; `None` when there was none.
    pub from: Option<i64>,
    /// The offset after the record applied.
    pub to: i64,
}

impl Advance<'_> {
    /// Whether the move may write over `stored` (the position's offset now,
    /// `None` when there is none): see the module's docs.
    pub fn applies_to(&self, stored: Option<i64>) -> bool {
        match stored {
            None => true,
            Some(stored) => stored == self.to || Some(stored) == self.from,
        }
    }
}

/// An inbox that also keeps the positions of a partitioned broker's
/// consumer (see the module's docs).
///
/// Every step's error is the inbox's ([`InboxError`](super::InboxError)): an
/// unreachable database is [`InboxError::Unavailable`](super::InboxError::Unavailable),
/// and nothing was written.
pub trait Positions: Inbox {
    /// Creates where the positions are kept if it is missing (idem-diesel:
    /// the table `idem_kafka_offsets`); nothing for an inbox in memory.
    fn migrate_positions(&self) -> InboxFuture<'_, ()>;

    /// The stored next offset of each of the topic's partitions that has
    /// one, as committed.
    fn positions<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> InboxFuture<'a, HashMap<i32, i64>>;

    /// Moves a partition's position as `advance` says, on the handler's
    /// transaction `tx` (it commits or rolls back with the inbox row); `true`
    /// too when the position is already at `advance.to` (see the module's
    /// docs); `false` (nothing written) when it holds any other offset than
    /// `advance.from`: the partition has another owner.
    ///
    /// On a database the move also takes the position's lock: a member that
    /// lost the partition waits for the new owner's commit, then finds the
    /// position moved.
    fn advance_in<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        advance: &'a Advance<'a>,
    ) -> InboxFuture<'a, bool>;

    /// Moves a partition's position in a transaction of its own (a record
    /// that ran no handler: a duplicate, a dead letter); `false` when fenced.
    fn advance_alone<'a>(&'a self, advance: &'a Advance<'a>) -> InboxFuture<'a, bool>;

    /// [`Inbox::process`] of a partition's record, its position moved as
    /// `advance` says on the same transaction before `handler` runs: the
    /// effect, the inbox row and the position commit together. Fenced (the
    /// position holds another offset: the partition has another owner), the
    /// handler does not run and nothing commits: [`Entered::Failed`] whose
    /// error is [`PartitionLost`]. A message that runs no handler (a
    /// duplicate, a dead letter) moves nothing here: see
    /// [`advance_alone`](Self::advance_alone).
    ///
    /// The default moves the position from the transaction, before the
    /// handler ([`advance_in`](Self::advance_in)). A database inbox may send
    /// the move with its entry instead (idem-diesel's `PgInbox`: one round
    /// trip fewer).
    fn process_advancing<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        advance: &'a Advance<'a>,
        handler: &'a (dyn Handler<Self::Tx> + 'a),
    ) -> InboxFuture<'a, Entered>
    where
        Self: Sized,
    {
        Box::pin(async move {
            let first = AdvanceFirst {
                positions: self,
                advance,
                handler,
            };
            self.process(entry, message, &first).await
        })
    }
}

/// A handler run after the partition's position moved on its transaction:
/// [`Positions::process_advancing`]'s default.
struct AdvanceFirst<'a, P: Positions> {
    positions: &'a P,
    advance: &'a Advance<'a>,
    handler: &'a (dyn Handler<P::Tx> + 'a),
}

impl<P: Positions> Handler<P::Tx> for AdvanceFirst<'_, P> {
    fn handle<'a>(&'a self, attempt: Attempt<'a>, tx: &'a mut P::Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            moved(self.positions, tx, self.advance).await?;
            self.handler.handle(attempt, tx).await
        })
    }
}

/// Moves the partition's position on the handler's transaction before the
/// handler runs: fenced, [`PartitionLost`]; the database's own error as the
/// handler's (a failed attempt, retried in place). What a record's move and
/// a batch's share.
pub(crate) async fn moved<P: Positions>(
    positions: &P,
    tx: &mut P::Tx,
    advance: &Advance<'_>,
) -> Result<(), HandlerError> {
    match positions.advance_in(tx, advance).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(HandlerError::transient(PartitionLost)),
        Err(InboxError::Unavailable(source)) => Err(HandlerError::transient(source)),
        Err(error) => Err(HandlerError::transient(error)),
    }
}
