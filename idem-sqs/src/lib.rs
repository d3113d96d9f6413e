#![doc = include_str!("../README.md")]
//!
//! # The parts
//!
//! - [`Consumer`]: built with [`Consumer::builder`] from an
//!   [`aws_sdk_sqs::Client`] and the queue's URL, run with [`Consumer::run`];
//!   it translates each received message for the protocol
//!   ([`Protocol::decide`]) and carries the decision out on SQS.
//! - [`ClientConfig`]: the SDK's client from the environment (region,
//!   credentials, endpoint), without aws-config.
//! - [`dead_letters`], [`redrive`]: the dead-letter queue, read without
//!   removing anything, and moved back by hand.
//! - [`Publisher`], [`Outgoing`]: deduplication ids from the content, groups,
//!   the `message_id` attribute.
//!
//! The consumer protocol's types are re-exported ([`Message`], [`Handler`],
//! [`handler`], [`ConsumerPolicy`], [`MemoryInbox`]…), and so are
//! [`idem_core`] and [`aws_sdk_sqs`]: one `idem-sqs` line in `Cargo.toml`
//! suffices.
//!
//! # Logs
//!
//! Events go through `tracing` (targets `idem_sqs` and, for the protocol's
//! decisions, `idem`). No event carries a body, a whole message id
//! ([`Redacted`](idem_core::Redacted)) or a credential. The SDK's own TRACE
//! and DEBUG events (targets `aws_smithy_runtime`, `aws_sdk_sqs`, `hyper`)
//! show requests and responses, bodies included: keep them at INFO or above.
//!
//! # Why aws-sdk-sqs, and how it is built
//!
//! [aws-sdk-sqs](https://docs.rs/aws-sdk-sqs) is AWS's own SDK for Rust,
//! generated from the service's model, so every SQS operation and attribute
//! is there as AWS defines it (FIFO, redrive policies, batch operations),
//! with SigV4 signing and the SDK's standard retries; the community crates
//! (rusoto, long unmaintained) are not. Its costs are compile time and
//! defaults, so this crate takes only what it needs:
//!
//! - `aws-sdk-sqs` without default features, with `rt-tokio` (the SDK's
//!   sleeps on Tokio) and `behavior-version-latest`;
//! - its HTTPS client from `aws-smithy-http-client` with `rustls-ring`
//!   only: hyper 1 and rustls on *ring*. The SDK's default client uses
//!   rustls on aws-lc-rs, whose C build (aws-lc-sys) costs minutes on a
//!   cold two-core machine; *ring* builds in seconds. Roots come from the
//!   system's certificate store;
//! - no `aws-config`: its default chain (profiles, SSO, STS, IMDS) brings
//!   three more generated SDKs. [`ClientConfig`] reads the environment as
//!   the SDK's environment provider does (`AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
//!   `AWS_ENDPOINT_URL_SQS`); an application that needs the full chain
//!   builds its client with aws-config and passes it in.
//!
//! `sha2` (deduplication ids) and `serde_json` (redrive policies, canonical
//! content) are the workspace's already; the attempts' RFC 3339 times are
//! idem-core's (`idem_core::consume::rfc3339`, re-exported here).

mod client;
mod consumer;
mod dead_letters;
mod error;
mod lease;
mod message;
mod publisher;
mod queue;

pub use client::{ClientConfig, DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_REGION};
pub use consumer::{
    Consumer, ConsumerBuilder, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_WAIT_TIME, MAX_BATCH, Polling,
    Unset,
};
pub use dead_letters::{DeadLetterMessage, MOVED_BY_REDRIVE_POLICY, dead_letters, redrive};
pub use error::Error;
pub use message::{
    ATTEMPTS_ATTRIBUTE, GROUP_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE, QUEUE_ATTRIBUTE, REASON_ATTRIBUTE,
    REDRIVEN_ATTRIBUTE, content_digest,
};
pub use publisher::{Deduplication, Outgoing, Publisher, Sent};
pub use queue::{MAX_QUEUE_NAME_LEN, dead_letter_queue_name, queue_name};

pub use aws_sdk_sqs;
pub use idem_core;
pub use idem_core::consume::{
    Attempt, Batch, BatchHandler, ConsumerPolicy, DeadLetterAlert, ErrorKind, Handler,
    HandlerError, HandlerFuture, Inbox, MemoryInbox, Message, MissingId, Protocol, batch_handler,
    each, handler, rfc3339,
};
pub use idem_core::retry::Backoff;
