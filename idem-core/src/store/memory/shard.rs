//! One lock's worth of records: the slots and the table that finds them.

use hashbrown::HashTable;

use super::RandomState;
use super::name::Name;
use super::retention::{Ref, RetentionQueue};
use super::scopes::ScopeTable;
use super::slot::Slot;

/// One lock's worth of records.
///
/// A record lives in a slot of `slots`; `table` maps its name to the slot's
/// index and 32 bits of the name's hash (8 bytes per entry), and the expiry
/// queues hold [`Ref`]s (8 bytes). Nothing else holds a copy of the name. The
/// hash bits in the table let it grow without reading a record (a rehash that
/// recomputed each hash from its record would stall the shard's lock for
/// milliseconds at a million records, a cache miss per record) and let a
/// lookup skip a record whose bits differ.
pub(super) struct Shard {
    hasher: RandomState,
    table: HashTable<(u32, u32)>,
    pub(super) slots: Vec<Slot>,
    /// Indexes of empty slots, reused first.
    free: Vec<u32>,
    /// Completed records, one FIFO per distinct retention: records of one
    /// retention expire in the order they completed.
    pub(super) queues: Vec<RetentionQueue>,
    /// In-progress records and completed ones of a retention beyond
    /// `RETENTION_QUEUES` ([`push_completed`](Self::push_completed)): swept
    /// whole.
    pub(super) loose: Vec<Ref>,
    /// When a list grows to these lengths, its stale entries are dropped.
    pub(super) queued_limit: usize,
    pub(super) loose_limit: usize,
}

/// The 32 bits of a name's hash a shard's table keeps (the shard was chosen by
/// the other 32).
fn table_bits(hash: u64) -> u32 {
    hash as u32
}

/// The table's hash of `bits`: spread over 64 bits (the table indexes by the
/// low bits and tags by the top 7), the same whether computed from the name or
/// from the table's entry.
fn spread(bits: u32) -> u64 {
    u64::from(bits).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Shard {
    pub(super) fn new(hasher: RandomState) -> Self {
        Self {
            hasher,
            table: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            queues: Vec::new(),
            loose: Vec::new(),
            queued_limit: 64,
            loose_limit: 64,
        }
    }

    pub(super) fn find(&self, hash: u64, name: &Name<'_>) -> Option<u32> {
        let (slots, bits) = (&self.slots, table_bits(hash));
        self.table
            .find(spread(bits), |&(slot, other)| {
                other == bits && slots[slot as usize].name().is(name)
            })
            .map(|&(slot, _)| slot)
    }

    /// Puts a new record in a free slot; answers the slot.
    pub(super) fn insert(&mut self, hash: u64, record: Slot) -> u32 {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = record;
                slot
            }
            None => {
                self.slots.push(record);
                // A shard never holds 2^32 records: memory runs out long before.
                (self.slots.len() - 1) as u32
            }
        };
        let bits = table_bits(hash);
        self.table
            .insert_unique(spread(bits), (slot, bits), |&(_, bits)| spread(bits));
        slot
    }

    /// Removes the record in `slot` from the shard and its scope's count, and wakes
    /// its waiters; answers what it counted.
    pub(super) fn remove(&mut self, scopes: &ScopeTable, slot: u32) -> usize {
        let record = &self.slots[slot as usize];
        let hash = spread(table_bits(record.name().hash(&self.hasher)));
        if let Ok(entry) = self.table.find_entry(hash, |&(other, _)| other == slot) {
            entry.remove();
        }
        let record = std::mem::replace(&mut self.slots[slot as usize], Slot::FREE);
        self.free.push(slot);
        let size = record.size();
        scopes.remove(record.name().scope, size);
        record.settle();
        size
    }
}
