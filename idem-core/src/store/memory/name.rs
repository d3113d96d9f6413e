//! A record's name: its scope and key, hashed and compared as one.

use std::hash::BuildHasher;

use super::RandomState;
use crate::{IdempotencyKey, Scope};

/// `(scope, key)` as the store hashes and compares it.
pub(super) struct Name<'a> {
    pub(super) scope: &'a [u8],
    pub(super) key: &'a [u8],
}

impl<'a> Name<'a> {
    pub(super) fn new(scope: &'a Scope, key: &'a IdempotencyKey) -> Self {
        Self {
            scope: scope.as_str().as_bytes(),
            key: key.as_str().as_bytes(),
        }
    }

    pub(super) fn hash(&self, hasher: &RandomState) -> u64 {
        hasher.hash_one((self.scope, self.key))
    }

    pub(super) fn is(&self, other: &Name<'_>) -> bool {
        self.key == other.key && self.scope == other.scope
    }
}
