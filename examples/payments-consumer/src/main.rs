//! `payments-consumer`: `run`, `dead-letters`, `redrive`, `balance`. See the
//! library's docs.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idem_diesel::PgStore;
use payments_consumer::consume::error_chain;
use payments_consumer::{ConsumerError, RunOptions, dead_letters, ledger};

/// An at-least-once consumer on RabbitMQ whose payments take effect once.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Consumes payments from the queue until SIGTERM.
    Run {
        /// The broker: amqp://user:password@host:port/vhost.
        #[arg(long)]
        amqp: String,
        /// The PostgreSQL database: postgres://… (tables created if missing).
        #[arg(long)]
        database: String,
        /// The work queue (its delay and dead-letter queues are named after it).
        #[arg(long, default_value = "payments")]
        queue: String,
        /// Failed attempts after which a message goes to the dead-letter queue.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
        max_attempts: u32,
        /// The first retry comes within this many milliseconds (full jitter),
        /// each later one within twice the previous bound.
        #[arg(long, default_value_t = 5000)]
        retry_base_ms: u64,
        /// More dead letters than this raise the dead-letter alert.
        #[arg(long, default_value_t = 10)]
        dlq_alert_threshold: u64,
        /// Every payment to this account fails (a deliberate bug).
        #[arg(long)]
        fail_account: Option<String>,
    },
    /// Prints each dead letter as one JSON line, without removing it.
    DeadLetters {
        /// The broker: amqp://user:password@host:port/vhost.
        #[arg(long)]
        amqp: String,
        /// The work queue.
        #[arg(long, default_value = "payments")]
        queue: String,
    },
    /// Moves the dead letters back to the work queue.
    Redrive {
        /// The broker: amqp://user:password@host:port/vhost.
        #[arg(long)]
        amqp: String,
        /// The work queue.
        #[arg(long, default_value = "payments")]
        queue: String,
    },
    /// Prints an account's balance and operations as JSON.
    Balance {
        /// The account.
        account: String,
        /// The PostgreSQL database: postgres://….
        #[arg(long)]
        database: String,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: no Tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(args.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = %error_chain(&error), "payments-consumer failed");
            ExitCode::FAILURE
        }
    }
}

async fn execute(command: Command) -> Result<(), ConsumerError> {
    match command {
        Command::Run {
            amqp,
            database,
            queue,
            max_attempts,
            retry_base_ms,
            dlq_alert_threshold,
            fail_account,
        } => {
            let options = RunOptions {
                amqp,
                database,
                queue,
                max_attempts,
                retry_base: Duration::from_millis(retry_base_ms),
                dead_letter_alert_threshold: dlq_alert_threshold,
                fail_account,
            };
            payments_consumer::run(options, |topology| {
                println!("consuming from {}", topology.queue());
            })
            .await
        }
        Command::DeadLetters { amqp, queue } => {
            for letter in dead_letters::list(&amqp, &queue).await? {
                println!("{}", serde_json::to_string(&letter).unwrap_or_default());
            }
            Ok(())
        }
        Command::Redrive { amqp, queue } => {
            let moved = dead_letters::redrive(&amqp, &queue).await?;
            println!("re-drove {moved} dead letters from {queue}.dlq to {queue}");
            Ok(())
        }
        Command::Balance { account, database } => {
            let store = PgStore::connect(&database).await?;
            ledger::migrate(store.pool()).await?;
            let account = ledger::account(store.pool(), &account).await?;
            println!("{}", serde_json::to_string(&account).unwrap_or_default());
            Ok(())
        }
    }
}
