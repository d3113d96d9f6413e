//! Start-up and shutdown, the same on every framework (orders-actix includes
//! this file too): the command line, the logs, the store migrated before the
//! first request, the cleanup job, the listening line, the exit status.

use std::error::Error;
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;

use std::time::Duration;

use idem::diesel::{SqliteOutbox, SqlitePool, SqliteStore};
use idem::log::error_chain;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing_subscriber::EnvFilter;

use crate::orders::{CrashPoint, Orders, Publishing};

/// Any start-up or serving failure, with its causes.
pub type StartError = Box<dyn Error + Send + Sync>;

/// The command line: `--listen ADDR` (default `127.0.0.1:3000`; port 0 picks a
/// free port), `--database sqlite://PATH` (default `sqlite://orders.db`),
/// `--publish URL` (`amqp://…` or `kafka://HOST:PORT[,…]`: stage
/// `order.created` in each order's transaction and relay it there),
/// `--publish-to NAME` (the queue or topic, default `orders`) and
/// `--lease-secs N` (the route's lease, default 30).
#[derive(Clone, Debug)]
pub struct Options {
    /// The address to listen on.
    pub listen: String,
    /// The SQLite file of the idempotency records, the orders and the outbox.
    pub database: String,
    /// Where events go, if anywhere.
    pub publish: Option<String>,
    /// The queue or topic.
    pub publish_to: String,
    /// The lease of `POST /orders`.
    pub lease: Duration,
}

impl Options {
    /// Reads the process's arguments.
    pub fn from_args() -> Result<Self, StartError> {
        let mut options = Self {
            listen: "127.0.0.1:3000".to_owned(),
            database: "sqlite://orders.db".to_owned(),
            publish: None,
            publish_to: "orders".to_owned(),
            lease: Duration::from_secs(30),
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let value = args.next().ok_or(format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--listen" => options.listen = value,
                "--database" => options.database = value,
                "--publish" => options.publish = Some(value),
                "--publish-to" => options.publish_to = value,
                "--lease-secs" => {
                    let secs = value
                        .parse::<u64>()
                        .ok()
                        .filter(|secs| *secs > 0)
                        .ok_or("--lease-secs needs a whole number of seconds, at least 1")?;
                    options.lease = Duration::from_secs(secs);
                }
                _ => {
                    return Err(format!(
                        "unknown argument {flag:?}: expected --listen, --database, --publish, --publish-to or --lease-secs"
                    )
                    .into());
                }
            }
        }
        Ok(options)
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`). Without a
/// subscriber, the cause of a `503 store-unavailable` is logged nowhere.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
}

/// Opens the store and the orders, and starts publishing if asked. The
/// records survive restarts in this file; `migrate` creates or upgrades their
/// table before the first request (without it, every keyed request would be
/// answered `503`). The route runs in transactional mode
/// ([`SqliteStore::transactional`]): the order and the record commit together.
pub async fn open(options: &Options) -> Result<(SqliteStore, Orders), StartError> {
    let store = SqliteStore::connect(&options.database).await?;
    store.migrate().await?;
    let publishing = match &options.publish {
        Some(url) => Some(publish(url, &options.publish_to, store.pool().clone()).await?),
        None => None,
    };
    let crash = CrashPoint::from_env()?;
    let orders = Orders::open(store.pool().clone(), publishing, crash).await?;
    Ok((store, orders))
}

/// Migrates the outbox in the orders' file, connects to the broker, declares
/// the queue (or creates the topic) and starts the relay and the outbox's
/// cleanup. An error never repeats the URL (it may hold a password).
async fn publish(url: &str, destination: &str, pool: SqlitePool) -> Result<Publishing, StartError> {
    let outbox = SqliteOutbox::new(pool);
    outbox.migrate().await?;
    if url.starts_with("amqp://") {
        let publisher = idem::rabbitmq::OutboxPublisher::connect(url).await?;
        let connection =
            idem::rabbitmq::lapin::Connection::connect(url, Default::default()).await?;
        let channel = connection.create_channel().await?;
        let declared = idem::rabbitmq::Topology::new(destination)
            .declare(&channel)
            .await;
        let _ = connection.close(200, "declared".into()).await;
        declared?;
        tokio::spawn(outbox.relay(publisher)?.run(std::future::pending()));
    } else if let Some(servers) = url.strip_prefix("kafka://") {
        let servers = servers.trim_end_matches('/');
        let publisher = idem::kafka::OutboxPublisher::connect(servers)?;
        idem::kafka::create_topic(servers, destination, 3).await?;
        tokio::spawn(outbox.relay(publisher)?.run(std::future::pending()));
    } else {
        return Err("--publish needs an amqp:// or a kafka:// URL".into());
    }
    tokio::spawn(outbox.cleanup().run(std::future::pending()));
    tracing::info!(destination = %idem::log::bounded(destination), "publishing order.created through the outbox");
    Ok(Publishing {
        outbox,
        destination: destination.to_owned(),
    })
}

/// The store's cleanup job, running: it deletes expired records (24 h after
/// completion by default) in batches, every minute, until stopped.
pub struct CleanupJob {
    stop: oneshot::Sender<()>,
    job: JoinHandle<u64>,
}

impl CleanupJob {
    /// Spawns the job on the current runtime.
    pub fn spawn(store: &SqliteStore) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let job = tokio::spawn(store.cleanup().run(async {
            let _ = stopped.await;
        }));
        Self { stop, job }
    }

    /// Stops the job (a sweep under way ends after its batch).
    pub async fn stop(self) -> Result<(), StartError> {
        let _ = self.stop.send(());
        let deleted = self.job.await?;
        tracing::info!(deleted, "stopped");
        Ok(())
    }
}

/// Prints `listening on http://ADDR`, the first line on stdout.
pub fn print_listening(addr: SocketAddr) -> Result<(), StartError> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on http://{addr}")?;
    stdout.flush()?;
    Ok(())
}

/// The exit status of a run; a failure is printed with its causes.
pub fn exit_code(name: &str, result: Result<(), StartError>) -> ExitCode {
    let Err(error) = result else {
        return ExitCode::SUCCESS;
    };
    let message = format!("{name}: {}", error_chain(&*error));
    eprintln!("{message}");
    ExitCode::FAILURE
}
