//! The consumer's harness: `payments-consumer` as a process, and the
//! scenarios ([`SCENARIOS`] on RabbitMQ, [`KAFKA_SCENARIOS`],
//! [`SQS_SCENARIOS`]) that `cargo xtask e2e` runs against it
//! ([`crate::e2e`]'s consumer rows), on throwaway servers (`idem_testkit`),
//! each on PostgreSQL and on SQLite; the chain and the demo drive the
//! consumer through it too.
//!
//! A scenario gets a [`Case`]: the binary, the broker's URL, a fresh database
//! (`postgres://…` or `sqlite://PATH`) and a queue name of its own, and a
//! directory for the consumers' logs. A scenario that stops the broker
//! ([`Scenario::stops_broker`]) runs while no other scenario on the node
//! does, with the node ([`Case::with_broker`]). It
//! starts consumers as processes (`run`, their stderr in the directory), drives
//! them through the broker, reads the outcome with the binary's other commands
//! (`balance`, `dead-letters`, `redrive`) and the database, and answers the
//! figure behind its verdict, or what went wrong.

// Test support: a failed expectation is an `Err` or a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod faults;
mod kafka;
mod process;
mod scenarios;
mod sqs;

pub(crate) use kafka::{KAFKA_SCENARIOS, positions as kafka_positions};
pub(crate) use process::{Case, Client, ConsumerProcess};
pub(crate) use scenarios::{SCENARIOS, Scenario, wait_operations};
pub(crate) use sqs::{Exercise, SQS_SCENARIOS, fifo_exercise};
