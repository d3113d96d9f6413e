#![doc = include_str!("../README.md")]

mod client;
mod consumer;
mod dead_letters;
mod error;
mod lease;
mod message;
mod publisher;
mod queue;

pub use client::{ClientConfig, DEFAULT_REGION};
pub use consumer::{
    Consumer, ConsumerBuilder, DEFAULT_SHUTDOWN_TIMEOUT, DEFAULT_WAIT_TIME, MAX_BATCH, Polling,
    Unset,
};
pub use dead_letters::{DeadLetterMessage, MOVED_BY_REDRIVE_POLICY, dead_letters, redrive};
pub use error::Error;
pub use message::{
    ATTEMPTS_ATTRIBUTE, GROUP_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE, QUEUE_ATTRIBUTE, REASON_ATTRIBUTE,
    REDRIVEN_ATTRIBUTE, content_digest, rfc3339,
};
pub use publisher::{Deduplication, Outgoing, Publisher, Sent};
pub use queue::{MAX_QUEUE_NAME_LEN, dead_letter_queue_name, queue_name};

pub use aws_sdk_sqs;
pub use idem_core;
pub use idem_core::consume::{
    Attempt, ConsumerPolicy, DeadLetterAlert, ErrorKind, Handler, HandlerError, HandlerFuture,
    Inbox, MemoryInbox, Message, MissingId, Protocol, handler,
};
pub use idem_core::retry::Backoff;
