//! The payments domain shared by `payments-axum` and `payments-actix`
//! (CONTRACT §8): the command line, the store it names, the bearer-token
//! principal, the request and answer types and their validation, the ledger and
//! the simulated payment provider. No web framework in here: each example wires
//! these into its routes, and both behave the same.
//!
//! - `POST /accounts/{account_id}/charges` (key required,
//!   [`Guards::charges`]): [`Payments::charge`], `201` [`Receipt`].
//! - `POST /accounts/{account_id}/deposits` (key optional,
//!   [`Guards::deposits`]): [`Payments::deposit`], `201` [`Receipt`].
//! - `GET /accounts/{account_id}`: [`Payments::account`], `200` [`AccountView`].
//! - Every route: [`Principal::from_authorization`] first, a missing or malformed
//!   bearer token is `401`; the principal is the idempotency scope.
//!
//! Every answer is an [`Answer`] (status, content type, `Retry-After`, body),
//! so that an example only converts it to its framework's response. A handler
//! hands the domain the request's [`Attempt`]: the key the idempotency
//! middleware let through, and in transactional mode the request's
//! [`PgTransaction`](idem_diesel::PgTransaction), taken from the adapter's
//! `ExecutionInfo::context`.
//!
//! ## Stores and the ledger
//!
//! `--store` (or `DATABASE_URL`) names one database for both the idempotency
//! records and the ledger ([`StoreUrl::open`] gives a [`Storage`]):
//!
//! - `memory`: both in this process, lost on exit.
//! - `sqlite://PATH` (the default, [`DEFAULT_STORE`]: `sqlite://payments.db`):
//!   idem-diesel's SQLite store, and the ledger's tables in the same file; both
//!   survive a restart.
//! - `postgres://…`: idem-diesel's PostgreSQL store, and the ledger's tables in
//!   the same database. The keyed routes run in **transactional mode**
//!   ([`Guards::transactional`]): the claim, the ledger's writes and the
//!   completion commit together, so a process killed at any point leaves one
//!   effect or none, and the retry gets exactly one charge. A duplicate that
//!   arrives while the first request's transaction is open waits for the commit
//!   and replays the committed answer.
//! - `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT…]`:
//!   idem-redis's store, and the ledger in the same Redis ([`Ledger::redis`]);
//!   both survive an application restart, and as much of a Redis restart or
//!   failover as Redis's persistence and replication keep. The record and the
//!   account cannot change in one step; the ledger remembers which operation
//!   each key applied, so a retry after a crash gets it back instead of a
//!   second charge.
//!
//! `open` migrates the store's table and the ledger's
//! (`payment_accounts`, `payment_operations`; see [`Ledger`]) and starts the
//! store's cleanup job (Redis needs none: it expires records itself). `--retention-secs` (default 86 400, the contract's
//! 24 h) is how long the keyed routes keep a completed record, and
//! `--cleanup-interval-secs` (default 60) how often the job deletes the
//! expired ones ([`Expiry`]).
//!
//! ```
//! use std::time::Duration;
//! use payments::{Answer, Attempt, Ledger, Payments, Principal};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let payments = Payments::new(Ledger::memory(), Duration::ZERO);
//! let principal = Principal::from_authorization(Some(b"Bearer alice"))?;
//! let body = br#"{"amount": 5, "currency": "EUR"}"#;
//! let answer: Answer = payments.deposit("acct-1", body, &Attempt::unkeyed()).await.into();
//! assert_eq!(answer.status, 201);
//! let answer: Answer = payments.account("acct-1").await.into();
//! assert_eq!(answer.body, r#"{"account_id":"acct-1","balance":5,"operations":1}"#);
//! # let _ = principal;
//! # Ok::<(), payments::PaymentError>(())
//! # }).unwrap();
//! ```
//!
//! ## Testing
//!
//! The `test-util` feature adds `payments::testing`: the checks both example binaries
//! pass as processes on a throwaway PostgreSQL cluster, among them the crash
//! test (servers killed with `SIGKILL` while charges are in flight; every
//! charge takes effect exactly once).

mod guards;
mod ledger;
mod service;
mod start;
#[cfg(feature = "test-util")]
pub mod testing;

pub use guards::{Guard, Guards, TRANSACTIONAL_WAIT, charge_policy, deposit_policy};
pub use ledger::{AccountView, Applied, Attempt, Ledger, LedgerError, Operation, OperationKind};
pub use service::{Answer, OperationRequest, PaymentError, Payments, Principal, Receipt};
pub use start::{
    DEFAULT_STORE, Expiry, Options, StartError, Storage, StoreUrl, init_tracing, listening_line,
};
