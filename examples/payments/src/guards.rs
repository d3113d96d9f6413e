//! The idempotency middleware of each route: the store it keeps records in, and
//! its policy.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{InProgress, Policy, Store};

/// How long, in transactional mode, a request waits for a running request
/// with its key to commit before it is answered `409`.
pub const TRANSACTIONAL_WAIT: Duration = Duration::from_secs(10);

/// The idempotency middleware of both keyed routes. Each example puts
/// [`charges`](Self::charges) on `POST /accounts/{account_id}/charges` and
/// [`deposits`](Self::deposits) on `POST /accounts/{account_id}/deposits`.
///
/// ```
/// use std::sync::Arc;
/// use idem_core::KeyRequirement;
/// use payments::Guards;
///
/// let guards = Guards::plain(Arc::new(idem_core::MemoryStore::new()));
/// assert!(!guards.charges.is_transactional());
/// assert_eq!(guards.charges.policy().key_requirement(), KeyRequirement::Required);
/// assert_eq!(guards.deposits.policy().key_requirement(), KeyRequirement::Optional);
/// ```
#[derive(Clone, Debug)]
pub struct Guards {
    /// `POST /accounts/{account_id}/charges`: key required.
    pub charges: Guard,
    /// `POST /accounts/{account_id}/deposits`: key optional.
    pub deposits: Guard,
}

/// One route's idempotency middleware: its store and its policy.
#[derive(Clone)]
pub struct Guard {
    store: Arc<dyn Store>,
    policy: Policy,
    transactional: bool,
}

/// The idempotency policy of `POST /accounts/{account_id}/charges` on a plain
/// store: key required; a duplicate of a running charge is answered `409`.
pub fn charge_policy() -> Policy {
    Policy::required()
}

/// The idempotency policy of `POST /accounts/{account_id}/deposits` on a plain
/// store: key optional (without one, every delivery takes effect).
pub fn deposit_policy() -> Policy {
    Policy::optional()
}

impl Guards {
    /// Both routes on `store` (memory, SQLite, or PostgreSQL without
    /// transactional mode): the claim, the handler's writes and the completion
    /// are separate steps.
    pub fn plain(store: Arc<dyn Store>) -> Self {
        Self {
            charges: Guard {
                store: Arc::clone(&store),
                policy: charge_policy(),
                transactional: false,
            },
            deposits: Guard {
                store,
                policy: deposit_policy(),
                transactional: false,
            },
        }
    }

    /// Both routes in transactional mode on `store`, a store's
    /// `transactional()` (`docs/contract.md` §7): the ledger's writes
    /// (through the request's [`PgTransaction`](idem_diesel::PgTransaction)
    /// or [`SqliteTransaction`](idem_diesel::SqliteTransaction)) and the
    /// completion commit together, or not at all, so a crash at any point
    /// leaves one effect or none.
    ///
    /// - **Deposits too**: a keyed deposit joins the transaction as a charge
    ///   does. A deposit without a key has no record to commit with; it passes
    ///   through, and its writes commit on their own.
    /// - **Duplicates wait**: a request whose key is running waits up to
    ///   [`TRANSACTIONAL_WAIT`] for the commit and replays the committed
    ///   answer (or gets `422` if its body differs; if the first request
    ///   rolled back, it runs itself). On PostgreSQL it sees only the running
    ///   transaction's lock, not its record (uncommitted, so invisible), so a
    ///   `409` would tell it nothing; on SQLite it behaves the same, for one
    ///   behaviour on both.
    pub fn transactional(store: impl Store) -> Self {
        let store: Arc<dyn Store> = Arc::new(store);
        let wait = InProgress::Wait {
            up_to: TRANSACTIONAL_WAIT,
        };
        Self {
            charges: Guard {
                store: Arc::clone(&store),
                policy: charge_policy().in_progress(wait),
                transactional: true,
            },
            deposits: Guard {
                store,
                policy: deposit_policy().in_progress(wait),
                transactional: true,
            },
        }
    }

    /// Keeps both routes' completed records for `retention` (the policies'
    /// default is the 24 h of `docs/contract.md` §6); after that a retry runs afresh.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use payments::Guards;
    ///
    /// let guards = Guards::plain(Arc::new(idem_core::MemoryStore::new()))
    ///     .retention(Duration::from_secs(60));
    /// assert_eq!(guards.charges.policy().get_retention(), Duration::from_secs(60));
    /// assert_eq!(guards.deposits.policy().get_retention(), Duration::from_secs(60));
    /// ```
    pub fn retention(self, retention: Duration) -> Self {
        let keep = |guard: Guard| Guard {
            policy: guard.policy.retention(retention),
            ..guard
        };
        Self {
            charges: keep(self.charges),
            deposits: keep(self.deposits),
        }
    }
}

impl Guards {
    /// Gives both routes' claims `lease` (the policies' default is 30 s): how
    /// long a claim holds its key without renewal. The engine renews it while
    /// the handler runs, so a handler slower than the lease still runs once.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use payments::Guards;
    ///
    /// let guards = Guards::plain(Arc::new(idem_core::MemoryStore::new()))
    ///     .lease(Duration::from_secs(1));
    /// assert_eq!(guards.charges.policy().get_lease(), Duration::from_secs(1));
    /// assert_eq!(guards.deposits.policy().get_lease(), Duration::from_secs(1));
    /// ```
    pub fn lease(self, lease: Duration) -> Self {
        let hold = |guard: Guard| Guard {
            policy: guard.policy.lease(lease),
            ..guard
        };
        Self {
            charges: hold(self.charges),
            deposits: hold(self.deposits),
        }
    }
}

impl Guard {
    /// The store the route's records are kept in.
    pub fn store(&self) -> Arc<dyn Store> {
        Arc::clone(&self.store)
    }

    /// The route's policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Whether the route runs its handler inside the store's transaction.
    pub fn is_transactional(&self) -> bool {
        self.transactional
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("policy", &self.policy)
            .field("transactional", &self.transactional)
            .finish_non_exhaustive()
    }
}
