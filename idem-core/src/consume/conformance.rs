//! The conformance suite every inbox passes (feature `test-util`).
//!
//! An inbox only makes each step atomic, but every step must mean the same in
//! every inbox: one application per message id under any concurrency, a
//! failed attempt rolled back (for a transactional inbox) and counted, the
//! count that buries, dead letters skipped and published once, re-drives, a
//! reused id, isolated consumers, and concurrent buries that each see a
//! different count (so each crossing of the alert's threshold alerts once).
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
        other => panic!("no inbox conformance case is named {other}"),
    }
}
