//! Start-up and shutdown, the same on every framework (orders-actix includes
//! this file too): the command line, the logs, the store migrated before the
//! first request, the cleanup job, the listening line, the exit status.

use std::error::Error;
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;

use idem::diesel::SqliteStore;
use idem::log::error_chain;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing_subscriber::EnvFilter;

use crate::Orders;

/// Any start-up or serving failure, with its causes.
pub type StartError = Box<dyn Error + Send + Sync>;

/// The command line: `--listen ADDR` (default `127.0.0.1:3000`; port 0 picks a
/// free port) and `--database sqlite://PATH` (default `sqlite://orders.db`).
#[derive(Clone, Debug)]
pub struct Options {
    /// The address to listen on.
    pub listen: String,
    /// The SQLite file of the idempotency records and the orders.
    pub database: String,
}

impl Options {
    /// Reads the process's arguments.
    pub fn from_args() -> Result<Self, StartError> {
        let mut options = Self {
            listen: "127.0.0.1:3000".to_owned(),
            database: "sqlite://orders.db".to_owned(),
        };
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let target = match flag.as_str() {
                "--listen" => &mut options.listen,
                "--database" => &mut options.database,
                _ => {
                    return Err(format!(
                        "unknown argument {flag:?}: expected --listen or --database"
                    )
                    .into());
                }
            };
            *target = args.next().ok_or(format!("{flag} needs a value"))?;
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

/// Opens the store and the orders. The records survive restarts in this file;
/// `migrate` creates or upgrades their table before the first request
/// (without it, every keyed request would be answered `503`).
pub async fn open(database: &str) -> Result<(SqliteStore, Orders), StartError> {
    let store = SqliteStore::connect(database).await?;
    store.migrate().await?;
    let orders = Orders::open(store.pool().clone()).await?;
    Ok((store, orders))
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
