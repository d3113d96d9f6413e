//! `payments-consumer`: an at-least-once consumer on RabbitMQ whose payments
//! take effect once, written as an application of
//! [idem-rabbitmq](idem_rabbitmq) and idem-diesel's inboxes
//! ([`PgInbox`](idem_diesel::PgInbox), [`SqliteInbox`](idem_diesel::SqliteInbox)).
//! `docs/contract.md` §9 is its specification.
//!
//! A message is a JSON body `{"account_id": STRING, "amount": INT > 0}` whose
//! AMQP `message_id` is its idempotency key. All the broker work is
//! idem-rabbitmq's [`Consumer`](idem_rabbitmq::Consumer), declared in
//! [`consume::run`]: the queues (the work queue, its delay queues, its
//! dead-letter queue `<queue>.dlq`), acknowledging after the commit,
//! full-jitter retries (base `--retry-base-ms`) that block no other message,
//! the dead letter after exactly `--max-attempts` failures with its reason,
//! attempt times and `x-death` history, `--concurrency` handlers at once,
//! reconnecting after a broker restart, and a graceful stop on SIGTERM. The
//! decisions (a duplicate, a `message_id` reused with another body, a retry,
//! a dead letter, the `dead-letter alert` line past `--dlq-alert-threshold`)
//! are idem-core's consumer protocol.
//!
//! What is the application's own:
//!
//! - [`payment`]: what a payment is. Anything else is a permanent error,
//!   dead-lettered at once, with a reason that never quotes the body: not
//!   JSON, an amount that is not a positive integer, an account id empty or
//!   over [`MAX_ACCOUNT_ID_LEN`](payment::MAX_ACCOUNT_ID_LEN) bytes.
//! - [`ledger`]: the effect, one statement on the inbox's transaction (so it
//!   commits with the inbox row), with the sum checked: a balance that would
//!   pass `i64::MAX` is a permanent error too. One schema per database,
//!   applied at start.
//! - [`database`]: `--database` (`postgres://…` or `sqlite://PATH`, the
//!   default [`DEFAULT_DATABASE`](database::DEFAULT_DATABASE), so a first run
//!   needs no database server), the inbox and the ledger on it.
//! - [`dead_letters`]: the JSON lines of `dead-letters` (the listing itself,
//!   and `redrive`, are idem-rabbitmq's).
//!
//! # Logs
//!
//! On stderr, filtered by `RUST_LOG` (default `info`), through
//! [`example_tracing::init`]: whatever `RUST_LOG` says, the PostgreSQL and
//! RabbitMQ drivers log at `info` at most (below it they write statement
//! parameters and whole frames). idem logs message ids redacted and never a
//! body, and this crate's errors name no account: no line carries a whole
//! message id or any part of a body, at any level.

pub mod consume;
pub mod database;
pub mod dead_letters;
pub mod kafka;
pub mod ledger;
pub mod payment;
pub mod sqs;

pub use consume::{RunOptions, Settings, run};

use idem_diesel::idem_core::store::BoxError;

/// Why a command of the consumer failed.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    /// `--database` is neither `postgres://…` nor `sqlite://PATH`.
    #[error("the database URL is neither postgres://… nor sqlite://PATH")]
    UnknownDatabase,
    /// The database could not be reached or migrated.
    #[error("the database could not be set up")]
    Setup(#[from] idem_diesel::SetupError),
    /// A query failed.
    #[error("a database query failed")]
    Database(#[from] idem_diesel::diesel::result::Error),
    /// No connection could be had from the pool.
    #[error("no database connection")]
    Pool(#[source] BoxError),
    /// The broker failed in a way reconnecting cannot help (refused
    /// credentials, a queue declared with other arguments), or a
    /// `dead-letters` or `redrive` could not reach it.
    #[error("the broker failed")]
    Broker(#[from] idem_rabbitmq::Error),
    /// The Kafka broker failed in a way retrying cannot help, or a
    /// `dead-letters` or `redrive` could not reach it.
    #[error("the Kafka broker failed")]
    Kafka(#[from] idem_kafka::Error),
    /// SQS failed in a way retrying cannot help, or a `dead-letters` or
    /// `redrive` could not reach it.
    #[error("SQS failed")]
    Sqs(#[from] idem_sqs::Error),
    /// No signal handler could be installed.
    #[error("no signal handler")]
    Signal(#[source] std::io::Error),
}

impl ConsumerError {
    /// A pool's error ([`with_connection!`]).
    pub fn pool(error: impl Into<BoxError>) -> Self {
        Self::Pool(error.into())
    }
}
