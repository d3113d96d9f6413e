//! Start-up: the command line, the store it names (with the ledger in the same
//! database), the listener.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use idem_core::MemoryStore;
use idem_core::cleanup::Cleanup;
use idem_diesel::{PgStore, SetupError, SqliteStore};
use idem_redis::RedisStore;

use crate::publish::{DEFAULT_PUBLISH_TO, PublishUrl, Publishing};
use crate::{Guards, InvalidProviderUrl, Ledger, LedgerError, Provider};

/// The store used when neither `--store` nor `DATABASE_URL` names one.
pub const DEFAULT_STORE: &str = "sqlite://payments.db";

/// The PostgreSQL pool's size: in transactional mode every running keyed
/// request holds a connection until it commits (the provider's latency
/// included), besides the waiting duplicates' polls and the ledger's reads.
const POSTGRES_POOL_SIZE: u32 = 32;

/// The longest `--retention-secs`: a year.
const MAX_RETENTION_SECS: u64 = 365 * 24 * 60 * 60;

/// The longest `--cleanup-interval-secs`: a day.
const MAX_CLEANUP_INTERVAL_SECS: u64 = 24 * 60 * 60;

/// The longest `--lease-secs`: a day.
const MAX_LEASE_SECS: u64 = 24 * 60 * 60;

/// The command line of both payments services (`docs/contract.md` §8).
///
/// ```
/// use clap::Parser;
/// use payments::{Options, StoreUrl};
///
/// let options = Options::try_parse_from(["payments", "--listen", "127.0.0.1:0", "--store", "memory"])?;
/// assert_eq!(options.store_url()?, StoreUrl::Memory);
/// assert_eq!(options.provider_latency().as_millis(), 0);
/// assert_eq!(options.expiry(), payments::Expiry::default());
/// assert_eq!(options.lease().as_secs(), 30);
/// assert!(options.provider_url.is_none());
///
/// let options = Options::try_parse_from([
///     "payments", "--lease-secs", "1", "--provider-url", "http://127.0.0.1:9000",
/// ])?;
/// assert_eq!(options.lease().as_secs(), 1);
/// assert!(options.provider().is_ok());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Parser)]
#[command(
    about = "A payments service that is safe to retry: Idempotency-Key handling with idem",
    long_about = None
)]
pub struct Options {
    /// The address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:3000")]
    pub listen: String,
    /// The idempotency store: `memory`, `sqlite://PATH`, `postgres://…`,
    /// `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT…]`.
    /// Default: `DATABASE_URL`, else `sqlite://payments.db`.
    #[arg(long, env = "DATABASE_URL")]
    pub store: Option<String>,
    /// The simulated payment provider's latency inside a charge, in milliseconds
    /// (when no `--provider-url` is given).
    #[arg(long, default_value_t = 0)]
    pub provider_latency_ms: u64,
    /// A real payment provider: each charge calls `POST {URL}/payments` with the
    /// JSON `{"account_id", "amount", "currency"}` and an `Idempotency-Key`
    /// derived from the principal and the key; anything but a 2xx within 10 s
    /// answers the charge 502, nothing applied. Default: the simulated provider.
    #[arg(long, value_name = "URL")]
    pub provider_url: Option<String>,
    /// The keyed routes' lease, in seconds: how long a claim holds a key
    /// without renewal (renewed while the handler runs).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=MAX_LEASE_SECS))]
    pub lease_secs: u64,
    /// How long completed idempotency records are kept, in seconds; a retry after that runs afresh.
    #[arg(long, default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..=MAX_RETENTION_SECS))]
    pub retention_secs: u64,
    /// How often the cleanup job deletes expired records, in seconds.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=MAX_CLEANUP_INTERVAL_SECS))]
    pub cleanup_interval_secs: u64,
    /// Publish an event `{"account_id", "amount"}` for every charge and
    /// deposit applied, staged in its transaction (the outbox) and sent by
    /// this process's relay: `amqp://…` (RabbitMQ). Needs `sqlite://…` or
    /// `postgres://…` as the store.
    #[arg(long, value_name = "URL")]
    pub publish: Option<String>,
    /// The queue (or topic) the events go to.
    #[arg(long, value_name = "NAME", default_value = DEFAULT_PUBLISH_TO)]
    pub publish_to: String,
}

/// How long the keyed routes keep their completed records, and how often the
/// store's cleanup job deletes the expired ones (`--retention-secs`,
/// `--cleanup-interval-secs`).
///
/// ```
/// use std::time::Duration;
///
/// let expiry = payments::Expiry::default();
/// assert_eq!(expiry.retention, Duration::from_secs(24 * 60 * 60));
/// assert_eq!(expiry.cleanup_interval, Duration::from_secs(60));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expiry {
    /// The routes' policies' retention: a completed record counts as absent
    /// after this.
    pub retention: Duration,
    /// The time from the end of one cleanup sweep to the start of the next.
    pub cleanup_interval: Duration,
}

impl Default for Expiry {
    /// The 24 h retention of `docs/contract.md` §6; a sweep a minute.
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 60 * 60),
            cleanup_interval: Duration::from_secs(60),
        }
    }
}

/// A store named on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUrl {
    /// `memory`: the in-memory store (records are lost on exit).
    Memory,
    /// `sqlite://PATH`.
    Sqlite(String),
    /// `postgres://…` or `postgresql://…`, the whole URL.
    Postgres(String),
    /// `redis://…` (one node) or `redis+cluster://…` (a Redis Cluster), the
    /// whole URL.
    Redis(String),
}

/// What `--store` opened: the idempotency middleware of each route and the
/// ledger, both in the one database the URL names.
///
/// | `--store` | records | ledger | keyed charges and deposits |
/// |---|---|---|---|
/// | `memory` | in memory | in memory | plain: `409` for a running duplicate |
/// | `sqlite://PATH` | `idem_records` in the file | `payment_accounts`, `payment_operations` in the file | transactional ([`Guards::transactional`]) |
/// | `postgres://…` | `idem_records` | `payment_accounts`, `payment_operations` | transactional ([`Guards::transactional`]) |
/// | `redis://…`, `redis+cluster://…` | hashes under `idem:` | keys under `payments:` | plain, with a ledger that remembers each key's operation |
///
/// With the plain stores, the claim, the ledger's writes and the completion are
/// separate steps: a process killed between the ledger's commit and the
/// completion leaves a charge applied with its key still in progress; once the
/// claim's lease (`--lease-secs`, 30 s by default) lapses, the retry applies it
/// again. On PostgreSQL and SQLite (transactional mode) the ledger's writes
/// and the completion commit together, so a crash at any point leaves one
/// effect or none.
/// On Redis the record and the account live in different slots, so they
/// cannot change in one step; instead the ledger's script records, with the
/// operation, which operation the request's key applied, and the retry gets
/// that operation back rather than a second one: one effect after a crash
/// too. A Redis failover that loses acknowledged writes can still let a retry
/// apply a charge again (idem-redis's docs say when).
#[derive(Clone, Debug)]
pub struct Storage {
    /// The idempotency middleware of the keyed routes.
    pub guards: Guards,
    /// The accounts.
    pub ledger: Ledger,
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The `--store` / `DATABASE_URL` value names no known store.
    #[error(
        "unknown store {0:?}: expected `memory`, `sqlite://PATH`, `postgres://…`, \
         `redis://HOST:PORT` or `redis+cluster://HOST:PORT[,HOST:PORT…]`"
    )]
    UnknownStore(String),
    /// The Redis store could not connect (a cluster's slot map is read at
    /// start; one node is connected on first use).
    #[error("cannot open the Redis store")]
    Redis(#[source] idem_redis::SetupError),
    /// The store could not be opened or migrated.
    #[error("cannot open the {kind} store")]
    Store {
        /// `SQLite` or `PostgreSQL`.
        kind: &'static str,
        /// Why.
        #[source]
        source: SetupError,
    },
    /// The ledger's tables could not be created.
    #[error("cannot open the {kind} ledger")]
    Ledger {
        /// `SQLite` or `PostgreSQL`.
        kind: &'static str,
        /// Why.
        #[source]
        source: LedgerError,
    },
    /// A crash test's `PAYMENTS_CRASH_AT` names no crash point.
    #[error("{0}")]
    CrashPoint(String),
    /// The `--provider-url` value is not a provider URL.
    #[error("invalid --provider-url")]
    Provider(#[from] InvalidProviderUrl),
    /// `--publish` with a store that has no transaction to stage events in.
    #[error(
        "--publish needs a store with transactions (sqlite://… or postgres://…): \
         the {0} store has none to stage events in, so an event could be lost or sent \
         for an operation that did not happen"
    )]
    PublishNeedsTransactions(&'static str),
    /// A `--publish` URL that is neither `amqp://…` nor `kafka://…` (not
    /// repeated: it may hold a password).
    #[error("unknown --publish URL: expected amqp://… or kafka://HOST:PORT")]
    UnknownPublishUrl,
    /// The outbox's relay refused to start (its table unverified).
    #[error("cannot start the outbox's relay")]
    Relay(#[source] idem_core::store::NotReady),
    /// The outbox's table could not be created.
    #[error("cannot open the {kind} outbox")]
    Outbox {
        /// `SQLite` or `PostgreSQL`.
        kind: &'static str,
        /// Why.
        #[source]
        source: SetupError,
    },
    /// The publisher could not connect to the broker, or declare the queue.
    #[error("cannot publish to RabbitMQ")]
    Publisher(#[source] idem_rabbitmq::Error),
    /// The Kafka producer could not be created, or the topic not created.
    #[error("cannot publish to Kafka")]
    KafkaPublisher(#[source] idem_kafka::Error),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address given.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl StartError {
    /// The exit status for this error: 2 for a command line that can never
    /// work (`--publish` without transactions, or to no known broker), 1
    /// otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::PublishNeedsTransactions(_) | Self::UnknownPublishUrl => 2,
            _ => 1,
        }
    }
}

impl Options {
    /// The options of this process's command line; prints help or an error and
    /// exits when they are wrong.
    pub fn from_command_line() -> Self {
        Self::parse()
    }

    /// Opens the store and the ledger ([`StoreUrl::open`]) and, with
    /// `--publish`, the outbox in the ledger's database and its relay
    /// (`docs/contract.md` §11). `--publish` with the memory or a Redis store
    /// fails before anything is opened.
    pub async fn open(&self) -> Result<Storage, StartError> {
        let store = self.store_url()?;
        let publish = self.publish.as_deref().map(PublishUrl::parse).transpose()?;
        if publish.is_some() {
            match &store {
                StoreUrl::Memory => return Err(StartError::PublishNeedsTransactions("memory")),
                StoreUrl::Redis(_) => return Err(StartError::PublishNeedsTransactions("Redis")),
                StoreUrl::Sqlite(_) | StoreUrl::Postgres(_) => {}
            }
        }
        let storage = store.open(self.expiry()).await?;
        let Some(publish) = publish else {
            return Ok(storage);
        };
        let outbox = storage
            .ledger
            .outbox()
            .ok_or(StartError::PublishNeedsTransactions("this"))?;
        let publishing = Publishing::start(&publish, &self.publish_to, outbox).await?;
        Ok(Storage {
            ledger: storage.ledger.publishing(publishing),
            ..storage
        })
    }

    /// The store named by `--store` or `DATABASE_URL`; [`DEFAULT_STORE`] when
    /// neither is given.
    pub fn store_url(&self) -> Result<StoreUrl, StartError> {
        StoreUrl::parse(self.store.as_deref().unwrap_or(DEFAULT_STORE))
    }

    /// The simulated provider latency.
    pub fn provider_latency(&self) -> Duration {
        Duration::from_millis(self.provider_latency_ms)
    }

    /// The payment provider: `--provider-url`'s, else the simulated one with
    /// `--provider-latency-ms`.
    pub fn provider(&self) -> Result<Provider, StartError> {
        match &self.provider_url {
            Some(url) => Ok(Provider::http(url)?),
            None => Ok(Provider::simulated(self.provider_latency())),
        }
    }

    /// The keyed routes' lease (`--lease-secs`).
    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_secs)
    }

    /// The retention and the cleanup interval.
    pub fn expiry(&self) -> Expiry {
        Expiry {
            retention: Duration::from_secs(self.retention_secs),
            cleanup_interval: Duration::from_secs(self.cleanup_interval_secs),
        }
    }

    /// Binds the listen address (a non-blocking std listener, for any runtime).
    pub fn bind(&self) -> Result<TcpListener, StartError> {
        let failed = |source| StartError::Listen {
            addr: self.listen.clone(),
            source,
        };
        let listener = TcpListener::bind(&self.listen).map_err(failed)?;
        listener.set_nonblocking(true).map_err(failed)?;
        Ok(listener)
    }
}

impl StoreUrl {
    /// Parses a store URL.
    ///
    /// ```
    /// use payments::StoreUrl;
    ///
    /// assert_eq!(StoreUrl::parse("sqlite://payments.db")?, StoreUrl::Sqlite("payments.db".into()));
    /// assert_eq!(StoreUrl::parse("redis://127.0.0.1:6379")?, StoreUrl::Redis("redis://127.0.0.1:6379".into()));
    /// assert!(StoreUrl::parse("mysql://localhost").is_err());
    /// # Ok::<(), payments::StartError>(())
    /// ```
    pub fn parse(url: &str) -> Result<Self, StartError> {
        if url == "memory" {
            Ok(Self::Memory)
        } else if let Some(path) = url.strip_prefix("sqlite://") {
            Ok(Self::Sqlite(path.to_owned()))
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Self::Postgres(url.to_owned()))
        } else if url.starts_with("redis://") || url.starts_with("redis+cluster://") {
            Ok(Self::Redis(url.to_owned()))
        } else {
            Err(StartError::UnknownStore(url.to_owned()))
        }
    }

    /// Opens the store and the ledger in its database: connects, creates or
    /// upgrades the idempotency table and the ledger's tables, and starts the
    /// store's cleanup job (deleting expired records every
    /// `expiry.cleanup_interval`) on the current Tokio runtime. The routes keep
    /// their completed records for `expiry.retention`. See [`Storage`] for what
    /// each store gives.
    ///
    /// The memory store needs no job to be correct (an expired record counts as
    /// absent, and is removed when next touched), but it runs one all the same,
    /// so that expired records free their memory. Redis needs none: it
    /// deletes expired records itself.
    pub async fn open(&self, expiry: Expiry) -> Result<Storage, StartError> {
        let storage = match self {
            Self::Memory => {
                let store = MemoryStore::new();
                tokio::spawn(
                    Cleanup::new(store.clone())
                        .interval(expiry.cleanup_interval)
                        .run(std::future::pending()),
                );
                Storage {
                    guards: Guards::plain(Arc::new(store)),
                    ledger: Ledger::memory(),
                }
            }
            Self::Sqlite(path) => {
                let kind = "SQLite";
                let failed = |source| StartError::Store { kind, source };
                let store = SqliteStore::connect(path).await.map_err(failed)?;
                store.migrate().await.map_err(failed)?;
                let ledger = Ledger::sqlite(store.pool().clone());
                ledger
                    .migrate()
                    .await
                    .map_err(|source| StartError::Ledger { kind, source })?;
                tokio::spawn(
                    store
                        .cleanup()
                        .interval(expiry.cleanup_interval)
                        .run(std::future::pending()),
                );
                Storage {
                    guards: Guards::transactional(store.transactional()),
                    ledger,
                }
            }
            Self::Postgres(url) => {
                let kind = "PostgreSQL";
                let failed = |source| StartError::Store { kind, source };
                let store = PgStore::builder()
                    .max_connections(POSTGRES_POOL_SIZE)
                    .connect(url)
                    .await
                    .map_err(failed)?;
                store.migrate().await.map_err(failed)?;
                let ledger = Ledger::postgres(store.pool().clone());
                ledger
                    .migrate()
                    .await
                    .map_err(|source| StartError::Ledger { kind, source })?;
                tokio::spawn(
                    store
                        .cleanup()
                        .interval(expiry.cleanup_interval)
                        .run(std::future::pending()),
                );
                Storage {
                    guards: Guards::transactional(store.transactional()),
                    ledger,
                }
            }
            Self::Redis(url) => {
                let store = RedisStore::connect(url).await.map_err(StartError::Redis)?;
                let ledger = Ledger::redis(store.connection(), expiry.retention);
                Storage {
                    guards: Guards::plain(Arc::new(store)),
                    ledger,
                }
            }
        };
        let storage = Storage {
            guards: storage.guards.retention(expiry.retention),
            ledger: storage
                .ledger
                .crash_point_from_env()
                .map_err(StartError::CrashPoint)?,
        };
        tracing::info!(
            ledger = storage.ledger.kind(),
            retention_secs = expiry.retention.as_secs(),
            cleanup_interval_secs = expiry.cleanup_interval.as_secs(),
            transactional = storage.guards.charges.is_transactional(),
            "store and ledger opened"
        );
        Ok(storage)
    }
}

/// The first line the services print on stdout.
///
/// ```
/// let addr = "127.0.0.1:3000".parse().unwrap();
/// assert_eq!(payments::listening_line(addr), "listening on http://127.0.0.1:3000");
/// ```
pub fn listening_line(addr: SocketAddr) -> String {
    format!("listening on http://{addr}")
}

/// Logs to stderr (stdout's first line belongs to [`listening_line`]), filtered
/// by `RUST_LOG` (default `info`).
///
/// Whatever `RUST_LOG` says, the PostgreSQL driver (`tokio_postgres`) logs at
/// `info` at most ([`example_tracing::QUIET_DRIVERS`]): at `debug` it writes
/// every statement's bound parameters, which hold idempotency keys and the
/// values of request bodies. So no line carries a bearer token (the scope is
/// its hash, see [`Principal`](crate::Principal)), a full idempotency key (idem
/// logs it redacted) or a request body.
pub fn init_tracing() {
    example_tracing::init();
}
