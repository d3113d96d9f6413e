//! Test support (feature `test-util`): the scenarios ([`SCENARIOS`]) that the
//! crate's tests and `cargo xtask e2e` run against the `payments-consumer`
//! binary, on a throwaway RabbitMQ node (`idem_testkit`), each on PostgreSQL
//! and on SQLite.
//!
//! A scenario gets a [`Case`]: the binary, the broker's URL, a fresh database
//! (`postgres://…` or `sqlite://PATH`) and a queue name of its own, and a
//! directory for the consumers' logs. A scenario that stops the broker
//! ([`Scenario::alone`]) runs alone, with the node ([`Case::with_broker`]). It
//! starts consumers as processes (`run`, their stderr in the directory), drives
//! them through the broker, reads the outcome with the binary's other commands
//! (`balance`, `dead-letters`, `redrive`) and the database, and answers the
//! figure behind its verdict, or what went wrong.
//!
//! ```no_run
//! use std::sync::Arc;
//! use idem_testkit::{TestPostgres, TestRabbitMq};
//! use payments_consumer::testing::{Case, SCENARIOS};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let broker = Arc::new(TestRabbitMq::start()?);
//! let cluster = TestPostgres::start()?;
//! for scenario in SCENARIOS {
//!     cluster.create_database(scenario.name)?;
//!     let case = Case::new(
//!         "target/debug/payments-consumer",
//!         broker.url(),
//!         cluster.url(scenario.name), // or "sqlite:///tmp/NAME.db"
//!         scenario.name,
//!         std::env::temp_dir(),
//!     )
//!     .with_broker(broker.clone());
//!     match (scenario.run)(case).await {
//!         Ok(figure) => println!("{}: {figure}", scenario.check),
//!         Err(failure) => println!("{}: FAILED: {failure}", scenario.check),
//!     }
//! }
//! # Ok(())
//! # }
//! ```

// Test support: a failed expectation is an `Err` or a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod demo;
mod faults;
mod kafka;
mod process;
mod scenarios;
mod sqs;

pub use kafka::{KAFKA_SCENARIOS, positions as kafka_positions};
pub use process::{Case, Client, ConsumerProcess};
pub use scenarios::{SCENARIOS, Scenario};
pub use sqs::{Exercise, SQS_SCENARIOS, fifo_exercise};
