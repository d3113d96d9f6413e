//! The processes `cargo xtask bench` measures and the helpers it drives.
//!
//! - `serve`: one HTTP server (axum or actix-web) with the same trivial POST
//!   handler on two routes, `/bare` and `/layered` (behind idem's middleware over
//!   the in-memory store, `PgStore` or `RedisStore`), so that both are measured against the same
//!   process; with axum, also `/layered-slow` and `GET /executions` (the
//!   duplicates check). The first line on stdout is `listening on http://HOST:PORT`.
//! - `load`: the load generator, closed-loop HTTP/1.1 clients (see `load`).
//! - `memory`: bytes per record of the in-memory store, from the growth of this
//!   process's resident set.
//! - `cluster`: a throwaway PostgreSQL cluster (`idem-diesel`'s `TestPostgres`)
//!   that lives until stdin closes or a signal arrives.
//! - `pg-fill`, `pg-statements`, `cleanup`: PostgreSQL set-up, the store's own
//!   SQL as the server prepared it (for pgbench), and one timed cleanup sweep.
//! - `redis-load`: the Redis store's own scripts called at a given concurrency,
//!   without HTTP: the route's ceiling on that server.
//! - `profile`: the axum routes driven in process, for an instruction counter.
//! - `consume`: one drain of pre-published payments from RabbitMQ, through
//!   idem-rabbitmq with the PostgreSQL or SQLite inbox, or through a bare
//!   lapin consumer applying the same transaction (see `consume`).
//! - `kafka-consume`: the same on Kafka, through idem-kafka (the offsets in
//!   the transaction) or a bare rdkafka consumer with auto-commit (see
//!   `kafka_consume`).
//! - `sqs-consume`: the same on SQS (moto's server), through idem-sqs or a
//!   bare aws-sdk-sqs receive, apply, delete loop (see `sqs_consume`).
//! - `outbox-drain`, `outbox-lag`: idem-diesel's outbox relay publishing to
//!   RabbitMQ: a drain of staged events, and the lag from commit to confirm
//!   under a fixed rate of charges (see `outbox`).
//!
//! Helpers that answer print one JSON object on stdout.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idem_core::log::error_chain;

mod consume;
mod handler;
mod kafka_consume;
mod load;
mod memory;
mod outbox;
mod postgres;
mod profile;
mod redis;
mod serve;
mod sqs_consume;

/// A failure, told on stderr.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Parser)]
#[command(about = "Servers and helpers for `cargo xtask bench`")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serves `/bare` and `/layered` until killed.
    Serve(serve::Options),
    /// Loads a server with closed-loop HTTP/1.1 clients and prints what it measured.
    Load(load::Plan),
    /// Measures the in-memory store's bytes per record.
    Memory(memory::Options),
    /// Runs a throwaway PostgreSQL cluster until stdin closes.
    Cluster(postgres::ClusterOptions),
    /// Inserts live and expired completed records.
    PgFill(postgres::FillOptions),
    /// Prints the store's claim and complete statements as the server prepared them.
    PgStatements(postgres::UrlOptions),
    /// Runs one cleanup sweep and prints what it deleted and how long it took.
    Cleanup(postgres::CleanupOptions),
    /// Calls the Redis store's scripts at a given concurrency and prints the rate.
    RedisLoad(redis::LoadOptions),
    /// Drives the axum routes in process (no sockets), for an instruction counter.
    Profile(profile::Options),
    /// Publishes payments to a fresh queue, drains them through a consumer and
    /// prints the drain's time and CPU.
    Consume(consume::Options),
    /// Fills a fresh Kafka topic with payments, drains it through idem-kafka
    /// or a bare rdkafka consumer with auto-commit, and prints what it
    /// measured.
    KafkaConsume(kafka_consume::Options),
    /// Fills a fresh SQS queue with payments, drains it through idem-sqs or
    /// a bare aws-sdk-sqs loop, and prints what it measured.
    SqsConsume(sqs_consume::Options),
    /// Stages events, then measures a relay draining them to RabbitMQ.
    OutboxDrain(outbox::DrainOptions),
    /// Charges at a fixed rate, each staging an event, and measures the lag
    /// from commit to the broker's confirm.
    OutboxLag(outbox::LagOptions),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(options) => serve::run(options),
        Command::Load(plan) => load::run(plan),
        Command::Memory(options) => memory::run(&options),
        Command::Cluster(options) => postgres::cluster(&options),
        Command::PgFill(options) => block_on(postgres::fill(options)),
        Command::PgStatements(options) => block_on(postgres::statements(options)),
        Command::Cleanup(options) => block_on(postgres::cleanup(options)),
        Command::RedisLoad(options) => redis::load(options),
        Command::Profile(options) => profile::run(&options),
        Command::Consume(options) => consume::run(options),
        Command::KafkaConsume(options) => kafka_consume::run(options),
        Command::SqsConsume(options) => sqs_consume::run(options),
        Command::OutboxDrain(options) => outbox::drain(options),
        Command::OutboxLag(options) => outbox::lag(options),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let message = format!("bench-server: {}", error_chain(&*error));
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a helper on a current-thread runtime.
fn block_on(future: impl Future<Output = Result<(), BoxError>>) -> Result<(), BoxError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(future)
}
