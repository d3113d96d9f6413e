//! The conformance suite every inbox passes (feature `test-util`).
//!
//! An inbox only makes each step atomic, but every step must mean the same in
//! every inbox: one application per message id under any concurrency, a
//! failed attempt rolled back (for a transactional inbox) and counted, the
//! count that buries, dead letters skipped and published once, re-drives, a
//! reused id, isolated consumers, concurrent buries that each see a
//! different count (so each crossing of the alert's threshold alerts once),
//! and batches ([`Inbox::process_batch`]): each new message applied once, a
//! poison message alone after exactly its attempts, overlapping batches.
//!
//! # Running it against an inbox
//!
//! Implement [`Subject`] (the inbox, and how a handler writes an effect on its
//! transaction and how committed effects are counted) and hand an async
//! function answering a **fresh** subject to
//! [`inbox_conformance_tests!`](crate::inbox_conformance_tests), which writes
//! one test per case:
//!
//! ```
//! use idem_core::consume::MemoryInbox;
//! use idem_core::consume::conformance::Untransacted;
//!
//! // An inbox without a transaction: effects are counted in memory.
//! async fn fresh() -> Untransacted<MemoryInbox> {
//!     Untransacted::new(MemoryInbox::new())
//! }
//!
//! idem_core::inbox_conformance_tests!(fresh);
//! # fn main() {}
//! ```
//!
//! A transactional inbox implements [`Subject`] itself: its handlers write a
//! row in the transaction they are given, and `count` reads the committed
//! rows.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

pub mod positions;

/// Runs one case of the suites' test macros on a runtime of its own (two
/// workers: the cases run steps concurrently). Not for use outside them.
///
/// # Panics
///
/// When the runtime cannot be built.
#[doc(hidden)]
pub fn block_on<F: std::future::Future>(case: F) -> F::Output {
    #[allow(clippy::expect_used)]
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(case)
}

use super::{Attempt, Buried, Entered, Entry, Failure, Handler, HandlerError, Inbox, Message};
use crate::store::BoxError;

/// The future a [`Subject`] step answers.
pub type SubjectFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send + 'a>>;

/// An inbox under test, with a way to write and count effects.
pub trait Subject: Send + Sync + 'static {
    /// The inbox.
    type Inbox: Inbox;
    /// The inbox under test.
    fn inbox(&self) -> &Self::Inbox;
    /// Writes one effect named `name` on the handler's transaction (for a
    /// transactional inbox it commits or rolls back with the inbox row).
    fn write<'a>(
        &'a self,
        tx: &'a mut <Self::Inbox as Inbox>::Tx,
        name: &'a str,
    ) -> SubjectFuture<'a, ()>;
    /// How many effects named `name` are committed.
    fn count<'a>(&'a self, name: &'a str) -> SubjectFuture<'a, u64>;
}

/// The [`Subject`] of an inbox without a transaction (`Tx = ()`:
/// [`MemoryInbox`](super::MemoryInbox), [`StoreInbox`](super::StoreInbox)):
/// its effects are counted in memory.
pub struct Untransacted<I> {
    inbox: I,
    effects: Mutex<HashMap<String, u64>>,
}

impl<I> Untransacted<I> {
    /// The subject of `inbox`, no effect counted yet.
    pub fn new(inbox: I) -> Self {
        Self {
            inbox,
            effects: Mutex::new(HashMap::new()),
        }
    }

    fn effects(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.effects.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<I: Inbox<Tx = ()>> Subject for Untransacted<I> {
    type Inbox = I;

    fn inbox(&self) -> &I {
        &self.inbox
    }

    fn write<'a>(&'a self, _tx: &'a mut (), name: &'a str) -> SubjectFuture<'a, ()> {
        Box::pin(async move {
            *self.effects().entry(name.to_owned()).or_default() += 1;
            Ok(())
        })
    }

    fn count<'a>(&'a self, name: &'a str) -> SubjectFuture<'a, u64> {
        Box::pin(async move { Ok(self.effects().get(name).copied().unwrap_or(0)) })
    }
}

/// Writes one effect named after the message id, then fails if told to, and
/// counts its runs and the attempt numbers it saw.
struct Effect<'s, S> {
    subject: &'s S,
    fail: bool,
    pause: Duration,
    runs: AtomicU32,
    attempts: std::sync::Mutex<Vec<u32>>,
}

impl<'s, S: Subject> Effect<'s, S> {
    fn new(subject: &'s S) -> Self {
        Self {
            subject,
            fail: false,
            pause: Duration::ZERO,
            runs: AtomicU32::new(0),
            attempts: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn failing(mut self) -> Self {
        self.fail = true;
        self
    }

    fn slow(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }

    fn attempts(&self) -> Vec<u32> {
        self.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl<S: Subject> Handler<<S::Inbox as Inbox>::Tx> for Effect<'_, S> {
    fn handle<'a>(
        &'a self,
        attempt: Attempt<'a>,
        tx: &'a mut <S::Inbox as Inbox>::Tx,
    ) -> super::HandlerFuture<'a> {
        Box::pin(async move {
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.attempts
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(attempt.number());
            self.subject
                .write(tx, attempt.key())
                .await
                .map_err(HandlerError::transient)?;
            if !self.pause.is_zero() {
                tokio::time::sleep(self.pause).await;
            }
            if self.fail {
                return Err(HandlerError::transient("the handler failed on purpose"));
            }
            Ok(())
        })
    }
}

fn entry<'a>(consumer: &'a str, id: &'a str, message: &Message) -> Entry<'a> {
    Entry {
        consumer,
        message_id: id,
        fingerprint: message.fingerprint(),
        at: SystemTime::now(),
    }
}

async fn process<S: Subject>(
    subject: &S,
    consumer: &str,
    message: &Message,
    handler: &Effect<'_, S>,
) -> Entered {
    let id = message.message_id().unwrap_or("none");
    let entry = entry(consumer, id, message);
    match subject.inbox().process(&entry, message, handler).await {
        Ok(entered) => entered,
        Err(error) => panic!("process failed: {error}"),
    }
}

async fn fail<S: Subject>(subject: &S, consumer: &str, id: &str, bury_at: u32) -> super::Counted {
    let message = Message::new("body").id(id);
    let entry = entry(consumer, id, &message);
    let failure = Failure {
        reason: "it failed",
        bury_at,
    };
    match subject.inbox().fail(&entry, &failure).await {
        Ok(counted) => counted,
        Err(error) => panic!("fail failed: {error}"),
    }
}

async fn count<S: Subject>(subject: &S, name: &str) -> u64 {
    match subject.count(name).await {
        Ok(n) => n,
        Err(error) => panic!("count failed: {error}"),
    }
}

/// A message is applied once; its redeliveries are duplicates.
pub async fn applies_once_and_skips_duplicates<S: Subject>(subject: S) {
    let message = Message::new("body").id("m-once");
    let effect = Effect::new(&subject);
    let first = process(&subject, "c", &message, &effect).await;
    assert!(
        matches!(first, Entered::Processed { attempt: 1 }),
        "a new message is processed on attempt 1, got {first:?}"
    );
    for _ in 0..3 {
        let again = process(&subject, "c", &message.clone().redelivered(true), &effect).await;
        assert!(
            matches!(again, Entered::Duplicate),
            "a redelivery is a duplicate, got {again:?}"
        );
    }
    assert_eq!(effect.runs(), 1, "the handler ran once");
    assert_eq!(count(&subject, "m-once").await, 1, "one effect committed");
}

/// Of concurrent deliveries of one message, one applies it; the others wait
/// and are duplicates.
pub async fn concurrent_deliveries_apply_once<S: Subject>(subject: S) {
    let message = Message::new("body").id("m-race");
    let effect = Effect::new(&subject).slow(Duration::from_millis(30));
    let deliveries = (0..16).map(|_| process(&subject, "c", &message, &effect));
    let outcomes = futures_util::future::join_all(deliveries).await;
    let processed = outcomes
        .iter()
        .filter(|o| matches!(o, Entered::Processed { .. }))
        .count();
    let duplicates = outcomes
        .iter()
        .filter(|o| matches!(o, Entered::Duplicate))
        .count();
    assert_eq!(
        (processed, duplicates),
        (1, 15),
        "one of 16 concurrent deliveries applies the message: {outcomes:?}"
    );
    assert_eq!(effect.runs(), 1, "the handler ran once");
    assert_eq!(count(&subject, "m-race").await, 1, "one effect committed");
}

/// A failed attempt rolls back (a transactional inbox) and the next runs
/// with the next attempt number.
pub async fn a_failed_attempt_rolls_back_and_the_next_is_numbered<S: Subject>(subject: S) {
    let message = Message::new("body").id("m-fail");
    let failing = Effect::new(&subject).failing();
    let first = process(&subject, "c", &message, &failing).await;
    assert!(
        matches!(first, Entered::Failed { attempt: 1, .. }),
        "a failing handler's attempt is reported failed, got {first:?}"
    );
    if <S::Inbox as Inbox>::TRANSACTIONAL {
        assert_eq!(
            count(&subject, "m-fail").await,
            0,
            "a failed attempt's writes are rolled back"
        );
    }
    let counted = fail(&subject, "c", "m-fail", 3).await;
    assert_eq!((counted.attempts, counted.buried), (1, None));
    let effect = Effect::new(&subject);
    let second = process(&subject, "c", &message, &effect).await;
    assert!(
        matches!(second, Entered::Processed { attempt: 2 }),
        "the attempt after one failure is number 2, got {second:?}"
    );
    assert_eq!(effect.attempts(), vec![2], "the handler is told attempt 2");
    let expected = if <S::Inbox as Inbox>::TRANSACTIONAL {
        1
    } else {
        2
    };
    assert_eq!(count(&subject, "m-fail").await, expected);
}

/// The failure that reaches `bury_at` makes the message a dead letter, with
/// every attempt's time in order.
pub async fn the_last_failure_buries_with_every_attempt_time<S: Subject>(subject: S) {
    let first = fail(&subject, "c", "m-bury", 3).await;
    let second = fail(&subject, "c", "m-bury", 3).await;
    let third = fail(&subject, "c", "m-bury", 3).await;
    assert_eq!((first.attempts, second.attempts, third.attempts), (1, 2, 3));
    assert_eq!((first.buried, second.buried), (None, None));
    assert_eq!(
        third.buried,
        Some(Buried::New { dead_letters: 1 }),
        "the third failure of three buries it, the consumer's first dead letter"
    );
    assert_eq!(third.attempted_at.len(), 3, "three attempt times");
    assert!(
        third.attempted_at.windows(2).all(|w| w[0] <= w[1]),
        "attempt times in order"
    );
    let letter = match subject.inbox().dead_letter("c", "m-bury").await {
        Ok(Some(letter)) => letter,
        other => panic!("the dead letter is recorded, got {other:?}"),
    };
    assert_eq!(
        (
            letter.attempts,
            letter.reason.as_str(),
            letter.attempted_at.len(),
            letter.published
        ),
        (3, "it failed", 3, false)
    );
    let again = fail(&subject, "c", "m-bury", 3).await;
    assert_eq!(
        again.buried,
        Some(Buried::Already { published: false }),
        "a dead letter's failure is not counted again"
    );
    assert_eq!(again.attempts, 3);
}

/// `bury_at` 1 buries a fresh message at once.
pub async fn a_permanent_failure_buries_at_once<S: Subject>(subject: S) {
    let counted = fail(&subject, "c", "m-permanent", 1).await;
    assert_eq!(
        (counted.attempts, counted.buried),
        (1, Some(Buried::New { dead_letters: 1 }))
    );
}

/// A dead letter is not run; once published, it says so.
pub async fn a_dead_letter_is_skipped_and_published_once<S: Subject>(subject: S) {
    let message = Message::new("body").id("m-dead");
    fail(&subject, "c", "m-dead", 1).await;
    let effect = Effect::new(&subject);
    let before = process(&subject, "c", &message, &effect).await;
    assert!(
        matches!(before, Entered::Dead { published: false }),
        "a dead letter not yet published, got {before:?}"
    );
    if let Err(error) = subject.inbox().published("c", "m-dead").await {
        panic!("published failed: {error}");
    }
    let after = process(&subject, "c", &message, &effect).await;
    assert!(
        matches!(after, Entered::Dead { published: true }),
        "a published dead letter, got {after:?}"
    );
    assert_eq!(effect.runs(), 0, "a dead letter's handler never runs");
}

/// A different body under an id already applied is reported, not run.
pub async fn a_reused_id_is_reported_not_run<S: Subject>(subject: S) {
    let effect = Effect::new(&subject);
    process(
        &subject,
        "c",
        &Message::new("amount 5").id("m-reused"),
        &effect,
    )
    .await;
    let reused = process(
        &subject,
        "c",
        &Message::new("amount 7").id("m-reused"),
        &effect,
    )
    .await;
    assert!(
        matches!(reused, Entered::Reused),
        "another body under the id is reused, got {reused:?}"
    );
    assert_eq!(effect.runs(), 1);
    assert_eq!(count(&subject, "m-reused").await, 1);
}

/// A re-driven dead letter is forgotten: its next delivery runs, attempt 1.
pub async fn a_redriven_dead_letter_runs_again_from_attempt_one<S: Subject>(subject: S) {
    let message = Message::new("body").id("m-redrive");
    fail(&subject, "c", "m-redrive", 2).await;
    fail(&subject, "c", "m-redrive", 2).await;
    let forgotten = match subject.inbox().redrive("c", "m-redrive").await {
        Ok(forgotten) => forgotten,
        Err(error) => panic!("redrive failed: {error}"),
    };
    assert_eq!(
        forgotten.map(|l| l.attempts),
        Some(2),
        "redrive answers the letter"
    );
    let none = subject.inbox().redrive("c", "m-redrive").await;
    assert!(
        matches!(none, Ok(None)),
        "a second redrive finds nothing, got {none:?}"
    );
    let effect = Effect::new(&subject);
    let entered = process(&subject, "c", &message, &effect).await;
    assert!(
        matches!(entered, Entered::Processed { attempt: 1 }),
        "a re-driven message runs from attempt 1, got {entered:?}"
    );
    let letters = subject.inbox().dead_letters("c").await.ok();
    assert_eq!(letters.map(|l| l.len()), Some(0), "no dead letter is left");
}

/// Consumers are isolated: each applies a message once, and each has its
/// own dead letters.
pub async fn consumers_are_isolated<S: Subject>(subject: S) {
    let message = Message::new("body").id("m-shared");
    let effect = Effect::new(&subject);
    let a = process(&subject, "consumer-a", &message, &effect).await;
    let b = process(&subject, "consumer-b", &message, &effect).await;
    assert!(
        matches!(
            (&a, &b),
            (Entered::Processed { .. }, Entered::Processed { .. })
        ),
        "each consumer applies the message, got {a:?} and {b:?}"
    );
    fail(&subject, "consumer-a", "m-a", 1).await;
    let counted = fail(&subject, "consumer-b", "m-b", 1).await;
    assert_eq!(
        counted.buried,
        Some(Buried::New { dead_letters: 1 }),
        "dead letters are counted per consumer"
    );
    let listed = subject.inbox().dead_letters("consumer-a").await.ok();
    assert_eq!(
        listed.map(|l| l.into_iter().map(|l| l.message_id).collect::<Vec<_>>()),
        Some(vec!["m-a".to_owned()])
    );
}

/// Concurrent buries each see a different count, so a crossing of the
/// alert's threshold is seen by exactly one.
pub async fn concurrent_buries_count_distinctly<S: Subject>(subject: S) {
    let subject = Arc::new(subject);
    let ids: Vec<String> = (0..12).map(|i| format!("m-bury-{i}")).collect();
    let buries = ids.iter().map(|id| fail(&*subject, "c", id, 1));
    let mut counts: Vec<u64> = futures_util::future::join_all(buries)
        .await
        .into_iter()
        .map(|counted| match counted.buried {
            Some(Buried::New { dead_letters }) => dead_letters,
            other => panic!("each is buried anew, got {other:?}"),
        })
        .collect();
    counts.sort_unstable();
    assert_eq!(
        counts,
        (1..=12).collect::<Vec<u64>>(),
        "each of 12 concurrent buries sees its own count"
    );
    let listed = subject.inbox().dead_letters("c").await.ok();
    assert_eq!(listed.map(|l| l.len()), Some(12));
}

/// The subject's inbox, lent to a [`Protocol`](super::Protocol) (which owns
/// its inbox) for the batch cases.
struct Lent<S>(Arc<S>);

impl<S: Subject> Inbox for Lent<S> {
    type Tx = <S::Inbox as Inbox>::Tx;
    const TRANSACTIONAL: bool = <S::Inbox as Inbox>::TRANSACTIONAL;
    const BATCHES: bool = <S::Inbox as Inbox>::BATCHES;

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<Self::Tx> + 'a),
    ) -> super::InboxFuture<'a, Entered> {
        self.0.inbox().process(entry, message, handler)
    }

    fn process_batch<'a>(
        &'a self,
        batch: &'a [super::BatchEntry<'a>],
        handler: &'a (dyn super::BatchHandler<Self::Tx> + 'a),
    ) -> super::InboxFuture<'a, super::Batched> {
        self.0.inbox().process_batch(batch, handler)
    }

    fn fail<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        failure: &'a Failure<'a>,
    ) -> super::InboxFuture<'a, super::Counted> {
        self.0.inbox().fail(entry, failure)
    }

    fn published<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> super::InboxFuture<'a, ()> {
        self.0.inbox().published(consumer, message_id)
    }

    fn dead_letter<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> super::InboxFuture<'a, Option<super::DeadLetter>> {
        self.0.inbox().dead_letter(consumer, message_id)
    }

    fn dead_letters<'a>(
        &'a self,
        consumer: &'a str,
    ) -> super::InboxFuture<'a, Vec<super::DeadLetter>> {
        self.0.inbox().dead_letters(consumer)
    }

    fn redrive<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> super::InboxFuture<'a, Option<super::DeadLetter>> {
        self.0.inbox().redrive(consumer, message_id)
    }
}

/// The protocol of consumer `c` over the subject's inbox: 3 attempts, no
/// pause between them.
fn protocol<S: Subject>(subject: &Arc<S>) -> super::Protocol<Lent<S>> {
    let policy = super::ConsumerPolicy::new()
        .max_attempts(3)
        .backoff(crate::retry::Backoff::new(Duration::ZERO, Duration::ZERO));
    super::Protocol::new("c", Lent(Arc::clone(subject)), policy)
}

/// Writes one effect per message of its batch (named after its key), then
/// fails the batch if one of them is the poison; records each batch it saw
/// as its keys and attempt numbers.
struct Effects<'s, S> {
    subject: &'s S,
    poison: Option<&'static str>,
    batches: Mutex<Vec<Vec<(String, u32)>>>,
}

impl<'s, S: Subject> Effects<'s, S> {
    fn new(subject: &'s S, poison: Option<&'static str>) -> Self {
        Self {
            subject,
            poison,
            batches: Mutex::new(Vec::new()),
        }
    }

    fn batches(&self) -> Vec<Vec<(String, u32)>> {
        self.batches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl<S: Subject> super::BatchHandler<<S::Inbox as Inbox>::Tx> for Effects<'_, S> {
    fn handle<'a>(
        &'a self,
        batch: &'a [Attempt<'a>],
        tx: &'a mut <S::Inbox as Inbox>::Tx,
    ) -> super::HandlerFuture<'a> {
        Box::pin(async move {
            self.batches.lock().unwrap_or_else(|p| p.into_inner()).push(
                batch
                    .iter()
                    .map(|a| (a.key().to_owned(), a.number()))
                    .collect(),
            );
            for attempt in batch {
                self.subject
                    .write(&mut *tx, attempt.key())
                    .await
                    .map_err(HandlerError::transient)?;
            }
            if let Some(poison) = self.poison
                && batch.iter().any(|attempt| attempt.key() == poison)
            {
                return Err(HandlerError::transient("the poison failed its batch"));
            }
            Ok(())
        })
    }
}

fn processed(attempt: u32) -> super::Decision {
    super::Decision::Ack(super::Acked::Processed { attempt })
}

const DUPLICATE: super::Decision = super::Decision::Ack(super::Acked::Duplicate);

/// A batch applies each new message once, with its attempt number; the
/// messages applied before are duplicates; an id twice in one batch is
/// applied once (the second copy a duplicate, or a reused id when its body
/// differs); the same batch again runs nothing.
pub async fn a_batch_applies_its_new_messages_once<S: Subject>(subject: S) {
    let subject = Arc::new(subject);
    let protocol = protocol(&subject);
    let before = Effect::new(&*subject);
    let _ = process(&*subject, "c", &Message::new("body").id("b-2"), &before).await;
    fail(&*subject, "c", "b-4", 3).await;
    let batch = [
        Message::new("body").id("b-1"),
        Message::new("body").id("b-2"),
        Message::new("body").id("b-3"),
        Message::new("body").id("b-1"),
        Message::new("body").id("b-4"),
        Message::new("another body").id("b-3"),
    ];
    let handler = Effects::new(&*subject, None);
    let decisions = protocol.decide_batch(&batch, &handler).await;
    assert_eq!(
        decisions[..5],
        [
            processed(1),
            DUPLICATE,
            processed(1),
            DUPLICATE,
            processed(2)
        ]
    );
    assert!(
        matches!(&decisions[5], super::Decision::DeadLetter(letter) if letter.reason == super::MESSAGE_ID_REUSED),
        "{:?}",
        decisions[5]
    );
    for (id, n) in [("b-1", 1), ("b-2", 1), ("b-3", 1), ("b-4", 1)] {
        assert_eq!(count(&*subject, id).await, n, "{id}");
    }
    let ran: Vec<(String, u32)> = handler.batches().concat();
    assert_eq!(
        ran,
        [("b-1", 1), ("b-3", 1), ("b-4", 2)].map(|(k, n)| (k.to_owned(), n)),
        "only the new messages ran, in the batch's order"
    );

    // (b-3's key is a dead letter now: the reused id was recorded there.)
    let again = Effects::new(&*subject, None);
    let repeated = [0, 1, 3, 4].map(|i| batch[i].clone());
    let decisions = protocol.decide_batch(&repeated, &again).await;
    assert_eq!(decisions, [DUPLICATE; 4]);
    assert!(
        again.batches().is_empty(),
        "nothing new: the handler did not run"
    );
}

/// A message that fails its batch ends alone: the others are applied once,
/// and it is retried, then dead-lettered after exactly its attempts, in its
/// own steps; nothing of a failed batch is counted.
pub async fn a_poison_message_ends_alone_after_exactly_its_attempts<S: Subject>(subject: S) {
    let subject = Arc::new(subject);
    let protocol = protocol(&subject);
    let ids: Vec<String> = (0..8).map(|i| format!("p-{i}")).collect();
    let batch: Vec<Message> = ids.iter().map(|id| Message::new("body").id(id)).collect();
    let handler = Effects::new(&*subject, Some("p-5"));
    let mut rounds = Vec::new();
    for _ in 0..3 {
        rounds.push(protocol.decide_batch(&batch, &handler).await);
    }
    for (round, decisions) in rounds.iter().enumerate() {
        for (i, decision) in decisions.iter().enumerate() {
            if i == 5 {
                continue;
            }
            let expected = if round == 0 { processed(1) } else { DUPLICATE };
            assert_eq!(decision, &expected, "round {round}, message {i}");
        }
    }
    for (round, attempts) in [(0, 1), (1, 2)] {
        assert!(
            matches!(&rounds[round][5], super::Decision::Retry(retry) if retry.attempts == attempts),
            "round {round}: {:?}",
            rounds[round][5]
        );
    }
    let super::Decision::DeadLetter(letter) = &rounds[2][5] else {
        panic!("the third failure dead-letters it: {:?}", rounds[2][5]);
    };
    assert_eq!(letter.attempted_at.len(), 3);
    assert_eq!(letter.reason, "the poison failed its batch");
    // An inbox without a transaction keeps what a failed handler wrote.
    let poison_effects = if <S::Inbox as Inbox>::TRANSACTIONAL {
        0
    } else {
        3
    };
    for (i, id) in ids.iter().enumerate() {
        let expected = if i == 5 { poison_effects } else { 1 };
        assert_eq!(count(&*subject, id).await, expected, "{id}");
    }
    let alone: Vec<u32> = handler
        .batches()
        .iter()
        .filter(|batch| batch.len() == 1 && batch[0].0 == "p-5")
        .map(|batch| batch[0].1)
        .collect();
    assert_eq!(alone, [1, 2, 3], "alone, it ran once per attempt, numbered");
    let letters = protocol.dead_letters().await.ok();
    assert_eq!(letters.map(|l| l.len()), Some(1));
}

/// Concurrent batches that share messages, in opposite orders, apply each
/// message once, and neither waits on the other forever.
pub async fn concurrent_batches_that_overlap_apply_each_once<S: Subject>(subject: S) {
    let subject = Arc::new(subject);
    let protocol = protocol(&subject);
    let ids: Vec<String> = (0..24).map(|i| format!("o-{i:02}")).collect();
    let forward: Vec<Message> = ids[..16]
        .iter()
        .map(|id| Message::new("body").id(id))
        .collect();
    let backward: Vec<Message> = ids[8..]
        .iter()
        .rev()
        .map(|id| Message::new("body").id(id))
        .collect();
    let (one, two) = (Effects::new(&*subject, None), Effects::new(&*subject, None));
    let (a, b) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(
            protocol.decide_batch(&forward, &one),
            protocol.decide_batch(&backward, &two)
        )
    })
    .await
    .unwrap_or_else(|_| panic!("the overlapping batches did not finish within 30 s"));
    let applied = a
        .iter()
        .chain(&b)
        .filter(|decision| **decision == processed(1))
        .count();
    assert!(
        a.iter()
            .chain(&b)
            .all(|d| *d == processed(1) || *d == DUPLICATE),
        "{a:?} {b:?}"
    );
    assert_eq!(applied, 24, "each message applied by one batch");
    for id in &ids {
        assert_eq!(count(&*subject, id).await, 1, "{id}");
    }
}

/// Writes one test per case of the inbox suite, each on a multi-threaded
/// runtime with 2 workers, from an async function answering a fresh
/// [`Subject`](crate::consume::conformance::Subject).
#[macro_export]
macro_rules! inbox_conformance_tests {
    ($fresh:path) => {
        $crate::inbox_conformance_tests!(@cases $fresh;
            applies_once_and_skips_duplicates,
            concurrent_deliveries_apply_once,
            a_failed_attempt_rolls_back_and_the_next_is_numbered,
            the_last_failure_buries_with_every_attempt_time,
            a_permanent_failure_buries_at_once,
            a_dead_letter_is_skipped_and_published_once,
            a_reused_id_is_reported_not_run,
            a_redriven_dead_letter_runs_again_from_attempt_one,
            consumers_are_isolated,
            concurrent_buries_count_distinctly,
            a_batch_applies_its_new_messages_once,
            a_poison_message_ends_alone_after_exactly_its_attempts,
            concurrent_batches_that_overlap_apply_each_once,
        );
    };
    (@cases $fresh:path; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::consume::conformance::block_on(async {
                    let subject = $fresh().await;
                    $crate::consume::conformance::$case(subject).await;
                });
            }
        )*
    };
}

/// The names of the suite's cases, in order (for harnesses that run them one
/// by one through [`run_case`]).
pub const CASES: &[&str] = &[
    "applies_once_and_skips_duplicates",
    "concurrent_deliveries_apply_once",
    "a_failed_attempt_rolls_back_and_the_next_is_numbered",
    "the_last_failure_buries_with_every_attempt_time",
    "a_permanent_failure_buries_at_once",
    "a_dead_letter_is_skipped_and_published_once",
    "a_reused_id_is_reported_not_run",
    "a_redriven_dead_letter_runs_again_from_attempt_one",
    "consumers_are_isolated",
    "concurrent_buries_count_distinctly",
    "a_batch_applies_its_new_messages_once",
    "a_poison_message_ends_alone_after_exactly_its_attempts",
    "concurrent_batches_that_overlap_apply_each_once",
];

/// Runs the case named `name` (one of [`CASES`]) against `subject`.
pub async fn run_case<S: Subject>(name: &str, subject: S) {
    match name {
        "applies_once_and_skips_duplicates" => applies_once_and_skips_duplicates(subject).await,
        "concurrent_deliveries_apply_once" => concurrent_deliveries_apply_once(subject).await,
        "a_failed_attempt_rolls_back_and_the_next_is_numbered" => {
            a_failed_attempt_rolls_back_and_the_next_is_numbered(subject).await
        }
        "the_last_failure_buries_with_every_attempt_time" => {
            the_last_failure_buries_with_every_attempt_time(subject).await
        }
        "a_permanent_failure_buries_at_once" => a_permanent_failure_buries_at_once(subject).await,
        "a_dead_letter_is_skipped_and_published_once" => {
            a_dead_letter_is_skipped_and_published_once(subject).await
        }
        "a_reused_id_is_reported_not_run" => a_reused_id_is_reported_not_run(subject).await,
        "a_redriven_dead_letter_runs_again_from_attempt_one" => {
            a_redriven_dead_letter_runs_again_from_attempt_one(subject).await
        }
        "consumers_are_isolated" => consumers_are_isolated(subject).await,
        "concurrent_buries_count_distinctly" => concurrent_buries_count_distinctly(subject).await,
        "a_batch_applies_its_new_messages_once" => {
            a_batch_applies_its_new_messages_once(subject).await
        }
        "a_poison_message_ends_alone_after_exactly_its_attempts" => {
            a_poison_message_ends_alone_after_exactly_its_attempts(subject).await
        }
        "concurrent_batches_that_overlap_apply_each_once" => {
            concurrent_batches_that_overlap_apply_each_once(subject).await
        }
        other => panic!("no inbox conformance case is named {other}"),
    }
}
