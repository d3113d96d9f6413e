//! `payments-consumer`: `run`, `dead-letters`, `redrive`, `balance`, on
//! RabbitMQ (`--amqp`), Kafka (`--kafka`) or SQS (`--sqs`). See the library's
//! docs.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use payments_consumer::database::{DEFAULT_DATABASE, Database};
use payments_consumer::dead_letters::DeadLetterLine;
use payments_consumer::{ConsumerError, RunOptions, Settings, kafka, sqs};

/// An at-least-once consumer on RabbitMQ, Kafka or SQS whose payments take
/// effect once.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

/// The broker: exactly one of `--amqp`, `--kafka`, `--sqs`.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct BrokerArgs {
    /// RabbitMQ: amqp://user:password@host:port/vhost.
    #[arg(long)]
    amqp: Option<String>,
    /// Kafka: HOST:PORT[,HOST:PORT…].
    #[arg(long)]
    kafka: Option<String>,
    /// SQS: the queue's URL.
    #[arg(long)]
    sqs: Option<String>,
}

/// Where on the broker: the flags of each broker.
#[derive(Debug, clap::Args)]
struct PlaceArgs {
    /// RabbitMQ: the work queue (its delay and dead-letter queues are named
    /// after it).
    #[arg(long, default_value = "payments")]
    queue: String,
    /// Kafka: the topic (its dead letters go to `<topic>.dlq`).
    #[arg(long, default_value = "payments")]
    topic: String,
    /// SQS: the endpoint, when not AWS's (a local SQS).
    #[arg(long)]
    sqs_endpoint: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Consumes payments until SIGTERM.
    Run {
        #[command(flatten)]
        broker: BrokerArgs,
        #[command(flatten)]
        place: PlaceArgs,
        /// Kafka: the consumer group.
        #[arg(long, default_value = "payments")]
        group: String,
        /// The database, postgres://… or sqlite://PATH (tables created if
        /// missing).
        #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE, hide_env_values = true)]
        database: String,
        /// Failed attempts after which a message is a dead letter.
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
        /// Each effect waits this many milliseconds inside its transaction
        /// (a slow handler).
        #[arg(long, default_value_t = 0)]
        handler_latency_ms: u64,
        /// Apply up to this many messages already delivered in one transaction
        /// (1: one at a time; on SQS, up to a receive's 10; on Kafka, a
        /// partition's records in order).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
        batch: u16,
    },
    /// Prints each dead letter as one JSON line, without removing it.
    DeadLetters {
        #[command(flatten)]
        broker: BrokerArgs,
        #[command(flatten)]
        place: PlaceArgs,
    },
    /// Moves the dead letters back to the work queue (or topic); each is then
    /// applied once.
    Redrive {
        #[command(flatten)]
        broker: BrokerArgs,
        #[command(flatten)]
        place: PlaceArgs,
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

/// The broker a command names.
enum Broker {
    Amqp(String),
    Kafka(String),
    Sqs(String),
}

impl BrokerArgs {
    fn broker(self) -> Broker {
        match (self.amqp, self.kafka, self.sqs) {
            (Some(url), _, _) => Broker::Amqp(url),
            (_, Some(servers), _) => Broker::Kafka(servers),
            // clap requires exactly one.
            (_, _, sqs) => Broker::Sqs(sqs.unwrap_or_default()),
        }
    }
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
            broker,
            place,
            group,
            database,
            max_attempts,
            retry_base_ms,
            dlq_alert_threshold,
            concurrency,
            fail_account,
            handler_latency_ms,
            batch,
        } => {
            let settings = Settings {
                database,
                max_attempts,
                retry_base: Duration::from_millis(retry_base_ms),
                dead_letter_alert_threshold: dlq_alert_threshold,
                concurrency: usize::from(concurrency),
                fail_account,
                handler_latency: Duration::from_millis(handler_latency_ms),
                batch: usize::from(batch),
            };
            let subscribed = |name: &str| println!("consuming from {name}");
            match broker.broker() {
                Broker::Amqp(amqp) => {
                    let options = RunOptions {
                        amqp,
                        queue: place.queue,
                        settings,
                    };
                    payments_consumer::run(options, subscribed).await
                }
                Broker::Kafka(servers) => {
                    let options = kafka::KafkaOptions {
                        servers,
                        topic: place.topic,
                        group,
                        settings,
                    };
                    kafka::run(options, subscribed).await
                }
                Broker::Sqs(queue_url) => {
                    let options = sqs::SqsOptions {
                        queue_url,
                        endpoint: place.sqs_endpoint,
                        settings,
                    };
                    sqs::run(options, subscribed).await
                }
            }
        }
        Command::DeadLetters { broker, place } => {
            let letters = match broker.broker() {
                Broker::Amqp(amqp) => idem_rabbitmq::dead_letters(&amqp, &place.queue)
                    .await?
                    .iter()
                    .map(DeadLetterLine::from)
                    .collect(),
                Broker::Kafka(servers) => kafka::dead_letters(&servers, &place.topic).await?,
                Broker::Sqs(queue_url) => {
                    sqs::dead_letters(&queue_url, place.sqs_endpoint.as_deref()).await?
                }
            };
            for line in letters {
                println!("{}", serde_json::to_string(&line).unwrap_or_default());
            }
            Ok(())
        }
        Command::Redrive { broker, place } => {
            match broker.broker() {
                Broker::Amqp(amqp) => {
                    let moved = idem_rabbitmq::redrive(&amqp, &place.queue).await?;
                    println!(
                        "re-drove {moved} dead letters from {queue}.dlq to {queue}",
                        queue = place.queue
                    );
                }
                Broker::Kafka(servers) => {
                    let redrive = kafka::redrive(&servers, &place.topic).await?;
                    println!(
                        "re-drove {moved} dead letters from {topic}.dlq to {topic}",
                        moved = redrive.republished,
                        topic = place.topic
                    );
                    for letter in &redrive.kept {
                        println!(
                            "not re-driven: message_id {id}, its body cut to fit {topic}.dlq ({size} bytes whole; offset {offset} there)",
                            id = letter.message_id.as_deref().unwrap_or("(none)"),
                            size = letter.truncated.unwrap_or_default(),
                            offset = letter.offset,
                            topic = place.topic
                        );
                    }
                }
                Broker::Sqs(queue_url) => {
                    let moved = sqs::redrive(&queue_url, place.sqs_endpoint.as_deref()).await?;
                    println!("re-drove {moved} dead letters");
                }
            }
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
