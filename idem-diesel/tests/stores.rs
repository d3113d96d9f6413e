//! The stores against real databases: the core conformance suite, migrations,
//! the cleanup job, outages, transactional mode, the consumer inbox and the
//! inbox conformance suite, the outbox and its relay, on PostgreSQL (a throwaway cluster this binary
//! starts) and on SQLite (a temporary file per test).
//!
//! One binary with its own harness (libtest-mimic), because the cluster must be
//! stopped and its files deleted when the tests end, whatever they did: `main`
//! starts it on first use, runs every trial, then drops it. Every trial gets
//! fresh, empty storage: a new database on the cluster, or a new SQLite file.
//!
//! `cargo test -p idem-diesel --test stores -- --ignored measure` runs the
//! throughput measurements.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "stores/cleanup.rs"]
mod cleanup;
#[path = "stores/consumer_inbox.rs"]
mod consumer_inbox;
#[path = "stores/outbox.rs"]
mod outbox;
#[path = "stores/postgres.rs"]
mod postgres;
#[path = "stores/sqlite.rs"]
mod sqlite;
#[path = "stores/sqlite_transactional.rs"]
mod sqlite_transactional;
#[path = "stores/transactional.rs"]
mod transactional;

use std::any::Any;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::store::ReplayCache;
use idem_core::{Begin, Engine, Execution, Fingerprint, Scope, Store, StoredResponse};
use idem_diesel::{PgStore, SqliteStore};
use idem_testkit::TestPostgres;
use libtest_mimic::{Arguments, Failed, Trial};

/// What a test gets: a way to fresh storage.
pub(crate) struct Databases {
    cluster: OnceLock<Result<TestPostgres, String>>,
    scratch: PathBuf,
    next: AtomicUsize,
}

/// A test: an async function over the databases that panics on failure.
pub(crate) type TestFn = fn(Arc<Databases>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// How long a trial may run before it counts as hung.
const HANG: Duration = Duration::from_secs(180);

/// Trials mostly sleep (leases lapsing) or wait on the database, so more run at
/// once than there are cores.
const DEFAULT_TEST_THREADS: usize = 6;

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    if args.test_threads.is_none() {
        let from_env = std::env::var("RUST_TEST_THREADS").ok();
        args.test_threads = Some(
            from_env
                .and_then(|threads| threads.parse().ok())
                .unwrap_or(DEFAULT_TEST_THREADS),
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a Tokio runtime for the tests");
    let databases = Arc::new(Databases::new());

    let mut trials = Vec::new();
    for case in idem_core::conformance::cases() {
        let run = case.run;
        for (variant, make) in STORE_VARIANTS {
            let make = *make;
            trials.push(trial(
                &runtime,
                &databases,
                format!("{variant}::conformance::{}", case.name),
                false,
                move |databases| async move { run(make(databases).await).await },
            ));
        }
    }
    for case in idem_core::conformance::cases() {
        if !transactional::CONFORMANCE.contains(&case.name) {
            continue;
        }
        let run = case.run;
        trials.push(trial(
            &runtime,
            &databases,
            format!("postgres_transactional::conformance::{}", case.name),
            false,
            move |databases| async move {
                let store = transactional::fresh_transactional(&databases).await;
                run(Arc::new(store)).await
            },
        ));
    }
    for case in idem_core::consume::conformance::CASES {
        for (inbox, run) in consumer_inbox::INBOXES {
            let run = *run;
            trials.push(trial(
                &runtime,
                &databases,
                format!("{inbox}::conformance::{case}"),
                false,
                move |databases| run(databases, case),
            ));
        }
    }
    for case in idem_core::consume::conformance::positions::CASES {
        for (inbox, run) in consumer_inbox::POSITIONS {
            let run = *run;
            trials.push(trial(
                &runtime,
                &databases,
                format!("{inbox}::positions::{case}"),
                false,
                move |databases| run(databases, case),
            ));
        }
    }
    for (name, test) in postgres::TESTS
        .iter()
        .chain(sqlite::TESTS)
        .chain(cleanup::TESTS)
        .chain(transactional::TESTS)
        .chain(sqlite_transactional::TESTS)
        .chain(consumer_inbox::TESTS)
        .chain(outbox::TESTS)
    {
        let test = *test;
        trials.push(trial(&runtime, &databases, (*name).to_owned(), false, test));
    }
    for (name, test) in postgres::MEASUREMENTS
        .iter()
        .chain(sqlite::MEASUREMENTS)
        .chain(transactional::MEASUREMENTS)
        .chain(sqlite_transactional::MEASUREMENTS)
    {
        let test = *test;
        trials.push(trial(&runtime, &databases, (*name).to_owned(), true, test));
    }

    let conclusion = libtest_mimic::run(&args, trials);
    // Tasks still on the runtime may hold the databases: end them first.
    drop(runtime);
    match Arc::try_unwrap(databases) {
        Ok(databases) => drop(databases),
        Err(_) => eprintln!("warning: the test databases are still in use and were not removed"),
    }
    conclusion.exit_code()
}

/// Makes a fresh, empty store of one variant for a conformance case.
type MakeStore = fn(Arc<Databases>) -> Pin<Box<dyn Future<Output = Arc<dyn Store>> + Send>>;

/// Every store configuration the conformance suite runs against.
const STORE_VARIANTS: &[(&str, MakeStore)] = &[
    // The replay cache in front of each durable store answers as the store.
    ("postgres_cached", |databases| {
        Box::pin(async move {
            let url = databases.fresh_postgres().await;
            let store = PgStore::connect(&url).await.expect("connect");
            store.migrate().await.expect("migrate");
            Arc::new(ReplayCache::new(store, 1_000)) as Arc<dyn Store>
        })
    }),
    ("sqlite_cached", |databases| {
        Box::pin(async move {
            let store = SqliteStore::connect(&databases.fresh_sqlite_url())
                .await
                .expect("connect");
            store.migrate().await.expect("migrate");
            Arc::new(ReplayCache::new(store, 1_000)) as Arc<dyn Store>
        })
    }),
    ("postgres", |databases| {
        Box::pin(async move {
            let url = databases.fresh_postgres().await;
            let store = PgStore::connect(&url).await.expect("connect");
            store.migrate().await.expect("migrate");
            Arc::new(store) as Arc<dyn Store>
        })
    }),
    ("postgres_custom_table", |databases| {
        Box::pin(async move {
            let url = databases.fresh_postgres().await;
            let store = PgStore::builder()
                .schema("idem")
                .table("payment_keys")
                .connect(&url)
                .await
                .expect("connect");
            store.migrate().await.expect("migrate");
            Arc::new(store) as Arc<dyn Store>
        })
    }),
    ("sqlite", |databases| {
        Box::pin(async move {
            let store = SqliteStore::connect(&databases.fresh_sqlite_url())
                .await
                .expect("connect");
            store.migrate().await.expect("migrate");
            Arc::new(store) as Arc<dyn Store>
        })
    }),
    // Its claims commit on their own, so every case holds.
    ("sqlite_transactional", |databases| {
        Box::pin(async move {
            Arc::new(sqlite_transactional::fresh_transactional(&databases).await) as Arc<dyn Store>
        })
    }),
    ("sqlite_custom_table", |databases| {
        Box::pin(async move {
            let store = SqliteStore::builder()
                .table("payment_keys")
                .connect(&databases.fresh_sqlite_url())
                .await
                .expect("connect");
            store.migrate().await.expect("migrate");
            Arc::new(store) as Arc<dyn Store>
        })
    }),
];

/// A trial that runs `test` on the shared runtime, as a task of its own so that
/// its panic becomes the trial's failure message.
fn trial<F, Fut>(
    runtime: &tokio::runtime::Runtime,
    databases: &Arc<Databases>,
    name: String,
    ignored: bool,
    test: F,
) -> Trial
where
    F: FnOnce(Arc<Databases>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let handle = runtime.handle().clone();
    let databases = Arc::clone(databases);
    Trial::test(name, move || {
        handle.block_on(async move {
            let task = tokio::spawn(test(databases));
            match tokio::time::timeout(HANG, task).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(error)) if error.is_panic() => Err(panic_message(error.into_panic())),
                Ok(Err(error)) => Err(Failed::from(error.to_string())),
                Err(_) => Err(Failed::from(format!("did not finish within {HANG:?}"))),
            }
        })
    })
    .with_ignored_flag(ignored)
}

fn panic_message(payload: Box<dyn Any + Send>) -> Failed {
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panicked".to_owned());
    Failed::from(message)
}

impl Databases {
    fn new() -> Self {
        let scratch = std::env::temp_dir().join(format!("idem-sqlite-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).expect("a scratch directory for SQLite files");
        Self {
            cluster: OnceLock::new(),
            scratch,
            next: AtomicUsize::new(0),
        }
    }

    /// The shared cluster, started on first use. Panics, saying how to get
    /// PostgreSQL, when it cannot start.
    pub(crate) fn cluster(&self) -> &TestPostgres {
        let started = self
            .cluster
            .get_or_init(|| TestPostgres::start().map_err(|error| error_chain(&error)));
        match started {
            Ok(cluster) => cluster,
            Err(error) => panic!("could not start the PostgreSQL test cluster: {error}"),
        }
    }

    /// The URL of a new, empty database on the shared cluster.
    pub(crate) async fn fresh_postgres(self: &Arc<Self>) -> String {
        let databases = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let name = format!("test_{}", databases.next.fetch_add(1, Ordering::Relaxed));
            let cluster = databases.cluster();
            cluster
                .create_database(&name)
                .unwrap_or_else(|error| panic!("{}", error_chain(&error)));
            cluster.url(&name)
        })
        .await
        .unwrap_or_else(|error| std::panic::resume_unwind(error.into_panic()))
    }

    /// The `sqlite://` URL of a file that does not exist yet.
    pub(crate) fn fresh_sqlite_url(&self) -> String {
        format!("sqlite://{}", self.fresh_sqlite_path().display())
    }

    /// The path of a SQLite file that does not exist yet.
    pub(crate) fn fresh_sqlite_path(&self) -> PathBuf {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        self.scratch.join(format!("test_{n}.db"))
    }
}

impl Drop for Databases {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

pub(crate) use idem_core::log::error_chain;

/// The fingerprint every transactional-mode test's request has.
pub(crate) fn fingerprint() -> Fingerprint {
    Fingerprint::from_bytes([1; 32])
}

/// A `201` answer with `body`.
pub(crate) fn created(body: &'static str) -> StoredResponse {
    StoredResponse::new(201, vec![], body)
}

/// The execution of a new key of alice's, which must be granted.
pub(crate) async fn execute_new(engine: &Engine, key_name: &str) -> Execution {
    match engine
        .begin(Scope::new("alice"), postgres::key(key_name), fingerprint())
        .await
    {
        Begin::Execute(execution) => execution,
        other => panic!("a new key answered {other:?}"),
    }
}

/// What the store handed the execution (a transactional store's
/// transaction), as a handler gets it.
pub(crate) fn context_of<T: Clone + Send + Sync + 'static>(execution: &Execution) -> T {
    let context = execution
        .context()
        .expect("a transactional execution has a context");
    T::clone(
        &Arc::clone(context)
            .downcast::<T>()
            .expect("the context is the store's transaction"),
    )
}

/// Waits until `condition` holds, checking every few milliseconds. The trial's
/// own bound ends a wait that never succeeds.
pub(crate) async fn until<F, Fut>(mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    while !condition().await {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
