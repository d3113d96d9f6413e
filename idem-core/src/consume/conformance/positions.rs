//! The conformance suite of the positions ([`Positions`]), which every inbox
//! that keeps them passes (feature `test-util`): a first move inserts, a
//! move from a stale offset writes nothing, a move repeated after it landed
//! answers `true`, a rolled-back transaction moves nothing, the positions
//! read back are what committed, per consumer and topic, and a record
//! processed with its move ([`Positions::process_advancing`]) runs its
//! handler only once the position moved, and records applied in batches
//! ([`Protocol::decide_batch_advancing`](crate::consume::Protocol::decide_batch_advancing))
//! move it in order, a poison record alone.
//!
//! # Running it against an inbox
//!
//! Hand an async function answering a **fresh**, empty inbox (its own tables
//! created: each case creates the positions' with
//! [`Positions::migrate_positions`]) to
//! [`positions_conformance_tests!`](crate::positions_conformance_tests),
//! which writes one test per case, or run the cases one by one through
//! [`run_case`] (names in [`CASES`]):
//!
//! ```
//! use idem_core::consume::MemoryInbox;
//!
//! async fn fresh() -> MemoryInbox {
//!     MemoryInbox::new()
//! }
//!
//! idem_core::positions_conformance_tests!(fresh);
//! # fn main() {}
//! ```

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::SystemTime;

use crate::consume::{
    Advance, Attempt, Entered, Entry, Handler, HandlerError, HandlerFuture, Message, PartitionLost,
    Positions,
};

/// A handler that moves one position on its transaction, remembers the
/// answer, then fails if told to.
struct Mover<'i, I> {
    inbox: &'i I,
    consumer: &'static str,
    topic: &'static str,
    partition: i32,
    from: Option<i64>,
    to: i64,
    fail: bool,
    answer: Mutex<Option<bool>>,
}

impl<I: Positions> Handler<I::Tx> for Mover<'_, I> {
    fn handle<'a>(&'a self, _attempt: Attempt<'a>, tx: &'a mut I::Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            let advance = Advance {
                consumer: self.consumer,
                topic: self.topic,
                partition: self.partition,
                from: self.from,
                to: self.to,
            };
            let moved = self
                .inbox
                .advance_in(tx, &advance)
                .await
                .map_err(HandlerError::transient)?;
            *self.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(moved);
            if self.fail {
                return Err(HandlerError::transient("the handler failed on purpose"));
            }
            Ok(())
        })
    }
}

/// Moves a position in a handler's transaction, through [`Inbox::process`]
/// of a new message (`id`); answers what the move answered and what the
/// inbox did.
async fn move_in<I: Positions>(
    inbox: &I,
    id: &str,
    (consumer, topic, partition): (&'static str, &'static str, i32),
    from: Option<i64>,
    to: i64,
    fail: bool,
) -> (Option<bool>, Entered) {
    let mover = Mover {
        inbox,
        consumer,
        topic,
        partition,
        from,
        to,
        fail,
        answer: Mutex::new(None),
    };
    let message = Message::new("body").id(id);
    let entry = Entry {
        consumer,
        message_id: id,
        fingerprint: message.fingerprint(),
        at: SystemTime::now(),
    };
    let entered = match inbox.process(&entry, &message, &mover).await {
        Ok(entered) => entered,
        Err(error) => panic!("process failed: {error}"),
    };
    let answer = *mover.answer.lock().unwrap_or_else(|p| p.into_inner());
    (answer, entered)
}

/// Moves a position in a transaction of its own.
async fn alone<I: Positions>(
    inbox: &I,
    (consumer, topic, partition): (&str, &str, i32),
    from: Option<i64>,
    to: i64,
) -> bool {
    let advance = Advance {
        consumer,
        topic,
        partition,
        from,
        to,
    };
    match inbox.advance_alone(&advance).await {
        Ok(moved) => moved,
        Err(error) => panic!("advance_alone failed: {error}"),
    }
}

async fn positions<I: Positions>(inbox: &I, consumer: &str, topic: &str) -> HashMap<i32, i64> {
    match inbox.positions(consumer, topic).await {
        Ok(positions) => positions,
        Err(error) => panic!("positions failed: {error}"),
    }
}

async fn migrated<I: Positions>(inbox: &I) {
    for _ in 0..2 {
        if let Err(error) = inbox.migrate_positions().await {
            panic!("migrate_positions failed (twice is allowed): {error}");
        }
    }
}

fn processed(entered: &Entered) -> bool {
    matches!(entered, Entered::Processed { .. })
}

/// A partition's first move inserts its position, alone or in a handler's
/// transaction, whatever offset the writer believed it saw.
pub async fn a_first_move_inserts_the_position<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    assert_eq!(positions(&inbox, "c", "t").await, HashMap::new());
    assert!(
        alone(&inbox, ("c", "t", 0), None, 5).await,
        "a first move alone inserts"
    );
    let (answer, entered) = move_in(&inbox, "m-first", ("c", "t", 1), None, 8, false).await;
    assert_eq!(answer, Some(true), "a first move in a transaction inserts");
    assert!(processed(&entered), "the handler's transaction committed");
    assert!(
        alone(&inbox, ("c", "t", 2), Some(41), 42).await,
        "a missing position is inserted even when the writer saw one"
    );
    assert_eq!(
        positions(&inbox, "c", "t").await,
        HashMap::from([(0, 5), (1, 8), (2, 42)])
    );
}

/// A move from an offset the position no longer holds writes nothing and
/// answers `false`: another member owns the partition.
pub async fn a_move_from_a_stale_offset_writes_nothing<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    assert!(alone(&inbox, ("c", "t", 0), None, 10).await);
    assert!(
        !alone(&inbox, ("c", "t", 0), Some(5), 6).await,
        "from 5, the position being 10: fenced"
    );
    assert!(
        !alone(&inbox, ("c", "t", 0), None, 3).await,
        "another member inserted first: fenced"
    );
    let (answer, entered) = move_in(&inbox, "m-stale", ("c", "t", 0), Some(7), 8, false).await;
    assert_eq!(answer, Some(false), "fenced in a transaction too");
    assert!(processed(&entered));
    assert_eq!(
        positions(&inbox, "c", "t").await,
        HashMap::from([(0, 10)]),
        "nothing written"
    );
}

/// A move repeated after it landed (a COMMIT whose answer was lost) finds
/// the position at its target and answers `true`.
pub async fn a_move_repeated_after_it_landed_answers_true<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    assert!(alone(&inbox, ("c", "t", 0), None, 5).await);
    assert!(
        alone(&inbox, ("c", "t", 0), None, 5).await,
        "the first move again: at its target"
    );
    assert!(alone(&inbox, ("c", "t", 0), Some(5), 6).await);
    assert!(
        alone(&inbox, ("c", "t", 0), Some(5), 6).await,
        "5 to 6 again: at its target"
    );
    let (answer, entered) = move_in(&inbox, "m-again", ("c", "t", 0), Some(5), 6, false).await;
    assert_eq!(answer, Some(true), "at its target, in a transaction too");
    assert!(processed(&entered));
    let (answer, _) = move_in(&inbox, "m-next", ("c", "t", 0), Some(6), 7, false).await;
    assert_eq!(answer, Some(true));
    let (answer, _) = move_in(&inbox, "m-next-again", ("c", "t", 0), Some(6), 7, false).await;
    assert_eq!(answer, Some(true), "a committed move repeated");
    assert_eq!(positions(&inbox, "c", "t").await, HashMap::from([(0, 7)]));
}

/// A move in a handler's transaction that rolls back (the handler failed)
/// moves nothing: the position is where it was, and the move can be made
/// again.
pub async fn a_rolled_back_transaction_moves_nothing<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    let (answer, entered) = move_in(&inbox, "m-undone", ("c", "t", 0), None, 3, true).await;
    assert_eq!(answer, Some(true), "the move itself went through");
    assert!(
        matches!(entered, Entered::Failed { .. }),
        "the handler failed, got {entered:?}"
    );
    assert_eq!(
        positions(&inbox, "c", "t").await,
        HashMap::new(),
        "a first move rolled back inserts nothing"
    );
    assert!(alone(&inbox, ("c", "t", 0), None, 3).await);
    let (answer, entered) = move_in(&inbox, "m-undone-2", ("c", "t", 0), Some(3), 4, true).await;
    assert_eq!(answer, Some(true));
    assert!(matches!(entered, Entered::Failed { .. }));
    assert_eq!(
        positions(&inbox, "c", "t").await,
        HashMap::from([(0, 3)]),
        "a move rolled back leaves the position"
    );
    assert!(
        !alone(&inbox, ("c", "t", 0), Some(4), 5).await,
        "the rolled-back target is not the position"
    );
    let (answer, entered) = move_in(&inbox, "m-undone-2", ("c", "t", 0), Some(3), 4, false).await;
    assert_eq!(answer, Some(true), "the move is made again");
    assert!(processed(&entered));
    assert_eq!(positions(&inbox, "c", "t").await, HashMap::from([(0, 4)]));
}

/// The positions read back are what committed, for the consumer and topic
/// asked: other consumers and topics keep their own.
pub async fn positions_are_kept_per_consumer_and_topic<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    assert!(alone(&inbox, ("c-a", "t-1", 0), None, 10).await);
    assert!(alone(&inbox, ("c-a", "t-1", 1), None, 11).await);
    assert!(alone(&inbox, ("c-a", "t-2", 0), None, 20).await);
    assert!(alone(&inbox, ("c-b", "t-1", 0), None, 30).await);
    let (answer, _) = move_in(&inbox, "m-a", ("c-a", "t-1", 1), Some(11), 12, false).await;
    assert_eq!(answer, Some(true));
    let (answer, _) = move_in(&inbox, "m-b", ("c-b", "t-1", 0), Some(30), 31, true).await;
    assert_eq!(answer, Some(true));
    assert!(
        !alone(&inbox, ("c-b", "t-1", 0), Some(10), 11).await,
        "c-b's position is its own (30), not c-a's (10)"
    );
    assert_eq!(
        positions(&inbox, "c-a", "t-1").await,
        HashMap::from([(0, 10), (1, 12)])
    );
    assert_eq!(
        positions(&inbox, "c-a", "t-2").await,
        HashMap::from([(0, 20)])
    );
    assert_eq!(
        positions(&inbox, "c-b", "t-1").await,
        HashMap::from([(0, 30)]),
        "c-b's rolled-back move is not read back"
    );
    assert_eq!(positions(&inbox, "c-b", "t-2").await, HashMap::new());
}

/// A handler that notes it ran, then fails if told to.
struct Noted {
    ran: Mutex<bool>,
    fail: bool,
}

impl<Tx: Send + ?Sized> Handler<Tx> for Noted {
    fn handle<'a>(&'a self, _attempt: Attempt<'a>, _tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            *self.ran.lock().unwrap_or_else(|p| p.into_inner()) = true;
            if self.fail {
                return Err(HandlerError::transient("the handler failed on purpose"));
            }
            Ok(())
        })
    }
}

/// Processes a new message (`id`) with its move, through
/// [`Positions::process_advancing`]; answers whether the handler ran and
/// what the inbox did.
async fn advancing<I: Positions>(
    inbox: &I,
    id: &str,
    partition: i32,
    from: Option<i64>,
    to: i64,
    fail: bool,
) -> (bool, Entered) {
    let noted = Noted {
        ran: Mutex::new(false),
        fail,
    };
    let message = Message::new("body").id(id);
    let entry = Entry {
        consumer: "c",
        message_id: id,
        fingerprint: message.fingerprint(),
        at: SystemTime::now(),
    };
    let advance = Advance {
        consumer: "c",
        topic: "t",
        partition,
        from,
        to,
    };
    let entered = match inbox
        .process_advancing(&entry, &message, &advance, &noted)
        .await
    {
        Ok(entered) => entered,
        Err(error) => panic!("process_advancing failed: {error}"),
    };
    let ran = *noted.ran.lock().unwrap_or_else(|p| p.into_inner());
    (ran, entered)
}

fn lost(entered: &Entered) -> bool {
    matches!(entered, Entered::Failed { error, .. } if error.source_error().is::<PartitionLost>())
}

/// A record processed with its move runs its handler once the position
/// moved, and both commit; fenced, the handler does not run and nothing
/// commits, the message's entry neither (it runs once its owner's move
/// applies); a failed handler moves nothing; a duplicate runs nothing and
/// moves nothing.
pub async fn a_record_processed_with_its_move_runs_once_the_position_moved<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    let (ran, entered) = advancing(&inbox, "r-0", 0, None, 1, false).await;
    assert!(ran && processed(&entered), "a first record: {entered:?}");
    assert_eq!(positions(&inbox, "c", "t").await, HashMap::from([(0, 1)]));

    let (ran, entered) = advancing(&inbox, "r-1", 0, Some(5), 6, false).await;
    assert!(!ran, "fenced: the handler does not run");
    assert!(lost(&entered), "fenced: PartitionLost, got {entered:?}");
    assert_eq!(positions(&inbox, "c", "t").await, HashMap::from([(0, 1)]));

    let (ran, entered) = advancing(&inbox, "r-1", 0, Some(1), 2, false).await;
    assert!(
        ran && processed(&entered),
        "the fenced record's entry was not kept: it runs, got {entered:?}"
    );
    assert_eq!(positions(&inbox, "c", "t").await, HashMap::from([(0, 2)]));

    let (ran, entered) = advancing(&inbox, "r-2", 0, Some(2), 3, true).await;
    assert!(ran, "the handler ran, and failed");
    assert!(
        matches!(entered, Entered::Failed { .. }) && !lost(&entered),
        "a failed handler, not a fence: {entered:?}"
    );
    assert_eq!(
        positions(&inbox, "c", "t").await,
        HashMap::from([(0, 2)]),
        "a failed handler moves nothing"
    );

    let (ran, entered) = advancing(&inbox, "r-1", 0, Some(2), 3, false).await;
    assert!(!ran, "a duplicate runs nothing");
    assert!(matches!(entered, Entered::Duplicate), "got {entered:?}");
    assert_eq!(
        positions(&inbox, "c", "t").await,
        HashMap::from([(0, 2)]),
        "a duplicate moves nothing here"
    );
}

/// How a partition's records went through [`drive`].
#[derive(Debug, Default, PartialEq, Eq)]
struct Driven {
    /// The partition's next offset at the end.
    next: Option<i64>,
    /// The records applied in a batch, and one at a time.
    batched: usize,
    alone: usize,
    /// Attempts that failed alone, and the records dead-lettered.
    retried: usize,
    dead: Vec<String>,
    /// Whether a fence stopped it.
    fenced: bool,
}

/// Applies `ids` (offsets from `first`) in order as a partition's worker
/// does: batches while they apply, the record a batch stops at one at a
/// time (retried in place, dead-lettered after its attempts), then batches
/// again.
async fn drive<I: Positions>(
    protocol: &crate::consume::Protocol<I>,
    ids: &[String],
    first: i64,
    from: Option<i64>,
    handler: &crate::consume::Batch<Poisoned>,
) -> Driven {
    use crate::consume::{Acked, Advanced, Decision, PartitionBatch};
    let messages: Vec<Message> = ids.iter().map(|id| Message::new("body").id(id)).collect();
    let offsets: Vec<i64> = (first..).take(ids.len()).collect();
    let mut driven = Driven {
        next: from,
        ..Driven::default()
    };
    let mut i = 0;
    while i < messages.len() {
        let partition = PartitionBatch {
            consumer: "c",
            topic: "t",
            partition: 0,
            from: driven.next,
            offsets: &offsets[i..],
        };
        match protocol
            .decide_batch_advancing(&messages[i..], &partition, handler.handler())
            .await
        {
            Advanced::Applied(n) => {
                if n > 0 {
                    i += n;
                    driven.batched += n;
                    driven.next = Some(offsets[i - 1] + 1);
                }
            }
            Advanced::Fenced => {
                driven.fenced = true;
                return driven;
            }
            Advanced::Unavailable { .. } => panic!("the inbox is unavailable"),
        }
        if i == messages.len() {
            break;
        }
        let advance = Advance {
            consumer: "c",
            topic: "t",
            partition: 0,
            from: driven.next,
            to: offsets[i] + 1,
        };
        match protocol
            .decide_advancing(&messages[i], &advance, handler)
            .await
        {
            Decision::Ack(Acked::Processed { .. }) => {}
            Decision::Ack(_) => {
                assert!(alone(protocol.inbox(), ("c", "t", 0), advance.from, advance.to).await)
            }
            Decision::Retry(retry) if retry.reason.contains("another owner") => {
                driven.fenced = true;
                return driven;
            }
            Decision::Retry(_) => {
                driven.retried += 1;
                continue;
            }
            Decision::DeadLetter(letter) => {
                protocol.published(&letter).await;
                driven.dead.push(letter.message_id);
                assert!(alone(protocol.inbox(), ("c", "t", 0), advance.from, advance.to).await);
            }
            Decision::Requeue { .. } => panic!("the inbox is unavailable"),
        }
        driven.alone += 1;
        driven.next = Some(advance.to);
        i += 1;
    }
    driven
}

/// A batch handler that fails every batch holding the poison.
struct Poisoned(Option<&'static str>);

impl<Tx: ?Sized + Send> crate::consume::BatchHandler<Tx> for Poisoned {
    fn handle<'a>(&'a self, batch: &'a [Attempt<'a>], _tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            match self.0 {
                Some(poison) if batch.iter().any(|attempt| attempt.key() == poison) => {
                    Err(HandlerError::transient("the poison failed its batch"))
                }
                _ => Ok(()),
            }
        })
    }
}

/// A partition's records applied in batches, in order, each batch with its
/// move: a poison record ends alone, retried and dead-lettered after exactly
/// its attempts, the records around it applied once and the position past
/// all of them; the same records again are duplicates that move nothing
/// back; a stale owner's batch is fenced and keeps nothing.
pub async fn records_applied_in_batches_move_the_position_in_order<I: Positions>(inbox: I) {
    migrated(&inbox).await;
    let policy = crate::consume::ConsumerPolicy::new()
        .max_attempts(3)
        .backoff(crate::retry::Backoff::new(
            std::time::Duration::ZERO,
            std::time::Duration::ZERO,
        ));
    let protocol = crate::consume::Protocol::new("c", inbox, policy);
    let ids: Vec<String> = (0..20).map(|i| format!("r-{i}")).collect();
    let handler = crate::consume::Batch::new(Poisoned(Some("r-13")), 64);
    let driven = drive(&protocol, &ids, 0, None, &handler).await;
    assert_eq!(driven.next, Some(20), "{driven:?}");
    assert_eq!(driven.dead, ["r-13"], "{driven:?}");
    assert_eq!(
        driven.retried, 2,
        "two retries, then the dead letter: {driven:?}"
    );
    assert_eq!(driven.batched + driven.alone, 20, "{driven:?}");
    assert_eq!(
        positions(protocol.inbox(), "c", "t").await,
        HashMap::from([(0, 20)])
    );
    let letter = match protocol.inbox().dead_letter("c", "r-13").await {
        Ok(Some(letter)) => letter,
        other => panic!("r-13 is a dead letter: {other:?}"),
    };
    assert_eq!(letter.attempts, 3);

    // The same records again (a consumer whose broker position was behind):
    // each a duplicate, the position where it was.
    let again = drive(&protocol, &ids, 0, Some(20), &handler).await;
    assert_eq!((again.batched, again.dead.len()), (0, 0), "{again:?}");
    assert_eq!(
        positions(protocol.inbox(), "c", "t").await,
        HashMap::from([(0, 20)])
    );

    // A stale owner, which saw the position at 5: fenced, nothing kept.
    let more: Vec<String> = (20..24).map(|i| format!("r-{i}")).collect();
    let stale = drive(&protocol, &more, 20, Some(5), &handler).await;
    assert!(stale.fenced, "{stale:?}");
    assert_eq!(
        positions(protocol.inbox(), "c", "t").await,
        HashMap::from([(0, 20)])
    );
    let owner = drive(&protocol, &more, 20, Some(20), &handler).await;
    assert_eq!(
        (owner.next, owner.fenced, owner.batched + owner.alone),
        (Some(24), false, 4),
        "the fenced records were not kept: the owner applies them, {owner:?}"
    );
}

/// Writes one test per case of the positions' suite, each on a
/// multi-threaded runtime with 2 workers, from an async function answering a
/// fresh inbox that implements [`Positions`](crate::consume::Positions).
#[macro_export]
macro_rules! positions_conformance_tests {
    ($fresh:path) => {
        $crate::positions_conformance_tests!(@cases $fresh;
            a_first_move_inserts_the_position,
            a_move_from_a_stale_offset_writes_nothing,
            a_move_repeated_after_it_landed_answers_true,
            a_rolled_back_transaction_moves_nothing,
            positions_are_kept_per_consumer_and_topic,
            a_record_processed_with_its_move_runs_once_the_position_moved,
            records_applied_in_batches_move_the_position_in_order,
        );
    };
    (@cases $fresh:path; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::consume::conformance::block_on(async {
                    let inbox = $fresh().await;
                    $crate::consume::conformance::positions::$case(inbox).await;
                });
            }
        )*
    };
}

/// The names of the suite's cases, in order (for harnesses that run them one
/// by one through [`run_case`]).
pub const CASES: &[&str] = &[
    "a_first_move_inserts_the_position",
    "a_move_from_a_stale_offset_writes_nothing",
    "a_move_repeated_after_it_landed_answers_true",
    "a_rolled_back_transaction_moves_nothing",
    "positions_are_kept_per_consumer_and_topic",
    "a_record_processed_with_its_move_runs_once_the_position_moved",
    "records_applied_in_batches_move_the_position_in_order",
];

/// Runs the case named `name` (one of [`CASES`]) against `inbox`.
pub async fn run_case<I: Positions>(name: &str, inbox: I) {
    match name {
        "a_first_move_inserts_the_position" => a_first_move_inserts_the_position(inbox).await,
        "a_move_from_a_stale_offset_writes_nothing" => {
            a_move_from_a_stale_offset_writes_nothing(inbox).await
        }
        "a_move_repeated_after_it_landed_answers_true" => {
            a_move_repeated_after_it_landed_answers_true(inbox).await
        }
        "a_rolled_back_transaction_moves_nothing" => {
            a_rolled_back_transaction_moves_nothing(inbox).await
        }
        "positions_are_kept_per_consumer_and_topic" => {
            positions_are_kept_per_consumer_and_topic(inbox).await
        }
        "a_record_processed_with_its_move_runs_once_the_position_moved" => {
            a_record_processed_with_its_move_runs_once_the_position_moved(inbox).await
        }
        "records_applied_in_batches_move_the_position_in_order" => {
            records_applied_in_batches_move_the_position_in_order(inbox).await
        }
        other => panic!("no positions conformance case is named {other}"),
    }
}
