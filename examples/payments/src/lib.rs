//! The payments domain shared by `payments-axum` and `payments-actix`
//! (`docs/contract.md` §8): the command line, the store it names, the bearer-token
//! principal, the request and answer types and their validation, the ledger and
//! the payment provider (simulated, or over HTTP). No web framework in here: each example wires
//! these into its routes, and both behave the same.
//!
//! - `POST /accounts/{account_id}/charges` (key required,
//!   [`Guards::charges`]): [`Payments::charge`], `201` [`Receipt`].
//! - `POST /accounts/{account_id}/deposits` (key optional,
//!   [`Guards::deposits`]): [`Payments::deposit`], `201` [`Receipt`].
//! - `GET /accounts/{account_id}`: [`Payments::account`], `200` [`AccountView`].
//! - Every route: [`Principal::from_authorization`] first, a missing or malformed
//!   bearer token is `401`; the principal is the idempotency scope, named by
//!   a hash of the token ([`Principal::from_token`]), never the token itself.
//!
//! ## Logs
//!
//! [`init_tracing`] logs to stderr, filtered by `RUST_LOG` (default `info`).
//! No line, at any level, carries a bearer token, a full idempotency key or a
//! request body: the scope is the token's hash, idem logs keys redacted (their
//! first characters and length), the service logs the account, kind, amount
//! and balance of what it applied, and the PostgreSQL driver, which at `debug`
//! would write each statement's parameters, logs at `info` at most.
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
//!   the same database.
//!
//!   On both, the keyed routes run in **transactional mode**
//!   ([`Guards::transactional`]): the ledger's writes and the completion
//!   commit together, so a process killed at any point leaves one effect or
//!   none, and the retry gets exactly one charge. A duplicate that arrives
//!   while the first request runs waits for the commit and replays the
//!   committed answer.
//! - `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT…]`:
//!   idem-redis's store, and the ledger in the same Redis ([`Ledger::redis`]);
//!   both survive an application restart, and as much of a Redis restart or
//!   failover as Redis's persistence and replication keep. The record and the
//!   account cannot change in one step; the ledger remembers which operation
//!   each key applied, so a retry after a crash gets it back instead of a
//!   second charge.
//!
//! ## The provider and the lease
//!
//! A charge asks the payment [`Provider`] before it applies: by default the
//! simulated one, which waits `--provider-latency-ms` (0) and accepts; with
//! `--provider-url URL`, `POST {URL}/payments` with the JSON body
//! `{"account_id", "amount", "currency"}` and an `Idempotency-Key` header,
//! [`forwarded_key`] of the principal's scope and the request's key (the same on
//! every retry of one charge, different between principals and keys). A `2xx`
//! lets the charge proceed; anything else (another status, a refused
//! connection, no answer within 10 s) answers the charge `502 provider-failed`
//! with nothing applied, and the record is released, so a retry calls the
//! provider again. On PostgreSQL the call happens inside the request's
//! transaction. `--lease-secs N` (default 30) is the keyed routes' lease
//! ([`Guards::lease`]); the engine renews it while the charge runs, so a
//! provider slower than the lease is still called once.
//!
//! `open` migrates the store's table and the ledger's
//! (`payment_accounts`, `payment_operations`; see [`Ledger`]) and starts the
//! store's cleanup job (Redis needs none: it expires records itself).
//! `--retention-secs` (default 86 400, the 24 h of `docs/contract.md` §6) is
//! how long the keyed routes keep a completed record, and
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
//! Both example binaries pass the same checks as processes, on a throwaway
//! PostgreSQL cluster among other stores: their `tests/binary.rs`, on the
//! workspace's test harness `e2e/payments-harness` (not part of the example),
//! among them the crash test (servers killed with `SIGKILL` while charges are
//! in flight; every charge takes effect exactly once).

mod guards;
mod ledger;
mod provider;
mod publish;
mod service;
mod start;

pub use guards::{Guard, Guards, TRANSACTIONAL_WAIT, charge_policy, deposit_policy};
pub use ledger::{AccountView, Applied, Attempt, Ledger, LedgerError, Operation, OperationKind};
pub use provider::{InvalidProviderUrl, PROVIDER_TIMEOUT, Provider, ProviderError, forwarded_key};
pub use publish::{DEFAULT_PUBLISH_TO, PublishUrl};
pub use service::{Answer, OperationRequest, PaymentError, Payments, Principal, Receipt};
pub use start::{
    DEFAULT_STORE, Expiry, Options, StartError, Storage, StoreUrl, init_tracing, listening_line,
};
