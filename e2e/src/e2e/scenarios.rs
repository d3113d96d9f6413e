//! The catalogue: every scenario, the stores it applies to, and whether what
//! it needs is built yet.

use std::sync::Arc;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use super::Room;
use super::api::{Failure, Outcome};
use super::site::{Deployment, StoreKind};

mod answers;
mod cleanup;
mod client;
mod in_flight;
mod outage;
mod restarts;
mod scopes;
mod slow_provider;
mod storm;

/// What a scenario reports: one outcome per check it declares.
pub(crate) type Checks = Vec<(&'static str, Outcome)>;

/// A scenario: one fresh store, one or more servers, one or more checks (rows).
pub(crate) struct Scenario {
    /// Selects it on the command line (`--scenario NAME`).
    pub(crate) name: &'static str,
    /// Its rows in the table, in order.
    pub(crate) checks: &'static [&'static str],
    pub(crate) stores: &'static [StoreKind],
    /// What it needs beside it: a storm opens hundreds of connections, the
    /// slow provider's 1 s leases need a quiet machine.
    pub(crate) room: Room,
    /// It waits tens of seconds (a default lease, a timeout): it queues for
    /// a slot before the others, so that it does not end the run alone.
    pub(crate) long: bool,
    pub(crate) readiness: Readiness,
    /// An `Err` is a failed setup: every check fails with it.
    pub(crate) run: fn(Arc<Deployment>) -> BoxFuture<'static, Result<Checks, Failure>>,
}

/// Whether the project has built what a scenario needs.
pub(crate) enum Readiness {
    Built,
    /// Built once the example's `--help` offers every one of these flags.
    NeedsFlags(&'static [&'static str]),
}

const EVERY_STORE: &[StoreKind] = &StoreKind::ALL;
const DURABLE_STORES: &[StoreKind] = &[StoreKind::Sqlite, StoreKind::Postgres, StoreKind::Redis];
/// The stores that keep records across a process's crash and share them.
const SHARED_STORES: &[StoreKind] = &[StoreKind::Postgres, StoreKind::Redis];
const POSTGRES: &[StoreKind] = &[StoreKind::Postgres];

/// Every scenario, in the order of the table.
pub(crate) const CATALOG: &[Scenario] = &[
    Scenario {
        name: "answers",
        checks: answers::CHECKS,
        stores: EVERY_STORE,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| answers::run(d).boxed(),
    },
    Scenario {
        name: "in-progress",
        checks: &[in_flight::IN_PROGRESS],
        stores: EVERY_STORE,
        room: Room::Shared,
        long: true,
        readiness: Readiness::Built,
        run: |d| in_flight::in_progress(d).boxed(),
    },
    Scenario {
        name: "scopes",
        checks: &[scopes::CHECK],
        stores: EVERY_STORE,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| scopes::run(d).boxed(),
    },
    Scenario {
        name: "storm",
        checks: &[storm::CHECK],
        stores: EVERY_STORE,
        room: Room::Alone,
        long: false,
        readiness: Readiness::Built,
        run: |d| storm::run(d).boxed(),
    },
    Scenario {
        name: "timeouts",
        checks: &[in_flight::TIMEOUTS],
        stores: EVERY_STORE,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| in_flight::timeouts(d).boxed(),
    },
    Scenario {
        name: "disconnect",
        checks: &[in_flight::DISCONNECT],
        stores: EVERY_STORE,
        room: Room::Shared,
        long: false,
        readiness: Readiness::NeedsFlags(in_flight::DISCONNECT_FLAGS),
        run: |d| in_flight::disconnect(d).boxed(),
    },
    Scenario {
        name: "restart",
        checks: &[restarts::RESTART],
        stores: DURABLE_STORES,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| restarts::restart(d).boxed(),
    },
    Scenario {
        name: "crash",
        checks: &[restarts::CRASH],
        stores: SHARED_STORES,
        room: Room::Shared,
        long: true,
        readiness: Readiness::Built,
        run: |d| restarts::crash(d).boxed(),
    },
    Scenario {
        name: "crash-at-write",
        checks: &[restarts::CRASH_AT_WRITE],
        stores: DURABLE_STORES,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| restarts::crash_at_write(d).boxed(),
    },
    Scenario {
        name: "outage",
        checks: &[outage::DOWN],
        stores: POSTGRES,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| outage::down(d).boxed(),
    },
    Scenario {
        name: "outage-mid-charge",
        checks: &[outage::CUT_OFF],
        stores: POSTGRES,
        room: Room::Shared,
        long: false,
        readiness: Readiness::Built,
        run: |d| outage::cut_off(d).boxed(),
    },
    Scenario {
        name: "slow-provider",
        checks: &[slow_provider::CHECK],
        stores: EVERY_STORE,
        // Its lease is 1 s: a busy machine could delay a renewal past it;
        // two of them leave the machine idle most of their 3 s.
        room: Room::Half,
        long: false,
        readiness: Readiness::NeedsFlags(slow_provider::FLAGS),
        run: |d| slow_provider::run(d).boxed(),
    },
    Scenario {
        name: "cleanup",
        checks: &[cleanup::CHECK],
        stores: EVERY_STORE,
        room: Room::Shared,
        long: false,
        readiness: Readiness::NeedsFlags(cleanup::FLAGS),
        run: |d| cleanup::run(d).boxed(),
    },
    Scenario {
        name: "client",
        checks: client::CHECKS,
        stores: EVERY_STORE,
        room: Room::Shared,
        // On SQLite and PostgreSQL a charge outlasts the route's 10 s wait.
        long: true,
        readiness: Readiness::Built,
        run: |d| client::run(d).boxed(),
    },
    Scenario {
        name: "client-budget",
        checks: &[client::BUDGET],
        stores: POSTGRES,
        room: Room::Shared,
        // 12-19 s: queued last, it ended the run 13 s after every other row.
        long: true,
        readiness: Readiness::Built,
        run: |d| client::budget(d).boxed(),
    },
];

impl Readiness {
    /// What is missing for `deployment`, if anything.
    pub(crate) fn missing(&self, deployment: &Deployment) -> Option<String> {
        match self {
            Self::Built => None,
            Self::NeedsFlags(flags) => {
                let absent: Vec<&str> = flags
                    .iter()
                    .copied()
                    .filter(|flag| !deployment.offers(flag))
                    .collect();
                (!absent.is_empty()).then(|| format!("needs {} in the example", absent.join(", ")))
            }
        }
    }
}

/// A name unique to this run, so that scenarios sharing a store never meet.
pub(crate) fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A random number of milliseconds in `low..=high`.
pub(crate) fn random_millis(low: u64, high: u64) -> u64 {
    let span = u128::from(high.saturating_sub(low)) + 1;
    // A v4 UUID is 122 random bits: plenty, and no extra dependency.
    low + u64::try_from(uuid::Uuid::new_v4().as_u128() % span).unwrap_or(0)
}
