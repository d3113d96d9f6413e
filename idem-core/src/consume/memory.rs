//! An inbox in this process's memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use tokio::sync::Notify;

use super::{
    Advance, Attempt, Buried, Counted, DeadLetter, Entered, Entry, Failure, Handler, Inbox,
    InboxError, InboxFuture, Message, Positions,
};
use crate::Fingerprint;

/// An inbox in this process's memory: for tests, demos and consumers whose
/// messages need no memory across restarts (a restart forgets every message,
/// so a redelivery after it runs again).
///
/// It has no transaction (`Tx = ()`): the handler's effect is its own, so a
/// handler that fails after a partial effect leaves it. One execution runs at
/// a time per message: a concurrent delivery waits for the first to end.
///
/// It keeps a partitioned broker's positions too ([`Positions`]), in memory:
/// a move made while a handler runs ([`Positions::advance_in`]) is held
/// with the message's entry and made when the entry settles as processed,
/// with the same fence; a handler that fails (or is dropped unfinished)
/// moves nothing.
#[derive(Clone, Default)]
pub struct MemoryInbox {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: Mutex<HashMap<(String, String), State>>,
    settled: Notify,
    /// The positions: consumer, topic, partition → next offset.
    positions: Mutex<HashMap<PositionKey, i64>>,
}

type PositionKey = (String, String, i32);

/// The moves made by the handler running in this task, held until its entry
/// settles.
#[derive(Default)]
struct Held {
    /// The inbox whose `process` runs the handler (its `Inner`'s address).
    inbox: usize,
    moves: Vec<(PositionKey, Option<i64>, i64)>,
}

tokio::task_local! {
    /// The transaction of the handler `MemoryInbox::process` runs: `Tx` is
    /// `()`, so its moves are found through the task.
    static HELD: Arc<Mutex<Held>>;
}

fn key_of(advance: &Advance<'_>) -> PositionKey {
    (
        advance.consumer.to_owned(),
        advance.topic.to_owned(),
        advance.partition,
    )
}

/// The move, if the fence lets it through; `true` when written (or already
/// there).
fn fenced_write(
    positions: &mut HashMap<PositionKey, i64>,
    key: PositionKey,
    advance: &Advance<'_>,
) -> bool {
    if advance.applies_to(positions.get(&key).copied()) {
        positions.insert(key, advance.to);
        true
    } else {
        false
    }
}

/// A move made outside a handler that [`MemoryInbox::process`] runs.
#[derive(Debug, thiserror::Error)]
#[error(
    "a MemoryInbox position moved outside a handler the same inbox runs: no transaction to join"
)]
struct NoTransaction;

#[derive(Clone)]
enum State {
    /// A handler runs.
    Running,
    Processed(Fingerprint),
    Failing(Vec<SystemTime>),
    Dead(DeadLetter),
}

impl MemoryInbox {
    /// An empty inbox.
    pub fn new() -> Self {
        Self::default()
    }

    fn entries(&self) -> MutexGuard<'_, HashMap<(String, String), State>> {
        self.inner
            .entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn stored_positions(&self) -> MutexGuard<'_, HashMap<PositionKey, i64>> {
        self.inner
            .positions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn address(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Takes the entry for running (answering the failures before), waits
    /// (`Ok(None)`: another delivery runs it), or answers what it is.
    fn enter(&self, entry: &Entry<'_>) -> Result<Option<Vec<SystemTime>>, Entered> {
        let mut entries = self.entries();
        let name = (entry.consumer.to_owned(), entry.message_id.to_owned());
        match entries.get(&name) {
            Some(State::Processed(fingerprint)) if *fingerprint == entry.fingerprint => {
                Err(Entered::Duplicate)
            }
            Some(State::Processed(_)) => Err(Entered::Reused),
            Some(State::Dead(letter)) => Err(Entered::Dead {
                published: letter.published,
            }),
            Some(State::Running) => Ok(None),
            Some(State::Failing(times)) => {
                let times = times.clone();
                entries.insert(name, State::Running);
                Ok(Some(times))
            }
            None => {
                entries.insert(name, State::Running);
                Ok(Some(Vec::new()))
            }
        }
    }
}

impl Inbox for MemoryInbox {
    type Tx = ();
    const TRANSACTIONAL: bool = false;

    fn process<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        message: &'a Message,
        handler: &'a (dyn Handler<()> + 'a),
    ) -> InboxFuture<'a, Entered> {
        Box::pin(async move {
            let name = (entry.consumer.to_owned(), entry.message_id.to_owned());
            let previous = loop {
                let settled = self.inner.settled.notified();
                match self.enter(entry) {
                    Ok(None) => settled.await,
                    Ok(Some(previous)) => break previous,
                    Err(entered) => return Ok(entered),
                }
            };
            let attempt = previous.len() as u32 + 1;
            // Dropped unfinished (a shutdown's deadline, a cancelled task),
            // the entry goes back to what it was, so that a later delivery
            // runs instead of waiting for ever.
            let mut running = Running {
                inbox: self,
                name: Some(name),
                previous,
            };
            let held = Arc::new(Mutex::new(Held {
                inbox: self.address(),
                moves: Vec::new(),
            }));
            let ran = HELD
                .scope(
                    Arc::clone(&held),
                    handler.handle(Attempt::new(message, entry.message_id, attempt), &mut ()),
                )
                .await;
            let entered = match ran {
                Ok(()) => {
                    let moves = std::mem::take(
                        &mut held
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                            .moves,
                    );
                    running.settle_with(State::Processed(entry.fingerprint), moves);
                    Entered::Processed { attempt }
                }
                Err(error) => {
                    running.undo();
                    Entered::Failed { attempt, error }
                }
            };
            Ok(entered)
        })
    }

    fn fail<'a>(
        &'a self,
        entry: &'a Entry<'a>,
        failure: &'a Failure<'a>,
    ) -> InboxFuture<'a, Counted> {
        Box::pin(async move {
            let mut entries = self.entries();
            let name = (entry.consumer.to_owned(), entry.message_id.to_owned());
            let mut times = match entries.get(&name) {
                Some(State::Dead(letter)) => {
                    return Ok(Counted {
                        attempts: letter.attempts,
                        attempted_at: letter.attempted_at.clone(),
                        buried: Some(Buried::Already {
                            published: letter.published,
                        }),
                    });
                }
                Some(State::Failing(times)) => times.clone(),
                _ => Vec::new(),
            };
            times.push(entry.at);
            let attempts = times.len() as u32;
            if attempts < failure.bury_at {
                entries.insert(name, State::Failing(times.clone()));
                return Ok(Counted {
                    attempts,
                    attempted_at: times,
                    buried: None,
                });
            }
            entries.insert(
                name,
                State::Dead(DeadLetter {
                    consumer: entry.consumer.to_owned(),
                    message_id: entry.message_id.to_owned(),
                    attempts,
                    reason: failure.reason.to_owned(),
                    attempted_at: times.clone(),
                    dead_at: SystemTime::now(),
                    published: false,
                }),
            );
            let dead_letters = entries
                .iter()
                .filter(|((consumer, _), state)| {
                    consumer == entry.consumer && matches!(state, State::Dead(_))
                })
                .count() as u64;
            Ok(Counted {
                attempts,
                attempted_at: times,
                buried: Some(Buried::New { dead_letters }),
            })
        })
    }

    fn published<'a>(&'a self, consumer: &'a str, message_id: &'a str) -> InboxFuture<'a, ()> {
        Box::pin(async move {
            let mut entries = self.entries();
            if let Some(State::Dead(letter)) =
                entries.get_mut(&(consumer.to_owned(), message_id.to_owned()))
            {
                letter.published = true;
            }
            Ok(())
        })
    }

    fn dead_letter<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>> {
        Box::pin(async move {
            Ok(
                match self
                    .entries()
                    .get(&(consumer.to_owned(), message_id.to_owned()))
                {
                    Some(State::Dead(letter)) => Some(letter.clone()),
                    _ => None,
                },
            )
        })
    }

    fn dead_letters<'a>(&'a self, consumer: &'a str) -> InboxFuture<'a, Vec<DeadLetter>> {
        Box::pin(async move {
            let mut letters: Vec<DeadLetter> = self
                .entries()
                .iter()
                .filter_map(|((c, _), state)| match state {
                    State::Dead(letter) if c == consumer => Some(letter.clone()),
                    _ => None,
                })
                .collect();
            letters.sort_by(|a, b| (a.dead_at, &a.message_id).cmp(&(b.dead_at, &b.message_id)));
            Ok(letters)
        })
    }

    fn redrive<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a str,
    ) -> InboxFuture<'a, Option<DeadLetter>> {
        Box::pin(async move {
            let mut entries = self.entries();
            let name = (consumer.to_owned(), message_id.to_owned());
            match entries.get(&name) {
                Some(State::Dead(letter)) => {
                    let letter = letter.clone();
                    entries.remove(&name);
                    Ok(Some(letter))
                }
                _ => Ok(None),
            }
        })
    }
}

/// An entry taken for running: settled, or undone when dropped unsettled.
struct Running<'a> {
    inbox: &'a MemoryInbox,
    name: Option<(String, String)>,
    previous: Vec<SystemTime>,
}

impl Running<'_> {
    /// Settles the entry and makes the handler's moves (each fenced again:
    /// of two handlers moving one position at once, the later one finds it
    /// moved unless it moves it to the same place).
    fn settle_with(&mut self, state: State, moves: Vec<(PositionKey, Option<i64>, i64)>) {
        if let Some(name) = self.name.take() {
            {
                let mut positions = self.inbox.stored_positions();
                for ((consumer, topic, partition), from, to) in moves {
                    let advance = Advance {
                        consumer: &consumer,
                        topic: &topic,
                        partition,
                        from,
                        to,
                    };
                    let key = key_of(&advance);
                    fenced_write(&mut positions, key, &advance);
                }
            }
            self.inbox.entries().insert(name, state);
            self.inbox.inner.settled.notify_waiters();
        }
    }

    /// Back to the failures before this attempt (or to nothing).
    fn undo(&mut self) {
        if let Some(name) = self.name.take() {
            let previous = std::mem::take(&mut self.previous);
            let mut entries = self.inbox.entries();
            if previous.is_empty() {
                entries.remove(&name);
            } else {
                entries.insert(name, State::Failing(previous));
            }
            drop(entries);
            self.inbox.inner.settled.notify_waiters();
        }
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.undo();
    }
}

impl Positions for MemoryInbox {
    fn migrate_positions(&self) -> InboxFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    fn positions<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> InboxFuture<'a, HashMap<i32, i64>> {
        Box::pin(async move {
            Ok(self
                .stored_positions()
                .iter()
                .filter(|((c, t, _), _)| c == consumer && t == topic)
                .map(|((_, _, partition), next)| (*partition, *next))
                .collect())
        })
    }

    fn advance_in<'a>(
        &'a self,
        _tx: &'a mut (),
        advance: &'a Advance<'a>,
    ) -> InboxFuture<'a, bool> {
        Box::pin(async move {
            let held = HELD
                .try_with(Arc::clone)
                .map_err(|_| InboxError::unavailable(NoTransaction))?;
            let mut held = held.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if held.inbox != self.address() {
                return Err(InboxError::unavailable(NoTransaction));
            }
            let key = key_of(advance);
            // What this transaction sees: the committed position, under its
            // own moves so far.
            let seen = held
                .moves
                .iter()
                .rev()
                .find(|(k, _, _)| *k == key)
                .map(|(_, _, to)| *to)
                .or_else(|| self.stored_positions().get(&key).copied());
            if !advance.applies_to(seen) {
                return Ok(false);
            }
            held.moves.push((key, advance.from, advance.to));
            Ok(true)
        })
    }

    fn advance_alone<'a>(&'a self, advance: &'a Advance<'a>) -> InboxFuture<'a, bool> {
        Box::pin(async move {
            let key = key_of(advance);
            Ok(fenced_write(&mut self.stored_positions(), key, advance))
        })
    }
}

impl std::fmt::Debug for MemoryInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryInbox")
            .field("entries", &self.entries().len())
            .finish()
    }
}
