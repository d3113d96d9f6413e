#![doc = include_str!("../README.md")]
//!
//! # The parts
//!
//! - [`Consumer`]: built with [`Consumer::builder`], run with
//!   [`Consumer::run`]; it translates each delivery for the protocol
//!   ([`Protocol::decide`]) and carries the decision out, acknowledging
//!   only after the broker confirmed that work.
//! - [`Topology`]: the work queue, its delay queues (one per power of two
//!   of milliseconds, so that no retry waits behind a longer one) and its
//!   dead-letter queue; classic or quorum ([`QueueType`]).
//! - [`dead_letters`], [`redrive`], [`redrive_message`]: the dead-letter
//!   queue, read without removing anything, and moved back by hand.
//! - [`Publisher`]: publisher confirms, persistent messages, a stable
//!   `message_id`.
//! - [`OutboxPublisher`]: the transactional outbox's publisher
//!   ([`idem_core::outbox::Publish`]): idem-diesel's relay publishes the
//!   events staged in the effects' transactions with it, each with its id
//!   as `message_id`, parking those the broker can never take.
//!
//! The consumer protocol's types are re-exported ([`Message`], [`Handler`],
//! [`handler`], [`ConsumerPolicy`], [`MemoryInbox`]…), and so is
//! [`idem_core`]: one `idem-rabbitmq` line in `Cargo.toml` suffices.
//!
//! # Logs
//!
//! Events go through `tracing` (targets `idem_rabbitmq` and, for the
//! protocol's decisions, `idem`). No event carries a body or a whole message
//! id ([`Redacted`](idem_core::Redacted)), and the broker's address is shown
//! without its password. lapin's own TRACE events show every frame, bodies
//! and message ids included: keep `lapin` at DEBUG or above
//! (`RUST_LOG=info,lapin=info`).
//!
//! # Why lapin
//!
//! [lapin](https://docs.rs/lapin) is the AMQP 0-9-1 client of the Rust
//! ecosystem that is the most used and the longest maintained (releases
//! since 2017), async on Tokio, and it has everything this crate needs:
//! manual acknowledgements, `basic.qos`, `basic.cancel`, publisher confirms
//! with returned (unroutable) messages, `basic.get`, and headers of every
//! AMQP type. It is built here without TLS (`default-features = false,
//! features = ["tokio"]`): `amqps://` is not supported by this build.
//! Its own automatic recovery is not used: the consumer reconnects, declares
//! and resubscribes itself, so that what a reconnection does (wait for the
//! running handlers, forget the declared delay queues) is this crate's.

mod broker;
mod consumer;
mod dead_letters;
mod error;
mod message;
mod outbox;
mod publisher;
mod topology;

pub use consumer::{
    Consumer, ConsumerBuilder, DEFAULT_PREFETCH, DEFAULT_SHUTDOWN_TIMEOUT, Subscribed, Unset,
};
pub use dead_letters::{DeadLetterMessage, Death, dead_letters, redrive, redrive_message};
pub use error::Error;
pub use message::{ATTEMPTS_HEADER, QUEUE_HEADER, REASON_HEADER, REDRIVEN_HEADER};
pub use outbox::OutboxPublisher;
pub use publisher::Publisher;
pub use topology::{
    DEFAULT_DELIVERY_LIMIT, MAX_DELAY, MAX_QUEUE_NAME_LEN, QueueType, Topology, ready,
};

pub use idem_core;
pub use idem_core::consume::{
    Attempt, Batch, BatchHandler, ConsumerPolicy, DeadLetterAlert, ErrorKind, Handler,
    HandlerError, HandlerFuture, Inbox, MemoryInbox, Message, MissingId, Protocol, batch_handler,
    each, handler, rfc3339,
};
pub use idem_core::retry::Backoff;
pub use lapin;
