//! The payments domain shared by `payments-axum` and `payments-actix`
//! (CONTRACT §8): the command line, the store it names, the bearer-token
//! principal, the request and answer types and their validation, the ledger and
//! the simulated payment provider. No web framework in here: each example wires
//! these into its routes, and both behave the same.
//!
//! - `POST /accounts/{account_id}/charges` (key required, [`charge_policy`]):
//!   [`Payments::charge`], `201` [`Receipt`].
//! - `POST /accounts/{account_id}/deposits` (key optional, [`deposit_policy`]):
//!   [`Payments::deposit`], `201` [`Receipt`].
//! - `GET /accounts/{account_id}`: [`Payments::account`], `200` [`AccountView`].
//! - Every route: [`Principal::from_authorization`] first, a missing or malformed
//!   bearer token is `401`; the principal is the idempotency scope.
//!
//! Every answer is an [`Answer`] (status, content type, body), so that an example
//! only converts it to its framework's response.
//!
//! ## Stores
//!
//! `--store` (or `DATABASE_URL`) names the idempotency store: `memory`,
//! `sqlite://PATH` (the default, [`DEFAULT_STORE`]: `sqlite://payments.db`, kept
//! across restarts) or `postgres://…`. The SQLite and PostgreSQL stores are
//! `idem-diesel`'s; [`StoreUrl::open`] migrates their table and starts their
//! cleanup job. The ledger itself lives in memory: it is the example's
//! stand-in for the application's own database.
//!
//! ```
//! use std::time::Duration;
//! use payments::{Answer, Ledger, Payments, Principal};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let payments = Payments::new(Ledger::new(), Duration::ZERO);
//! let principal = Principal::from_authorization(Some(b"Bearer alice"))?;
//! let answer: Answer = payments.deposit("acct-1", br#"{"amount": 5, "currency": "EUR"}"#).await.into();
//! assert_eq!(answer.status, 201);
//! let answer: Answer = payments.account("acct-1").into();
//! assert_eq!(answer.body, r#"{"account_id":"acct-1","balance":5,"operations":1}"#);
//! # let _ = principal;
//! # Ok::<(), payments::PaymentError>(())
//! # }).unwrap();
//! ```

mod ledger;
mod service;
mod start;

pub use ledger::{AccountView, Applied, Ledger, LedgerError, OperationKind};
pub use service::{
    Answer, OperationRequest, PaymentError, Payments, Principal, Receipt, charge_policy,
    deposit_policy,
};
pub use start::{DEFAULT_STORE, Options, StartError, StoreUrl, init_tracing, listening_line};
