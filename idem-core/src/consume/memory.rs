//! An inbox in this process's memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use tokio::sync::Notify;

use super::{
    Attempt, Buried, Counted, DeadLetter, Entered, Entry, Failure, Handler, Inbox, InboxFuture,
    Message,
};
use crate::Fingerprint;

/// An inbox in this process's memory: for tests, demos and consumers whose
/// messages need no memory across restarts (a restart forgets every message,
/// so a redelivery after it runs again).
///
/// It has no transaction (`Tx = ()`): the handler's effect is its own, so a
/// handler that fails after a partial effect leaves it. One execution runs at
/// a time per message: a concurrent delivery waits for the first to end.
#[derive(Clone, Default)]
pub struct MemoryInbox {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: Mutex<HashMap<(String, String), State>>,
    settled: Notify,
}

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
            let ran = handler
                .handle(Attempt::new(message, entry.message_id, attempt), &mut ())
                .await;
            let entered = match ran {
                Ok(()) => {
                    running.settle(State::Processed(entry.fingerprint));
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
    fn settle(&mut self, state: State) {
        if let Some(name) = self.name.take() {
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

impl std::fmt::Debug for MemoryInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryInbox")
            .field("entries", &self.entries().len())
            .finish()
    }
}
