//! `payments-consumer`: an at-least-once consumer on RabbitMQ whose effects
//! happen once, with idem-diesel's [`Inbox`](idem_diesel::Inbox) in
//! PostgreSQL, full-jitter retries that do not block the queue, and a
//! dead-letter queue people can act on.
//!
//! A message is a JSON body `{"account_id": STRING, "amount": INT}` whose AMQP
//! `message_id` is its idempotency key. The consumer (`run`) takes deliveries
//! with manual acknowledgements and a bounded prefetch ([`consume::PREFETCH`]),
//! and hands each to [`Inbox::process_once`](idem_diesel::Inbox::process_once):
//! the balance update ([`ledger::apply`]) and the inbox row commit in one
//! transaction, and the delivery is acknowledged only after the commit. A
//! redelivery (after a crash, a lost acknowledgement, a producer's retry) finds
//! the row and is acknowledged without a second effect.
//!
//! A failed attempt is counted by the inbox and retried after
//! [`Backoff::delay`](idem_core::retry::Backoff::delay) (full jitter, base
//! `--retry-base-ms`): the message is published to a delay queue with that
//! TTL, which dead-letters it back to the work queue (see [`Topology`]), so
//! other messages go on meanwhile. The attempt that reaches `--max-attempts`
//! sends it to `<queue>.dlq` through RabbitMQ's dead-lettering (its `x-death`
//! history kept), with the reason and every attempt's time in headers
//! ([`message::REASON_HEADER`], [`message::ATTEMPTS_HEADER`]). A message that
//! can never be processed ([`message::Permanent`]: no `message_id`, a body
//! that is not a payment) goes there at once. More than
//! `--dlq-alert-threshold` dead letters raise the [`alert`]: one error line
//! with `dead-letter alert` and the count per crossing, and the metric
//! [`alert::ALERTS_COUNTER`] (through the `metrics` facade; the gauge
//! [`alert::DEAD_LETTERS_GAUGE`] follows the count).
//!
//! `dead-letters` prints the dead letters without removing them
//! ([`dead_letters::list`]); `redrive` moves them back to the work queue by
//! hand ([`dead_letters::redrive`]), marked so that the consumer lets them
//! through the inbox's dead letters again. Nothing re-drives automatically.
//!
//! # Dependencies
//!
//! - **lapin**, the AMQP 0-9-1 client: the most used and longest maintained
//!   one for Rust (releases since 2017, an active maintainer), async on Tokio,
//!   with everything this needs: manual acknowledgements, `basic.qos`,
//!   publisher confirms, `basic.get`, headers of every AMQP type. Built
//!   without TLS (`default-features = false`): the example talks to a local
//!   broker.
//! - **metrics**, the de facto metrics facade of the Rust ecosystem: the
//!   alert's counter and the dead-letter gauge go to whichever exporter the
//!   application installs (none in this example), at no cost without one.
//! - **chrono**, already in the workspace through diesel: RFC 3339 times.
//!
//! # Testing
//!
//! With the feature `test-util`, [`testing`] starts a throwaway RabbitMQ node
//! (Debian's `rabbitmq-server`) and holds the scenarios that the crate's tests
//! and `cargo xtask e2e` run against the binary.

pub mod alert;
pub mod consume;
pub mod dead_letters;
pub mod ledger;
pub mod message;
#[cfg(feature = "test-util")]
pub mod testing;
pub mod topology;

pub use consume::{RunOptions, run};
pub use topology::Topology;

use idem_core::store::BoxError;

/// Why a command of the consumer failed.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    /// The database could not be reached or migrated.
    #[error("the database could not be set up")]
    Setup(#[from] idem_diesel::SetupError),
    /// The inbox's database failed.
    #[error("the inbox failed")]
    Inbox(#[from] idem_diesel::InboxError),
    /// A query failed.
    #[error("a database query failed")]
    Database(#[from] diesel::result::Error),
    /// No connection could be had from the pool.
    #[error("no database connection")]
    Pool(#[source] BoxError),
    /// The broker failed (connection, channel, declaration).
    #[error("the broker failed")]
    Broker(#[from] lapin::Error),
    /// The broker did not take a published message.
    #[error("the broker did not take a message: {0}")]
    NotConfirmed(String),
    /// The broker cancelled the subscription.
    #[error("the broker cancelled the consumer")]
    Cancelled,
    /// No signal handler could be installed.
    #[error("no signal handler")]
    Signal(#[source] std::io::Error),
}

impl ConsumerError {
    pub(crate) fn pool(error: impl Into<BoxError>) -> Self {
        Self::Pool(error.into())
    }
}
