//! Records, claims and the owner tokens that fence them.

use std::fmt;
use std::time::{Duration, SystemTime};

use uuid::Uuid;

use crate::{Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// A record as a store keeps it, keyed by `(scope, key)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Who the key belongs to.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// Where the record is in its life.
    pub state: RecordState,
    /// After this instant the record counts as absent and cleanup may delete it.
    pub expires_at: SystemTime,
}

/// The state of a record that exists. (An absent record is "new".)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// A request holds the claim and its handler is running.
    InProgress {
        /// The request holding the claim.
        owner: OwnerToken,
        /// The claim is void after this instant unless renewed.
        lease_until: SystemTime,
    },
    /// The handler finished and its answer is kept for replay.
    Completed {
        /// The answer to replay.
        response: StoredResponse,
    },
}

/// A random token naming the request that holds a claim.
///
/// Stores refuse `complete`, `release` and `renew` from any other token, so a request
/// whose lease lapsed (and whose record was claimed again by a retry) cannot
/// overwrite the newer request's outcome: the token fences it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(Uuid);

impl OwnerToken {
    /// A fresh random token.
    pub fn random() -> Self {
        Self(Uuid::new_v4())
    }

    /// The token as a UUID, for stores.
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// The token from its UUID, for stores.
    pub fn from_uuid(uuid: Uuid) -> Self {
        Self(uuid)
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({})", self.0)
    }
}

/// What a request asks a store for when it wants to run its handler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRequest {
    /// Who the key belongs to.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token that will own the claim.
    pub owner: OwnerToken,
    /// How long the claim holds without renewal.
    pub lease: Duration,
    /// How long the record is kept (from the claim; reset on completion).
    pub retention: Duration,
}

/// A claim a store granted: the right, fenced by `owner`, to run the handler and
/// record its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Who the key belongs to.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token that owns the claim.
    pub owner: OwnerToken,
    /// The lease the claim was granted with.
    pub lease: Duration,
}

/// What a store found when asked for a claim. The store only makes the step
/// atomic; the engine decides what each outcome means for the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The record was new (absent, expired, or its lease had lapsed): the caller
    /// now holds the claim.
    Claimed(Claim),
    /// Another request holds a live claim.
    InProgress {
        /// The fingerprint of the request holding the claim.
        fingerprint: Fingerprint,
        /// When that claim lapses unless renewed.
        lease_until: SystemTime,
    },
    /// The record is completed.
    Completed {
        /// The fingerprint of the request that completed it.
        fingerprint: Fingerprint,
        /// Its answer.
        response: StoredResponse,
    },
}

impl ClaimRequest {
    /// The claim this request becomes when a store grants it.
    pub fn to_claim(&self) -> Claim {
        Claim {
            scope: self.scope.clone(),
            key: self.key.clone(),
            fingerprint: self.fingerprint,
            owner: self.owner,
            lease: self.lease,
        }
    }
}
