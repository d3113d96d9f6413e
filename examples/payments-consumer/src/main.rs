//! `payments-consumer`: `run`, `dead-letters`, `redrive`, `balance`. See the
//! library's docs.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use payments_consumer::database::{DEFAULT_DATABASE, Database};
use payments_consumer::dead_letters::DeadLetterLine;
use payments_consumer::{ConsumerError, RunOptions};

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
        /// The database, postgres://… or sqlite://PATH (tables created if
        /// missing).
        #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE, hide_env_values = true)]
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
        /// How many messages are processed at once.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
        concurrency: u16,
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
    /// Moves the dead letters back to the work queue; each is then applied
    /// once.
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
        /// The database, postgres://… or sqlite://PATH.
        #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE, hide_env_values = true)]
        database: String,
    },
}

fn main() -> ExitCode {
    example_tracing::init();
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
            // The error and its sources (`error.sources`).
            let error: &(dyn std::error::Error + 'static) = &error;
            tracing::error!(error, "payments-consumer failed");
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
            concurrency,
            fail_account,
        } => {
            let options = RunOptions {
                amqp,
                database,
                queue,
                max_attempts,
                retry_base: Duration::from_millis(retry_base_ms),
                dead_letter_alert_threshold: dlq_alert_threshold,
                concurrency: usize::from(concurrency),
                fail_account,
            };
            payments_consumer::run(options, |queue| println!("consuming from {queue}")).await
        }
        Command::DeadLetters { amqp, queue } => {
            for letter in idem_rabbitmq::dead_letters(&amqp, &queue).await? {
                let line = DeadLetterLine::from(&letter);
                println!("{}", serde_json::to_string(&line).unwrap_or_default());
            }
            Ok(())
        }
        Command::Redrive { amqp, queue } => {
            let moved = idem_rabbitmq::redrive(&amqp, &queue).await?;
            println!("re-drove {moved} dead letters from {queue}.dlq to {queue}");
            Ok(())
        }
        Command::Balance { account, database } => {
            let database = Database::open(&database, 1).await?;
            let account = database.account(&account).await?;
            println!("{}", serde_json::to_string(&account).unwrap_or_default());
            Ok(())
        }
    }
}
