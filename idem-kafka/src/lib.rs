#![doc = include_str!("../README.md")]
//!
//! # The parts
//!
//! - [`Consumer`]: built with [`Consumer::builder`], run with
//!   [`Consumer::run`]. A member of a consumer group whose partitions'
//!   positions live in the inbox ([`Positions`], from
//!   [`idem_core::consume`]: idem-diesel's `PgInbox` and `SqliteInbox` keep
//!   them in their database, in the handler's transaction; idem-core's
//!   [`MemoryInbox`] in memory); it translates each record for the protocol
//!   ([`Protocol::decide`]) and carries the decision out.
//! - [`dead_letters`], [`redrive`]: the dead-letter topic `<topic>.dlq`, read
//!   without consuming it, and re-driven by hand.
//! - [`OutboxPublisher`]: the transactional outbox's publisher
//!   ([`idem_core::outbox::Publish`]).
//!
//! The consumer protocol's types are re-exported ([`Message`], [`Handler`],
//! [`handler`], [`ConsumerPolicy`]…), and so is [`idem_core`].
//!
//! # Logs
//!
//! Events go through `tracing` (targets `idem_kafka` and, for the protocol's
//! decisions, `idem`). No event carries a record's value or a whole message
//! id. librdkafka's own log goes to `tracing` through rdkafka's `log` events
//! at most at their level; it names brokers and topics, never values.
//!
//! # Why rdkafka
//!
//! [rdkafka](https://docs.rs/rdkafka) binds librdkafka, the C client that
//! Confluent maintains and that most Kafka clients outside the JVM are built
//! on: consumer groups with rebalance callbacks (this crate positions
//! partitions from its database inside one), a queue per partition (a
//! partition's records wait there, fetched ahead, until its worker has
//! room), offsets stored for auto-commit, the idempotent producer, and the
//! admin API. It is the most used Kafka crate, maintained since 2016.
//! librdkafka is built from the source rdkafka-sys bundles (with zlib):
//! Debian 12's `librdkafka-dev` is 2.0.2, older than the 2.12 this rdkafka
//! is made for, so linking the system's library is not an option there.

mod consumer;
mod dead_letters;
mod error;
mod fence;
mod publisher;
mod record;
mod topics;

pub use consumer::{
    Consumer, ConsumerBuilder, DEFAULT_PREFETCH, DEFAULT_SHUTDOWN_TIMEOUT, Subscription, Unset,
};
pub use dead_letters::{DeadLetterRecord, REDRIVEN_THROUGH_HEADER, Redrive, dead_letters, redrive};
pub use error::Error;
pub use fence::{Fenced, PartitionLost};
pub use publisher::OutboxPublisher;
pub use record::{
    ATTEMPTS_HEADER, MESSAGE_ID_HEADER, OFFSET_HEADER, PARTITION_HEADER, REASON_HEADER,
    REDRIVEN_HEADER, TOPIC_HEADER, TRUNCATED_HEADER,
};
pub use topics::{create_topic, dead_letter_topic};

pub use idem_core;
pub use idem_core::consume::{
    AMBIGUOUS_MESSAGE_ID, Advance, Attempt, Batch, BatchHandler, ConsumerPolicy, DeadLetterAlert,
    ErrorKind, Handler, HandlerError, HandlerFuture, Inbox, MemoryInbox, Message, MissingId,
    Positions, Protocol, UNREADABLE_MESSAGE_ID, batch_handler, each, handler, rfc3339,
};
pub use idem_core::retry::Backoff;
pub use rdkafka;
