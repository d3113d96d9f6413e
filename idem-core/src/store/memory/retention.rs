//! The expiry queues of a shard: completed records in FIFOs by retention, the
//! rest in an unordered list; expired records are taken from them in order.

use std::collections::VecDeque;
use std::time::Duration;

use super::clock::{Nanos, later};
use super::scopes::ScopeTable;
use super::shard::Shard;

/// Distinct retentions that get a queue of their own in a shard; records of
/// further retentions go to the shard's unordered list.
const RETENTION_QUEUES: usize = 16;

pub(super) struct RetentionQueue {
    retention: Nanos,
    refs: VecDeque<Ref>,
}

/// A version of the record in a slot; stale once the slot holds another.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Ref {
    pub(super) slot: u32,
    pub(super) generation: u32,
}

impl Shard {
    fn is_current(&self, entry: Ref) -> bool {
        self.slots
            .get(entry.slot as usize)
            .is_some_and(|record| record.generation() == Some(entry.generation))
    }

    pub(super) fn push_loose(&mut self, entry: Ref) {
        if self.loose.len() >= self.loose_limit {
            let mut loose = std::mem::take(&mut self.loose);
            loose.retain(|&entry| self.is_current(entry));
            self.loose = loose;
            self.loose_limit = 2 * self.loose.len() + 64;
        }
        self.loose.push(entry);
    }

    pub(super) fn push_completed(&mut self, retention: Duration, entry: Ref) {
        let retention = later(0, retention);
        if let Some(queue) = self.queues.iter_mut().find(|q| q.retention == retention) {
            queue.refs.push_back(entry);
        } else if self.queues.len() < RETENTION_QUEUES {
            self.queues.push(RetentionQueue {
                retention,
                refs: VecDeque::from([entry]),
            });
        } else {
            return self.push_loose(entry);
        }
        let queued: usize = self.queues.iter().map(|q| q.refs.len()).sum();
        if queued >= self.queued_limit {
            let mut queues = std::mem::take(&mut self.queues);
            for queue in &mut queues {
                queue.refs.retain(|&entry| self.is_current(entry));
            }
            queues.retain(|queue| !queue.refs.is_empty());
            self.queues = queues;
            let queued: usize = self.queues.iter().map(|q| q.refs.len()).sum();
            self.queued_limit = 2 * queued + 64;
        }
    }

    /// Removes up to `limit` expired records, by expiry and then by write (the
    /// generation); answers how many and their bytes.
    pub(super) fn remove_expired(
        &mut self,
        scopes: &ScopeTable,
        now: Nanos,
        limit: usize,
    ) -> (usize, usize) {
        let (mut records, mut bytes) = (0, 0);
        // The unordered list's expired records, in order; its stale entries go.
        let mut loose = std::mem::take(&mut self.loose);
        loose.retain(|&entry| self.is_current(entry));
        let mut expired: Vec<(Nanos, u32, Ref)> = loose
            .iter()
            .filter_map(|&entry| {
                let record = &self.slots[entry.slot as usize];
                record
                    .is_expired(now)
                    .then(|| (record.expires_at(), entry.generation, entry))
            })
            .collect();
        self.loose = loose;
        expired.sort_unstable_by_key(|&(at, generation, _)| (at, generation));
        let mut expired = expired.into_iter().peekable();
        while records < limit {
            // The queue whose first current record expires first.
            let mut first: Option<(Nanos, u32, usize)> = None;
            for index in 0..self.queues.len() {
                while let Some(&entry) = self.queues[index].refs.front() {
                    if self.is_current(entry) {
                        let at = self.slots[entry.slot as usize].expires_at();
                        if first.is_none_or(|(earliest, generation, _)| {
                            (at, entry.generation) < (earliest, generation)
                        }) {
                            first = Some((at, entry.generation, index));
                        }
                        break;
                    }
                    self.queues[index].refs.pop_front();
                }
            }
            let queued = first.filter(|&(at, _, _)| at <= now);
            let entry = match (queued, expired.peek()) {
                (Some((at, generation, _)), Some(&(loose_at, loose_generation, entry)))
                    if (loose_at, loose_generation) < (at, generation) =>
                {
                    expired.next();
                    entry
                }
                (Some((_, _, index)), _) => match self.queues[index].refs.pop_front() {
                    Some(entry) => entry,
                    None => break,
                },
                (None, Some(&(_, _, entry))) => {
                    expired.next();
                    entry
                }
                (None, None) => break,
            };
            if self.is_current(entry) {
                bytes += self.remove(scopes, entry.slot);
                records += 1;
            }
        }
        if records > 0 {
            let mut loose = std::mem::take(&mut self.loose);
            loose.retain(|&entry| self.is_current(entry));
            self.loose = loose;
        }
        (records, bytes)
    }
}
