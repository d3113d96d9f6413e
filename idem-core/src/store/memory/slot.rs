//! A record in a shard's slot: a completed record's buffer, or a claim.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::Notify;

use super::MemoryStore;
use super::blob::Blob;
use super::clock::Nanos;
use super::name::Name;
use crate::store::OwnerToken;
use crate::{Fingerprint, IdempotencyKey, Scope};

/// A record. Completed, it is one buffer (see [`Blob`]), which replays hand out
/// slices of; in progress, a box of what the claim holds. An empty buffer marks a
/// free slot.
pub(super) enum Slot {
    Completed(Bytes),
    InProgress(Box<Pending>),
}

pub(super) struct Pending {
    pub(super) scope: Scope,
    pub(super) key: IdempotencyKey,
    pub(super) fingerprint: Fingerprint,
    pub(super) owner: OwnerToken,
    pub(super) generation: u32,
    pub(super) expires_at: Nanos,
    pub(super) lease_until: Nanos,
    /// Wakes the requests waiting in `changed` when the record leaves this state;
    /// made by the first of them.
    pub(super) changed: Option<Arc<Notify>>,
}

impl Slot {
    pub(super) const FREE: Slot = Slot::Completed(Bytes::new());

    pub(super) fn name(&self) -> Name<'_> {
        match self {
            Slot::Completed(blob) if blob.is_empty() => Name {
                scope: &[],
                key: &[],
            },
            Slot::Completed(blob) => Name {
                scope: Blob::scope(blob),
                key: &blob[Blob::key_range(blob)],
            },
            Slot::InProgress(pending) => Name::new(&pending.scope, &pending.key),
        }
    }

    pub(super) fn generation(&self) -> Option<u32> {
        match self {
            Slot::Completed(blob) if blob.is_empty() => None,
            Slot::Completed(blob) => Some(Blob::generation(blob)),
            Slot::InProgress(pending) => Some(pending.generation),
        }
    }

    /// What the record counts against `max_bytes`.
    pub(super) fn size(&self) -> usize {
        match self {
            Slot::Completed(blob) => MemoryStore::RECORD_OVERHEAD + blob.len() - Blob::SCOPE,
            Slot::InProgress(pending) => claim_size(&pending.scope, &pending.key),
        }
    }

    /// When the record expires (in progress, its lease may outlast that).
    pub(super) fn expires_at(&self) -> Nanos {
        match self {
            Slot::Completed(blob) if blob.is_empty() => 0,
            Slot::Completed(blob) => Blob::expires_at(blob),
            Slot::InProgress(pending) => pending.expires_at,
        }
    }

    /// Expired records count as absent. One in progress also needs its lease
    /// lapsed: a handler that renews its lease past the retention keeps its record.
    pub(super) fn is_expired(&self, now: Nanos) -> bool {
        match self {
            Slot::Completed(blob) => blob.is_empty() || now >= Blob::expires_at(blob),
            Slot::InProgress(pending) => now >= pending.expires_at && now >= pending.lease_until,
        }
    }

    /// Whether `owner` holds the record in progress. An owner whose lease lapsed
    /// still holds it until another request claims it or it expires: the token
    /// fences, and no other request ran the handler meanwhile.
    pub(super) fn is_held_by(&self, owner: OwnerToken, now: Nanos) -> bool {
        !self.is_expired(now) && matches!(self, Slot::InProgress(pending) if pending.owner == owner)
    }

    /// Wakes the requests waiting for this record in progress to change.
    pub(super) fn settle(self) {
        if let Slot::InProgress(pending) = self
            && let Some(changed) = pending.changed
        {
            changed.notify_waiters();
        }
    }
}

/// What a claim counts against `max_bytes`.
pub(super) fn claim_size(scope: &Scope, key: &IdempotencyKey) -> usize {
    MemoryStore::RECORD_OVERHEAD + scope.as_str().len() + key.as_str().len()
}

#[cfg(test)]
mod tests {
    use super::super::retention::Ref;
    use super::*;

    #[test]
    fn a_slot_is_as_small_as_its_buffer_handle() {
        // `RECORD_OVERHEAD` counts on it: a record in progress goes in the spare
        // bits of the completed record's `Bytes`.
        assert_eq!(size_of::<Slot>(), size_of::<Bytes>());
        assert_eq!(size_of::<Ref>(), 8);
    }
}
