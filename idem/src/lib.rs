#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// idem-core at the root: the HTTP side's types (`Policy`, `Scope`,
// `MemoryStore`, …) and its modules (`consume`, `cleanup`, `outbox`, `retry`,
// …), under the names idem-core gives them.
pub use idem_core::*;

/// The Tower layer for axum routes and any Tower service: idem-axum's items
/// (feature `axum`).
///
/// [`IdempotencyLayer`](idem_axum::IdempotencyLayer) wraps a route with
/// [`Policy`] and a [`Store`]; see idem-axum's documentation for the whole
/// setup, whose `idem_axum::` paths are `idem::axum::` paths here.
#[cfg(feature = "axum")]
pub mod axum {
    pub use idem_axum::*;
}

/// The actix-web middleware: idem-actix's items (feature `actix`).
///
/// [`Idempotency`](idem_actix::Idempotency) wraps a resource or a scope with
/// [`Policy`] and a [`Store`]; see idem-actix's documentation, whose
/// `idem_actix::` paths are `idem::actix::` paths here.
#[cfg(feature = "actix")]
pub mod actix {
    pub use idem_actix::*;
}

/// The SQL stores, inboxes and outboxes on diesel-async: idem-diesel's items
/// (features `sqlite` and `postgres`).
///
/// | item | feature |
/// |---|---|
/// | `SqliteStore`, `SqliteInbox`, `SqliteOutbox`, `AsyncSqliteConnection` | `sqlite` |
/// | `PgStore`, `TransactionalPgStore`, `TransactionalPgStoreBuilder`, `PgTransaction`, `Transaction`, `PgInbox`, `PgOutbox` | `postgres` |
/// | `Relay`, `Outbox`, `Cleanup`, `SetupError`, `diesel`, `diesel_async` | either |
///
/// See idem-diesel's documentation, whose `idem_diesel::` paths are
/// `idem::diesel::` paths here.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub mod diesel {
    pub use idem_diesel::*;
}

/// The Redis and Redis Cluster store: idem-redis's items (feature `redis`).
///
/// See idem-redis's documentation, whose `idem_redis::` paths are
/// `idem::redis::` paths here.
#[cfg(feature = "redis")]
pub mod redis {
    pub use idem_redis::*;
}

/// RabbitMQ for consumers: idem-rabbitmq's items (feature `rabbitmq`).
///
/// The consumer, its topology, dead letters and redrive, the publishers, and
/// the consumer protocol's types also found in [`consume`]; see
/// idem-rabbitmq's documentation, whose `idem_rabbitmq::` paths are
/// `idem::rabbitmq::` paths here.
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    pub use idem_rabbitmq::*;
}

/// Kafka for consumers: idem-kafka's items (feature `kafka`, with `sqlite`
/// and/or `postgres` for the inbox that keeps the positions).
///
/// The consumer, dead letters and redrive, the outbox's producer; see
/// idem-kafka's documentation, whose `idem_kafka::` paths are `idem::kafka::`
/// paths here.
#[cfg(feature = "kafka")]
pub mod kafka {
    pub use idem_kafka::*;
}

/// SQS for consumers: idem-sqs's items (feature `sqs`).
///
/// See idem-sqs's documentation, whose `idem_sqs::` paths are `idem::sqs::`
/// paths here.
#[cfg(feature = "sqs")]
pub mod sqs {
    pub use idem_sqs::*;
}

/// The client half: retries that keep the `Idempotency-Key` contract,
/// idem-client's items (feature `client`).
///
/// See idem-client's documentation, whose `idem_client::` paths are
/// `idem::client::` here.
#[cfg(feature = "client")]
pub mod client {
    pub use idem_client::*;
}
